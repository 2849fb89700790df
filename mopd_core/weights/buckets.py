"""Bucketing ("group tensor packing"): many named tensors → a few flat buffers, and back as zero-copy views.

Why: every IPC handle, shared-memory segment or collective call has a fixed cost (CUDA IPC handles also cost
driver state on the receiver). A Llama-style model has ~9 tensors per layer (a 0.5B model ≈ 290 tensors), so
handing them over one by one costs hundreds of handles/messages. Packing them into a few buffers of a bounded
size costs one handle per bucket instead.

Layout
- Tensors are grouped by **(dtype, device)** only — not by shape: shape-keyed groups degenerate to one group per
  parameter for real models (awex learned this on Qwen3-30B: 4888 params → 4636 groups). Within a group the
  caller's order is kept (deterministic: sender and receiver derive the same layout from the same metadata).
- Each bucket is a 1-D buffer of its dtype, `total_numel` elements; entry i occupies
  `buffer[offset_i : offset_i + numel_i]` and is unpacked with `.view(shape_i)` — a view, no copy.
- A bucket holds at most `bucket_bytes` bytes. A tensor larger than `bucket_bytes` gets a bucket of its own
  (`oversize="own"`, the default): splitting it would make the receiver re-assemble a tensor from pieces, i.e. a
  copy, and one oversized bucket is still only one handle. `oversize="error"` refuses instead.
- Metadata (`BucketLayout`) is plain Python (dtype/device as strings), so it pickles/JSON-serialises to any
  process; the data moves separately through a transport.

Updates (the hand-over of every step after the first): `refill_buckets(packed, named)` re-packs with one fused
`torch._foreach_copy_` per bucket; `bind_to_buckets(module)` goes further and makes the trainer's parameters
views of the bucket buffers, so the optimizer writes into the buckets and an update is handed over with no
re-pack at all — each byte moves once, by the receiver's copy (or not at all, where it maps the buffers).

Public API: `TensorMeta`, `BucketLayout`, `Bucket`, `PackedBuckets`, `plan_buckets(specs, bucket_bytes)`,
`pack_buckets(named_tensors, bucket_bytes)`, `refill_buckets(packed, named_tensors)`,
`bind_to_buckets(module, bucket_bytes)`, `buckets_bound(packed, module)`, `buckets_from_layout(layout, buffers)`,
`single_tensor_buckets(named_tensors)` (one "bucket" per tensor — the per-tensor baseline).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024  # 512 MiB: vLLM/verl use 0.5–1 GiB buckets for colocated hand-over


class BucketError(ValueError):
    """Bad bucketing input (bucket size, unknown name, layout/buffer mismatch)."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → `"bfloat16"` (stable across processes and JSON)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise BucketError(f"unknown dtype '{name}'")
    return dt


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lives inside its bucket. `offset`/`numel` count elements of the bucket's dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(dtype_from_name(self.dtype))


@dataclass(frozen=True)
class BucketLayout:
    """Metadata of one bucket: dtype, device and the entries. Picklable; enough to rebuild the views."""

    dtype: str
    device: str
    entries: tuple[TensorMeta, ...]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(dtype_from_name(self.dtype))

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "device": self.device,
                "entries": [[e.name, list(e.shape), e.dtype, e.offset, e.numel] for e in self.entries]}

    @staticmethod
    def from_dict(d: Mapping) -> "BucketLayout":
        return BucketLayout(d["dtype"], d["device"],
                            tuple(TensorMeta(n, tuple(s), dt, o, k) for n, s, dt, o, k in d["entries"]))


@dataclass
class Bucket:
    """A flat 1-D buffer (`layout.numel` elements of `layout.dtype`) plus its layout."""

    buffer: torch.Tensor
    layout: BucketLayout

    def __post_init__(self) -> None:
        if self.buffer.dim() != 1 or self.buffer.numel() != self.layout.numel:
            raise BucketError(f"bucket buffer has shape {tuple(self.buffer.shape)}, layout needs "
                              f"({self.layout.numel},)")
        if dtype_name(self.buffer.dtype) != self.layout.dtype:
            raise BucketError(f"bucket buffer dtype {self.buffer.dtype} != layout dtype {self.layout.dtype}")

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def views(self) -> dict[str, torch.Tensor]:
        """name → view into `buffer` (shares its storage: no copy)."""
        return {e.name: self.buffer[e.offset:e.offset + e.numel].view(e.shape) for e in self.layout.entries}


@dataclass
class PackedBuckets:
    """The packed form of a set of named tensors: buckets in a deterministic order."""

    buckets: list[Bucket] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def layouts(self) -> list[BucketLayout]:
        return [b.layout for b in self.buckets]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [e.name for b in self.buckets for e in b.layout.entries]

    def tensors(self) -> dict[str, torch.Tensor]:
        """name → zero-copy view, for every tensor of every bucket."""
        out: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            out.update(b.views())
        return out

    def get(self, name: str) -> torch.Tensor:
        for b in self.buckets:
            for e in b.layout.entries:
                if e.name == name:
                    return b.buffer[e.offset:e.offset + e.numel].view(e.shape)
        raise BucketError(f"no tensor named '{name}' in these buckets")


def _device_str(device: torch.device | str) -> str:
    return str(torch.device(device))


def plan_buckets(specs: Iterable[tuple[str, tuple[int, ...], torch.dtype | str, torch.device | str]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, oversize: str = "own") -> list[BucketLayout]:
    """Layouts for `(name, shape, dtype, device)` specs without touching any data (works for meta tensors).

    Greedy in input order per (dtype, device) group: a bucket is closed when the next tensor would push it past
    `bucket_bytes`. Groups appear in order of their first tensor.
    """
    if bucket_bytes <= 0:
        raise BucketError(f"bucket_bytes must be positive, got {bucket_bytes}")
    if oversize not in ("own", "error"):
        raise BucketError(f"oversize must be 'own' or 'error', got '{oversize}'")
    groups: dict[tuple[str, str], list[tuple[str, tuple[int, ...]]]] = {}
    seen: set[str] = set()
    for name, shape, dtype, device in specs:
        if name in seen:
            raise BucketError(f"duplicate tensor name '{name}'")
        seen.add(name)
        dt = dtype if isinstance(dtype, str) else dtype_name(dtype)
        groups.setdefault((dt, _device_str(device)), []).append((name, tuple(int(s) for s in shape)))

    layouts: list[BucketLayout] = []
    for (dt, dev), items in groups.items():
        esize = element_size(dtype_from_name(dt))
        cur: list[TensorMeta] = []
        cur_numel = 0

        def close() -> None:
            nonlocal cur, cur_numel
            if cur:
                layouts.append(BucketLayout(dt, dev, tuple(cur)))
            cur, cur_numel = [], 0

        for name, shape in items:
            numel = math.prod(shape)
            nbytes = numel * esize
            if nbytes > bucket_bytes:
                if oversize == "error":
                    raise BucketError(f"tensor '{name}' ({nbytes} bytes) is larger than bucket_bytes="
                                      f"{bucket_bytes}; raise bucket_bytes or use oversize='own'")
                close()
                layouts.append(BucketLayout(dt, dev, (TensorMeta(name, shape, dt, 0, numel),)))
                continue
            if (cur_numel + numel) * esize > bucket_bytes:
                close()
            cur.append(TensorMeta(name, shape, dt, cur_numel, numel))
            cur_numel += numel
        close()
    return layouts


def allocate(layout: BucketLayout, device: torch.device | str | None = None) -> torch.Tensor:
    """An uninitialised flat buffer for `layout` (on its own device unless `device` is given)."""
    return torch.empty(layout.numel, dtype=dtype_from_name(layout.dtype),
                       device=device if device is not None else layout.device)


@torch.no_grad()
def pack_buckets(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, oversize: str = "own") -> PackedBuckets:
    """Copy named tensors into fresh flat buffers (one copy of every byte; inputs may be non-contiguous).

    Gradient tracking is dropped (`.detach()` semantics): buckets carry weights, not autograd graphs.
    """
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    layouts = plan_buckets(((n, tuple(t.shape), t.dtype, t.device) for n, t in items), bucket_bytes, oversize)
    packed = PackedBuckets([Bucket(allocate(lay), lay) for lay in layouts])
    refill_buckets(packed, dict(items))
    return packed


@torch.no_grad()
def refill_buckets(packed: PackedBuckets, named_tensors: Mapping[str, torch.Tensor]) -> int:
    """Copy the current values of `named_tensors` into `packed`'s buffers — the sender's half of every update
    after the first — with one fused `torch._foreach_copy_` per bucket (not a kernel launch per tensor).
    Entries whose tensor already is the bucket's view (`bind_to_buckets`) are skipped. Returns the bytes copied:
    0 when every tensor is bound, else each byte of the unbound ones once."""
    copied = 0
    for b in packed.buckets:
        # the bound test is integer arithmetic on addresses: a view per entry would cost more than a bound
        # update's whole hand-over on a GPU (hundreds of entries)
        base, esize, dt = b.buffer.data_ptr(), b.buffer.element_size(), b.buffer.dtype
        dst, src = [], []
        for e in b.layout.entries:
            t = named_tensors.get(e.name)
            if t is None:
                raise BucketError(f"no tensor named '{e.name}' to refill its bucket with")
            if t.dtype == dt and t.data_ptr() == base + e.offset * esize:
                continue  # bound: the parameter lives in the bucket already
            dst.append(b.buffer[e.offset:e.offset + e.numel].view(e.shape))
            src.append(t.detach())
            copied += e.nbytes
        if dst:
            torch._foreach_copy_(dst, src)
    return copied


@torch.no_grad()
def bind_to_buckets(module: torch.nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    oversize: str = "own") -> PackedBuckets:
    """Make `module`'s parameters live in flat bucket buffers: each parameter's `.data` becomes a view of its
    bucket (values copied once, here). From then on the optimizer's in-place updates write straight into the
    buckets, so handing an update over needs no re-pack (`refill_buckets` copies 0 bytes): one IPC handle per
    bucket maps the current weights, and the receiver's copy into its own parameters is the only pass over the
    bytes. The Parameter objects stay the same (an optimizer built before or after keeps working).

    Call it after the module reached its device and dtype and before training: `module.to(...)`, `.half()` or a
    re-sharding give the parameters new storage and silently unbind them (`buckets_bound` tells; `refill_buckets`
    then falls back to one fused copy per bucket). Tied parameters are bound once, under their first name
    (`named_parameters()` order). Plain (non-DTensor) parameters only."""
    params = list(module.named_parameters())
    layouts = plan_buckets(((n, tuple(p.shape), p.dtype, p.device) for n, p in params), bucket_bytes, oversize)
    by_name = dict(params)
    out = []
    for lay in layouts:
        buf = allocate(lay)
        b = Bucket(buf, lay)
        for e in lay.entries:
            view = buf[e.offset:e.offset + e.numel].view(e.shape)
            view.copy_(by_name[e.name].data)
            by_name[e.name].data = view
        out.append(b)
    return PackedBuckets(out)


def buckets_bound(packed: PackedBuckets, module: torch.nn.Module) -> bool:
    """Does every parameter of `module` named in `packed` still live in its bucket (`bind_to_buckets`)?"""
    params = dict(module.named_parameters())
    for b in packed.buckets:
        base, esize = b.buffer.data_ptr(), b.buffer.element_size()
        for e in b.layout.entries:
            p = params.get(e.name)
            if p is None or p.dtype != b.buffer.dtype or p.data_ptr() != base + e.offset * esize:
                return False
    return True


def buckets_from_layout(layouts: Iterable[BucketLayout], buffers: Iterable[torch.Tensor]) -> PackedBuckets:
    """Pair received buffers with their layouts (a buffer received as raw bytes is re-viewed as the dtype)."""
    out = []
    layouts, buffers = list(layouts), list(buffers)
    if len(layouts) != len(buffers):
        raise BucketError(f"{len(layouts)} layouts but {len(buffers)} buffers")
    for lay, buf in zip(layouts, buffers):
        dt = dtype_from_name(lay.dtype)
        if buf.dtype != dt:
            if buf.dtype != torch.uint8:
                raise BucketError(f"buffer dtype {buf.dtype} does not match layout dtype {lay.dtype}")
            buf = buf.view(dt)  # raw bytes (shared memory, broadcast as uint8) re-viewed, no copy
        out.append(Bucket(buf.reshape(-1), lay))
    return PackedBuckets(out)


def single_tensor_buckets(named_tensors: Mapping[str, torch.Tensor]) -> PackedBuckets:
    """The per-tensor baseline: one bucket per tensor. Contiguous tensors are wrapped without a copy (the
    bucket buffer is a flat view of the tensor); non-contiguous ones are copied into a contiguous buffer."""
    out = []
    for name, t in named_tensors.items():
        t = t.detach()
        flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
        dt = dtype_name(t.dtype)
        out.append(Bucket(flat, BucketLayout(dt, _device_str(t.device),
                                             (TensorMeta(name, tuple(t.shape), dt, 0, t.numel()),))))
    return PackedBuckets(out)


def as_buckets(payload: "PackedBuckets | Mapping[str, torch.Tensor]") -> PackedBuckets:
    """Normalise a transport payload: buckets stay as they are, a dict becomes one bucket per tensor."""
    if isinstance(payload, PackedBuckets):
        return payload
    if isinstance(payload, Mapping):
        return single_tensor_buckets(payload)
    raise BucketError(f"payload must be PackedBuckets or a name→tensor mapping, got {type(payload).__name__}")
