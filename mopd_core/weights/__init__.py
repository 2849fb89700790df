"""Colocated weight hand-over from the trainer to the rollout engine.

Two parts, each usable alone (whole state dicts move: the in-process vLLM engine and the student's servers
reshard for tensor parallelism in their own `load_weights`, and the Ray trainers gather FSDP2 shards first):
- `buckets`: pack named tensors into a few flat per-(dtype, device) buffers of bounded size and unpack them as
  zero-copy views ("group tensor packing") — one IPC handle/message per bucket instead of per tensor.
- `transports`: in-process (zero-copy), CUDA IPC, host shared memory (the NPU path), torch.distributed
  broadcast, safetensors file — one `send`/`receive` interface, each reporting bytes copied, handles/messages
  and seconds.

Torch only (no transformers/ray at import), so Ray workers and spawned receivers import it cheaply.
"""

from .buckets import (DEFAULT_BUCKET_BYTES, Bucket, BucketError, BucketLayout, PackedBuckets, TensorMeta,
                      as_buckets, bind_to_buckets, buckets_bound, buckets_from_layout, pack_buckets, plan_buckets,
                      refill_buckets, single_tensor_buckets)
from .transports import (CollectiveTransport, CudaIpcTransport, InProcessTransport, Received,
                         SafetensorsTransport, Sent, SharedMemoryTransport, TransferReport, Transport,
                         TransportError, make_transport)

__all__ = [
    "DEFAULT_BUCKET_BYTES", "Bucket", "BucketError", "BucketLayout", "PackedBuckets", "TensorMeta", "as_buckets",
    "bind_to_buckets", "buckets_bound", "buckets_from_layout", "pack_buckets", "plan_buckets", "refill_buckets",
    "single_tensor_buckets",
    "CollectiveTransport", "CudaIpcTransport", "InProcessTransport", "Received", "SafetensorsTransport", "Sent",
    "SharedMemoryTransport", "TransferReport", "Transport", "TransportError", "make_transport",
]
