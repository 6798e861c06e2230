"""utils.distributed helpers for worker scripts: gpt_args (a GPTConfig as options), show_script."""

import argparse

import pytest

import utils
from utils.distributed import add_gpt_args, gpt_args, gpt_config, show_script


def test_gpt_args_round_trips_through_the_worker_parser():
    cfg = utils.GPTConfig(vocab_size=2048, block_size=128, n_layer=4, n_head=8, n_embd=256)
    parser = argparse.ArgumentParser()
    add_gpt_args(parser)  # defaults differ from cfg in every size
    args = gpt_args(cfg)
    assert all(isinstance(a, str) for a in args)
    assert gpt_config(parser.parse_args(args)) == cfg


def test_gpt_args_refuses_what_it_cannot_pass():
    with pytest.raises(ValueError, match="dropout"):
        gpt_args(utils.GPTConfig(dropout=0.1))
    with pytest.raises(TypeError, match="GPTConfig"):
        gpt_args({"vocab_size": 512})


def test_show_script_prints_the_named_definitions_in_file_order(tmp_path, capsys):
    script = tmp_path / "worker.py"
    script.write_text("import functools\n\n\ndef first():\n    return 1\n\n\n"
                      "@functools.lru_cache\ndef second(x):\n    return x\n\n\n"
                      "class Third:\n    pass\n\n\nif __name__ == '__main__':\n    first()\n")
    show_script(script, "Third", "second")
    out = capsys.readouterr().out
    assert out == "@functools.lru_cache\ndef second(x):\n    return x\n\nclass Third:\n    pass\n\n"


def test_show_script_refuses_names_it_cannot_show(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("def main():\n    pass\n")
    with pytest.raises(ValueError, match="nowhere"):
        show_script(script, "nowhere")
    with pytest.raises(ValueError, match="main"):
        show_script(script)
