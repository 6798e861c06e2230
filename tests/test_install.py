"""The two install paths (pip and conda) install the same things, as the README says."""

import re
import sys

import yaml

from conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # noqa: F401


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def test_pip_and_conda_install_the_same_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pip_reqs = {_norm(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda_reqs = {_norm(r) for r in pip_section if not r.startswith("-e")}
    assert conda_reqs == pip_reqs
    assert "-e ." in pip_section  # and the course package itself
    py = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert py.split("=")[-1] >= project["requires-python"].lstrip(">=")


def test_readme_and_ci_use_the_same_commands():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for command in ('pip install -e ".[dev]"', "pytest"):
        assert command in readme
        assert command in ci
    assert "conda env create -f environment.yml" in readme
    assert "python -m utils run" in readme and "jupyter lab" in readme
