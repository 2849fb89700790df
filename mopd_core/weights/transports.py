"""Transports: how the trainer's weights reach the rollout engine. One interface, five ways.

    sent = transport.send(payload)            # payload: PackedBuckets or {name: tensor}
    got = transport.receive(sent.message)     # in the receiving process; got.tensors: {name: tensor}
    sent.report / got.report                  # TransferReport: bytes_copied, messages, seconds

`message` is what travels between the two sides (picklable, small: handles, paths, layouts); the transport
decides how the data itself moves. A `{name: tensor}` payload is sent one tensor per handle/message (the
per-tensor baseline); `PackedBuckets` (see `buckets.py`) one per bucket.

| transport | data path | bytes_copied (send / receive) | messages |
|---|---|---|---|
| `InProcessTransport` | receiver gets the sender's tensor objects (same storage) | 0 / 0 | objects handed over |
| `CudaIpcTransport` | CUDA IPC handle per buffer (torch.multiprocessing reductions); receiver maps the same device memory | 0 / 0 | handles |
| `SharedMemoryTransport` | sender copies each buffer into a host shared-memory file (`/dev/shm`), the receiver maps it (and copies it to its device if asked) — AReaL-Ascend's path where NPU IPC is missing | nbytes / 0 on CPU, nbytes onto a device | segments |
| `CollectiveTransport` | `torch.distributed.broadcast` from `src` (gloo/nccl/hccl), after one `broadcast_object_list` with the layouts | nbytes / nbytes | 1 + buffers |
| `SafetensorsTransport` | one safetensors file (portable fallback: any process, any machine with the path) | file bytes / file bytes | 1 file |

`bytes_copied` counts the bytes this side wrote into new memory, a file or the wire (0 = zero-copy).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from .buckets import BucketLayout, PackedBuckets, as_buckets, buckets_from_layout, dtype_from_name

Payload = PackedBuckets | Mapping[str, torch.Tensor]


class TransportError(RuntimeError):
    """A hand-over that cannot happen (wrong device, missing segment/file, wrong rank)."""


@dataclass
class TransferReport:
    """What one side of a hand-over cost."""

    transport: str
    direction: str          # "send" | "receive"
    tensors: int            # named tensors handed over
    bytes_total: int        # payload size
    bytes_copied: int       # bytes this side copied (memory, file or wire); 0 = zero-copy
    messages: int           # IPC handles / shared-memory segments / collective calls / files / objects
    seconds: float

    @property
    def handles(self) -> int:
        return self.messages

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Sent:
    message: Any
    report: TransferReport


@dataclass
class Received:
    tensors: dict[str, torch.Tensor]
    report: TransferReport
    buckets: PackedBuckets | None = None


def _count(payload: Payload) -> tuple[int, int, int]:
    """(tensors, bytes, units) of a payload; units = buckets or tensors."""
    if isinstance(payload, PackedBuckets):
        return len(payload.names), payload.nbytes, len(payload)
    return len(payload), sum(t.numel() * t.element_size() for t in payload.values()), len(payload)


class Transport:
    """Base class. Subclasses implement `send(payload) -> Sent` and `receive(message) -> Received`."""

    name = "base"

    def send(self, payload: Payload) -> Sent:  # pragma: no cover - interface
        raise NotImplementedError

    def receive(self, message: Any = None) -> Received:  # pragma: no cover - interface
        raise NotImplementedError

    def release(self) -> None:
        """Drop what the sender keeps alive for the receiver (IPC buffers, shared-memory files)."""

    def _report(self, direction: str, tensors: int, nbytes: int, copied: int, messages: int,
                t0: float) -> TransferReport:
        return TransferReport(self.name, direction, tensors, nbytes, copied, messages, time.perf_counter() - t0)


class InProcessTransport(Transport):
    """Same process (colocated trainer and rollout engine in one worker): hand over the tensor objects.

    The receiver's tensors share storage with the sender's (`data_ptr` equal); nothing is copied. Buckets are
    unpacked into views of their buffers, also without a copy."""

    name = "inprocess"

    def send(self, payload: Payload) -> Sent:
        t0 = time.perf_counter()
        n, nbytes, units = _count(payload)
        return Sent(payload, self._report("send", n, nbytes, 0, units, t0))

    def receive(self, message: Any = None) -> Received:
        t0 = time.perf_counter()
        if isinstance(message, PackedBuckets):
            tensors, buckets = message.tensors(), message
        elif isinstance(message, Mapping):
            tensors, buckets = dict(message), None
        else:
            raise TransportError(f"in-process message must be PackedBuckets or a dict, got {type(message)}")
        n, nbytes, units = _count(message)
        return Received(tensors, self._report("receive", n, nbytes, 0, units, t0), buckets)


class CudaIpcTransport(Transport):
    """CUDA IPC: one handle per buffer via `torch.multiprocessing.reductions.reduce_tensor`.

    The message is a list of (rebuild function, args) pairs + layouts; it pickles with plain pickle, so any
    channel (mp queue, Ray, ZMQ) carries it. The receiver maps the same device memory (0 bytes copied). The
    sender must keep the buffers alive until the receiver is done with them: `release()` drops them (the next
    `send` does too). A receiver that sees the GPU under another index (different CUDA_VISIBLE_DEVICES) passes
    `device_index`. Receiving in the sending process itself is not possible (CUDA refuses to open its own
    handles); use `InProcessTransport` there."""

    name = "cuda_ipc"

    def __init__(self) -> None:
        self._keep: list[torch.Tensor] = []

    def send(self, payload: Payload) -> Sent:
        from torch.multiprocessing.reductions import reduce_tensor

        t0 = time.perf_counter()
        packed = as_buckets(payload)
        self.release()
        handles = []
        for b in packed.buckets:
            if not b.buffer.is_cuda:
                raise TransportError(f"CUDA IPC needs CUDA tensors; bucket '{b.layout.entries[0].name}' is on "
                                     f"{b.buffer.device}")
            self._keep.append(b.buffer)
            handles.append(reduce_tensor(b.buffer))
        msg = {"handles": handles, "layouts": [b.layout.to_dict() for b in packed.buckets]}
        n, nbytes, _ = _count(packed)
        return Sent(msg, self._report("send", n, nbytes, 0, len(handles), t0))

    def receive(self, message: Any = None, device_index: int | None = None) -> Received:
        t0 = time.perf_counter()
        bufs = []
        for fn, args in message["handles"]:
            if device_index is not None:
                args = list(args)
                args[6] = device_index  # storage_device of rebuild_cuda_tensor
            bufs.append(fn(*args))
        packed = buckets_from_layout([BucketLayout.from_dict(d) for d in message["layouts"]], bufs)
        n, nbytes, _ = _count(packed)
        return Received(packed.tensors(), self._report("receive", n, nbytes, 0, len(bufs), t0), packed)

    def release(self) -> None:
        self._keep = []


class SharedMemoryTransport(Transport):
    """Host shared memory: one file per buffer under `directory` (default `/dev/shm`, a tmpfs), mapped with
    `torch.from_file(shared=True)` on both sides.

    This is how AReaL-Ascend hands NPU weights over where NPU IPC is missing: device → shared host buffer
    (one copy on the sender), the receiver maps it (no copy) and, with `device="npu"`/`"cuda"`, copies it onto
    its device (one copy). The message (paths + layouts) is plain data: any process on the same host can
    receive it (spawned children, Ray actors). The sender deletes the files on `release()` or the next `send`;
    a receiver that has mapped them keeps valid memory (Linux keeps unlinked mappings alive)."""

    name = "shared_memory"

    def __init__(self, directory: str | os.PathLike = "/dev/shm", prefix: str = "mopd-weights") -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self._files: list[Path] = []
        self._maps: list[torch.Tensor] = []

    def send(self, payload: Payload) -> Sent:
        t0 = time.perf_counter()
        packed = as_buckets(payload)
        self.release()
        self.directory.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:12]
        segs = []
        for i, b in enumerate(packed.buckets):
            if b.nbytes == 0:
                segs.append(None)
                continue
            path = self.directory / f"{self.prefix}-{os.getpid()}-{tag}-{i}"
            shm = torch.from_file(str(path), shared=True, size=b.nbytes, dtype=torch.uint8)
            self._files.append(path)
            self._maps.append(shm)
            shm.view(b.buffer.dtype).copy_(b.buffer)  # device → host (or host → host) copy into the segment
            segs.append(str(path))
        msg = {"segments": segs, "layouts": [b.layout.to_dict() for b in packed.buckets]}
        n, nbytes, _ = _count(packed)
        return Sent(msg, self._report("send", n, nbytes, nbytes, sum(s is not None for s in segs), t0))

    def receive(self, message: Any = None, device: str | torch.device | None = None) -> Received:
        t0 = time.perf_counter()
        layouts = [BucketLayout.from_dict(d) for d in message["layouts"]]
        bufs, copied = [], 0
        for path, lay in zip(message["segments"], layouts):
            if path is None:
                buf = torch.empty(0, dtype=dtype_from_name(lay.dtype))
            else:
                p = Path(path)
                if not p.exists() or p.stat().st_size != lay.nbytes:
                    raise TransportError(f"shared-memory segment {p} is missing or has the wrong size "
                                         "(released by the sender before the receiver mapped it?)")
                buf = torch.from_file(str(p), shared=True, size=lay.nbytes, dtype=torch.uint8)
                buf = buf.view(dtype_from_name(lay.dtype))
            if device is not None and torch.device(device).type != "cpu":
                buf = buf.to(device)
                copied += lay.nbytes
            bufs.append(buf)
        packed = buckets_from_layout(layouts, bufs)
        n, nbytes, _ = _count(packed)
        return Received(packed.tensors(), self._report("receive", n, nbytes, copied,
                                                       sum(s is not None for s in message["segments"]), t0),
                        packed)

    def release(self) -> None:
        for p in self._files:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        self._files, self._maps = [], []

    def __del__(self) -> None:  # best effort: never leave segments in /dev/shm
        try:
            self.release()
        except Exception:
            pass


class CollectiveTransport(Transport):
    """torch.distributed broadcast from rank `src` to the group (gloo on CPU, nccl on CUDA, hccl on NPU).

    Every rank of the group calls: `send(payload)` on `src`, `receive()` on the others. One
    `broadcast_object_list` carries the layouts, then one `broadcast` per buffer. Buffers travel as raw bytes
    (`uint8` views), so every dtype (bfloat16, bool) works on every backend and arrives bit-exact."""

    name = "collective"

    def __init__(self, src: int = 0, group: Any = None, device: str | torch.device = "cpu") -> None:
        self.src, self.group, self.device = src, group, torch.device(device)

    def send(self, payload: Payload) -> Sent:
        import torch.distributed as dist

        t0 = time.perf_counter()
        if dist.get_rank() != self.src:
            raise TransportError(f"rank {dist.get_rank()} called send; the source is rank {self.src}")
        packed = as_buckets(payload)
        dist.broadcast_object_list([[b.layout.to_dict() for b in packed.buckets]], src=self.src, group=self.group)
        calls = 1
        for b in packed.buckets:
            if b.nbytes:
                dist.broadcast(b.buffer.view(torch.uint8), src=self.src, group=self.group)
                calls += 1
        n, nbytes, _ = _count(packed)
        return Sent(None, self._report("send", n, nbytes, nbytes, calls, t0))

    def receive(self, message: Any = None) -> Received:
        import torch.distributed as dist

        t0 = time.perf_counter()
        obj: list[Any] = [None]
        dist.broadcast_object_list(obj, src=self.src, group=self.group)
        layouts = [BucketLayout.from_dict(d) for d in obj[0]]
        bufs, calls = [], 1
        for lay in layouts:
            buf = torch.empty(lay.nbytes, dtype=torch.uint8, device=self.device)
            if lay.nbytes:
                dist.broadcast(buf, src=self.src, group=self.group)
                calls += 1
            bufs.append(buf)
        packed = buckets_from_layout(layouts, bufs)
        n, nbytes, _ = _count(packed)
        return Received(packed.tensors(), self._report("receive", n, nbytes, nbytes, calls, t0), packed)


class SafetensorsTransport(Transport):
    """A safetensors file: the portable fallback (another process, another machine, a restart).

    Buckets are stored as tensors `__bucket.<i>` with their layouts in the header metadata, so the receiver
    gets views into a few large tensors; a dict is stored tensor by tensor. Written to a temp file and renamed,
    so a reader never sees half a file."""

    name = "safetensors"
    _META_KEY = "mopd.weights.buckets"

    def __init__(self, directory: str | os.PathLike, filename: str = "weights.safetensors") -> None:
        self.path = Path(directory) / filename

    def send(self, payload: Payload) -> Sent:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        if isinstance(payload, PackedBuckets):
            tensors = {f"__bucket.{i}": b.buffer for i, b in enumerate(payload.buckets)}
            meta = {self._META_KEY: json.dumps([b.layout.to_dict() for b in payload.buckets])}
            save_file(tensors, str(tmp), metadata=meta)
        else:
            # views into a larger storage (parameters bound to buckets, received bucket views) are written as
            # they are: safetensors' own writer refuses tensors sharing storage, and a clone each would copy the
            # model once more before the file write
            save_safetensors(payload, tmp)
        os.replace(tmp, self.path)
        n, nbytes, _ = _count(payload)
        return Sent(str(self.path), self._report("send", n, nbytes, self.path.stat().st_size, 1, t0))

    def receive(self, message: Any = None, device: str = "cpu") -> Received:
        from safetensors import safe_open
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        path = Path(message) if message is not None else self.path
        if not path.exists():
            raise TransportError(f"weights file {path} does not exist")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        loaded = load_file(str(path), device=device)
        if self._META_KEY in meta:
            layouts = [BucketLayout.from_dict(d) for d in json.loads(meta[self._META_KEY])]
            packed = buckets_from_layout(layouts, [loaded[f"__bucket.{i}"] for i in range(len(layouts))])
            tensors = packed.tensors()
        else:
            packed, tensors = None, loaded
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Received(tensors, self._report("receive", len(tensors), nbytes, path.stat().st_size, 1, t0), packed)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` as a safetensors file (the format: an 8-byte little-endian header length, a JSON header of
    dtype / shape / byte offsets, the raw bytes), streaming each tensor's bytes from its own memory: views that
    share a storage (parameters bound to buckets) are written without a clone, and device tensors pass through
    host memory one at a time. `safetensors.torch.load_file` reads the result. Returns the bytes written."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    items, off = [], 0
    # widest dtypes first (as safetensors' own writer): every tensor's bytes start at a multiple of its item size
    for name, t in sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0])):
        t = t.detach()
        if t.dtype not in _ST_DTYPES:
            raise TransportError(f"tensor '{name}' has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        items.append(t)
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in items:
            if t.numel():
                host = t.contiguous().cpu()  # no-ops for a contiguous CPU view
                f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
    return 8 + len(raw) + off


def make_transport(kind: str, **kwargs) -> Transport:
    """`inprocess | cuda_ipc | shared_memory | collective | safetensors` → a transport."""
    kinds = {c.name: c for c in (InProcessTransport, CudaIpcTransport, SharedMemoryTransport,
                                 CollectiveTransport, SafetensorsTransport)}
    if kind not in kinds:
        raise TransportError(f"unknown transport '{kind}' — one of {sorted(kinds)}")
    return kinds[kind](**kwargs)


__all__ = ["TransferReport", "Sent", "Received", "Transport", "TransportError", "InProcessTransport",
           "CudaIpcTransport", "SharedMemoryTransport", "CollectiveTransport", "SafetensorsTransport",
           "make_transport", "save_safetensors"]
