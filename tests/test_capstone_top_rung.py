"""06-capstone/02_the_top_rung_up_close took notebook 01's exercises (the CNN ladder and
channels_last) with their ledger keys: the claims registry must read those keys from 02's
ledger, where the notebook records them, and 01 must no longer record them."""

from __future__ import annotations

import json
import re

from conftest import REPO
from utils.course import claims


def _code(notebook: str) -> str:
    nb = json.loads((REPO / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def _asked_of(notebook: str) -> list[str]:
    return [ev.key for c in claims.CLAIMS for t in c.tests for ev in t.evidence
            if ev.notebook == notebook]


def test_the_claims_read_the_cnn_keys_where_the_top_rung_notebook_records_them():
    asked = _asked_of(claims._NB_TOP_RUNG)
    assert asked == ["cnn_channels_last_speedup"], asked
    top, ladder = _code(claims._NB_TOP_RUNG), _code(claims._NB_LADDER)
    for key in asked:
        assert re.search(r'ledger\.record\(\s*"' + re.escape(key) + '"', top), key
        assert f'"{key}"' not in ladder, f"{key} is recorded by 02 now, not by 01"
    assert not [k for k in _asked_of(claims._NB_LADDER) if k.startswith("cnn_")]
