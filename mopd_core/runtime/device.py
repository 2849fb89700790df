"""The one place that knows how cpu, cuda and npu differ.

| kind | torch.distributed | visible-devices env | device memory | hand a tensor to another process |
|---|---|---|---|---|
| cpu  | gloo | — | host RSS only | (shared memory) |
| cuda | nccl | `CUDA_VISIBLE_DEVICES` | `torch.cuda.*` | CUDA IPC handles (0 bytes copied) |
| npu  | hccl | `ASCEND_RT_VISIBLE_DEVICES` | `torch.npu.*` (mirrors torch.cuda) | no IPC: host shared memory (AReaL-Ascend) |

`torch_npu` is imported only when the package is present and imports cleanly: on machines without Ascend CANN
it fails (libhccl.so missing), and once installed it breaks plain `import torch` unless
`TORCH_DEVICE_BACKEND_AUTOLOAD=0` — so we set that before probing and never let a broken install escape.
Everything else here goes through `device_module(kind)` (`torch.cuda` / `torch.npu`), so the npu path is the
cuda path with another module — which is also how the CPU tests check it (a fake `torch_npu` in `sys.modules`).
"""

from __future__ import annotations

import importlib.util
import os
import resource
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import PlacementError

DeviceKind = str  # "cpu" | "cuda" | "npu"


def _torch_npu_present() -> bool:
    if "torch_npu" in sys.modules:  # already imported (or injected by a test)
        return sys.modules["torch_npu"] is not None
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


@lru_cache(maxsize=1)
def npu_available() -> bool:
    """True only when torch_npu imports and reports a device; never raises."""
    if not _torch_npu_present():
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


def _info(kind: str) -> DeviceInfo:
    k = kind_of(kind)
    if k not in _INFO:
        raise ValueError(f"runtime.device='{kind}' is not one of auto, cpu, cuda, npu")
    return _INFO[k]


def resolve(kind: str = "auto") -> DeviceInfo:
    """`auto` picks npu, then cuda, then cpu. Asking for a missing device is a one-line error."""
    if kind == "auto":
        kind = "npu" if npu_available() else "cuda" if cuda_available() else "cpu"
    if kind not in _INFO:
        raise ValueError(f"runtime.device='{kind}' is not one of auto, cpu, cuda, npu")
    if kind == "cuda" and not cuda_available():
        raise PlacementError("runtime.device=cuda but torch sees no CUDA device; use runtime.device=cpu or auto")
    if kind == "npu" and not npu_available():
        raise PlacementError("runtime.device=npu but torch_npu is missing or broken (needs Ascend CANN); "
                             "install the `npu` extra on an Ascend host or use runtime.device=auto")
    return _INFO[kind]


def kind_of(device: torch.device | str) -> DeviceKind:
    """`"cuda:1"`, `torch.device("npu", 0)`, `"cpu"` → `"cuda"` / `"npu"` / `"cpu"` (no torch_npu needed)."""
    s = str(device)
    return s.split(":", 1)[0]


def dist_backend(kind: str) -> str:
    """torch.distributed backend: gloo (cpu), nccl (cuda), hccl (npu; registered by torch_npu)."""
    return _info(kind).dist_backend


def visible_devices_env(kind: str) -> str | None:
    """The env var that restricts which devices a child process sees: CUDA_VISIBLE_DEVICES /
    ASCEND_RT_VISIBLE_DEVICES; None on cpu."""
    return _info(kind).visible_devices_env


def ipc_supported(kind: str) -> bool:
    """Can a device tensor be handed to another process without a host copy? cuda: yes (CUDA IPC); npu: no —
    hand-overs go through host shared memory (`weights.SharedMemoryTransport`), as AReaL-Ascend does."""
    return _info(kind).supports_ipc


def handover_transport(kind: str, same_process: bool) -> str:
    """The `mopd_core.weights` transport for a colocated trainer → rollout-engine hand-over: `inprocess` when
    both live in one process (zero-copy), else `cuda_ipc` where the device has IPC, else `shared_memory`."""
    if same_process:
        return "inprocess"
    return "cuda_ipc" if ipc_supported(kind) else "shared_memory"


# The Ray resource that names each device kind (a worker's bundle asks for one, `get_accelerator_ids` keys by it).
RAY_RESOURCE = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}


def cluster_transport(kind: str) -> str:
    """The default weight transport of a Ray cluster (`distributed.cluster`: training rank 0 → every rollout
    instance). On an accelerator the trainer on an instance's own bundle sends, a hand-over between two processes
    on one device: `handover_transport(kind, same_process=False)` (cuda_ipc, or shared_memory on npu). On cpu a
    `collective` broadcast over the weights group instead: the instances need not share the trainer's host (host
    shared memory would need that), and gloo's broadcast costs a CPU nothing a device copy would save."""
    return "collective" if kind == "cpu" else handover_transport(kind, same_process=False)


def current_index(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.current_device()
    if kind == "npu":
        return torch.npu.current_device()  # type: ignore[attr-defined]
    return 0


def _module(kind: str):
    return getattr(torch, kind, None) if kind != "cpu" else None


def device_module(kind: str):
    """`torch.cuda` / `torch.npu` (present once torch_npu is imported); None on cpu."""
    return _module(kind)


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
    """Memory in MiB: host RSS always; allocated/reserved/peak device memory on cuda and npu
    (`torch.cuda.*` / `torch.npu.*`: memory_allocated, memory_reserved, max_memory_allocated)."""
    out = {"mem/host_rss_mb": host_rss_mb(), "mem/host_peak_rss_mb": peak_rss_mb()}
    mod = _module(kind)
    if mod is not None:
        out["mem/device_allocated_mb"] = mod.memory_allocated() / 2**20
        out["mem/device_reserved_mb"] = mod.memory_reserved() / 2**20
        out["mem/device_peak_mb"] = mod.max_memory_allocated() / 2**20
    return out


def reset_peak_memory_stats(kind: str) -> None:
    """Start a new peak window (`mem/device_peak_mb`) on cuda/npu; no-op on cpu."""
    mod = _module(kind)
    if mod is not None:
        mod.reset_peak_memory_stats()


def mem_get_info(kind: str) -> tuple[int, int]:
    """(free, total) bytes of the device as the driver sees it — includes memory held by other allocators in
    this process (a vLLM engine's weights and KV cache live outside torch's caching allocator, so its sleep/wake
    shows here and not in `memory_allocated`). On cpu: host MemAvailable / MemTotal."""
    mod = _module(kind)
    if mod is not None:
        free, total = mod.mem_get_info()
        return int(free), int(total)
    vals = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                vals[k] = int(v.split()[0]) * 1024
    except OSError:
        return 0, 0
    return vals.get("MemAvailable", 0), vals.get("MemTotal", 0)


def set_visible_devices(kind: str, ids: list[int]) -> dict[str, str]:
    """Env to restrict a child process to `ids` (for servers and Ray workers)."""
    var = _INFO[kind].visible_devices_env
    return {var: ",".join(map(str, ids))} if var else {}


def offload_module(module: torch.nn.Module, device: torch.device | str = "cpu", kind: str | None = None,
                   non_blocking: bool = False) -> int:
    """Move a module's parameters and buffers to `device` (e.g. off the accelerator between phases) and give
    the cached blocks back to the device when it left one. Returns the bytes moved."""
    moved = 0
    target = torch.device(device)
    src_kinds = set()
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device != target:
            moved += t.numel() * t.element_size()
            src_kinds.add(t.device.type)
    module.to(target, non_blocking=non_blocking)
    for k in src_kinds | ({kind} if kind else set()):
        if k != "cpu" and k != target.type:
            synchronize(k)
            empty_cache(k)
    return moved


class HostMirror:
    """Where the optimizer state (AdamW moments) waits on the host while colocated rollout and teachers use the
    device: one page-locked buffer per state tensor, allocated at the first offload and reused at every later
    one, each move one asynchronous copy per tensor and one synchronisation. A pageable `.to("cpu")` allocates host memory and stages each tensor through a bounce buffer every step — several times
    slower over the same link (the H200 stage: 12.8 GiB each way per step). As verl's and NeMo-RL's offload
    paths, pinned memory; on cpu nothing moves."""

    def __init__(self, kind: str, device: torch.device | str):
        self.kind, self.device = kind, torch.device(device)
        self.pin = kind in ("cuda", "npu")
        self.host: dict[tuple[int, str], torch.Tensor] = {}

    def _states(self, opt: torch.optim.Optimizer):
        for p, st in opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:  # 0-dim `step` counters stay put
                    yield (id(p), k), st, k, v

    def offload(self, opt: torch.optim.Optimizer) -> int:
        """Every state tensor into its host buffer; returns the bytes moved (0 on cpu)."""
        if self.kind == "cpu":
            return 0
        moved = 0
        for key, st, k, v in self._states(opt):
            if v.device.type == "cpu":
                continue
            h = self.host.get(key)
            if h is None or h.shape != v.shape or h.dtype != v.dtype:
                h = self.host[key] = torch.empty(v.shape, dtype=v.dtype, pin_memory=self.pin)
            h.copy_(v, non_blocking=self.pin)
            st[k] = h
            moved += v.numel() * v.element_size()
        synchronize(self.kind)  # the host copies are complete before anything reads them
        return moved

    def restore(self, opt: torch.optim.Optimizer) -> int:
        """Every state tensor back onto the device (fresh device memory; the host buffers stay for the next
        offload). The update's kernels run on the same stream, after the copies."""
        moved = 0
        for _, st, k, v in self._states(opt):
            if v.device == self.device or self.kind == "cpu":
                continue
            d = torch.empty(v.shape, dtype=v.dtype, device=self.device)
            d.copy_(v, non_blocking=self.pin)
            st[k] = d
            moved += v.numel() * v.element_size()
        return moved


def configure_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)  # also seeds cuda; npu seeds through torch.manual_seed with torch_npu loaded


# Training keeps fp32 master weights and optimizer state; `runtime.dtype` is the compute dtype. The single-process
# and DDP update (and the rollout that produces the behaviour log-probs, so the PPO ratio compares like with like)
# run under autocast; FSDP2 instead casts the gathered parameters (MixedPrecisionPolicy) — the way torch's FSDP2
# does mixed precision, which also halves the all-gather traffic. Autocast rather than bf16 parameters: AdamW on
# bf16 weights loses updates smaller than 2^-8 of a weight (lr 1e-6 on weights ~1 is far below that).
TRAIN_MASTER_DTYPE = "float32"


def autocast(kind: str, dtype: str):
    """The compute-dtype context of a training process: `torch.autocast` for bfloat16/float16 on `kind`'s device
    type (cpu, cuda, npu), a no-op context for float32."""
    import contextlib

    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=kind, dtype=getattr(torch, dtype))


# ---------------------------------------------------------------- what benchmarks read (tests/device/perf_checks.py)


def device_name(kind: str) -> str:
    """The accelerator's product name (`torch.cuda.get_device_name` / `torch.npu.get_device_name`), or "cpu"."""
    mod = _module(kind)
    return mod.get_device_name(current_index(kind)) if mod is not None else "cpu"


def allocated_bytes(kind: str) -> int:
    """Bytes the caching allocator has handed out now on the current device (0 on cpu)."""
    mod = _module(kind)
    return int(mod.memory_allocated()) if mod is not None else 0


def peak_allocated_bytes(kind: str) -> int:
    """The most bytes handed out since the last `reset_peak_memory_stats` (0 on cpu)."""
    mod = _module(kind)
    return int(mod.max_memory_allocated()) if mod is not None else 0


def compile_backend(kind: str) -> str | None:
    """The `torch.compile` backend for training on `kind`: inductor on cuda; None (do not compile) on cpu, where
    inductor's generated code costs more than it saves at the CPU presets' widths, and on npu, where inductor needs
    torch_npu's own backend support (pass one explicitly to `models.compile_decoder_layers` there)."""
    return "inductor" if kind == "cuda" else None


# ---------------------------------------------------------------- captured device graphs (rollout.graphed)


def graphs_supported(kind: str) -> bool:
    """Can a sequence of kernels be captured once and replayed (`torch.cuda.CUDAGraph`; torch_npu's
    `torch.npu.NPUGraph`, the same API)? Never on cpu, where the sampler runs the same step uncaptured."""
    mod = _module(kind)
    if mod is None:
        return False
    return hasattr(mod, "CUDAGraph" if kind == "cuda" else "NPUGraph")  # lib: torch.cuda / torch_npu builds


def capture_graph(kind: str, fn, warmup: int = 1):
    """Capture `fn()` (no arguments; it reads and writes tensors that stay allocated) into a device graph and
    return `(graph, output)`: `graph.replay()` re-runs the kernels and refreshes `output` in place. `fn` is run
    `warmup` times first on a side stream (lazy library handles, allocator warm-up: the device's documented
    capture recipe). Autocast's weight-cast cache is off during warm-up and capture: a cached cast would be
    captured as a stale tensor instead of a cast kernel that reads the current weights at every replay."""
    mod = _module(kind)
    graph = mod.CUDAGraph() if kind == "cuda" else mod.NPUGraph()
    ac = torch.autocast(device_type=kind, dtype=torch.get_autocast_dtype(kind),
                        enabled=torch.is_autocast_enabled(kind), cache_enabled=False)
    side = mod.Stream()
    side.wait_stream(mod.current_stream())
    with ac, mod.stream(side):
        for _ in range(warmup):
            fn()
    mod.current_stream().wait_stream(side)
    mod.synchronize()
    with ac, mod.graph(graph):
        out = fn()
    return graph, out
