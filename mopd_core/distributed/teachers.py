"""Local teachers on the training workers' devices (`teachers.placement: workers`).

With `runtime.strategy` ddp/fsdp2 the student's update runs on N Ray workers, one per device, while local
teachers would otherwise all live in the driver's process on device 0 — beside rank 0's training state and the
driver's sampling copy. Here each teacher is one Ray actor (`TeacherWorker`) placed on a bundle of the trainers'
own placement group, teacher i on bundle i mod N: one per device while there are as many devices as teachers,
the rest sharing round-robin. It scores with the same `LocalTeacher` (the same `score_completions`, dtype and
offload rule) as the driver would, so the numbers are the same; only where the weights live changes.

A bundle's resource is split between its trainer (half, as the colocated rollout worker takes it) and the
teachers placed on it (the other half, shared), so Ray puts them on the trainer's device and exports the same
visible-devices variable. The actors start on the first scoring call — the trainers' placement group exists
only once the loop started them — and go with it when the trainers stop (removing the group kills them).
The router asks them at the same time (they are not in the driver's process), like http teachers.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from ..models import load_tokenizer, tokenizer_fingerprint
from ..rollout import RolloutBatch
from ..runtime.phases import teacher_turn
from ..teachers import LocalTeacher, Teacher, TeacherScore
from .cluster import _SHARE, ClusterError, ClusterSpec, _actor_options, _gather, _Worker


def _to(t, device):
    return t.to(device) if t is not None else None


def teacher_bundle(index: int, num_workers: int) -> int:
    """The trainers' bundle (= rank) teacher `index` is placed on: round-robin. The memory pre-flight counts
    each rank's teachers by the same rule."""
    return index % num_workers


class TeacherWorker(_Worker):
    """One local teacher in its own actor on a trainer's bundle (no part in the trainers' torch.distributed
    world: it only scores)."""

    def __init__(self, spec: ClusterSpec, name: str, path: str, dtype: str, offload: bool, temperature: float,
                 batch_size: int | None, logprob_impl: str) -> None:
        super().__init__(-1, spec, path)
        self.teacher = LocalTeacher(name, path, self.device, dtype, offload, temperature, batch_size, logprob_impl)

    def describe(self) -> dict[str, Any]:
        """Where it runs and what it holds (pid, device, node, the weights' bytes)."""
        return {**self.info(), "param_bytes": self.teacher.param_bytes, "fingerprint": self.teacher.fingerprint}

    def score(self, batch: RolloutBatch, top_k: int = 0) -> TeacherScore:
        """`LocalTeacher.score` on this device, inside its turn (the weights visit the device for it, as in the
        driver's colocated phases); the scores come back on CPU."""
        with teacher_turn(self.teacher):
            s = self.teacher.score(batch.to(self.device), top_k)
        return TeacherScore(*(_to(t, "cpu") for t in (s.logp, s.topk_ids, s.topk_logp)))


class RayTeacher(Teacher):
    """The driver's handle of a `TeacherWorker`: the router's `Teacher` interface, scores back on the batch's
    device. `host` is the stage's `RayPolicyTrainer` (its started group gives the placement group)."""

    in_process = False  # its weights live in a worker process: no driver memory, no colocated turn here
    scores_before_training = False  # its actor lives on a training worker, started with the stage's trainers

    def __init__(self, host: Any, name: str, path: str | Path, index: int, count: int, *, dtype: str,
                 offload: bool, temperature: float, batch_size: int | None, logprob_impl: str) -> None:
        self.host, self.name, self.path, self.index, self.count = host, name, str(path), index, count
        self._args = (dtype, offload, temperature, batch_size, logprob_impl)
        self.temperature = float(temperature)
        self.tokenizer = load_tokenizer(path)  # its own: in teachers.cross_tokenizer it is bridged on the driver
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)  # the router's pre-flight, before any actor
        self.stats = {"seconds": 0.0, "tokens": 0, "calls": 0}
        self.actor = None
        self.worker: dict[str, Any] = {}

    @property
    def actor_name(self) -> str:
        group = self.host.group
        return f"mopd-{group.group_id if group is not None else '?'}-teacher-{self.name}"

    def _start(self) -> None:
        import ray

        group = self.host.group
        if group is None or group.pg is None:
            raise ClusterError(f"teacher '{self.name}' (teachers.placement=workers): the training workers are not "
                               "running — teachers on workers score only while the stage's trainers run")
        spec: ClusterSpec = group.spec
        bundle = teacher_bundle(self.index, spec.num_workers)
        # the bundle's other half, split between the teachers placed on it
        share = _SHARE / math.ceil(self.count / spec.num_workers)
        opts = _actor_options(spec, group.pg, bundle, self.actor_name, share=share)
        self.actor = ray.remote(TeacherWorker).options(**opts).remote(spec, self.name, self.path, *self._args)
        self.worker = {**_gather([self.actor.describe.remote()], spec.dist_timeout_s, f"teacher '{self.name}' "
                                 "start-up", [self.actor_name])[0], "bundle": bundle}

    def score(self, batch: RolloutBatch, top_k: int = 0) -> TeacherScore:
        t0 = time.perf_counter()
        if self.actor is None:
            self._start()
        dev = batch.completion_ids.device
        s = _gather([self.actor.score.remote(batch.tensors("cpu"), top_k)], self.host.group.spec.dist_timeout_s,
                    f"teacher '{self.name}' scoring", [self.actor_name])[0]
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["tokens"] += int(batch.completion_mask.sum())
        self.stats["calls"] += 1
        return TeacherScore(*(_to(t, dev) for t in (s.logp, s.topk_ids, s.topk_logp)))

    def placement(self) -> dict | None:
        """Where its actor ran (bundle, node, device, pid, the weights' bytes); None before it started."""
        if not self.worker:
            return None
        return {"placement": "workers",
                **{k: self.worker.get(k) for k in ("bundle", "node_id", "device", "pid", "param_bytes")}}

    def close(self) -> None:
        """Kill the actor (a no-op once the trainers' group, and with it the actor, is gone)."""
        if self.actor is None:
            return
        try:
            import ray

            if ray.is_initialized():
                ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead with its placement group
            pass
        self.actor = None


def worker_teachers(host: Any, paths: dict[str, str | Path], cfg, dtype: str,
                    logprob_impl: str) -> dict[str, RayTeacher]:
    """One `RayTeacher` per teacher (`cfg`: the TeachersConfig), teacher i on the trainers' bundle i mod N."""
    n = len(paths)
    return {name: RayTeacher(host, name, p, i, n, dtype=dtype, offload=cfg.offload, temperature=cfg.temperature,
                             batch_size=cfg.batch_size, logprob_impl=logprob_impl)
            for i, (name, p) in enumerate(paths.items())}


__all__ = ["RayTeacher", "TeacherWorker", "worker_teachers"]
