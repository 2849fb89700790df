"""Colocated weight hand-over from the trainer to the rollout engine (DESIGN §2 `weights/`, issue 5 item 1).

Three parts, each usable alone:
- `buckets`: pack named tensors into a few flat per-(dtype, device) buffers of bounded size and unpack them as
  zero-copy views ("group tensor packing") — one IPC handle/message per bucket instead of per tensor.
- `plan`: transfer plans between a training layout (FSDP-style shards over N ranks) and an inference layout
  (tensor-parallel over M ranks): for every inference rank the exact (source rank, slice) pieces it needs,
  each element once ("recursive partition"); `execute_plan` simulates a plan on CPU tensors.
- `transports`: in-process (zero-copy), CUDA IPC, host shared memory (the NPU path), torch.distributed
  broadcast, safetensors file — one `send`/`receive` interface, each reporting bytes copied, handles/messages
  and seconds.

Torch only (no transformers/ray at import), so Ray workers and spawned receivers import it cheaply.
"""

from .buckets import (DEFAULT_BUCKET_BYTES, Bucket, BucketError, BucketLayout, PackedBuckets, TensorMeta,
                      as_buckets, bind_to_buckets, buckets_bound, buckets_from_layout, pack_buckets, plan_buckets,
                      refill_buckets, single_tensor_buckets)
from .plan import (Layout, Piece, Replicate, Shard, TransferPlan, TransferPlanError, box_slices,
                   build_transfer_plan, column, execute_plan, llama_tp_placement, row, shard_box, shard_sizes,
                   shard_state, shard_tensor)
from .transports import (CollectiveTransport, CudaIpcTransport, InProcessTransport, Received,
                         SafetensorsTransport, Sent, SharedMemoryTransport, TransferReport, Transport,
                         TransportError, make_transport)

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Bucket", "BucketError", "BucketLayout", "PackedBuckets", "TensorMeta", "as_buckets",
    "bind_to_buckets", "buckets_bound", "buckets_from_layout", "pack_buckets", "plan_buckets", "refill_buckets",
    "single_tensor_buckets",
    "Layout", "Piece", "Replicate", "Shard", "TransferPlan", "TransferPlanError", "box_slices", "build_transfer_plan",
    "column", "execute_plan", "llama_tp_placement", "row", "shard_box", "shard_sizes", "shard_state", "shard_tensor",
    "CollectiveTransport", "CudaIpcTransport", "InProcessTransport", "Received", "SafetensorsTransport", "Sent",
    "SharedMemoryTransport", "TransferReport", "Transport", "TransportError", "make_transport",
]
