"""The install paths (pip, conda, CI) install the same things, as the README says."""

import re
import subprocess
import sys

import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement

from conftest import REPO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # noqa: F401

INSTALL = 'pip install -e ".[dev]" -c constraints.txt'
sys.path.insert(0, str(REPO / ".ci"))
import constraints as ci_constraints  # noqa: E402


def _norm(req: str) -> str:
    return re.sub(r"\s+", "", req).lower()


def _project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _pins():
    """[(Requirement, line)] of constraints.txt's pins."""
    pins = []
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pins.append((Requirement(line), line))
    return pins


def test_pip_and_conda_install_the_same_requirements():
    project = _project()
    pip_reqs = {_norm(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    conda_reqs = {_norm(r) for r in pip_section if not r.startswith("-")}
    assert conda_reqs == pip_reqs
    assert "-e ." in pip_section  # and the course package itself
    assert "-c constraints.txt" in pip_section  # with the same pins
    py = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert py.split("=")[-1] >= project["requires-python"].lstrip(">=")


def test_readme_and_ci_use_the_same_commands():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    for command in (INSTALL, "pytest"):
        assert command in readme
        assert re.search(rf"^{re.escape(command)}$", ci, re.M), command
    # CI makes its own fresh environment, so nothing left on the machine can stand in
    # for a missing install step
    assert re.search(r'-m venv "\$work/venv"', ci) and 'source "$work/venv/bin/activate"' in ci
    assert "conda env create -f environment.yml" in readme
    assert "python -m utils run" in readme and "jupyter lab" in readme
    assert ".ci/latest" in readme and "constraints.txt" in readme


def test_constraints_leave_torch_free_and_meet_the_project_bounds():
    pins = _pins()
    names = {ci_constraints.normalize(r.name) for r, _ in pins}
    assert names, "constraints.txt pins nothing"
    assert not names & {"torch", "torchvision", "triton"}, "torch must stay free for cluster builds"
    assert not any(n.startswith(("nvidia-", "cuda-")) for n in names)
    project = _project()
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    for req in declared:
        if req.marker and not req.marker.evaluate():
            continue
        name = ci_constraints.normalize(req.name)
        if name in ci_constraints.FREE:
            continue
        versions = [next(iter(r.specifier)).version for r, _ in pins
                    if ci_constraints.normalize(r.name) == name
                    and (r.marker is None or r.marker.evaluate())]
        assert len(versions) == 1, f"{req.name}: {len(versions)} pins apply to this Python"
        assert req.specifier.contains(versions[0]), f"{req.name}=={versions[0]} breaks {req}"


def test_constraints_cover_every_supported_python():
    """Each marker-split package has a pin for every Python the file was written from."""
    by_name = {}
    for req, line in _pins():
        by_name.setdefault(ci_constraints.normalize(req.name), []).append(req)
    for version in ("3.10", "3.11", "3.12", "3.13"):
        env = {"python_version": version, "python_full_version": version + ".0"}
        for name, reqs in by_name.items():
            applying = [r for r in reqs if r.marker is None or r.marker.evaluate(env)]
            assert len(applying) <= 1, f"{name}: several pins apply on Python {version}"


def test_constraints_tool_writes_markers_only_where_versions_differ(tmp_path):
    f310, f311 = tmp_path / "a.txt", tmp_path / "b.txt"
    f310.write_text("ipykernel==6.30.1\npytest==9.2.0\ntorch==2.15.0\nnvidia-nccl-cu13==2.30\n")
    f311.write_text("ipykernel==7.4.0\npytest==9.2.0\ntomli==2.0.0\n")
    lines = ci_constraints.constraint_lines({"3.10": ci_constraints.read_freeze(f310),
                                             "3.11": ci_constraints.read_freeze(f311)})
    assert lines == ['ipykernel==6.30.1; python_version < "3.11"',
                     'ipykernel==7.4.0; python_version >= "3.11"',
                     "pytest==9.2.0",
                     'tomli==2.0.0; python_version >= "3.11"']
    assert all(Marker(ln.split(";")[1]) for ln in lines if ";" in ln)
    out = tmp_path / "c.txt"
    r = subprocess.run([sys.executable, str(REPO / ".ci" / "constraints.py"), "write", str(f310),
                        str(f311), "--python", "3.10", "3.11", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_text().splitlines()[-4:] == lines


def test_the_torch_floor_is_the_torch_ci_tests():
    """The oldest torch that pyproject, environment.yml and the README allow is the one
    `.ci/run` installs for its second pass: a floor CI never runs is a promise nobody checks."""
    ci = (REPO / ".ci" / "run").read_text()
    oldest = re.search(r"OLDEST_TORCH=\$\{OLDEST_TORCH:-([0-9.]+)\}", ci).group(1)
    torch_req = next(Requirement(r) for r in _project()["dependencies"]
                     if Requirement(r).name == "torch")
    assert str(torch_req.specifier) == f">={oldest}"
    env = (REPO / "environment.yml").read_text()
    assert f"torch>={oldest}" in env
    readme = (REPO / "README.md").read_text()
    assert f"Any torch from {oldest} on is supported" in readme
    assert f'pip install "torch=={oldest}.*" -e ".[dev]" -c constraints.txt' in readme
    assert f'"torch==$OLDEST_TORCH.*" -e ".[dev]" -c constraints.txt' in ci
