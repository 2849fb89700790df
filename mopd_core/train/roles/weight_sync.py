"""The weight-sync role: how the trainer's weights reach the rollout engine before a rollout, chosen once per
stage (`roles.build_roles`). The phase scheduler calls `push(model, version)` at the start of every rollout phase
(whatever the engine) and `after_rollout()` at its end; `version` is the weight version the engine holds (the
number of updates behind it). `push` returns the step metrics of the hand-over, `{}` when nothing moved.

- `IdentitySync`: the in-process HF engine samples from the trainer's own module (0 bytes);
- `EngineSync`: an in-process vLLM engine, through its `weight_transport` (in-process, CUDA IPC, shared memory);
- `ServedSync`: the student's vLLM servers, a safetensors folder per version (`ServedRollout.write_version` /
  `load_version`) — also the async pipeline's publish/load halves;
- `MergedSync`: LoRA with the in-process engine: a plain copy holding the merged weights, refreshed.

Ray training workers hand their weights to the driver's copy inside the updater (`updater.RemoteUpdater`), before
any of these runs.
"""

from __future__ import annotations

import time

from ...models.lora import refresh_merged


class WeightSync:
    """Base: the engine samples from what it was given; nothing to hand over."""

    name = "none"

    def __init__(self, engine, version: int = 0) -> None:
        self.engine, self.version = engine, int(version)

    def push(self, model, version: int) -> dict[str, float]:
        """Bring the engine to `model`'s weights as `version`; the hand-over's metrics."""
        self.version = int(version)
        return {}

    def after_rollout(self, colocated: bool) -> None:
        """The rollout phase ended (colocated: the engine gives its device memory back)."""

    def sampler(self, model):
        """The module eval samples from, current."""
        return model

    def record(self) -> dict:
        """What the stage record keeps of the engine (served: its servers and counters)."""
        return {}


class EngineSync(WeightSync):
    """An in-process engine holding its own copy (vLLM): every rollout gets the trainer's weights through the
    engine's transport; it sleeps between rollouts when it shares the devices."""

    name = "engine"

    def push(self, model, version: int) -> dict[str, float]:
        # the engine wakes itself in two halves: `sync_weights` wakes only its weight memory (writing into slept
        # memory crashes vllm-ascend), `generate` the KV cache — so no blanket wake() here
        t0 = time.perf_counter()
        rep = self.engine.sync_weights(model)
        self.version = int(version)
        out = {"perf/weight_sync_s": time.perf_counter() - t0}
        if "bytes_copied" in rep:
            out["weights/bytes_copied"] = float(rep["bytes_copied"])
        return out

    def after_rollout(self, colocated: bool) -> None:
        if colocated:
            self.engine.sleep()


class IdentitySync(EngineSync):
    """The HF engine samples from the trainer's module: the hand-over is the identity (0 bytes copied), reported
    as such."""

    name = "identity"


class ServedSync(WeightSync):
    """The student's servers: each version is a safetensors folder they load (`ServedRollout`)."""

    name = "served"

    def push(self, model, version: int) -> dict[str, float]:
        if self.engine.version == version:
            return {}
        t0 = time.perf_counter()
        rep = self.engine.sync_weights(model, version=version)
        self.version = int(version)
        return {"perf/weight_sync_s": time.perf_counter() - t0, "weights/bytes_copied": float(rep["bytes_copied"])}

    def record(self) -> dict:
        return {"rollout": {"backend": "served", **self.engine.manifest(), **self.engine.stats}}

    def publish(self, model, version: int) -> dict[str, float]:
        """The trainer's half (async): write `version` for the generator to load when it needs it."""
        rep = self.engine.write_version(model, version)
        return {"perf/publish_s": rep["seconds"], "weights/bytes_written": float(rep["bytes"])}

    def load(self, version: int) -> dict:
        """The generator's half (async): the servers load `version` (older folders are pruned); its report."""
        if self.engine.version == version:
            return {}
        rep = self.engine.load_version(version)
        self.engine.prune(version)
        self.version = int(version)
        return rep


class MergedSync(WeightSync):
    """LoRA with the in-process engine: it samples from `merged`, a plain copy of the model with the adapters
    merged in (`lora.merged_copy`), at the plain model's speed; refreshed when the version moves and before eval."""

    name = "lora-merge"

    def __init__(self, engine, merged, version: int = 0) -> None:
        super().__init__(engine, version)
        self.merged = merged

    def push(self, model, version: int) -> dict[str, float]:
        if version == self.version:  # the copy is current
            return {}
        t0 = time.perf_counter()
        n = refresh_merged(self.merged, model)
        self.version = int(version)
        return {"weights/bytes_copied": float(n), "perf/weight_sync_s": time.perf_counter() - t0}

    def sampler(self, model):
        refresh_merged(self.merged, model)
        return self.merged
