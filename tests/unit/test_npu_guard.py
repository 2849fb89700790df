"""`import mopd_core` keeps working when torch_npu is absent or broken (a CANN-less machine). The broken
package is a stand-in written here: the real one cannot be installed on these machines (it breaks torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import mopd_core.recipe, mopd_core.runtime.device as D; "
         "print(D.npu_available(), D.resolve('auto').kind)")


def _run(extra_path: Path | None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path or ""), str(ROOT)) if p)
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)


def test_absent_torch_npu():
    p = _run(None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[0] == "False"


def test_broken_torch_npu_is_ignored(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    p = _run(tmp_path)
    assert p.returncode == 0, p.stderr
    out = p.stdout.split()
    assert out[0] == "False" and out[1] in ("cpu", "cuda")
