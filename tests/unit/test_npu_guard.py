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


def test_broken_torch_npu_leaves_the_rollout_engines_importable(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise OSError('libascendcl.so: cannot open shared object file')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))))
    probe = ("import mopd_core, mopd_core.rollout.engines as E, mopd_core.runtime.device as D; "
             "print(D.npu_available(), D.dist_backend('npu'), E.vllm_importable() in (True, False))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "hccl", "True"]


# ---------------------------------------------------------------- npu boundary, torch_npu faked
# The real torch_npu needs Ascend's CANN toolkit, which no CI machine has; these tests put a fake one in its
# place and check that the device layer takes the npu path — hccl, ASCEND_RT_VISIBLE_DEVICES, torch.npu.*
# memory — at the boundary.

import types  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mopd_core.errors import PlacementError  # noqa: E402
from mopd_core.runtime import device as D  # noqa: E402

MB = 2**20


class _FakeNpu:
    """What torch_npu registers as `torch.npu` (it mirrors torch.cuda), recording every call."""

    def __init__(self):
        self.calls: list[str] = []

    def _rec(self, name, value=None):
        self.calls.append(name)
        return value

    def is_available(self):
        return self._rec("is_available", True)

    def current_device(self):
        return self._rec("current_device", 0)

    def device_count(self):
        return self._rec("device_count", 2)

    def memory_allocated(self, device=None):
        return self._rec("memory_allocated", 3 * MB)

    def memory_reserved(self, device=None):
        return self._rec("memory_reserved", 8 * MB)

    def max_memory_allocated(self, device=None):
        return self._rec("max_memory_allocated", 5 * MB)

    def reset_peak_memory_stats(self, device=None):
        return self._rec("reset_peak_memory_stats")

    def mem_get_info(self, device=None):
        return self._rec("mem_get_info", (60 * MB, 64 * MB))

    def synchronize(self, device=None):
        return self._rec("synchronize")

    def empty_cache(self):
        return self._rec("empty_cache")


@pytest.fixture
def fake_torch_npu(monkeypatch):
    npu = _FakeNpu()
    mod = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    D.npu_available.cache_clear()
    yield npu
    D.npu_available.cache_clear()


def test_npu_boundary_torch_npu_faked_device_choice(fake_torch_npu):
    assert D.npu_available()
    info = D.resolve("auto")  # auto prefers npu over cuda and cpu
    assert info.kind == "npu" and info.dist_backend == "hccl"
    assert D.resolve("npu") is info
    assert D.dist_backend("npu") == "hccl" and D.dist_backend("npu:1") == "hccl"
    assert D.dist_backend("cuda") == "nccl" and D.dist_backend("cpu") == "gloo"
    assert D.visible_devices_env("npu") == "ASCEND_RT_VISIBLE_DEVICES"
    assert D.visible_devices_env("cuda") == "CUDA_VISIBLE_DEVICES" and D.visible_devices_env("cpu") is None
    assert D.set_visible_devices("npu", [2, 3]) == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    assert D.current_index("npu") == 0 and "current_device" in fake_torch_npu.calls
    # no device IPC on Ascend: a hand-over to another process goes through host shared memory
    assert not D.ipc_supported("npu") and D.ipc_supported("cuda")
    assert D.handover_transport("npu", same_process=False) == "shared_memory"
    assert D.handover_transport("cuda", same_process=False) == "cuda_ipc"
    assert D.handover_transport("npu", same_process=True) == "inprocess"
    assert D.device_module("npu") is fake_torch_npu and D.device_module("cpu") is None


def test_npu_boundary_torch_npu_faked_memory_calls(fake_torch_npu):
    st = D.memory_stats("npu")
    assert st["mem/device_allocated_mb"] == 3 and st["mem/device_reserved_mb"] == 8
    assert st["mem/device_peak_mb"] == 5 and st["mem/host_rss_mb"] > 0
    D.reset_peak_memory_stats("npu")
    assert D.mem_get_info("npu") == (60 * MB, 64 * MB)
    D.synchronize("npu")
    D.empty_cache("npu")
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "reset_peak_memory_stats",
                 "mem_get_info", "synchronize", "empty_cache"):
        assert name in fake_torch_npu.calls, name
    # cpu never touches a device module
    n = len(fake_torch_npu.calls)
    D.synchronize("cpu"), D.empty_cache("cpu"), D.reset_peak_memory_stats("cpu")
    assert "mem/device_allocated_mb" not in D.memory_stats("cpu")
    free, total = D.mem_get_info("cpu")
    assert 0 < free <= total and len(fake_torch_npu.calls) == n


def test_npu_boundary_torch_npu_faked_but_no_device(monkeypatch):
    """torch_npu imports but sees no NPU (or raises while probing): the npu path stays off, one-line error."""
    mod = types.ModuleType("torch_npu")
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    for probe in (lambda: False, lambda: (_ for _ in ()).throw(RuntimeError("drvMemGetInfo failed"))):
        monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=probe), raising=False)
        D.npu_available.cache_clear()
        try:
            assert not D.npu_available()
            assert D.resolve("auto").kind in ("cpu", "cuda")
            with pytest.raises(PlacementError, match="runtime.device=npu but torch_npu"):
                D.resolve("npu")
        finally:
            D.npu_available.cache_clear()


def test_npu_boundary_torch_npu_faked_in_a_fresh_process(tmp_path):
    """A torch_npu package on the path that imports and registers `torch.npu` (as the real one does): a fresh
    `import mopd_core` resolves `auto` to npu and the device layer names hccl and ASCEND_RT_VISIBLE_DEVICES."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import torch, types\n"
        "torch.npu = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 0,\n"
        "    memory_allocated=lambda *a: 1 << 20, memory_reserved=lambda *a: 2 << 20,\n"
        "    max_memory_allocated=lambda *a: 3 << 20, synchronize=lambda *a: None, empty_cache=lambda: None)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(tmp_path), str(ROOT))))
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    probe = ("import os, mopd_core.recipe, mopd_core.runtime.device as D; i = D.resolve('auto'); "
             "m = D.memory_stats(i.kind); "
             "print(i.kind, i.dist_backend, D.visible_devices_env(i.kind), m['mem/device_reserved_mb'], "
             "os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'])")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "2.0", "0"]
