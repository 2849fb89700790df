"""Phase scheduling for `runtime.placement: colocated` — trainer, rollout engine and teachers take turns on the
same devices (AReaL-Ascend / verl "hybrid engine" style):

    rollout: engine wakes (weights handed over) → generate → engine sleeps
    score:   each in-process teacher in turn is loaded → scores → is offloaded (never two at once)
    train:   optimizer state back on the device → update → optimizer state and gradients offloaded

Two memory views are kept per phase:
- `resident_mb`: what this scheduler knows it holds on the compute device — student weights, gradients,
  optimizer state and loaded teachers — counted from tensor sizes. Deterministic on every device (on CPU,
  where offloading moves nothing, it is the bookkeeping the same run would have on an accelerator).
- the device layer's measured memory (`device_allocated_mb`/peak on cuda/npu, host RSS on cpu).

`disaggregated` placement runs the same phases without offloading (the devices are not shared).
Every phase event goes to `phases.jsonl` in the stage dir; per-step maxima go to the step metrics.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import PlacementError
from . import device as devlib

log = logging.getLogger("mopd")

MB = 2**20


class ColocationError(PlacementError):
    """The colocated phases cannot fit the device memory budget; one line naming the phase and the fix."""


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_bytes(opt: torch.optim.Optimizer | None) -> int:
    """Bytes of an optimizer's state in this process (0 without one: the update runs on workers)."""
    return sum(tensor_bytes(st.values()) for st in opt.state.values()) if opt is not None else 0


def device_budget_mb(kind: str, limit_gib: float | None) -> float | None:
    """The memory the colocated phases may use: `runtime.memory_limit_gib` when set, else the device's total."""
    if limit_gib is not None:
        return float(limit_gib) * 1024
    total = devlib.mem_get_info(kind)[1]
    return total / MB if total else None


def layer_activation_bytes(hidden: int, intermediate: int | None = None, kv_dim: int | None = None, *,
                           dtype_bytes: int = 4) -> int:
    """Bytes one decoder layer keeps for its backward, per token: a Llama/Qwen-style layer (RMSNorm, GQA
    attention through sdpa — no s×s scores —, SwiGLU MLP) as transformers runs it, the residual stream and the
    norms in the float32 master dtype and the matmuls' inputs and outputs in the compute dtype (`dtype_bytes`).
    Fitted to what autograd really saves (`torch.autograd.graph.saved_tensors_hooks` on Qwen3 layers of several
    widths, bf16 autocast and float32: `tests/unit/test_phases.py` checks it on shapes the fit did not use):
    about 40·H + 8·I + 10·KV bytes under bf16 autocast, 45·H + 16·I + 18·KV in float32 — twice the 34·H
    (16-bit, plain MLP) of Korthikanti et al. 2022, whose count has neither the float32 residual and norms
    nor SwiGLU's three I-wide tensors. Unknown widths: I = 3·H, KV = H."""
    intermediate = 3 * hidden if intermediate is None else intermediate
    kv_dim = hidden if kv_dim is None else kv_dim
    b = dtype_bytes
    return int((34 + 2.75 * b) * hidden + 4 * b * intermediate + (4 * b + 2) * kv_dim)


def activation_bytes(tokens: int, hidden: int, layers: int, vocab: int, *, dtype_bytes: int = 4,
                     checkpointing: bool = False, logprob_impl: str = "chunked", intermediate: int | None = None,
                     kv_dim: int | None = None) -> int:
    """Activation memory of one forward/backward of `tokens` tokens (one micro-batch), an estimate:
    `layer_activation_bytes` per layer; with gradient checkpointing only each layer's input (the float32
    residual, 4·H bytes a token) stays, plus one layer being recomputed. The log-probs: `full` holds logits,
    log-softmax and their gradient ([T,V] fp32 × 3); `chunked` only the final hidden states and their gradient.
    Compiled decoder layers (`train.compile`) fuse and save less (about half, measured on an H200): the estimate
    stays the eager one, an upper bound."""
    per_layer = layer_activation_bytes(hidden, intermediate, kv_dim, dtype_bytes=dtype_bytes)
    layers_b = (layers * 4 * hidden + per_layer) if checkpointing else layers * per_layer
    head = 3 * vocab * 4 if logprob_impl == "full" else 2 * hidden * 4
    return tokens * (layers_b + head)


def kv_cache_bytes(rows: int, positions: int, layers: int, kv_dim: int, dtype_bytes: int = 2) -> int:
    """The sampler's KV cache: keys and values of every layer for `rows` sequences of `positions` (prompt +
    budget; the HF engine preallocates them, `rollout.kvcache`), `kv_dim` = KV heads × head dim."""
    return 2 * rows * positions * layers * kv_dim * dtype_bytes


def forward_activation_bytes(tokens: int, hidden: int, intermediate: int, dtype_bytes: int = 2) -> int:
    """The transient peak of one no-grad forward over `tokens` tokens (a teacher scoring a batch): one layer's
    live tensors — the residual stream, its normed copy and attention output (3·H) and the MLP's gate, up and
    product (3·I) — the layers before it freed. An estimate."""
    return tokens * (3 * hidden + 3 * intermediate) * dtype_bytes


def fsdp_gathered_bytes(num_params: int, shape: tuple[int, int, int] | None, dtype_bytes: int) -> int:
    """FSDP2 with CPU offload: the most a rank gathers on the device at once — the root unit (embeddings and
    lm_head, untied counted twice; it stays gathered through the forward) plus one decoder layer, in the compute
    dtype (`distributed.cluster.fully_shard_model`'s units). `shape` = (hidden, layers, vocabulary); without
    it: the whole model."""
    if shape is None or not num_params:
        return (num_params or 0) * dtype_bytes
    hidden, layers, vocab = shape
    root = min(2 * vocab * hidden, num_params)
    return (root + (num_params - root) // max(layers, 1)) * dtype_bytes


def check_colocated_fit(*, kind: str, limit_gib: float | None, student_bytes: int, optimizer_factor: float,
                        teacher_bytes: dict[str, int], teachers_offload: bool, placement: str, shards: int = 1,
                        driver_copy: bool = False, activations: int = 0,
                        teachers_on_ranks: bool = False, gathered: int | None = None,
                        trainable_bytes: int | None = None, sampling: int = 0,
                        scoring: int = 0) -> dict[str, float]:
    """Pre-flight (before any compute): the largest phase must fit the budget of one device (one rank). Returns
    the phase needs (MiB).

    train = weights + gradients + optimizer state (AdamW: 2 moments → factor 2), divided by `shards` under FSDP2
    (each rank holds 1/N of all three; DDP replicates them: shards=1). Colocated, the optimizer state and
    gradients are offloaded after training, so rollout holds the weights and score the weights + one teacher;
    disaggregated, every phase keeps the training state. `teachers.offload: false` keeps every teacher resident
    in every phase. `driver_copy`: the update runs on workers and the sampling process keeps its own whole copy
    of the weights on device 0, beside rank 0's training state. `activations`: one micro-batch's
    (`activation_bytes`), held during the update. `teachers_on_ranks` (teachers.placement=workers): `teacher_bytes`
    is per rank (the teachers placed on it, asked at once, so loaded together) and the ranks keep their training
    state while they score. `gathered` (train.fsdp_cpu_offload): the shards and the optimizer live on the host, the
    device holds only the units gathered at once (these bytes, with their gradients) beside the driver's copy.
    `trainable_bytes` (LoRA): only these parameters have gradients and optimizer state; the frozen rest is weights
    alone. `sampling`: what the rollout engine holds beyond the weights while it samples (the HF engine's KV cache,
    `kv_cache_bytes`); `scoring`: a teacher's forward over the batch (`forward_activation_bytes`). Both 0 unless
    given: the pre-flight passes them (`preflight.transient_bytes`); the loop's re-check of the loaded models
    leaves them out."""
    w = student_bytes / MB
    if gathered is not None:
        on_device = 2 * gathered / MB
    elif trainable_bytes is not None:
        on_device = (w + trainable_bytes / MB * (1 + optimizer_factor)) / shards
    else:
        on_device = w * (2 + optimizer_factor) / shards
    state = on_device + (w if driver_copy else 0.0)
    trainer = state + activations / MB
    held = w if placement == "colocated" else state  # what rollout/score hold of the student
    tb = {n: b / MB for n, b in teacher_bytes.items()}
    always = 0.0 if teachers_offload else (max(tb.values(), default=0.0) if teachers_on_ranks else sum(tb.values()))
    need = {"train": trainer + always, "rollout": held + always + sampling / MB}
    if tb:
        big = max(tb, key=tb.get)
        one = teachers_offload or teachers_on_ranks  # one entry of `tb` scores at a time (per rank)
        need[f"score ({big})" if one else "score (all teachers)"] = ((state if teachers_on_ranks else held)
                                                                     + (tb[big] if one else always) + scoring / MB)
    budget = device_budget_mb(kind, limit_gib)
    if budget is not None:
        phase = max(need, key=need.get)
        if need[phase] > budget:
            n_t = len(teacher_bytes)
            if phase == "train" and trainer > budget:  # the update alone does not fit: shard it or cut activations
                act = activations / MB
                fix = ("shard it: runtime.strategy=fsdp2 with more runtime.num_workers (and train.fsdp_cpu_offload="
                       "true to keep the shards on the host), or a smaller model"
                       if state >= act else "cut the activations: train.gradient_checkpointing=true, a smaller "
                       "train.max_tokens_per_micro_batch (or micro_batch_size)")
                raise ColocationError(
                    f"runtime.placement={placement}: phase 'train' needs {need[phase] / 1024:.3g} GiB per device "
                    f"(weights + gradients + AdamW state{f' over {shards} shards' if shards > 1 else ''}: "
                    f"{state / 1024:.3g} GiB; activations of one micro-batch: {act / 1024:.3g} GiB) but the "
                    f"{kind} budget is {budget / 1024:.3g} GiB (runtime.memory_limit_gib) — {fix}")
            raise ColocationError(
                f"runtime.placement={placement}: phase '{phase}' needs {need[phase] / 1024:.3g} GiB but the "
                f"{kind} budget is {budget / 1024:.3g} GiB (runtime.memory_limit_gib) with {n_t} teacher(s)"
                + ("" if teachers_offload else " all resident (teachers.offload=false)")
                + " — set teachers.offload=true, use fewer/smaller teachers, or serve them elsewhere "
                  "(runtime.placement=disaggregated, teachers.backend=http)")
    return need


@contextmanager
def _unloading(teacher):
    try:
        yield
    finally:
        teacher.unload()


@contextmanager
def teacher_turn(teacher):
    """The one place an in-process teacher's weights move: onto the device for its turn, back when it has scored
    (`unload` keeps them with `teachers.offload: false`). Entered by `PhaseScheduler.teacher`, and by the router
    for a caller without a scheduler (the asynchronous pipeline's scorer, a teacher on a training worker)."""
    teacher.load()
    with _unloading(teacher):
        yield


class PhaseScheduler:
    """Runs the loop's phases, offloading what the next phase does not need (colocated) and recording memory.

    `model`/`opt`: the trainer's; `sync`: the stage's weight-sync role (`train.roles.weight_sync`), called at the
    start of every rollout phase to bring the engine to the trainer's weights (`push(model, version) -> metrics`)
    and at its end (`after_rollout(colocated)`: an engine with its own memory sleeps); None = no engine here."""

    def __init__(self, *, kind: str, device: torch.device, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 sync=None, teachers=None, placement: str = "colocated", events_path: str | Path | None = None):
        self.kind, self.device = kind, torch.device(device)
        self.model, self.opt, self.sync = model, opt, sync
        self.teachers = teachers
        self.colocated = placement == "colocated"
        self.placement = placement
        self.events_path = Path(events_path) if events_path else None
        self.step = 0
        self.opt_on_device = True
        self.mirror = devlib.HostMirror(kind, device)
        self.max_teachers_resident = 0
        self._step_metrics: dict[str, float] = {}
        self._events: list[dict] = []
        self.param_bytes = tensor_bytes(model.parameters())

    # -- accounting ------------------------------------------------------------------------------------------
    def _loaded_teachers(self) -> list[str]:
        if self.teachers is None:
            return []
        return [n for n, t in self.teachers.teachers.items() if t.resident]

    def resident(self) -> dict[str, float]:
        """MiB this process holds on the compute device, by owner."""
        grads = tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        loaded = self._loaded_teachers()
        t_bytes = sum(self.teachers.teachers[n].param_bytes for n in loaded) if loaded else 0
        out = {"weights": self.param_bytes / MB, "grads": grads / MB,
               "optim": optimizer_bytes(self.opt) / MB if self.opt_on_device else 0.0, "teachers": t_bytes / MB}
        out["total"] = sum(out.values())
        return out

    def _record(self, phase: str, where: str, teacher: str | None = None) -> None:
        res = self.resident()
        loaded = self._loaded_teachers()
        self.max_teachers_resident = max(self.max_teachers_resident, len(loaded))
        measured = devlib.memory_stats(self.kind)
        ev = {"step": self.step, "phase": phase, "at": where, "resident_mb": round(res["total"], 4),
              "teachers_resident": loaded, **({"teacher": teacher} if teacher else {}),
              **{f"{k}_mb": round(v, 4) for k, v in res.items() if k != "total"},
              **{k.split("/", 1)[1]: round(v, 2) for k, v in measured.items()}}
        self._events.append(ev)
        key = f"mem/{phase}/resident_mb"
        self._step_metrics[key] = max(self._step_metrics.get(key, 0.0), res["total"])
        dkey = "mem/device_allocated_mb" if "mem/device_allocated_mb" in measured else "mem/host_rss_mb"
        mkey = f"mem/{phase}/{dkey.split('/', 1)[1]}"
        self._step_metrics[mkey] = max(self._step_metrics.get(mkey, 0.0), measured[dkey])
        if where == "end" and "mem/device_peak_mb" in measured:  # the phase's own peak (reset at its start)
            for k in (f"mem/{phase}/device_peak_mb", "mem/device_peak_mb"):  # the step's: the max of its phases
                self._step_metrics[k] = max(self._step_metrics.get(k, 0.0), measured["mem/device_peak_mb"])

    @contextmanager
    def phase(self, name: str, teacher: str | None = None):
        self._record(name, "start", teacher)
        # each phase its own peak window: the end record's device_peak_mb is this phase's peak (cuda/npu)
        devlib.reset_peak_memory_stats(self.kind)
        try:
            yield
        finally:
            self._record(name, "end", teacher)

    # -- the phases ------------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.step = step
        self._step_metrics = {}

    @contextmanager
    def rollout(self, version: int):
        """The rollout phase of the step whose samples weight `version` (the updates so far) generates."""
        with self.phase("rollout"):
            if self.sync is not None:
                self._step_metrics.update(self.sync.push(self.model, version))
            try:
                yield
            finally:
                if self.sync is not None:
                    self.sync.after_rollout(self.colocated)

    @contextmanager
    def teacher(self, name: str):
        """One teacher's turn (entered by the router around each in-process teacher): it is loaded first, so the
        start record shows it resident next to the student, and unloaded before the end record."""
        t = self.teachers.teachers[name] if self.teachers is not None else None
        if t is None:
            with self.phase("score", teacher=name):
                yield
        else:
            t.load()  # outside the phase: the start record shows it resident
            with self.phase("score", teacher=name), _unloading(t):
                yield
        loaded = self._loaded_teachers()
        if self.colocated and len(loaded) > 1:  # a teacher kept its weights: the memory plan no longer holds
            log.warning("colocated: %d teachers resident at once (%s) — teachers.offload is off?", len(loaded),
                        ", ".join(loaded))

    @contextmanager
    def train(self):
        self.restore()  # before the start record: it shows what the update really holds
        with self.phase("train"):
            yield
            self._record("train", "updated")  # the phase's peak: weights + gradients + optimizer state
            if self.colocated:  # the next phases need neither: give the memory to the rollout engine/teachers
                self.model.zero_grad(set_to_none=True)
                if self.opt is not None:  # None: the optimizer lives on the training workers
                    t0 = time.perf_counter()
                    self.mirror.offload(self.opt)
                    self._step_metrics["perf/optim_offload_s"] = time.perf_counter() - t0
                    self.opt_on_device = False
                devlib.empty_cache(self.kind)

    def restore(self) -> None:
        """Put the optimizer state back on the device (before checkpointing or at the end of the stage)."""
        if not self.opt_on_device and self.opt is not None:
            t0 = time.perf_counter()
            self.mirror.restore(self.opt)
            self._step_metrics["perf/optim_restore_s"] = time.perf_counter() - t0
            self.opt_on_device = True

    def end_step(self) -> dict[str, float]:
        """This step's phase metrics; the events go to `phases.jsonl`."""
        if self.events_path is not None and self._events:
            with open(self.events_path, "a") as f:
                for ev in self._events:
                    f.write(json.dumps(ev) + "\n")
        self._events = []
        out = dict(self._step_metrics)
        out["colocated/max_teachers_resident"] = float(self.max_teachers_resident)
        return out

    def summary(self) -> str:
        who = (f"at most {self.max_teachers_resident} teacher(s) resident at once" if self.teachers is not None
               else "no teachers")
        return f"{self.placement}: {who}; student weights {self.param_bytes / MB:.3g} MiB"
