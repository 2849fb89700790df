"""Rollout engines behind one interface (`rollout.backend`), and `build_rollout` that picks one.

Every engine offers

    generate(examples, *, max_new_tokens, temperature, top_p, greedy, generator, batch_size, top_k, min_p)
        -> RolloutBatch
    sync_weights(model) -> dict     # hand the trainer's current weights to the engine; a transfer report
    sleep() / wake()                # give the device memory back between rollouts / take it again

| backend | engine | weights | sleep / wake |
|---|---|---|---|
| `hf` | `HFRollout`: transformers forward with a KV cache, any device | samples from the trainer's own module: `sync_weights` is the identity (0 bytes) | no-ops |
| `vllm` | `VllmRollout`: an in-process `vllm.LLM` (CUDA; Ascend through vllm-ascend, same API) | its own copy, refreshed by `sync_weights` through `mopd_core.weights` + the engine's `load_weights` | `LLM.sleep(level)` / `LLM.wake_up(tags)` (`enable_sleep_mode`) |

Both return the same `RolloutBatch` layout (prompts rendered by `models.chat.PromptFormatter` and left-padded by
`encode_prompts`, completions right-padded, the stop token inside the mask) and behaviour log-probs of the sampled
tokens at the sampling temperature, so the loop, the teachers and the losses cannot tell them apart. Both stop on
every id of `PromptFormatter.stop_ids`: EOS, the generation config's eos ids and, with `data.chat`, the chat
template's end-of-turn token.

**vLLM specifics** (read with TRL `trl/generation/vllm_generation.py` colocate mode and verl's
`vllm_rollout_spmd`, which do the same):
- Behaviour log-probs are vLLM's per-token logprob of the sampled token (`SamplingParams(logprobs=0)`) with
  `logprobs_mode="processed_logprobs"`: those of the distribution the token was drawn from — after temperature
  scaling, min_p, top_k and top_p, renormalised. `HFRollout` reports the same (`rollout.sample`, which truncates
  in vLLM's order); without truncation both equal `completion_logprobs`' `log_softmax(logits / T)`, with it they
  exceed it by `log(mass kept)` ≥ 0. With `greedy` vLLM reports the untempered log-softmax.
  Who sees which: eval only samples; the policy loop (expert/MOPD) passes the engine's log-probs to the PPO ratio
  and the reverse-KL advantage as they are when sampling does not truncate, and otherwise replaces them with the
  trainer's recomputed `completion_logprobs` (`train.update.recompute_behaviour_logp`, as verl's `old_log_prob` and
  TRL's GRPO do), logging the difference as `rollout/trunc_logp_gap`.
- **RNG**: `hf` draws every token from the one `generator` (so a sample depends on its batch neighbours);
  `vllm` draws one seed per request from `generator` (`SamplingParams(seed=…)`, in example order) and vLLM
  samples each request from its own seeded stream. Each backend is reproducible for a given generator state and
  independent of `batch_size` for vLLM, but the two backends never produce the same samples for one seed.
- `batch_size` is accepted for interface parity and ignored: vLLM schedules all requests itself within its
  preallocated KV cache.
- Weight hand-over, `engine_process`:
  - `inprocess` (default; `VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's engine core and worker live in this
    process, as TRL's colocate mode): `InProcessTransport` hands the trainer's tensors over as they are
    (0 bytes copied by the transport) and the worker's `load_weights` copies them into the engine's
    parameters (fusing q/k/v and gate/up on the way) — the one unavoidable copy.
  - `separate` (vLLM's engine core in its own process): the weights are packed bucket by bucket
    (`weights.plan_buckets`, at most one extra bucket of device memory at a time) and handed over by
    `CudaIpcTransport` on CUDA (one IPC handle per bucket, 0 bytes copied) or `SharedMemoryTransport` on
    NPU, where device IPC is missing (AReaL-Ascend's path: device → `/dev/shm` → device). The worker-side
    function travels through `LLM.collective_rpc`, which needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (set
    here) to pickle a callable; the hand-over message (IPC handles / segment paths + layouts) is pickled by us
    and travels as bytes, so vLLM's msgpack channel cannot reshape it.
  - Loading: `model.load_weights(weights)`; where a backend repacks its linear weights after loading (vLLM's
    CPU backend: "'Parameter' object has no attribute 'weight_loader'") the worker falls back to vLLM's
    in-place `reload_weights(weights_iterator=…)`. The prefix cache is reset after every hand-over (cached KV
    blocks were computed with the old weights).
- Sleep: level 1 (default) offloads the weights to host memory and drops the KV cache, so a `wake` without a
  `sync_weights` still samples from the right weights; level 2 drops the weights too — cheaper when every wake
  is followed by a hand-over (the loop's case). After a level-2 sleep the next `generate` syncs from the
  trainer's module first. `sync_weights` wakes the weights only (TRL: writing into slept, unmapped memory
  crashes on Ascend), `generate` wakes the rest.
- The engine takes the process's first visible device (restrict it with `CUDA_VISIBLE_DEVICES` /
  `ASCEND_RT_VISIBLE_DEVICES`); in-process, vLLM initialises a one-rank torch.distributed group in this
  process, so a multi-rank trainer uses `engine_process="separate"` (or vLLM's `external_launcher`).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pickle
import time
from typing import Any, Sequence

import torch

from ..config import RecipeConfig, RolloutConfig, TeachersConfig
from ..errors import PlacementError
from ..runtime import device as devlib
from ..weights import DEFAULT_BUCKET_BYTES, InProcessTransport, make_transport
from ..weights.buckets import Bucket, PackedBuckets, allocate, plan_buckets
from ..models import generation_config
from ..models.chat import formatter_for
from ..models.lora import export_state_dict
from . import HFRollout, RolloutBatch, RolloutEngine, assemble_completions, encode_prompts
from .requests import request_seeds, sampling_kwargs
from .served import ServedRollout

BACKENDS = ("hf", "hf_graphed", "vllm", "served")
_VLLM_FIX = ("install it with `pip install -e .[vllm]` on a CUDA machine (`.[npu]` on Ascend), "
             "or set rollout.backend=hf")


class RolloutBackendError(PlacementError):
    """A rollout backend that cannot run here; the message is one line naming `rollout.backend` and the fix."""


def vllm_importable() -> bool:
    """Is a `vllm` package installed? (Cheap: does not import it — importing vLLM takes seconds.)"""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def check_vllm_backend(device: torch.device | str) -> None:
    """Raise the one-line `rollout.backend=vllm` error where vLLM cannot run: no vllm, or a cpu device."""
    kind = devlib.kind_of(device)
    problems = []
    if kind == "cpu":
        problems.append("the device is cpu (vLLM's sleep mode and weight hand-over need CUDA or an Ascend NPU)")
    if not vllm_importable():
        problems.append("vllm is not importable in this environment")
    if problems:
        raise RolloutBackendError(f"rollout.backend=vllm cannot run here: {'; '.join(problems)} — {_VLLM_FIX}")


def build_rollout(recipe_or_rollout_cfg: RecipeConfig | RolloutConfig, model, tokenizer, device,
                  max_prompt_tokens: int | None = None, **vllm_kwargs):
    """The rollout engine for `rollout.backend`.

    `recipe_or_rollout_cfg`: a `RecipeConfig` (its `rollout`, `seed`, `runtime.dtype`, `teachers` (the served
    backend's python, start-up and KV cache) and `data.max_prompt_tokens`/`data.chat` are used) or a
    `RolloutConfig`. `hf` → `HFRollout` over the trainer's `model`; `vllm` → `VllmRollout` (vLLM model len =
    max_prompt_tokens + rollout.max_new_tokens; `rollout.gpu_memory_utilization`, `sleep_level` and
    `engine_process` from the config, any other `VllmRollout` option as a keyword). Prompts are rendered and
    generation stops as the recipe's `data.chat` says (`models.chat`; a `chat=` keyword overrides it: a
    `ChatConfig` or a `PromptFormatter`)."""
    recipe = recipe_or_rollout_cfg if isinstance(recipe_or_rollout_cfg, RecipeConfig) else None
    cfg = recipe.rollout if recipe is not None else recipe_or_rollout_cfg
    if max_prompt_tokens is None and recipe is not None:
        max_prompt_tokens = recipe.data.max_prompt_tokens
    chat = vllm_kwargs.pop("chat", None)
    if chat is None and recipe is not None:
        chat = recipe.data.chat  # how prompts become ids and which ids stop (models.chat)
    backend = cfg.backend
    if backend == "hf":
        return HFRollout(model, tokenizer, device, max_prompt_tokens, chat=chat, ignore_eos=cfg.ignore_eos)
    if backend == "served":
        teachers = recipe.teachers if recipe is not None else TeachersConfig()
        return _served(cfg, teachers, model, tokenizer, device, max_prompt_tokens, chat, vllm_kwargs)
    if backend == "hf_graphed":  # vLLM's keywords (max_model_len from eval) mean nothing to it
        from .graphed import GraphedRollout

        return GraphedRollout(model, tokenizer, device, max_prompt_tokens, chat=chat, ignore_eos=cfg.ignore_eos)
    if backend != "vllm":
        raise ValueError(f"rollout.backend='{backend}' is not one of {', '.join(BACKENDS)}")
    check_vllm_backend(device)
    kw: dict[str, Any] = {"sleep_level": cfg.sleep_level, "engine_process": cfg.engine_process}
    if cfg.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    if recipe is not None:
        kw["seed"] = recipe.seed
        kw["dtype"] = recipe.runtime.dtype  # the compute dtype: the trainer's module holds float32 master weights
    if max_prompt_tokens is not None:
        kw["max_model_len"] = max_prompt_tokens + cfg.max_new_tokens
    kw.update(vllm_kwargs)
    return VllmRollout(model, tokenizer, device, max_prompt_tokens, chat=chat, **kw)


def _served(cfg: RolloutConfig, t: TeachersConfig, model, tokenizer, device, max_prompt_tokens, chat, kw):
    """`rollout.backend: served`: start `rollout.servers` student servers on `model_path` (the checkpoint the
    trainer's module was loaded from) under `run_dir`; `version` = the weight version that checkpoint is. The
    servers' python, start-up timeout and CPU KV cache are the teachers' (`t`)."""
    if "model_path" not in kw or "run_dir" not in kw:
        raise ValueError("rollout.backend=served needs model_path= and run_dir= (the loop passes them)")
    return ServedRollout.start(
        kw["model_path"], kw["run_dir"], tokenizer=tokenizer, device=device, max_prompt_tokens=max_prompt_tokens,
        max_new_tokens=cfg.max_new_tokens, servers=cfg.servers, dtype=cfg.server_dtype, python=t.serve_python,
        startup_timeout_s=t.startup_timeout_s, kv_cache_gib=t.kv_cache_gib, restarts=cfg.restarts,
        version=kw.get("version", 0), model=model, chat=chat, request_timeout_s=cfg.request_timeout_s)


# ---------------------------------------------------------------- worker side (runs inside vLLM's worker)


def _worker_device(worker) -> torch.device | None:
    dev = getattr(worker, "device", None)  # lib: vllm workers: the GPU worker has `device`, others only the runner's
    if dev is None:
        dev = getattr(getattr(worker, "model_runner", None), "device", None)  # lib: vllm model runner
    return torch.device(dev) if dev is not None else None


def _engine_model(worker):
    runner = worker.model_runner
    get = getattr(runner, "get_model", None)  # lib: vllm runners expose `get_model()`, older ones only `.model`
    return get() if callable(get) else runner.model


def _hand_over_state(worker) -> dict:
    """What this module remembers on a vLLM worker between hand-overs (the load method that worked, staged
    tensors), kept in one dict of ours in the worker's `__dict__`."""
    return worker.__dict__.setdefault("_mopd_hand_over", {"method": None, "staged": []})


def _load_into_engine(worker, weights: list[tuple[str, torch.Tensor]], method: str = "auto",
                      final: bool = True) -> str:
    """Load named HF-layout tensors into the engine's model; returns the method used.

    `load_weights` takes any subset of the weights at a time (one bucket per call). vLLM's in-place
    `reload_weights` — the fallback where parameters were repacked after loading — needs every weight of a layer
    in one call, so its buckets are staged (copied) on the worker until the `final` one arrives. The method that
    worked is remembered on the worker for the next hand-overs."""
    state = _hand_over_state(worker)
    chosen = state["method"] or method
    if chosen in ("auto", "load_weights"):
        try:
            _engine_model(worker).load_weights(weights=weights)
            state["method"] = "load_weights"
            return "load_weights"
        except AttributeError:  # parameters repacked after loading (vLLM CPU backend): no weight_loader left
            if chosen != "auto" or not hasattr(worker, "reload_weights"):  # lib: vllm (older workers lack it)
                raise
            chosen = state["method"] = "reload_weights"
    staged = state["staged"]
    if final and not staged:
        worker.reload_weights(weights_iterator=iter(weights))
    else:
        staged.extend((n, t.clone()) for n, t in weights)  # the sender reuses its buffers after this call
        if final:
            state["staged"] = []
            worker.reload_weights(weights_iterator=iter(staged))
    return chosen


def _engine_load(worker, transport: str, message: Any, method: str = "auto", final: bool = True) -> dict:
    """`LLM.collective_rpc` target: receive one hand-over message and load it. Module-level so that it pickles
    by reference into a separate engine process (the package is importable there too)."""
    if isinstance(message, (bytes, bytearray)):  # pickled by the sender: survives vLLM's msgpack channel intact
        message = pickle.loads(message)
    tr = InProcessTransport() if transport == "inprocess" else make_transport(transport)
    dev = _worker_device(worker)
    if transport == "shared_memory":
        got = tr.receive(message, device=dev)
    else:
        got = tr.receive(message)
    used = _load_into_engine(worker, list(got.tensors.items()), method, final)
    if dev is not None and dev.type != "cpu":
        devlib.synchronize(dev.type)  # the sender frees/reuses its buffers as soon as this returns
    rep = got.report.to_dict()
    rep["load_method"] = used
    return rep


# ---------------------------------------------------------------- the vLLM engine


class VllmRollout(RolloutEngine):
    """`rollout.backend: vllm` — an in-process vLLM engine with its own copy of the student's weights.

    `model`: the trainer's module (source of `sync_weights` and, through `model.name_or_path`, of the checkpoint
    vLLM starts from; pass `model_path` for a module built in memory). `allow_cpu` is for tests with the CPU
    build of vLLM (no sleep mode there); `build_rollout` never sets it. See the module docstring for the
    hand-over, sleep levels and RNG semantics."""

    def __init__(self, model, tokenizer, device, max_prompt_tokens: int | None = None, *,
                 max_model_len: int | None = None, model_path: str | os.PathLike | None = None,
                 dtype: str | None = None, seed: int = 0, gpu_memory_utilization: float = 0.3,
                 enable_sleep_mode: bool = True, sleep_level: int = 1, engine_process: str = "inprocess",
                 transport: str = "auto", bucket_bytes: int = DEFAULT_BUCKET_BYTES, load_method: str = "auto",
                 load_format: str = "auto", enforce_eager: bool = True, allow_cpu: bool = False,
                 llm_kwargs: dict | None = None, chat=None, formatter=None):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.max_prompt_tokens = max_prompt_tokens
        # prompt ids and stop ids exactly as HFRollout computes them (vLLM runs without a tokenizer here)
        self.formatter = formatter_for(tokenizer, formatter if formatter is not None else chat)
        self.kind = devlib.kind_of(self.device)
        if self.kind == "cpu" and not allow_cpu:
            check_vllm_backend(self.device)
        if engine_process not in ("inprocess", "separate"):
            raise ValueError(f"engine_process='{engine_process}' is not one of inprocess, separate")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level} is not 1 (offload weights) or 2 (discard weights)")
        self.engine_process = engine_process
        if transport == "auto":
            transport = devlib.handover_transport(self.kind, same_process=engine_process == "inprocess")
        if engine_process == "inprocess" and transport != "inprocess":
            raise ValueError(f"transport='{transport}' needs engine_process='separate' (in one process the "
                             "hand-over is `inprocess`; CUDA refuses to open its own IPC handles)")
        self.transport = transport
        self.bucket_bytes = int(bucket_bytes)
        self.load_method = load_method
        self.enable_sleep_mode = bool(enable_sleep_mode) and self.kind != "cpu"  # no sleep mode on CPU
        self.sleep_level = sleep_level
        self._awake: set[str] = {"weights", "kv_cache"}
        self._weights_stale = load_format == "dummy"  # random init: the first generate syncs first
        self.last_sync: dict | None = None

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine_process == "inprocess" else "1"
        if engine_process == "separate":
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        try:
            import vllm
            from vllm import envs as vllm_envs
        except Exception as e:  # not installed, or a build that does not match this torch/driver
            raise RolloutBackendError(f"rollout.backend=vllm: `import vllm` failed ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}) — {_VLLM_FIX}") from None
        disable = getattr(vllm_envs, "disable_envs_cache", None)  # lib: vllm ≥ 0.11 caches env reads
        if disable is not None:  # a previous in-process engine froze vLLM's env reads; ours must be seen
            disable()
        self._SamplingParams = vllm.SamplingParams

        path = model_path or getattr(model, "name_or_path", None) or getattr(  # lib: transformers (either name)
            getattr(model, "config", None), "_name_or_path", None)  # lib: transformers
        if not path:
            raise ValueError("VllmRollout needs a checkpoint to start the engine from: the model has no "
                             "name_or_path — pass model_path=<save_pretrained dir>")
        if dtype is None:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = dict(
            model=str(path), dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=enforce_eager,
            enable_sleep_mode=self.enable_sleep_mode, logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,   # we tokenise and detokenise with the trainer's tokenizer
            generation_config="vllm",   # ignore the checkpoint's sampling defaults (e.g. Qwen's top_k=20)
            load_format=load_format)
        if self.kind != "cpu":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(llm_kwargs or {})
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**kwargs)
        self.init_seconds = time.perf_counter() - t0

    # -- phases ----------------------------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return self._awake != {"weights", "kv_cache"}

    def sleep(self, level: int | None = None) -> None:
        """Give the device memory back (weights offloaded at level 1, discarded at level 2; KV cache dropped)."""
        if not self.enable_sleep_mode or not self._awake:
            return
        level = level or self.sleep_level
        self.llm.sleep(level=level)
        self._awake = set()
        if level >= 2:
            self._weights_stale = True

    def wake(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory again: `tags` ⊆ {"weights", "kv_cache"}; None = both."""
        if not self.enable_sleep_mode:
            return
        todo = [t for t in ("weights", "kv_cache") if (tags is None or t in tags) and t not in self._awake]
        if not todo:
            return
        devlib.empty_cache(self.kind)  # hand the trainer's cached blocks to vLLM's allocator
        self.llm.wake_up(tags=todo)
        self._awake |= set(todo)

    # -- weights ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self, model=None) -> dict:
        """Hand `model`'s (default: the trainer's module) current weights to the engine. Returns a report:
        transport, tensors, bytes_total, bytes_copied (what the transport copied, both sides: 0 in-process and
        over CUDA IPC, the shared-memory copies otherwise), bytes_packed (packing into buckets, a device-side
        copy; 0 in-process), messages (objects / IPC handles / shm segments), rpc_calls, load_method, seconds.
        The engine's own copy into its parameters (`load_weights`) is in none of them."""
        model = self.model if model is None else model
        self.wake(["weights"])
        t0 = time.perf_counter()
        # a LoRA policy hands over its merged weights (the engine's model has no adapters)
        named = [(n, t.detach()) for n, t in export_state_dict(model).items()]
        total = sum(t.numel() * t.element_size() for _, t in named)
        copied = packed = messages = calls = 0
        methods = set()
        if self.transport == "inprocess":
            tr = InProcessTransport()
            sent = tr.send(dict(named))
            rep = self.llm.collective_rpc(_engine_load, args=("inprocess", sent.message, self.load_method,
                                                              True))[0]
            copied, messages, calls = sent.report.bytes_copied + rep["bytes_copied"], sent.report.messages, 1
            methods.add(rep["load_method"])
        else:
            tr = make_transport(self.transport)
            by_name = dict(named)
            layouts = plan_buckets(((n, tuple(t.shape), t.dtype, t.device) for n, t in named), self.bucket_bytes)
            try:
                for i, lay in enumerate(layouts):  # one bucket at a time: at most one extra bucket of memory
                    buf = allocate(lay)
                    for e in lay.entries:
                        buf[e.offset:e.offset + e.numel].view(e.shape).copy_(by_name[e.name])
                    sent = tr.send(PackedBuckets([Bucket(buf, lay)]))
                    rep = self.llm.collective_rpc(_engine_load, args=(
                        self.transport, pickle.dumps(sent.message), self.load_method, i == len(layouts) - 1))[0]
                    tr.release()
                    packed += lay.nbytes
                    copied += sent.report.bytes_copied + rep["bytes_copied"]
                    messages += sent.report.messages
                    calls += 1
                    methods.add(rep["load_method"])
                    del buf
            finally:
                tr.release()
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self._weights_stale = False
        report = {"transport": self.transport, "tensors": len(named), "bytes_total": total,
                  "bytes_copied": copied, "bytes_packed": packed, "messages": messages, "rpc_calls": calls,
                  "load_method": ",".join(sorted(methods)), "seconds": time.perf_counter() - t0}
        self.last_sync = report
        return report

    # -- sampling --------------------------------------------------------------------------------------------
    def stop_ids(self) -> list[int]:
        """EOS, the trainer module's generation-config eos ids, and the chat template's end-of-turn token — vLLM
        starts with `skip_tokenizer_init` and `generation_config="vllm"`, so these are the only stops it knows."""
        return self.formatter.stop_ids(generation_config(self.model), self.tokenizer)

    def generate(self, examples: Sequence[Any], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
                 batch_size: int | None = None, top_k: int = 0, min_p: float = 0.0,
                 top_logprobs: int = 0) -> RolloutBatch:
        # vLLM batches by itself (see the module docstring); its top-k log-probs are not asked for (the dense
        # objective scores its candidates with the trainer, in the trainer's numerics)
        del batch_size, top_logprobs
        self.wake()
        if self._weights_stale:
            self.sync_weights(self.model)
        examples = list(examples)
        tok = self.tokenizer
        ids, mask = encode_prompts(tok, examples, self.device, self.max_prompt_tokens, formatter=self.formatter)
        ids_c, mask_c = ids.cpu(), mask.cpu()
        prompts = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids_c, mask_c)]
        seeds = request_seeds(len(examples), generator)
        stops = self.stop_ids()
        params = [self._SamplingParams(**sampling_kwargs(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy, seed=int(s),
            stop_ids=stops, top_k=top_k, min_p=min_p)) for s in seeds]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        rows = []
        for o in outs:
            r = o.outputs[0]
            toks = list(r.token_ids)
            if toks and r.logprobs is None:
                # a bug (ours or vLLM's), not the user's input: keeps its traceback
                raise RuntimeError("rollout.backend=vllm: the engine returned no logprobs for a sample")
            rows.append((toks, [r.logprobs[t][tok].logprob for t, tok in enumerate(toks)]))
        return assemble_completions(tok, ids, mask, rows, examples, self.device)

    # -- teardown --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the engine down and give its memory back (best effort: vLLM keeps some process state). With
        sleep mode the memory is released through a level-2 sleep first — the engine's pool would otherwise
        stay mapped in this process."""
        llm = self.llm
        if llm is None:
            return
        if self.enable_sleep_mode:
            try:
                if self._awake:
                    llm.sleep(level=2)
                    self._awake = set()
            except Exception:
                pass
        self.llm = None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)  # lib: vllm V1 engine core
        try:
            if core is not None and hasattr(core, "shutdown"):  # lib: vllm (in-process cores have no shutdown)
                core.shutdown()
        except Exception:
            pass
        del llm, core
        gc.collect()
        devlib.empty_cache(self.kind)


__all__ = ["BACKENDS", "RolloutBackendError", "VllmRollout", "build_rollout", "check_vllm_backend",
           "sampling_kwargs", "vllm_importable"]
