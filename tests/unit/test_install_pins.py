"""The install files agree with each other: pyproject's lower bounds admit the versions CI runs
(requirements-ci.lock), the `npu` extra is the one released set infra/npu_venv.sh installs, and the Makefile's
torch index is overridable with its default (the configured indexes) unchanged."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and "==" in line:
            name, ver = line.split("==", 1)
            out[name.strip().lower().replace("_", "-")] = ver.strip()
    return out


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_lower_bounds_admit_the_locked_ci_versions():
    lock = _pins(ROOT / "requirements-ci.lock")
    for dep in _project()["dependencies"]:
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        assert name in lock, f"{name} is a dependency but not in requirements-ci.lock (run make lock)"
        assert req.specifier.contains(lock[name], prereleases=True), f"{dep} excludes the locked {lock[name]}"
    trl = next(Requirement(d) for d in _project()["dependencies"] if d.startswith("trl"))
    assert not trl.specifier.contains("1.15.0")  # mopd.kd_loss=full_jsd needs TRL 1.16


def test_npu_extra_is_the_set_npu_venv_installs():
    cons = _pins(ROOT / "infra" / "npu-constraints.txt")
    reqs = [Requirement(r) for r in _project()["optional-dependencies"]["npu"]]
    extra = {r.name.lower(): str(r.specifier) for r in reqs}
    assert set(extra) == {"torch", "torch-npu", "vllm-ascend", "transformers"}
    for name, spec in extra.items():
        assert spec == f"=={cons[name]}", (name, spec, cons[name])
    # torch-npu is built for exactly one torch release
    assert cons["torch-npu"].split(".post")[0] == cons["torch"]
    assert cons["vllm"] == cons["vllm-ascend"]  # vllm-ascend runs on the vLLM of its own version


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_torch_index_is_overridable_and_off_by_default():
    def dry(*args: str) -> str:
        return subprocess.run(["make", "-n", "-B", "-C", str(ROOT), "venv", *args], capture_output=True, text=True,
                              timeout=60).stdout
    default = next(ln for ln in dry().splitlines() if "torch==" in ln and "pip install" in ln)
    assert "--index-url" not in default
    cpu = next(ln for ln in dry("TORCH_INDEX=https://download.pytorch.org/whl/cpu").splitlines()
               if "torch==" in ln and "pip install" in ln)
    assert "--index-url https://download.pytorch.org/whl/cpu" in cpu
    assert "-c requirements-ci.lock" in dry()
