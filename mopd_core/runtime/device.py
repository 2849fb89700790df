"""The one place that knows how cpu, cuda and npu differ.

`torch_npu` is imported only when the package is present and imports cleanly: on machines without Ascend CANN
it fails (libhccl.so missing), and once installed it breaks plain `import torch` unless
`TORCH_DEVICE_BACKEND_AUTOLOAD=0` — so we set that before probing and never let a broken install escape.
"""

from __future__ import annotations

import importlib.util
import os
import resource
from dataclasses import dataclass
from functools import lru_cache

import torch

DeviceKind = str  # "cpu" | "cuda" | "npu"


@lru_cache(maxsize=1)
def npu_available() -> bool:
    """True only when torch_npu imports and reports a device; never raises."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    except Exception:  # a broken CANN install must not take the engine down
        return False


def cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass(frozen=True)
class DeviceInfo:
    kind: DeviceKind
    dist_backend: str          # torch.distributed backend for this device
    visible_devices_env: str | None  # env var that restricts visible devices
    supports_ipc: bool         # can hand tensors to another process without a host copy

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind if self.kind == "cpu" else f"{self.kind}:{current_index(self.kind)}")


_INFO = {
    "cpu": DeviceInfo("cpu", "gloo", None, False),
    "cuda": DeviceInfo("cuda", "nccl", "CUDA_VISIBLE_DEVICES", True),
    "npu": DeviceInfo("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", False),  # AReaL-Ascend goes via CPU shm
}


def resolve(kind: str = "auto") -> DeviceInfo:
    """`auto` picks npu, then cuda, then cpu. Asking for a missing device is a one-line error."""
    if kind == "auto":
        kind = "npu" if npu_available() else "cuda" if cuda_available() else "cpu"
    if kind not in _INFO:
        raise ValueError(f"runtime.device='{kind}' is not one of auto, cpu, cuda, npu")
    if kind == "cuda" and not cuda_available():
        raise RuntimeError("runtime.device=cuda but torch sees no CUDA device; use runtime.device=cpu or auto")
    if kind == "npu" and not npu_available():
        raise RuntimeError("runtime.device=npu but torch_npu is missing or broken (needs Ascend CANN); "
                           "install the `npu` extra on an Ascend host or use runtime.device=auto")
    return _INFO[kind]


def current_index(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.current_device()
    if kind == "npu":
        return torch.npu.current_device()  # type: ignore[attr-defined]
    return 0


def _module(kind: str):
    return getattr(torch, kind, None) if kind != "cpu" else None


def synchronize(kind: str) -> None:
    mod = _module(kind)
    if mod is not None:
        mod.synchronize()


def empty_cache(kind: str) -> None:
    mod = _module(kind)
    if mod is not None:
        mod.empty_cache()


def host_rss_mb() -> float:
    """Current resident set size of this process (Linux /proc), MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mb()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def memory_stats(kind: str) -> dict[str, float]:
    """Memory in MiB: host RSS always; allocated/reserved/peak device memory on cuda and npu."""
    out = {"mem/host_rss_mb": host_rss_mb(), "mem/host_peak_rss_mb": peak_rss_mb()}
    mod = _module(kind)
    if mod is not None:
        out["mem/device_allocated_mb"] = mod.memory_allocated() / 2**20
        out["mem/device_reserved_mb"] = mod.memory_reserved() / 2**20
        out["mem/device_peak_mb"] = mod.max_memory_allocated() / 2**20
    return out


def set_visible_devices(kind: str, ids: list[int]) -> dict[str, str]:
    """Env to restrict a child process to `ids` (for servers and Ray workers)."""
    var = _INFO[kind].visible_devices_env
    return {var: ",".join(map(str, ids))} if var else {}


def configure_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)  # also seeds cuda; npu seeds through torch.manual_seed with torch_npu loaded
