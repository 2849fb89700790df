"""The on-policy loop's update on many devices: `runtime.num_workers` Ray training workers (one per device) under
torch DDP or FSDP2 (`runtime.strategy`), driven by `train.loop.run_policy_loop` through its `PolicyTrainer`
interface.

The loop itself stays in the driver: it samples with its rollout engine from the weights the workers hand back
after every update (gathered whole: FSDP2's `get_model_state_dict(full_state_dict=True)`), scores with the
teachers, computes the advantages, and sends the batch + advantages to the workers, which split the rows
`rank::N` and run the loop's own `policy_update` (token weights scaled so the ranks' gradient mean is the whole
batch's token-mean gradient: the same update as one process, up to float summation order). Checkpoints: the
driver writes the whole model (`save_pretrained`, what the next stage loads) and every rank its optimizer shard
(`torch.distributed.checkpoint`, resharded on load, so a run may resume on another number of workers).

Ray: joins `runtime.ray_address` when set (an existing cluster: `ray start --head` …), else starts a local one
for the stage and shuts it down afterwards.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from ..config import PolicyLoopConfig, RecipeConfig
from ..runtime import device as devlib
from .cluster import ClusterSpec, WorkerGroup, init_ray

log = logging.getLogger("mopd")

# Stages of one process share its Ray (a Prefect flow may run expert stages in threads): the first trainer that
# needs Ray starts (or joins) it, the last one to close shuts it down — never under another stage's workers.
_RAY_LOCK = threading.Lock()
_RAY_USERS = 0
_RAY_TMP: str | None = None


def check_ray_address(address: str | None, timeout_s: float = 10.0) -> None:
    """`runtime.ray_address` answers as a Ray cluster, checked before a stage writes anything: `ray.init`
    against a dead address retries past `ray_timeout_s` and ends in a library traceback. A TCP connect alone
    proves little (a proxy may accept any), so the probe speaks HTTP/2's connection preface, which Ray's GCS (a
    gRPC server) answers with a SETTINGS frame. `auto` and unset are left to Ray."""
    import socket

    from ..errors import PlacementError

    if not address or address == "auto":
        return
    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise PlacementError(f"runtime.ray_address={address!r} is not HOST:PORT (e.g. 10.0.0.1:6379, "
                             "ray://10.0.0.1:10001 or auto)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s) as sock:
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            head = sock.recv(9)
        if len(head) < 9 or head[3] != 4:  # frame type 4 = SETTINGS
            raise OSError(f"it does not answer like a Ray cluster (got {head[:9]!r})")
    except OSError as e:
        raise PlacementError(f"runtime.ray_address={address!r}: no Ray cluster answers there ({e}) — start it "
                             "(`ray start --head`), fix the address, or unset it for a local Ray") from None


def acquire_ray(address: str | None, kind: str, num_workers: int) -> bool:
    """Count one more user of this process's Ray, starting it (or joining `address`) for the first. Returns False
    when some other code initialised Ray before any of ours: it is used as it is and never shut down here."""
    global _RAY_USERS, _RAY_TMP
    import ray

    with _RAY_LOCK:
        if _RAY_USERS == 0 and ray.is_initialized():
            return False
        if _RAY_USERS == 0:
            if address:
                try:
                    init_ray(address=address)
                except ConnectionError as e:  # ray.init's own error for a cluster that never answered
                    from ..errors import PlacementError

                    raise PlacementError(f"runtime.ray_address={address!r}: {e} — start the cluster (`ray start "
                                         "--head`), fix the address, or unset it for a local Ray") from None
            else:  # a short temp dir: Ray's socket paths must stay under 107 bytes
                _RAY_TMP = tempfile.mkdtemp(prefix="mopd-ray-", dir="/tmp")
                res = {"num_cpus": max(num_workers, os.cpu_count() or 1)} if kind == "cpu" else {}
                init_ray(tmp_dir=_RAY_TMP, **res)
        _RAY_USERS += 1
        return True


def release_ray() -> None:
    """One user fewer (after a True `acquire_ray`); the last one shuts Ray down."""
    global _RAY_USERS, _RAY_TMP
    with _RAY_LOCK:
        _RAY_USERS -= 1
        if _RAY_USERS == 0:
            import shutil

            import ray

            ray.shutdown()
            if _RAY_TMP:
                shutil.rmtree(_RAY_TMP, ignore_errors=True)
                _RAY_TMP = None


def recipe_spec(recipe: RecipeConfig) -> ClusterSpec:
    """The trainers-only `ClusterSpec` of a recipe's `runtime` and `train` sections (RL workers and SFT
    processes alike)."""
    rt, tr = recipe.runtime, recipe.train
    return ClusterSpec(num_workers=rt.num_workers, kind=devlib.resolve(rt.device).kind, dtype=rt.dtype,
                       num_threads=rt.num_threads or 1, strategy=rt.ray_placement, train_strategy=rt.strategy,
                       rollout=False, logprob_impl=tr.logprob_impl, gradient_checkpointing=tr.gradient_checkpointing,
                       cpu_offload=tr.fsdp_cpu_offload,
                       max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch, packing=tr.packing,
                       pg_timeout_s=rt.ray_timeout_s, dist_timeout_s=rt.ray_timeout_s).validate()


class RayPolicyTrainer:
    """`train.loop.PolicyTrainer` on a Ray `WorkerGroup` of trainers only (the driver samples)."""

    def __init__(self, recipe: RecipeConfig, loop_cfg: PolicyLoopConfig, stage: str) -> None:
        rt = recipe.runtime
        self.stage = stage
        self.spec = recipe_spec(recipe)
        self.loop_cfg = loop_cfg.model_dump(include=set(PolicyLoopConfig.model_fields))  # what the update reads
        self.address = rt.ray_address
        self.group: WorkerGroup | None = None
        self._uses_ray = False

    def _ray(self) -> None:
        self._uses_ray = acquire_ray(self.address, self.spec.kind, self.spec.num_workers)

    def _release_ray(self) -> None:
        if self._uses_ray:
            self._uses_ray = False
            release_ray()

    def start(self, model_dir: str | Path, resume: str | Path | None = None,
              scheduler_state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Start the workers on the weights in `model_dir` (+ a checkpoint's sharded optimizer state)."""
        self._ray()
        self.group = WorkerGroup(self.spec, str(model_dir), loop_cfg=self.loop_cfg,
                                 group_id=f"{self.stage}-{os.getpid()}"[:40])
        self.group.start(resume=resume, scheduler_state=scheduler_state)
        w = self.group.worker_info
        log.info("%s: %d %s workers (%s) on %d node(s): %.3g MiB of parameters per rank", self.stage,
                 self.spec.num_workers, self.spec.train_strategy, w[0]["backend"],
                 len({x["node_id"] for x in w}), max(x["param_bytes"] for x in w) / 2**20)
        d = self.group.describe()
        return {"strategy": self.spec.train_strategy, "num_workers": self.spec.num_workers,
                "placement_group": d["placement_group"],
                "workers": [{k: x.get(k) for k in ("rank", "pid", "node_id", "device", "backend", "param_bytes",
                                                "cpu_offload")}
                            for x in w]}

    def update(self, batch, advantages: torch.Tensor, token_weights: torch.Tensor | None, *, temperature: float,
               seed: int, routed=None) -> dict[str, float]:
        """One update of the whole batch over the workers; the loop's metric names (+ `dist/*`)."""
        out = self.group.train_step(batch, advantages, token_weights, temperature=temperature, seed=seed,
                                    routed=routed)
        m = {k: out[k] for k in ("loss", "grad_norm", "entropy", "clip_frac", "approx_kl", "ratio_mean", "lr",
                                 "perf/micro_batches", "perf/pad_frac", "jsd") if k in out}
        m.update({"dist/workers": float(self.spec.num_workers), "dist/worker_s": out["worker_seconds"],
                  "dist/param_mb_per_rank": out["param_bytes_per_rank"] / 2**20,
                  "dist/optim_mb_per_rank": out["optim_bytes_per_rank"] / 2**20,
                  "dist/comm_mb_per_rank": out["allreduce_bytes"] / 2**20})
        return m

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights, whole, on CPU."""
        return self.group.state_dict()

    def save(self, path: str | Path) -> dict[str, Any]:
        """The optimizer shards under `path`; returns the scheduler state for the loop's record."""
        return self.group.save_sharded(path)

    def close(self) -> None:
        """Kill the workers (also after an error) and the Ray instance this trainer started."""
        if self.group is not None:
            self.group.stop()
            self.group = None
        self._release_ray()


__all__ = ["RayPolicyTrainer", "acquire_ray", "recipe_spec", "release_ray"]
