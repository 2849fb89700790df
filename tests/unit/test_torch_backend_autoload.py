"""`import mopd_core` turns torch's device-backend autoload off before torch is imported: a broken out-of-tree
backend (torch_npu on a machine without CANN registers a `torch.backends` entry point that fails to load) must not
take `import torch` down. The stand-in here is an installed distribution (a dist-info with that entry point, in
a site dir on PYTHONPATH) whose backend raises on load — the real torch_npu cannot be installed on these
machines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _broken_backend_site(tmp: Path) -> Path:
    site = tmp / "site"
    (site / "broken_npu_backend").mkdir(parents=True)
    (site / "broken_npu_backend" / "__init__.py").write_text(
        "def _autoload():\n    raise ImportError('libhccl.so: cannot open shared object file')\n")
    info = site / "torch_npu_standin-2.13.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-npu-standin\nVersion: 2.13.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = broken_npu_backend:_autoload\n")
    return site


def _python(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join((str(site), str(ROOT)))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)


def test_the_stand_in_breaks_a_plain_torch_import(tmp_path):
    p = _python("import torch", _broken_backend_site(tmp_path))
    assert p.returncode != 0 and "Failed to load the backend extension: torch_npu" in p.stderr


def test_import_mopd_core_first_keeps_torch_importable(tmp_path):
    site = _broken_backend_site(tmp_path)
    p = _python("import mopd_core, torch, os; import mopd_core.runtime.device as D; "
                "print(torch.ones(2).sum().item(), os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'], "
                "D.npu_available(), D.resolve('auto').kind)", site)
    assert p.returncode == 0, p.stderr
    out = p.stdout.split()
    assert out[:3] == ["2.0", "0", "False"] and out[3] in ("cpu", "cuda")


def test_the_cli_entry_point_starts(tmp_path):
    p = _python("import sys; sys.argv = ['mopd', '--help']; from mopd_core.cli import main; main()",
                _broken_backend_site(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "usage" in p.stdout.lower()
