"""Transfer plans ("recursive partition"): which pieces of which training shard each inference rank needs.

Training holds every parameter sharded FSDP-style: along one dim across N ranks (`Shard(dim)`), with torch.chunk
sizes (what FSDP2 does: ceil(n/N) per rank, trailing ranks may get 0), tensor_split sizes (`split="even"`) or
explicit sizes; or replicated (`Replicate()`, DDP). Inference holds it tensor-parallel across M ranks: column-
parallel = `Shard(0)` (q/k/v/gate/up, vocab-parallel embeddings and lm_head), row-parallel = `Shard(1)`
(o/down), or `Replicate()` (norms). Every shard is an axis-aligned box of the full tensor.

For each inference rank r and parameter p the planner starts from r's destination box and cuts it recursively
by the training boxes: the overlap with a source box becomes a `Piece` (source rank, source-local slices,
destination-local slices), the rest of the box (≤ 2·ndim smaller boxes) is cut by the next source. So
- every element an inference rank needs arrives exactly once (pieces of one destination are disjoint and
  cover its box — property-tested), and
- nothing is sent to a rank that does not hold it (pieces lie inside destination boxes).
When training replicates a tensor, the sources are tried starting at rank `r mod N`, so replicas share the load.

`execute_plan` runs a plan on CPU tensors (N source shard dicts → M destination shard dicts): the simulation
used by the tests, and the reference for a real transport that moves each piece as a message/slice copy.
Public API: `Shard`, `Replicate`, `Layout`, `Piece`, `TransferPlan`, `build_transfer_plan`, `shard_sizes`,
`shard_box`, `box_slices`, `shard_tensor`, `shard_state`, `execute_plan`, `llama_tp_placement`, `TransferPlanError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, Union

import torch

Box = tuple[tuple[int, int], ...]  # (start, stop) per dim, in global coordinates


class TransferPlanError(ValueError):
    """The layouts cannot produce a plan: a tensor without a placement, sizes that don't add up, bad dims."""


@dataclass(frozen=True)
class Shard:
    """Split along `dim` across the layout's ranks. `sizes` (one per rank, summing to the dim) overrides
    `split`: "chunk" = torch.chunk / FSDP2 (ceil(n/N) each, trailing ranks may be empty), "even" =
    torch.tensor_split (sizes differ by at most 1)."""

    dim: int = 0
    sizes: tuple[int, ...] | None = None
    split: str = "chunk"


@dataclass(frozen=True)
class Replicate:
    """Every rank holds the whole tensor."""


Placement = Union[Shard, Replicate]


def column() -> Shard:
    """Column-parallel linear (output features, dim 0, split across ranks)."""
    return Shard(0, split="even")


def row() -> Shard:
    """Row-parallel linear (input features, dim 1)."""
    return Shard(1, split="even")


@dataclass
class Layout:
    """A parallel layout: `world_size` ranks and a placement per parameter name (or a rule name → placement,
    or a default for names not listed)."""

    world_size: int
    placements: Mapping[str, Placement] | Callable[[str, tuple[int, ...]], Placement] = field(default_factory=dict)
    default: Placement | None = None

    def placement(self, name: str, shape: tuple[int, ...]) -> Placement:
        if callable(self.placements):
            return self.placements(name, shape)
        p = self.placements.get(name, self.default)
        if p is None:
            raise TransferPlanError(f"layout (world {self.world_size}) has no placement for tensor '{name}' "
                                    "and no default — every tensor must be covered")
        return p


def shard_sizes(n: int, world: int, placement: Shard) -> list[int]:
    """Per-rank lengths along the sharded dim (length `world`, summing to n)."""
    if placement.sizes is not None:
        sizes = [int(s) for s in placement.sizes]
        if len(sizes) != world or sum(sizes) != n or min(sizes) < 0:
            raise TransferPlanError(f"explicit shard sizes {sizes} must be {world} non-negative numbers "
                                    f"summing to {n}")
        return sizes
    if placement.split == "chunk":
        c = -(-n // world) if n else 0
        return [max(0, min(c, n - i * c)) for i in range(world)]
    if placement.split == "even":
        q, r = divmod(n, world)
        return [q + (1 if i < r else 0) for i in range(world)]
    raise TransferPlanError(f"unknown split '{placement.split}' (chunk or even)")


def shard_box(shape: tuple[int, ...], placement: Placement, world: int, rank: int) -> Box:
    """The global box of `rank`'s shard."""
    full = tuple((0, s) for s in shape)
    if isinstance(placement, Replicate):
        return full
    d = placement.dim
    if not -len(shape) <= d < len(shape):
        raise TransferPlanError(f"shard dim {d} is out of range for a tensor of shape {tuple(shape)}")
    d %= len(shape)
    sizes = shard_sizes(shape[d], world, placement)
    start = sum(sizes[:rank])
    return full[:d] + ((start, start + sizes[rank]),) + full[d + 1:]


def box_slices(box: Box, origin: Box | None = None) -> tuple[slice, ...]:
    """Index tuple of `box` in global coordinates, or relative to the shard whose box is `origin`."""
    if origin is None:
        return tuple(slice(a, b) for a, b in box)
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def _numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def _intersect(x: Box, y: Box) -> Box | None:
    out = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(x, y))
    return out if all(a < b for a, b in out) else None


def _subtract(box: Box, cut: Box) -> list[Box]:
    """`box` minus `cut` (cut ⊆ box) as ≤ 2·ndim disjoint boxes: peel off the part below/above the cut along
    each dim in turn, then narrow that dim to the cut."""
    rest, cur = [], list(box)
    for d, ((a, b), (c0, c1)) in enumerate(zip(box, cut)):
        if a < c0:
            rest.append(tuple(cur[:d]) + ((a, c0),) + tuple(cur[d + 1:]))
        if c1 < b:
            rest.append(tuple(cur[:d]) + ((c1, b),) + tuple(cur[d + 1:]))
        cur[d] = (c0, c1)
    return rest


@dataclass(frozen=True)
class Piece:
    """One message: the part `box` (global coordinates) of tensor `name`, from training rank `src` to inference
    rank `dst`. `src_slices`/`dst_slices` index the source/destination *shards* (local coordinates)."""

    name: str
    src: int
    dst: int
    box: Box
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]

    @property
    def numel(self) -> int:
        return _numel(self.box)


@dataclass
class TransferPlan:
    """All pieces, plus the shapes/dtypes/boxes they were planned from."""

    pieces: list[Piece]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    src_boxes: dict[str, list[Box]]
    dst_boxes: dict[str, list[Box]]
    src_world: int
    dst_world: int

    def for_dst(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == rank]

    def for_src(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.src == rank]

    def nbytes(self, piece: Piece) -> int:
        return piece.numel * self.dtypes[piece.name].itemsize

    @property
    def total_bytes(self) -> int:
        return sum(self.nbytes(p) for p in self.pieces)

    @property
    def pairs(self) -> dict[tuple[int, int], list[Piece]]:
        """(src, dst) → pieces: with bucketing, one message per pair instead of one per piece."""
        out: dict[tuple[int, int], list[Piece]] = {}
        for p in self.pieces:
            out.setdefault((p.src, p.dst), []).append(p)
        return out

    def summary(self) -> dict:
        return {"src_world": self.src_world, "dst_world": self.dst_world, "tensors": len(self.shapes),
                "pieces": len(self.pieces), "rank_pairs": len(self.pairs), "bytes": self.total_bytes}


def build_transfer_plan(shapes: Mapping[str, Sequence[int]], train: Layout, infer: Layout,
                        dtypes: Mapping[str, torch.dtype] | None = None) -> TransferPlan:
    """Plan the hand-over of tensors `shapes` (name → full shape) from layout `train` to layout `infer`.

    Raises `TransferPlanError` when a tensor has no placement in either layout, a layout names a tensor that
    does not exist, sizes don't add up, a shard dim is out of range, or the training shards leave part of a
    tensor uncovered.
    """
    if train.world_size < 1 or infer.world_size < 1:
        raise TransferPlanError(f"world sizes must be ≥ 1 (train {train.world_size}, infer {infer.world_size})")
    for lay, what in ((train, "training"), (infer, "inference")):
        if not callable(lay.placements):
            extra = sorted(set(lay.placements) - set(shapes))
            if extra:
                raise TransferPlanError(f"{what} layout names tensors that are not in the model: {extra[:5]}")
    dtypes = dict(dtypes or {})
    pieces: list[Piece] = []
    src_boxes: dict[str, list[Box]] = {}
    dst_boxes: dict[str, list[Box]] = {}
    N, M = train.world_size, infer.world_size
    for name, shape in shapes.items():
        shape = tuple(int(s) for s in shape)
        dtypes.setdefault(name, torch.float32)
        sb = [shard_box(shape, train.placement(name, shape), N, r) for r in range(N)]
        db = [shard_box(shape, infer.placement(name, shape), M, r) for r in range(M)]
        src_boxes[name], dst_boxes[name] = sb, db
        for r in range(M):
            remaining = [db[r]] if _numel(db[r]) else []
            for k in range(N):
                if not remaining:
                    break
                s = (r + k) % N
                if not _numel(sb[s]):
                    continue
                nxt = []
                for rem in remaining:
                    inter = _intersect(rem, sb[s])
                    if inter is None:
                        nxt.append(rem)
                        continue
                    pieces.append(Piece(name, s, r, inter, box_slices(inter, sb[s]), box_slices(inter, db[r])))
                    nxt.extend(_subtract(rem, inter))
                remaining = nxt
            if remaining:
                raise TransferPlanError(f"training layout does not cover tensor '{name}' {shape}: inference "
                                        f"rank {r} still needs {remaining[0]}")
    return TransferPlan(pieces, {n: tuple(int(x) for x in s) for n, s in shapes.items()}, dtypes,
                        src_boxes, dst_boxes, N, M)


def shard_tensor(full: torch.Tensor, placement: Placement, world: int, rank: int) -> torch.Tensor:
    """Reference slicing: `rank`'s shard of `full` (a view)."""
    return full[box_slices(shard_box(tuple(full.shape), placement, world, rank))]


def shard_state(state: Mapping[str, torch.Tensor], layout: Layout) -> list[dict[str, torch.Tensor]]:
    """Per-rank shard dicts of a full state dict under `layout` (views of `state`)."""
    return [{n: shard_tensor(t, layout.placement(n, tuple(t.shape)), layout.world_size, r)
             for n, t in state.items()} for r in range(layout.world_size)]


@torch.no_grad()
def execute_plan(plan: TransferPlan, src_shards: Sequence[Mapping[str, torch.Tensor]]
                 ) -> list[dict[str, torch.Tensor]]:
    """Simulate the plan on CPU: N source shard dicts → M destination shard dicts, one slice copy per piece."""
    if len(src_shards) != plan.src_world:
        raise TransferPlanError(f"plan has {plan.src_world} source ranks, got {len(src_shards)} shard dicts")
    for name, boxes in plan.src_boxes.items():
        for r, box in enumerate(boxes):
            got = tuple(src_shards[r][name].shape) if name in src_shards[r] else None
            want = tuple(b - a for a, b in box)
            if got != want:
                raise TransferPlanError(f"source rank {r} shard of '{name}' has shape {got}, plan expects {want}")
    out: list[dict[str, torch.Tensor]] = []
    for r in range(plan.dst_world):
        out.append({})
        for name, boxes in plan.dst_boxes.items():
            ref = src_shards[0][name]
            out[r][name] = torch.empty(tuple(b - a for a, b in boxes[r]), dtype=ref.dtype, device=ref.device)
    for p in plan.pieces:
        out[p.dst][p.name][p.dst_slices] = src_shards[p.src][p.name][p.src_slices]
    return out


_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")


def llama_tp_placement(name: str, shape: tuple[int, ...]) -> Placement:
    """Megatron/vLLM tensor parallelism for Llama/Qwen-style names: q/k/v/gate/up column-parallel (weight and
    bias on dim 0), o/down row-parallel (weight on dim 1, bias replicated), embeddings and lm_head
    vocab-parallel (dim 0), everything else (norms) replicated. Usable as `Layout(M, llama_tp_placement)`."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    if module in _COLUMN or module in _VOCAB:
        return column()
    if module in _ROW:
        return row() if len(shape) == 2 else Replicate()
    return Replicate()
