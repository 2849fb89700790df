"""Ray runtime: one placement-group bundle per device, data-parallel training
workers running torch.distributed, colocated rollout workers, and the weight hand-over between them.

Layout for `ClusterSpec(num_workers=N, kind=..., tp=k)`:

    bundles          0            1            2            3           one per device: {"CPU"|"GPU"|"NPU": 1}
    TrainWorker      rank 0       rank 1       rank 2       rank 3      DDP or FSDP2 over the train group (0..N-1)
    RolloutWorker    instance 0                instance 1               on bundles 0, k, 2k… (k=2 here):
                     rank N                    rank N+1                 a TP group of k trainers → one instance

`train_strategy`: `ddp` replicates the student on every rank (gradients all-reduced); `fsdp2` shards parameters,
gradients and optimizer state over the train group with torch's `fully_shard` (one unit per decoder layer, as
`_no_split_modules` names them, plus the root), so each rank holds ~1/N of them. `rollout=False` starts no rollout
workers: the on-policy loop samples in the driver from the gathered weights (`distributed.trainer`).

Every actor joins one torch.distributed world (trainers first, then rollout workers) with the device's backend
(gloo on CPU, nccl on CUDA, hccl on NPU — from `runtime.device`), and creates the same two subgroups: `train`
(the DDP ranks) and `weights` (training rank 0 + every rollout instance) for the collective hand-over.
Trainer and rollout worker on one bundle share its device and take turns (colocated): each asks for half of the
bundle's resource, so Ray puts both on the same device and sets the same visible-devices variable for both.

Weight hand-over (`mopd_core.weights`): the trainer packs its (unwrapped) state dict into buckets and
- `collective` (default on CPU): one `broadcast` per bucket from training rank 0 to all instances;
- `cuda_ipc` / `shared_memory` (defaults on cuda / npu): the trainer on the instance's own bundle sends, the
  message (handles or segment paths) travels through Ray, the instance maps the buffers. nccl refuses two ranks
  of one communicator on the same GPU, so a colocated collective hand-over is refused there with a hint.

On a CPU box Ray's logical resources exercise the same code: `init_ray(resources={"NPU": 2})` and
`ClusterSpec(kind="npu", device="cpu")` places workers on NPU bundles (Ray sets ASCEND_RT_VISIBLE_DEVICES)
while they compute on CPU with gloo.

Ray is imported inside functions only: importing `mopd_core` must stay cheap and Ray-free.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import PlacementError, WorkerLostError
from ..runtime import device as devlib
from ..weights import DEFAULT_BUCKET_BYTES

#: Ray resource each device kind binds per bundle.
RESOURCE = devlib.RAY_RESOURCE  # the Ray resource of each device kind (runtime.device owns the map)
TRANSPORTS = ("collective", "cuda_ipc", "shared_memory")
TRAIN_STRATEGIES = ("ddp", "fsdp2")
# Trainer and rollout worker share a bundle (colocated): each asks for this fraction of its resource.
_SHARE = 0.5


class ClusterError(PlacementError):
    """Bad cluster input or a cluster that cannot host the request; one line naming the field and the fix."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to place. Field names are the ones error messages refer to (`cluster.<field>`)."""

    num_workers: int = 2               # training workers = bundles = devices
    kind: str = "cpu"                  # bundle resource: cpu → CPU, cuda → GPU, npu → NPU (logical on a CPU box)
    device: str | None = None          # compute device inside workers; None = kind ("cpu" with kind=npu: no NPU)
    tp: int = 1                        # training workers per rollout instance (instance i on bundle i*tp)
    transport: str | None = None       # collective | cuda_ipc | shared_memory; None = by device
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES  # hand-over bucket size; None = one message per tensor
    dtype: str = "float32"             # student dtype in trainers and rollout workers
    num_threads: int = 1               # torch intra-op threads per worker (1: OpenMP spin-waits under contention)
    strategy: str = "PACK"             # placement-group strategy (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)
    cpus_per_bundle: float = 0.0       # extra CPUs reserved per GPU/NPU bundle (split between its two actors)
    pg_timeout_s: float = 30.0         # how long to wait for the placement group before giving up
    dist_timeout_s: float = 300.0      # torch.distributed timeout (init and every collective)
    train_strategy: str = "ddp"        # ddp (replicated student) | fsdp2 (sharded parameters + optimizer state)
    rollout: bool = True               # start rollout instances (False: the driver samples, trainers only)
    chat: Any = None                   # data.chat: rollout instances render prompts and stop as the driver does
    logprob_impl: str = "chunked"      # train.logprob_impl inside the trainers' update
    gradient_checkpointing: bool = False  # train.gradient_checkpointing in the trainers
    cpu_offload: bool = False          # train.fsdp_cpu_offload: FSDP2 shards (and the optimizer step) on the host
    max_tokens_per_micro_batch: int | None = None  # train.max_tokens_per_micro_batch (ranks agree on the count)
    packing: bool = False              # train.packing: micro-batches without padding

    @property
    def compute_device(self) -> str:
        """The torch device kind the workers compute on."""
        return self.device or self.kind

    @property
    def hand_over(self) -> str:
        """The weight transport actually used."""
        return self.transport or devlib.cluster_transport(self.compute_device)

    @property
    def num_instances(self) -> int:
        """Rollout instances: one per `tp` training workers (none with `rollout=False`)."""
        return self.num_workers // self.tp if self.rollout else 0

    def rollout_bundles(self) -> list[int]:
        """Bundle index of each rollout instance (stride `tp`)."""
        return list(range(0, self.num_workers, self.tp)) if self.rollout else []

    def validate(self) -> "ClusterSpec":
        """One-line `ClusterError` for input no cluster can satisfy; returns self."""
        _check_kind(self.kind)
        if self.compute_device not in RESOURCE:
            raise ClusterError(f"cluster.device='{self.device}' is not one of {', '.join(RESOURCE)} "
                               "(or None = same as cluster.kind)")
        if self.kind == "cpu" and self.compute_device != "cpu":
            raise ClusterError(f"cluster.device={self.compute_device} needs {RESOURCE[self.compute_device]} "
                               f"bundles; set cluster.kind={self.compute_device}")
        if self.num_workers < 1:
            raise ClusterError(f"cluster.num_workers={self.num_workers} must be >= 1")
        if self.tp < 1 or self.num_workers % self.tp:
            raise ClusterError(f"cluster.tp={self.tp} must be >= 1 and divide cluster.num_workers="
                               f"{self.num_workers} (a TP group of tp training workers becomes one rollout "
                               "instance)")
        if self.hand_over not in TRANSPORTS:
            raise ClusterError(f"cluster.transport='{self.transport}' is not one of {', '.join(TRANSPORTS)}")
        if self.hand_over == "collective" and self.compute_device != "cpu":
            # rollout instance 0 shares training rank 0's device; nccl (and hccl) allow one rank per device
            # in a communicator
            raise ClusterError(f"cluster.transport=collective would put training rank 0 and rollout instance 0 "
                               f"on the same {self.compute_device} device; use cluster.transport="
                               f"{devlib.cluster_transport(self.compute_device)} for colocated workers")
        if self.hand_over == "cuda_ipc" and self.compute_device != "cuda":
            raise ClusterError(f"cluster.transport=cuda_ipc needs cluster.device=cuda, got "
                               f"{self.compute_device}; use collective (cpu) or shared_memory")
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ClusterError(f"cluster.bucket_bytes={self.bucket_bytes} must be positive (or None)")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ClusterError(f"cluster.strategy='{self.strategy}' is not one of PACK, SPREAD, STRICT_PACK, "
                               "STRICT_SPREAD")
        if self.num_threads < 1:
            raise ClusterError(f"cluster.num_threads={self.num_threads} must be >= 1")
        if self.train_strategy not in TRAIN_STRATEGIES:
            raise ClusterError(f"cluster.train_strategy='{self.train_strategy}' is not one of "
                               f"{', '.join(TRAIN_STRATEGIES)}")
        return self


def _check_kind(kind: str) -> str:
    """The Ray resource of `kind`, or a one-line error."""
    if kind not in RESOURCE:
        raise ClusterError(f"cluster.kind='{kind}' is not one of {', '.join(RESOURCE)} — the Ray resource each "
                           "worker binds (cpu → CPU, cuda → GPU, npu → NPU)")
    return RESOURCE[kind]


# ---------------------------------------------------------------------------------------------- Ray and bundles

def init_ray(num_cpus: int | None = None, resources: Mapping[str, float] | None = None,
             tmp_dir: str | os.PathLike | None = None, **kwargs: Any) -> dict[str, float]:
    """Start (or join, if already started) a local Ray instance; returns its total resources.

    Token auth is off unless the caller set `RAY_AUTH_MODE` (otherwise Ray writes `~/.ray/auth_token`), the
    dashboard is off, and `tmp_dir` (keep it short: Ray's socket paths must stay under 107 bytes) replaces
    `/tmp/ray`. `resources` declares logical resources, e.g. `{"NPU": 2}` on a CPU box. Idempotent: a second
    call returns the running cluster's resources unchanged.
    """
    import ray

    if ray.is_initialized():
        return dict(ray.cluster_resources())
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if tmp_dir is not None:
        os.makedirs(tmp_dir, exist_ok=True)
        kwargs.setdefault("_temp_dir", os.path.abspath(tmp_dir))
    if not kwargs.get("address"):  # joining a cluster: its own `ray start` settings hold
        kwargs.setdefault("include_dashboard", False)
    npu_log = logging.getLogger("ray._private.accelerators.npu")
    level = npu_log.level
    if resources and "NPU" in resources:
        # declaring NPU makes Ray probe AscendCL for the chip type and log a traceback when it is absent
        npu_log.setLevel(logging.CRITICAL)
    try:
        ray.init(num_cpus=num_cpus, resources=dict(resources) if resources else None, **kwargs)
    finally:
        npu_log.setLevel(level)
    return dict(ray.cluster_resources())


def bundle_for(kind: str, cpus_per_bundle: float = 0.0) -> dict[str, float]:
    """The bundle of one device: `{"CPU": 1}`, `{"GPU": 1}` or `{"NPU": 1}` (+ `cpus_per_bundle` CPUs)."""
    res = _check_kind(kind)
    b = {res: 1.0}
    if res != "CPU" and cpus_per_bundle:
        b["CPU"] = float(cpus_per_bundle)
    return b


def device_placement_group(n: int, kind: str, *, strategy: str = "PACK", cpus_per_bundle: float = 0.0,
                           timeout_s: float = 30.0, name: str = ""):
    """A ready placement group with one bundle per device. Fails fast with one line when the cluster has fewer
    devices than asked for in total, and after `timeout_s` when they exist but others hold them."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = bundle_for(kind, cpus_per_bundle)
    if n < 1:
        raise ClusterError(f"cluster.num_workers={n} must be >= 1")
    total = ray.cluster_resources()
    for res, q in bundle.items():
        have = float(total.get(res, 0.0))
        if have < n * q:
            raise ClusterError(
                f"cluster.num_workers={n} needs {n * q:g} {res} (one bundle {bundle} per worker) but the Ray "
                f"cluster has {have:g} — lower cluster.num_workers or give Ray more "
                f"({_declare_hint(res, n * q)})")
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=name)
    if not pg.wait(timeout_s):
        avail = ray.available_resources()
        remove_placement_group(pg)
        raise ClusterError(
            f"placement group of {n} x {bundle} not ready after {timeout_s:g}s: available now "
            f"{ {r: avail.get(r, 0.0) for r in bundle} } — other jobs hold the rest; free them or raise "
            "cluster.pg_timeout_s")
    return pg


def _declare_hint(res: str, q: float) -> str:
    """How to give a Ray cluster more of `res`."""
    if res == "CPU":
        return f"ray.init(num_cpus={q:g}) / `ray start --num-cpus`"
    if res == "GPU":
        return f"ray.init(num_gpus={q:g}) / `ray start --num-gpus`"
    return f"ray.init(resources={{'{res}': {q:g}}}) / `ray start --resources`"


def _actor_options(spec: ClusterSpec, pg, bundle: int, name: str, share: float = _SHARE) -> dict[str, Any]:
    """Ray actor options pinning one worker to `bundle` and taking `share` of its device."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    res = RESOURCE[spec.kind]
    opts: dict[str, Any] = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=False),
        "max_restarts": 0, "name": name,
    }
    if res == "CPU":
        opts["num_cpus"] = share
    else:
        opts["num_cpus"] = spec.cpus_per_bundle * share
        if res == "GPU":
            opts["num_gpus"] = share
        else:
            opts["resources"] = {res: share}
    return opts


def _gather(refs: Sequence[Any], timeout_s: float | None, what: str,
            names: Sequence[str] | None = None) -> list[Any]:
    """`ray.get` that fails fast: the first worker error is raised at once (its peers may be blocked in a
    collective that will never complete — `WorkerGroup.stop` kills them), and a deadline ends the wait. A worker
    that died (killed, out of memory, its node lost) becomes a `WorkerLostError` naming it (`names[i]` for
    `refs[i]`); an exception raised inside a worker keeps its type and traceback."""
    import ray
    from ray.exceptions import RayActorError

    pending = list(refs)
    deadline = time.monotonic() + timeout_s if timeout_s is not None else None  # None: as long as it takes
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise WorkerLostError(f"{what} did not finish within {timeout_s:g}s (a worker is stuck or gone); "
                                  "stop the group and check the worker logs")
        try:
            ray.get(ready[0])
        except RayActorError as e:
            if getattr(e, "actor_init_failed", False):  # lib: ray ≥ 2.x — its constructor raised: that error, as it is
                raise
            i = list(refs).index(ready[0])
            who = names[i] if names else f"worker {i}"
            raise WorkerLostError(f"{what}: Ray worker {who} died ({type(e).__name__}) — the stage stops here; "
                                  "its last checkpoint is intact, run it again to resume") from e
    return ray.get(list(refs))


# ------------------------------------------------------------------------------------------------ the actors

def fully_shard_model(model: torch.nn.Module, group, device_type: str, dtype: str = "float32",
                      cpu_offload: bool = False) -> None:
    """FSDP2 as TRL/accelerate apply it to transformers models: one `fully_shard` unit per decoder layer (the
    classes `_no_split_modules` names; the whole model when it names none), then the root, which holds the
    embeddings, the final norm and lm_head, over `group`'s ranks. `dtype` other than float32: parameters are
    gathered in it and gradients reduced in float32 (`MixedPrecisionPolicy`) over float32 master shards. The
    chunked log-probs read lm_head's weight after the root's forward (`models.last_hidden_state` runs the whole
    model under FSDP), where the root keeps it unsharded until backward, so its gradient is reduce-scattered with
    the rest (tested against one process). `cpu_offload`: torch's `CPUOffloadPolicy` — the shards, their
    gradients and so the optimizer state stay in host memory (pinned where there is an accelerator: CPU-only
    torch cannot pin), each unit copied to the device for its forward/backward."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    mp = (MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
          if dtype != "float32" else MixedPrecisionPolicy())
    off = CPUOffloadPolicy(pin_memory=device_type != "cpu") if cpu_offload else OffloadPolicy()
    units = set(getattr(model, "_no_split_modules", None) or ())  # lib: transformers (a plain module: none)
    for mod in list(model.modules()):
        if type(mod).__name__ in units:
            fully_shard(mod, mesh=mesh, mp_policy=mp, offload_policy=off)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)


def _state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names and raw bytes: equal digests ⇔ bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous().reshape(-1)
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class _Worker:
    """What trainers and rollout workers share: device visibility, threads, the distributed world."""

    def __init__(self, rank: int, spec: ClusterSpec, model_path: str) -> None:
        """Runs first in the actor process: visible devices (before torch touches the device), threads."""
        from ..models import quiet_hf
        quiet_hf()  # as the recipe does in the driver: no per-load progress bars from N workers
        self.rank, self.spec, self.model_path = rank, spec, model_path
        self.world = spec.num_workers + spec.num_instances
        if spec.kind != "cpu":
            import ray

            # Ray already exports the variable for GPU/NPU actors; doing it here too keeps workers correct
            # under RAY_EXPERIMENTAL_NOSET_* and records it in one place (the device layer names the variable).
            ids = ray.get_runtime_context().get_accelerator_ids().get(RESOURCE[spec.kind], [])
            os.environ.update(devlib.set_visible_devices(spec.kind, [int(i) for i in ids]))
        devlib.configure_threads(spec.num_threads)
        self.dinfo = devlib.resolve(spec.compute_device)
        self.device = self.dinfo.torch_device
        self.model = None  # the student; loaded by the subclass
        self.train_group = self.weight_group = None
        self._transport = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port (asked of training rank 0: the rendezvous of the world)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def _init_dist(self, addr: str, port: int) -> None:
        """Join the world and build the two subgroups, in the same order on every rank (new_group is
        collective over the world)."""
        import torch.distributed as dist

        dist.init_process_group(self.dinfo.dist_backend, init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=self.spec.dist_timeout_s))
        n = self.spec.num_workers
        self.train_group = dist.new_group(list(range(n)))
        self.weight_group = dist.new_group([0] + list(range(n, self.world))) if self.spec.num_instances else None

    def info(self) -> dict[str, Any]:
        """Where this worker runs: pid, rank, device, backend, the visible-devices variable Ray/we set."""
        import ray

        var = self.dinfo.visible_devices_env
        kind_var = devlib.visible_devices_env(self.spec.kind)
        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "rank": self.rank, "device": str(self.device),
                "backend": self.dinfo.dist_backend, "torch_threads": torch.get_num_threads(),
                "accelerator_ids": ctx.get_accelerator_ids().get(RESOURCE[self.spec.kind], []),
                "visible_devices": {v: os.environ.get(v) for v in {var, kind_var} if v},
                "node_id": ctx.get_node_id()}

    def digest(self) -> str:
        """Digest of this worker's student weights (the plain module, never the DDP wrapper)."""
        return _state_digest(self.model.state_dict())


class TrainWorker(_Worker):
    """One data-parallel rank: the student under DDP or FSDP2 over the train group, AdamW + the loop's schedule,
    updated by the on-policy loop's own `policy_update` on this rank's rows of a batch."""

    def __init__(self, rank: int, spec: ClusterSpec, model_path: str, loop_cfg: Mapping[str, Any]) -> None:
        """Load the student onto this worker's device (DDP/FSDP2 come in `setup`, once the world exists)."""
        super().__init__(rank, spec, model_path)
        from ..config import PolicyLoopConfig
        from ..models import load_model

        from ..train.loop import enable_gradient_checkpointing

        self.cfg = PolicyLoopConfig(**dict(loop_cfg))
        # float32 master weights; spec.dtype is the compute dtype (DDP: autocast; FSDP2: MixedPrecisionPolicy)
        self.model = load_model(model_path, self.device, devlib.TRAIN_MASTER_DTYPE)
        self.model.train()
        if spec.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.ddp = self.opt = self.sched = None
        self.fsdp = spec.train_strategy == "fsdp2"

    def setup(self, addr: str, port: int, resume: str | None = None,
              scheduler_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Join the world, wrap the student (DDP: rank 0's weights broadcast to all; FSDP2: every rank keeps its
        shard of the same loaded weights), build the optimizer; `resume`: a checkpoint's sharded optimizer
        state (`save_sharded`), any number of ranks ago — torch.distributed.checkpoint reshards it."""
        from ..train.loop import lr_lambda

        self._init_dist(addr, port)
        if self.fsdp:
            fully_shard_model(self.model, self.train_group, self.device.type, self.spec.dtype,
                              cpu_offload=self.spec.cpu_offload)
            self.ddp = self.model  # FSDP2 changes the module in place: the loop calls it like the plain model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = None if self.device.type == "cpu" else [self.device.index or 0]
            self.ddp = DDP(self.model, device_ids=ids, process_group=self.train_group)
        c = self.cfg
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=c.lr, betas=tuple(c.betas),
                                     weight_decay=c.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(c))
        if resume is not None:
            self._load_optimizer(resume)
        if scheduler_state:
            self.sched.load_state_dict(dict(scheduler_state))
        return {**self.info(), **self.shard_bytes(), "cpu_offload": self._offloaded()}

    def _offloaded(self) -> bool:
        """Whether torch FSDP2 applied a CPU offload policy to this rank's shards (what it did, not what was
        asked: the report a run's stage.json keeps)."""
        if not self.fsdp:
            return False
        from torch.distributed.fsdp import CPUOffloadPolicy

        group = getattr(self.model._get_fsdp_state(), "_fsdp_param_group", None)  # lib: torch FSDP2 (private)
        return isinstance(getattr(group, "offload_policy", None), CPUOffloadPolicy)  # lib: torch FSDP2 (private)

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of the student's parameters and of the optimizer state (FSDP2: its shards)."""
        def local(t):
            t = t.to_local() if hasattr(t, "to_local") else t  # lib: torch DTensor (FSDP2 shards)
            return t.numel() * t.element_size()

        params = sum(local(p) for p in self.model.parameters())
        optim = sum(local(v) for st in (self.opt.state.values() if self.opt is not None else ())
                    for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"param_bytes": params, "optim_bytes": optim}

    def train_step(self, payload: Mapping[str, Any], temperature: float, seed: int) -> dict[str, float]:
        """Update on rows `rank::world` of the batch. Each rank's token weights are scaled by
        `world · n_local / n_global`, so the ranks' gradient mean (DDP all-reduce, FSDP2 reduce-scatter) equals the
        gradient of the token-mean loss over the whole batch (with `minibatches=1`, the single-process update up
        to float summation order)."""
        from ..train.loop import policy_update

        t0 = time.perf_counter()
        batch, adv, tw_user = payload["batch"], payload["advantages"], payload.get("token_weights")
        W = self.spec.num_workers
        rows = list(range(self.rank, batch.size, W))
        sub = batch.select(rows).to(self.device)
        mask = sub.completion_mask.float()
        n_local = float(mask.sum())
        n_global = float(batch.completion_mask.sum())
        scale = W * n_local / max(n_global, 1.0)
        tw = torch.full_like(mask, scale)
        if tw_user is not None:
            tw = tw * tw_user[rows].to(self.device)
        routed = None
        if payload.get("teacher") is not None:  # kd_loss=jsd: this rank's rows of the teachers' scores
            from ..teachers import RoutedScore

            t = {k: v[rows].to(self.device) for k, v in payload["teacher"].items()}
            routed = RoutedScore(logp=t["logp"], teacher_index=torch.zeros(len(rows), dtype=torch.long),
                                 topk_ids=t["topk_ids"], topk_logp=t["topk_logp"])
        # DDP computes under autocast; FSDP2 already casts the parameters it gathers (MixedPrecisionPolicy)
        amp = devlib.autocast(self.dinfo.kind, "float32" if self.fsdp else self.spec.dtype)
        with amp:
            upd = policy_update(self.ddp, self.opt, self.sched, sub, adv[rows].to(self.device), mask, tw, routed,
                                self.cfg, temperature, random.Random(f"{seed}/{self.rank}"), self.spec.logprob_impl,
                                self.spec.max_tokens_per_micro_batch, agree=self._agree, packed=self.spec.packing,
                                kd_scale=scale)
        # every backward moves the full gradient once (DDP all-reduce; FSDP2 reduce-scatter, plus the forward's
        # parameter all-gathers): the payload per rank, before gloo/nccl's own traffic
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        if self.spec.max_tokens_per_micro_batch is not None:
            backwards = int(upd["perf/micro_batches"])
        else:
            mbs = [len(rows[i::self.cfg.minibatches]) for i in range(self.cfg.minibatches)]
            backwards = sum(-(-m // (self.cfg.micro_batch_size or max(m, 1))) for m in mbs if m)
        upd.update({"rows": len(rows), "tokens": n_local, "seconds": time.perf_counter() - t0,
                    "allreduce_bytes": backwards * grad_bytes, "lr": self.sched.get_last_lr()[0],
                    **self.shard_bytes()})
        return upd

    def _agree(self, n: int) -> int:
        """The largest of the ranks' micro-batch counts (every rank must run as many passes)."""
        import torch.distributed as dist

        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.train_group)
        return int(t.item())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The student's full weights on CPU (for the driver's rollout, checkpoints and reference checks). Under
        FSDP2 this gathers the shards — a collective: call it on every rank; rank 0 returns them, the others {}."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def digest(self) -> str:
        """Digest of this worker's full weights (FSDP2: gathered, so every rank must be asked at once)."""
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
            return _state_digest(full)
        return super().digest()

    def save_sharded(self, path: str) -> dict[str, Any]:
        """Write this rank's share of the optimizer state under `path` (torch.distributed.checkpoint: one file
        per rank + metadata; a collective over the train group). The weights are not in it: the driver saves
        them whole (`save_pretrained`), which is what the next stage and a resume load. Returns the scheduler
        state (the same on every rank) for the loop's own checkpoint record."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        dcp.save({"optimizer": get_optimizer_state_dict(self.ddp, self.opt)}, checkpoint_id=path,
                 process_group=self.train_group)
        return {"scheduler": self.sched.state_dict(), **self.shard_bytes()}

    def _load_optimizer(self, path: str) -> None:
        """The optimizer state of `save_sharded`, resharded onto this group's layout."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.ddp, self.opt)}  # the template: this rank's layout
        dcp.load(state, checkpoint_id=path, process_group=self.train_group)
        set_optimizer_state_dict(self.ddp, self.opt, optim_state_dict=state["optimizer"])

    def send_weights(self, transport: str) -> dict[str, Any]:
        """Pack the state dict into buckets and send it. `collective`: broadcast over the weights group (the
        rollout workers call `receive_weights` at the same time); otherwise returns the message to deliver."""
        from ..weights import CollectiveTransport, make_transport, pack_buckets

        state = self.model.state_dict()
        b = self.spec.bucket_bytes
        payload = pack_buckets(state, b) if b is not None else {k: v.detach() for k, v in state.items()}
        self.release_weights()
        self._transport = (CollectiveTransport(src=0, group=self.weight_group, device=self.device)
                           if transport == "collective" else make_transport(transport))
        sent = self._transport.send(payload)
        return {"message": sent.message, "report": sent.report.to_dict(), "buckets": len(payload)}

    def release_weights(self) -> None:
        """Drop what the last message-based send keeps alive (IPC buffers, shared-memory files)."""
        if self._transport is not None:
            self._transport.release()
            self._transport = None


class RolloutWorker(_Worker):
    """One inference instance: its own HF copy of the student, filled through the transport, sampled with
    `HFRollout` and an explicit seed (same weights + seed ⇒ same tokens as a single-process run)."""

    def __init__(self, rank: int, index: int, spec: ClusterSpec, model_path: str,
                 max_prompt_tokens: int | None = None) -> None:
        """Load this instance's copy of the student and tokenizer (the initial weights until a sync)."""
        super().__init__(rank, spec, model_path)
        from ..models import load_model, load_tokenizer
        from ..rollout import HFRollout

        self.index = index
        self.model = load_model(model_path, self.device, spec.dtype).eval()
        self.tokenizer = load_tokenizer(model_path)
        self.engine = HFRollout(self.model, self.tokenizer, self.device, max_prompt_tokens, chat=spec.chat)

    def setup(self, addr: str, port: int) -> dict[str, Any]:
        """Join the world (rollout workers take no part in the train group's collectives)."""
        self._init_dist(addr, port)
        return {**self.info(), "pad_id": self.tokenizer.pad_token_id}

    @torch.no_grad()
    def receive_weights(self, transport: str, message: Any = None) -> dict[str, Any]:
        """Receive the trainer's weights and copy them into this model (strict: every name must match)."""
        from ..weights import CollectiveTransport, make_transport

        t0 = time.perf_counter()
        if transport == "collective":
            got = CollectiveTransport(src=0, group=self.weight_group, device=self.device).receive()
        elif transport == "shared_memory":
            dev = None if self.device.type == "cpu" else self.device
            got = make_transport(transport).receive(message, device=dev)
        else:
            got = make_transport(transport).receive(message)
        self.model.load_state_dict(got.tensors, strict=True)
        report = got.report.to_dict()
        return {"report": report, "load_seconds": time.perf_counter() - t0 - report["seconds"],
                "digest": self.digest()}

    def generate(self, examples: Sequence[Any], seed: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, batch_size: int | None = None):
        """Sample completions for `examples` (objects with `.prompt`) with a generator seeded by `seed`."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        batch = self.engine.generate(examples, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, greedy=greedy, generator=gen, batch_size=batch_size)
        return batch.to("cpu")


@dataclass(frozen=True)
class Prompt:
    """A bare prompt for `WorkerGroup.generate` when there is no domain `Example` at hand."""

    prompt: str
    teacher_id: str = ""


# ------------------------------------------------------------------------------------------------ the driver

@dataclass
class WorkerGroup:
    """Driver of one placement group: N training workers + N/tp rollout instances. Use as a context manager
    (or `start`/`stop`): `stop` always kills the actors and removes the placement group, also after errors.

    Every operation returns a report with `seconds` (driver wall) and bytes moved."""

    spec: ClusterSpec
    model_path: str
    loop_cfg: Any = None               # PolicyLoopConfig, a dict of its fields, or None (defaults)
    max_prompt_tokens: int | None = None
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def __post_init__(self) -> None:
        """Validate the spec, the model path and the loop config before anything starts."""
        self.spec.validate()
        self.model_path = str(self.model_path)
        p = Path(self.model_path)
        local = p.exists() or p.is_absolute() or self.model_path.startswith(".")  # else: an HF model id
        if local and not (p / "config.json").exists():
            raise ClusterError(f"model_path '{p}' is not a model checkpoint (no config.json) — give a "
                               "save_pretrained dir (or an HF model id available locally)")
        from ..config import PolicyLoopConfig

        cfg = self.loop_cfg
        self._cfg = (dict(cfg) if isinstance(cfg, Mapping) else cfg.model_dump()) if cfg is not None else {}
        loop = PolicyLoopConfig(**self._cfg)  # a bad loop config fails here, not inside N actors
        self._needs_teacher_topk = loop.kd_loss == "jsd" and loop.w_kd > 0
        self.pg = None
        self.trainers: list[Any] = []
        self.rollouts: list[Any] = []
        self.worker_info: list[dict] = []
        self._step = 0

    # -- lifecycle
    def start(self, resume: str | os.PathLike | None = None,
              scheduler_state: Mapping[str, Any] | None = None) -> "WorkerGroup":
        """Placement group → actors on their bundles → one torch.distributed world. `resume`: the sharded
        optimizer state a `save_sharded` wrote (the weights come from `model_path`), `scheduler_state` the lr
        schedule's. On any failure everything started so far is torn down before the error propagates."""
        import ray

        if self.pg is not None:
            return self
        if not ray.is_initialized():
            init_ray()
        cfg, s = self._cfg, self.spec
        try:
            self.pg = device_placement_group(s.num_workers, s.kind, strategy=s.strategy,
                                             cpus_per_bundle=s.cpus_per_bundle, timeout_s=s.pg_timeout_s,
                                             name=f"mopd-{self.group_id}")
            T, R = ray.remote(TrainWorker), ray.remote(RolloutWorker)
            for r in range(s.num_workers):  # appended one by one: stop() must see every actor created
                self.trainers.append(T.options(**_actor_options(s, self.pg, r, self.actor_name("train", r)))
                                     .remote(r, s, self.model_path, cfg))
            for i, b in enumerate(s.rollout_bundles()):
                self.rollouts.append(R.options(**_actor_options(s, self.pg, b, self.actor_name("rollout", i)))
                                     .remote(s.num_workers + i, i, s, self.model_path, self.max_prompt_tokens))
            addr, port = _gather([self.trainers[0].address.remote()], s.dist_timeout_s, "worker start-up",
                                 self.names[:1])[0]
            res = str(resume) if resume is not None else None
            self.worker_info = _gather([a.setup.remote(addr, port, res, scheduler_state) for a in self.trainers]
                                       + [a.setup.remote(addr, port) for a in self.rollouts],
                                       s.dist_timeout_s + 60, "process-group set-up", self.names)
        except BaseException:
            self.stop()
            raise
        return self

    def actor_name(self, role: str, index: int) -> str:
        """Ray name of an actor of this group (names let tests and operators find leftovers)."""
        return f"mopd-{self.group_id}-{role}-{index}"

    @property
    def actors(self) -> list[Any]:
        """All actors: trainers in rank order, then rollout instances."""
        return self.trainers + self.rollouts

    @property
    def names(self) -> list[str]:
        """The Ray names of `actors`, in the same order (what errors about a worker name)."""
        return ([self.actor_name("train", r) for r in range(len(self.trainers))]
                + [self.actor_name("rollout", i) for i in range(len(self.rollouts))])

    def stop(self) -> None:
        """Kill every actor and remove the placement group. Idempotent; never raises. Killing (not a polite
        `destroy_process_group` call) because a rank stuck in a collective would never answer one."""
        try:
            import ray
            from ray.util.placement_group import remove_placement_group
        except ImportError:  # pragma: no cover - ray is a dependency
            return
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.trainers, self.rollouts = [], []
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None

    def __enter__(self) -> "WorkerGroup":
        """`start()`."""
        return self.start()

    def __exit__(self, *exc) -> None:
        """`stop()`, whatever happened inside the block."""
        self.stop()

    def _need_started(self) -> None:
        """Refuse operations on a group that is not running."""
        if self.pg is None:
            raise ClusterError("the worker group is not started; call start() or use it as a context manager")

    # -- operations
    def train_step(self, batch, advantages: torch.Tensor, token_weights: torch.Tensor | None = None, *,
                   temperature: float = 1.0, seed: int = 0, routed=None) -> dict[str, float]:
        """One data-parallel update on `batch` (a RolloutBatch; B must split evenly over the ranks so every rank
        runs the same number of backward passes). `advantages` is `[B,T]` or `[B]` (per sequence, broadcast
        over its completion tokens). `routed`: the teachers' `RoutedScore` (ℓᵀ and top-k ids/log-probs) for a
        `kd_loss: jsd` update, which needs them inside the loss; each rank gets its rows. Returns the global
        loss/metrics, `seconds` and `allreduce_bytes`."""
        import ray

        kd = None
        if self._needs_teacher_topk:
            if routed is None or routed.topk_ids is None or routed.topk_logp is None:
                raise ClusterError("kd_loss=jsd: train_step needs the teachers' scores with top-k (routed=, from "
                                   "TeacherRouter.score(..., top_k=jsd_top_k))")
            # [B,T] + 2×[B,T,k]: what the JSD reads, not the per-teacher copies the metrics use
            kd = {"logp": routed.logp.detach().cpu(), "topk_ids": routed.topk_ids.detach().cpu(),
                  "topk_logp": routed.topk_logp.detach().cpu()}
        self._need_started()
        W, B = self.spec.num_workers, batch.size
        if B < W or B % W:
            raise ClusterError(f"a batch of {B} rows does not split evenly over cluster.num_workers={W} ranks; "
                               f"make the rollout batch a multiple of {W}")
        mask = batch.completion_mask.float().cpu()
        adv = advantages.detach().float().cpu()
        if adv.dim() == 1:
            adv = adv[:, None] * mask
        if adv.shape != mask.shape:
            raise ClusterError(f"advantages of shape {tuple(advantages.shape)} match neither [B]=[{B}] nor "
                               f"[B,T]={list(mask.shape)}")
        ref = ray.put({"batch": batch.tensors("cpu"), "advantages": adv, "teacher": kd,
                       "token_weights": token_weights.detach().cpu() if token_weights is not None else None})
        t0 = time.perf_counter()
        outs = _gather([w.train_step.remote(ref, temperature, seed + self._step) for w in self.trainers],
                       self.spec.dist_timeout_s, "train_step", self.names)
        self._step += 1
        ntok = [o["tokens"] for o in outs]
        tot = sum(ntok) or 1.0
        res = {"loss": sum(o["loss"] for o in outs) / W,  # ranks' losses are pre-scaled: their mean is global
               "grad_norm": outs[0]["grad_norm"], "lr": outs[0]["lr"], "tokens": sum(ntok),
               "seconds": time.perf_counter() - t0, "worker_seconds": max(o["seconds"] for o in outs),
               "allreduce_bytes": outs[0]["allreduce_bytes"],
               "param_bytes_per_rank": max(o["param_bytes"] for o in outs),
               "optim_bytes_per_rank": max(o["optim_bytes"] for o in outs),
               "perf/micro_batches": max(o.get("perf/micro_batches", 0.0) for o in outs),  # equal on every rank
               "perf/pad_frac": sum(o.get("perf/pad_frac", 0.0) for o in outs) / W,
               "weights_finite": min(o.get("weights_finite", 1.0) for o in outs)}  # any rank's shard
        for k in ("entropy", "clip_frac", "approx_kl", "ratio_mean"):
            res[k] = sum(o.get(k, 0.0) * n for o, n in zip(outs, ntok)) / tot
        if kd is not None:  # pre-scaled like the loss
            res["jsd"] = sum(o.get("jsd", 0.0) for o in outs) / W
        return res

    def sync_weights(self) -> dict[str, Any]:
        """Hand training weights to every rollout instance through `spec.hand_over`. Returns seconds, bytes
        sent/received, messages (transport calls or handles) and buckets, plus each side's raw report."""
        self._need_started()
        if not self.rollouts:
            raise ClusterError("sync_weights: this group has no rollout instances (cluster.rollout=False); read "
                               "the weights with state_dict()")
        tr, T = self.spec.hand_over, self.spec.dist_timeout_s
        t0 = time.perf_counter()
        if tr == "collective":  # sender and receivers must be inside the broadcast at the same time
            refs = [self.trainers[0].send_weights.remote(tr)] + [r.receive_weights.remote(tr) for r in self.rollouts]
            outs = _gather(refs, T, "sync_weights")
            sends, recvs = outs[:1], outs[1:]
        else:  # colocated: the trainer on each instance's bundle sends, the message travels through Ray
            srcs = [self.trainers[b] for b in self.spec.rollout_bundles()]
            sends = _gather([s.send_weights.remote(tr) for s in srcs], T, "sync_weights (send)")
            recvs = _gather([r.receive_weights.remote(tr, s["message"]) for r, s in zip(self.rollouts, sends)],
                            T, "sync_weights (receive)")
            _gather([s.release_weights.remote() for s in srcs], T, "sync_weights (release)")
        send_reps = [s["report"] for s in sends]
        recv_reps = [r["report"] for r in recvs]
        return {"transport": tr, "seconds": time.perf_counter() - t0,
                "bytes_total": send_reps[0]["bytes_total"],
                "bytes_sent": sum(r["bytes_copied"] for r in send_reps),
                "bytes_received": sum(r["bytes_copied"] for r in recv_reps),
                "messages": send_reps[0]["messages"], "buckets": sends[0]["buckets"],
                "tensors": send_reps[0]["tensors"], "digests": [r["digest"] for r in recvs],
                "send": send_reps, "receive": recv_reps}

    def generate(self, examples: Sequence[Any], *, seed: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, batch_size: int | None = None,
                 instance: int | None = None):
        """Sample on the rollout instances. `instance=i`: all examples on instance i with generator seed
        `seed`. `None`: contiguous chunks over the instances, chunk i seeded `seed + i`. Strings are wrapped
        into `Prompt`. Returns `(RolloutBatch, report)`; report has `seconds`, `tokens`, `bytes` returned."""
        from ..rollout import concat_batches

        self._need_started()
        if not self.rollouts:
            raise ClusterError("generate: this group has no rollout instances (cluster.rollout=False)")
        exs = [Prompt(e) if isinstance(e, str) else e for e in examples]
        if not exs:
            raise ClusterError("generate() got no examples; pass at least one prompt")
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy,
                  batch_size=batch_size)
        if instance is not None:
            if not 0 <= instance < len(self.rollouts):
                raise ClusterError(f"instance={instance} is out of range: the group has {len(self.rollouts)} "
                                   "rollout instances (cluster.num_workers / cluster.tp)")
            jobs = [(self.rollouts[instance], exs, seed)]
        else:
            n = len(self.rollouts)
            q, r = divmod(len(exs), n)
            bounds = [i * q + min(i, r) for i in range(n + 1)]
            jobs = [(self.rollouts[i], exs[bounds[i]:bounds[i + 1]], seed + i) for i in range(n)
                    if bounds[i + 1] > bounds[i]]
        t0 = time.perf_counter()
        parts = _gather([a.generate.remote(chunk, s, **kw) for a, chunk, s in jobs], self.spec.dist_timeout_s,
                        "generate")
        batch = concat_batches(parts, self.worker_info[len(self.trainers)]["pad_id"])
        nbytes = sum(t.numel() * t.element_size() for p in parts for t in
                     (p.prompt_ids, p.prompt_mask, p.completion_ids, p.completion_mask, p.behaviour_logp))
        return batch, {"seconds": time.perf_counter() - t0, "tokens": int(batch.completion_mask.sum()),
                       "bytes": nbytes, "instances": len(jobs)}

    # -- inspection
    def state_dict(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Training rank `rank`'s weights, on CPU (FSDP2: the shards gathered by every rank, rank 0's copy)."""
        self._need_started()
        if self.spec.train_strategy == "fsdp2":
            return _gather([w.state_dict.remote() for w in self.trainers], self.spec.dist_timeout_s, "state_dict",
                           self.names)[0]
        return _gather([self.trainers[rank].state_dict.remote()], self.spec.dist_timeout_s, "state_dict",
                       self.names[rank:rank + 1])[0]

    def save_sharded(self, path: str | os.PathLike) -> dict[str, Any]:
        """Every rank writes its optimizer shard under `path` (torch.distributed.checkpoint); returns the lr
        scheduler's state and the bytes per rank. The weights are the caller's to save (whole)."""
        self._need_started()
        outs = _gather([w.save_sharded.remote(str(path)) for w in self.trainers], self.spec.dist_timeout_s,
                       "save_sharded", self.names)
        return {"scheduler": outs[0]["scheduler"], "param_bytes_per_rank": max(o["param_bytes"] for o in outs),
                "optim_bytes_per_rank": max(o["optim_bytes"] for o in outs)}

    def digests(self) -> dict[str, list[str]]:
        """Weight digests of every trainer and rollout instance (equal digests ⇔ bit-identical weights)."""
        self._need_started()
        d = _gather([a.digest.remote() for a in self.actors], self.spec.dist_timeout_s, "digests", self.names)
        n = len(self.trainers)
        return {"train": d[:n], "rollout": d[n:]}

    def describe(self) -> dict[str, Any]:
        """Spec, placement-group id and where each worker runs (as reported by `setup`)."""
        return {"spec": asdict(self.spec), "placement_group": self.pg.id.hex() if self.pg is not None else None,
                "workers": self.worker_info}


__all__ = ["RESOURCE", "TRANSPORTS", "TRAIN_STRATEGIES", "ClusterError", "ClusterSpec", "init_ray",
           "bundle_for", "device_placement_group", "fully_shard_model", "TrainWorker", "RolloutWorker", "Prompt",
           "WorkerGroup"]
