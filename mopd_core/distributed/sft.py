"""SFT on many devices (`runtime.strategy` ddp/fsdp2, `runtime.num_workers`): one Ray actor per device, each
running the same TRL `SFTTrainer` (`train.sft.train_process`) as one process of a torch.distributed world —
the Trainer's accelerate state joins it from the environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT; gloo on CPU,
nccl/hccl on devices), as `accelerate launch` / `torchrun` would set it up, and applies DDP or FSDP2 itself.
Ray is only the launcher and placement (the same bundles as the RL workers): the training is TRL's and
accelerate's. The stage's own process gets the main process's weights back and saves/evaluates as usual.
"""

from __future__ import annotations

import os
from pathlib import Path

import logging

from ..config import RecipeConfig
from .cluster import _actor_options, _gather, _Worker, device_placement_group
from .trainer import acquire_ray, recipe_spec, release_ray

log = logging.getLogger("mopd")


class SFTWorker(_Worker):
    """One SFT process: visible device and threads from `_Worker`, the distributed environment, TRL's Trainer."""

    def run(self, recipe: dict, base_path: str, rows: list[dict], stage_dir: str, domains, addr: str,
            port: int) -> tuple[list[dict], dict | None, dict]:
        from ..config import config_from_dict
        from ..train.sft import train_process

        n = self.spec.num_workers
        local = self.spec.kind == "cpu"  # a GPU/NPU actor sees only its own device: it is local rank 0 there
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(self.rank), WORLD_SIZE=str(n),
                          LOCAL_RANK=str(self.rank if local else 0), LOCAL_WORLD_SIZE=str(n if local else 1),
                          OMP_NUM_THREADS=str(self.spec.num_threads))  # accelerate would pick its own otherwise
        return train_process(config_from_dict(recipe), base_path, rows, stage_dir, domains, n)


def distributed_sft(recipe: RecipeConfig):
    """`train.sft.run_sft`'s `trainer` for `runtime.num_workers` SFT processes on Ray."""
    rt = recipe.runtime
    spec = recipe_spec(recipe)
    kind = spec.kind

    def run(base_path, rows, stage_dir: Path, domains) -> tuple[list[dict], dict, dict]:
        import ray
        from ray.util.placement_group import remove_placement_group

        if kind == "cpu" and spec.train_strategy == "fsdp2":
            log.warning("sft: accelerate has no FSDP on CPU — its %d processes run DDP (replicated weights); "
                        "the expert and MOPD stages shard with torch FSDP2 on CPU too", spec.num_workers)
        if recipe.sft.eval_every:
            log.warning("sft: sft.eval_every=%d is not run with %d SFT processes (the final eval is)",
                        recipe.sft.eval_every, spec.num_workers)
        uses = acquire_ray(rt.ray_address, kind, spec.num_workers)
        pg, actors = None, []
        try:
            pg = device_placement_group(spec.num_workers, kind, strategy=spec.strategy,
                                        timeout_s=spec.pg_timeout_s, name=f"mopd-sft-{os.getpid()}")
            names = [f"mopd-sft-{os.getpid()}-{r}" for r in range(spec.num_workers)]
            W = ray.remote(SFTWorker)
            for r in range(spec.num_workers):
                actors.append(W.options(**_actor_options(spec, pg, r, names[r])).remote(r, spec, str(base_path)))
            addr, port = _gather([actors[0].address.remote()], spec.dist_timeout_s, "SFT worker start-up",
                                 names[:1])[0]
            where = _gather([a.info.remote() for a in actors], spec.dist_timeout_s, "SFT worker start-up", names)
            rows_ref = ray.put(rows)
            cfg = recipe.model_dump(mode="json")
            outs = _gather([a.run.remote(cfg, str(base_path), rows_ref, str(stage_dir), domains, addr, port)
                            for a in actors], None, "sft", names)  # training: as long as it takes
            history, state, how = outs[0]
            return history, state, {"strategy": spec.train_strategy, "num_workers": spec.num_workers, **how,
                                    "workers": [{k: w.get(k) for k in ("rank", "pid", "node_id", "device")}
                                                for w in where]}
        finally:
            for a in actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if pg is not None:
                remove_placement_group(pg)
            if uses:
                release_ray()

    return run


__all__ = ["SFTWorker", "distributed_sft"]
