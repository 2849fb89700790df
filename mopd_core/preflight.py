"""Pre-flight: what a stage can check before any compute and before it writes anything — so a mistake costs
seconds, names the field or file and the fix, and leaves no stage folder behind.

`check_stage(recipe, spec, ...)` is called first thing by every stage entry point in `recipe.py` (with the stage's
`stages.StageSpec`), `check_recipe(recipe, plan, ...)` before a recipe's first stage:

- every model the stage loads (the student / `--init`, local teachers, served teachers' checkpoints, eval models)
  is a checkpoint dir that loads: config.json parses, the safetensors headers read (no tensor is loaded) and
  match the config, a tokenizer is there (`models.inspect_checkpoint`);
- prompt + completion + 1 fits the context (`max_position_embeddings`) of the student and every local teacher
  (http teachers: the servers' max-model-len is checked when the router is built, `teachers/http.py`);
- the device exists, `rollout.backend=vllm` can run here, and the colocated phases fit the memory budget
  (`runtime.memory_limit_gib`, from parameter counts);
- `train.max_tokens_per_micro_batch`, when set, holds the longest row (prompt + completion); else a warning;
- every prompt of the data fits `data.max_prompt_tokens`, tokenized with the run's tokenizer (dataset rows: all
  of them, named by file and row; synthetic domains: the eval set and a sample of training prompts);
- the output dir can be written (nothing in the way is a regular file, files can be created there) and its disk
  has the space a checkpoint needs: parameter bytes × 3 (weights + AdamW's two moments) + a margin;
- MOPD, once the teachers are open (`check_compatibility`, `teachers/compat.py`): every teacher's tokenizer, chat
  template, EOS, determinism, log-prob mode and temperature against the student, one line per failure;
- LoRA (`expert.lora` / `mopd.lora`): the memory estimate gives gradients and AdamW state to the adapter
  parameters only (counted on the model built on the meta device), and a `target_modules` that matches no module
  of the model fails here.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .config import RecipeConfig
from .errors import ConfigError, DataError, DiskFullError
from .runtime import device as devlib
from .stages import StageSpec, expert_loop_config
from .train.loop import check_loop_config

log = logging.getLogger("mopd")

MARGIN_BYTES = 16 * 2**20  # metrics, stage.json, tokenizer files, filesystem slack
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class _Model:
    label: str               # how messages name it: "--init", "teacher 'math'", …
    path: str
    context: int | None      # positions it supports; None = unknown (a hub id that does not say)
    num_params: int | None
    tokenizer: Any = None
    shape: tuple[int, int, int] | None = None  # hidden size, decoder layers, vocabulary: the activation estimate
    widths: tuple[int, int] | None = None  # MLP intermediate size, KV heads × head dim (`models.model_widths`)


def check_recipe(recipe: RecipeConfig, plan: Sequence[StageSpec], domains: Mapping[str, Any],
                 benchmarks: Mapping[str, Any] | None = None) -> None:
    """Pre-flight of a whole recipe before its first stage: the device, the config of every stage of `plan`, the
    base model (`model.base`, or the tiny model as it will be built), its context, every prompt of `domains` (the
    built domains) and `eval_sources` benchmark, and the run folder. Raises a `MopdError`."""
    dinfo = devlib.resolve(recipe.runtime.device)  # a device this host lacks: PlacementError, now
    if recipe.rollout.backend == "vllm":
        from .rollout.engines import check_vllm_backend

        check_vllm_backend(dinfo.torch_device)
    _check_config(recipe, "recipe", domains, has_teachers=True)  # a recipe's teachers are its experts
    for spec in plan:  # one round's experts: the later rounds run them with the same config
        if spec.kind == "expert" and spec.round == 1:
            check_loop_config(spec.preflight_name, expert_loop_config(recipe), recipe, [spec.domain],
                              has_teachers=False)
    stu = _base(recipe)
    _check_context(recipe, stu, eval=True)
    _check_prompts(recipe, _tokenizer(stu), domains)
    _check_benchmarks(recipe, _tokenizer(stu), [stu], benchmarks)  # a bad file fails now, not after the training
    _check_output_dir(recipe, recipe.run_dir(), stu)


def check_stage(recipe: RecipeConfig, spec: StageSpec, *, domains: Mapping[str, Any],
                student: str | Path | None = None, teachers: Mapping[str, str | Path] | None = None,
                models: Mapping[str, str | Path] | None = None, endpoints: Any = None,
                benchmarks: Mapping[str, Any] | None = None) -> None:
    """Pre-flight of one stage (`spec`), called first by its stage function. `student`: the model it starts from
    (sft: the base; None = `model.base`); `teachers` (mopd) and `models` (evaluate): {name: checkpoint};
    `domains`: the built domains; `endpoints`: teachers already served (their checkpoints are not loaded here);
    `benchmarks` (evaluate): {domain: `evaluation.load_benchmarks(...)`} already loaded. Raises a `MopdError`."""
    dinfo = devlib.resolve(recipe.runtime.device)  # a device this host lacks: PlacementError, now
    name, policy = spec.preflight_name, spec.kind in ("expert", "mopd")  # the stages that sample rollouts
    if policy and recipe.rollout.backend == "vllm":
        from .rollout.engines import check_vllm_backend

        check_vllm_backend(dinfo.torch_device)
    _check_config(recipe, name, domains, has_teachers=bool(teachers) or endpoints is not None
                  or bool(recipe.teachers.endpoints))
    if spec.kind == "evaluate":
        evals = [_inspect(recipe, f"eval model '{k}'", v) for k, v in (models or {}).items()]
        for m in evals:
            _check_context(recipe, m, eval=True)
        if evals:
            _check_prompts(recipe, _tokenizer(evals[0]), domains)
            _check_benchmarks(recipe, _tokenizer(evals[0]), evals, benchmarks)
        return  # evaluation writes nothing
    sft = spec.kind == "sft"
    stu = _base(recipe) if student is None and sft else _inspect(recipe, "--base" if sft else "--init", student)
    _check_context(recipe, stu, eval=True)
    local_teachers: dict[str, _Model] = {}
    if teachers and recipe.mopd.w_kd > 0 and spec.kind == "mopd":
        served_elsewhere = endpoints is not None or bool(recipe.teachers.endpoints)
        for tid, path in teachers.items():
            if recipe.teachers.backend == "http" and served_elsewhere:
                continue
            t = _inspect(recipe, f"teacher '{tid}'", path)
            if recipe.teachers.backend == "local":  # http: the server's max-model-len is checked at connect
                _check_context(recipe, t, eval=False)
                local_teachers[tid] = t
    if policy and stu.num_params:
        memory_needs(recipe, name, dinfo.kind, stu, local_teachers)
    _check_prompts(recipe, _tokenizer(stu), domains)
    # a stage that will be reused writes nothing (retrained after all: a full disk is still caught while saving)
    _check_output_dir(recipe, spec.stage_dir, None if spec.done() else stu)


def check_compatibility(recipe: RecipeConfig, router, student: str | Path, domains: Mapping[str, Any],
                        mappable=None):
    """The MOPD stage's compatibility pre-flight (`teachers.compat`): every teacher of `router` against the
    student at `student` on probe rows of `domains`, after the teachers are open and before the stage folder is
    claimed. Logs the table and each warning; raises `CompatError` (one line per failure, the table on it) when a
    check set to `fail` failed. Returns the `CompatReport` for the stage's run."""
    from .models import check_same_tokenizer, load_tokenizer, tokenizer_fingerprint
    from .models.chat import carry_chat_template
    from .teachers.compat import CompatError, check_compatibility as run_checks

    tok = load_tokenizer(student)
    carry_chat_template(tok, recipe.data.chat)
    fp = tokenizer_fingerprint(tok)
    for name, t in router.teachers.items():  # a hard rule, not a check to skip: the router's own, first
        check_same_tokenizer(fp, t.fingerprint, name, f" ({t.path})")
    report = run_checks(router, tok, recipe, domains, devlib.resolve(recipe.runtime.device).torch_device, mappable)
    log.info("teacher compatibility pre-flight:\n%s", report.markdown().split("\n\n## ")[0])
    for line in report.warnings():
        log.warning("%s", line)
    if report.failures():
        raise CompatError(report)
    return report


def _is_mopd_free(stage: str) -> bool:
    return stage in ("recipe", "sft", "eval") or stage.startswith("expert-")


def _check_config(recipe: RecipeConfig, stage: str, domains: Mapping[str, Any], has_teachers: bool) -> None:
    """Combinations no stage can run (or that would silently ignore a setting): before the first stage of a
    recipe, not after the experts have trained. `stage`: "recipe", or a `StageSpec.preflight_name`."""
    budget = recipe.train.max_tokens_per_micro_batch
    if budget is not None and stage not in ("sft", "eval") and budget < recipe.max_seq_len():
        # a warning, not an error: such a row still trains, in a micro-batch of its own over the budget
        log.warning("train.max_tokens_per_micro_batch=%d is below the longest row (data.max_prompt_tokens + "
                    "rollout.max_new_tokens = %d): such rows run alone, over the budget — raise it to at least %d",
                    budget, recipe.max_seq_len(), recipe.max_seq_len())
    rt = recipe.runtime
    if recipe.train.fsdp_cpu_offload and rt.strategy != "fsdp2":
        raise ConfigError(f"train.fsdp_cpu_offload=true offloads FSDP2 shards, but runtime.strategy={rt.strategy} — "
                          "set runtime.strategy=fsdp2 (with runtime.num_workers) or train.fsdp_cpu_offload=false")
    if rt.strategy != "single":
        from .distributed.trainer import check_ray_address  # cheap, but keeps `import preflight` free of ray code

        check_ray_address(rt.ray_address, timeout_s=min(rt.ray_timeout_s, 10.0))
    if stage in ("recipe", "sft") and rt.strategy != "single" and recipe.sft.batch_size % rt.num_workers:
        raise ConfigError(f"sft.batch_size={recipe.sft.batch_size} does not split over runtime.num_workers="
                          f"{rt.num_workers} (it is the global batch); make it a multiple of {rt.num_workers}")
    if stage == "recipe" or not _is_mopd_free(stage):  # the mopd stage, or a recipe that will reach it
        t = recipe.teachers
        if t.placement == "workers" and (t.backend != "local" or rt.strategy == "single"):
            raise ConfigError(f"teachers.placement=workers puts local teachers on the training workers' devices, "
                              f"but teachers.backend={t.backend} and runtime.strategy={rt.strategy} — set "
                              "teachers.backend=local and runtime.strategy=ddp or fsdp2, or teachers.placement=driver")
        if t.endpoints and t.backend != "http":
            raise ConfigError(f"teachers.endpoints is set but teachers.backend={t.backend}: the endpoints would be "
                              "ignored — set teachers.backend=http or remove teachers.endpoints")
        m = recipe.mopd
        if m.w_kd > 0 and m.kd_loss == "jsd" and t.backend == "http" and m.jsd_top_k > t.max_logprobs:
            raise ConfigError(f"mopd.jsd_top_k={m.jsd_top_k} exceeds teachers.max_logprobs={t.max_logprobs} (the "
                              "servers' --max-logprobs): lower mopd.jsd_top_k or raise teachers.max_logprobs")
        check_loop_config("student" if stage == "recipe" else stage, m, recipe, list(domains),
                          has_teachers=has_teachers)


# ---------------------------------------------------------------- models


def _inspect(recipe: RecipeConfig, label: str, path: str | Path | None) -> _Model:
    from .models import inspect_checkpoint, model_shape, model_widths

    if path is None or not str(path).strip():
        raise ConfigError(f"{label}: no model given — pass a checkpoint dir")
    info = inspect_checkpoint(path, label)
    if info is not None:
        return _Model(label, str(path), info.context, info.num_params, shape=model_shape(info.config),
                      widths=model_widths(info.config))
    context, n, shape, widths = _hub_shape(str(path), recipe.model.trust_remote_code)  # a hub id: its config
    return _Model(label, str(path), context, n, shape=shape, widths=widths)


def _base(recipe: RecipeConfig) -> _Model:
    """The SFT base: `model.base`, or the tiny model as it will be built (nothing written yet)."""
    if recipe.model.base != "tiny":
        return _inspect(recipe, "model.base", recipe.model.base)
    built = recipe.run_dir() / "base"
    if (built / "config.json").exists():
        return _inspect(recipe, "model.base (tiny)", built)
    import torch

    from .models import build_tiny_model, run_tokenizer

    tok = run_tokenizer(recipe.model)  # the tokenizer base_model will build
    with torch.device("meta"):  # shapes only: no memory, no init
        n = sum(p.numel() for p in build_tiny_model(recipe.model.tiny, len(tok), tok.pad_token_id,
                                                    tok.eos_token_id).parameters())
    t = recipe.model.tiny
    return _Model("the tiny model", "tiny", t.max_position_embeddings, n, tok,
                  shape=(t.hidden_size, t.num_layers, len(tok)),
                  widths=(t.intermediate_size, (t.num_kv_heads or t.num_heads) * (t.hidden_size // t.num_heads)))


def _hub_shape(model_id: str, trust_remote_code: bool) -> tuple[int | None, int | None, Any, Any]:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from .models import model_context, model_shape, model_widths

        cfg = AutoConfig.from_pretrained(model_id, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(
                cfg, trust_remote_code=trust_remote_code).parameters())
        return model_context(cfg.to_dict()), n, model_shape(cfg.to_dict()), model_widths(cfg.to_dict())
    except Exception:  # noqa: BLE001 - not resolvable now: the stage's own load reports it
        return None, None, None, None


def _tokenizer(m: _Model):
    if m.tokenizer is None:
        from .models import load_tokenizer

        m.tokenizer = load_tokenizer(m.path)
    return m.tokenizer


def _check_context(recipe: RecipeConfig, m: _Model, eval: bool) -> None:
    """prompt + completion + 1 ≤ the model's positions (SFT appends EOS; a teacher scores one more token)."""
    if m.context is None:
        return
    need = recipe.max_seq_len(eval=eval) + 1
    if need <= m.context:
        return
    P, T = recipe.data.max_prompt_tokens, recipe.rollout.max_new_tokens
    parts = f"data.max_prompt_tokens={P} + rollout.max_new_tokens={T}"
    if eval and recipe.max_seq_len(eval=True) > recipe.max_seq_len():
        parts = f"data.max_prompt_tokens={P} + eval.max_new_tokens={recipe.eval.max_new_tokens}"
    where = ("(model.tiny.max_position_embeddings)" if m.path == "tiny"
             else f"'{m.path}' (max_position_embeddings in its config.json)")
    raise ConfigError(f"prompt + completion + 1 = {parts} + 1 = {need} exceeds the {m.context} positions of "
                      f"{m.label} {where} — lower rollout.max_new_tokens or data.max_prompt_tokens, or use a model "
                      "with a longer context")


def update_activation_bytes(recipe: RecipeConfig, stage: str, shape: tuple[int, int, int],
                            widths: tuple[int, int] | None = None) -> int:
    """The activations of one micro-batch of `stage`'s update (`runtime.phases.activation_bytes`) for a model of
    `shape` (hidden, layers, vocabulary) and `widths` (MLP, key/value: `models.model_widths`; None = guessed):
    the token budget, else micro_batch_size rows (all of a rank's rows of a minibatch when unset) × the longest
    row."""
    from .runtime.phases import activation_bytes

    rt, tr = recipe.runtime, recipe.train
    loop = recipe.expert if stage.startswith("expert-") else recipe.mopd
    rows = max(loop.prompts_per_step * loop.group_size // rt.num_workers // loop.minibatches, 1)
    tokens = tr.max_tokens_per_micro_batch or (min(loop.micro_batch_size or rows, rows) * recipe.max_seq_len())
    inter, kv = widths or (None, None)
    return activation_bytes(max(tokens, recipe.max_seq_len()), *shape, dtype_bytes=_DTYPE_BYTES.get(rt.dtype, 4),
                            checkpointing=tr.gradient_checkpointing, logprob_impl=tr.logprob_impl,
                            intermediate=inter, kv_dim=kv)


def transient_bytes(recipe: RecipeConfig, stage: str, kind: str, stu: _Model) -> dict[str, int]:
    """What the phases hold beyond weights, gradients and optimizer state, per device: `activations` (one
    micro-batch's, plus autocast's compute-dtype copy of the float32 weights, which it keeps while its context
    lasts), `sampling` (the in-process engines: the preallocated KV cache of the batch, and the weight copies
    autocast makes — one for `hf`; two for a captured `hf_graphed`, the eager prefill's and the casts recorded
    in the graph's memory pool; vLLM holds its own memory, `rollout.gpu_memory_utilization`) and `scoring` (a
    local teacher's forward over its batch). Bytes; 0 where the model's shape is unknown."""
    from .runtime.phases import forward_activation_bytes, kv_cache_bytes

    if stu.shape is None or not stu.num_params:
        return {"activations": 0, "sampling": 0, "scoring": 0}
    rt, ro = recipe.runtime, recipe.rollout
    b = _DTYPE_BYTES.get(rt.dtype, 4)
    hidden, layers, _ = stu.shape
    inter, kv = stu.widths or (3 * hidden, hidden)
    loop = recipe.expert if stage.startswith("expert-") else recipe.mopd
    rows, seq = loop.prompts_per_step * loop.group_size, recipe.max_seq_len()
    # FSDP2 casts the gathered units instead (MixedPrecisionPolicy), counted in its gathered bytes
    cast = stu.num_params * b if rt.dtype != "float32" and rt.strategy != "fsdp2" else 0
    copies = {"hf": 1, "hf_graphed": 2 if devlib.graphs_supported(kind) else 1}.get(ro.backend)
    sampling = 0 if copies is None else (kv_cache_bytes(min(ro.batch_size or rows, rows), seq, layers, kv, b)
                                         + copies * cast)
    t_rows = min(recipe.teachers.batch_size or rows, rows)
    return {"activations": update_activation_bytes(recipe, stage, stu.shape, stu.widths) + cast,
            "sampling": sampling, "scoring": forward_activation_bytes(t_rows * seq, hidden, inter, b)}


def memory_needs(recipe: RecipeConfig, stage: str, kind: str, stu: _Model,
                 teachers: dict[str, _Model]) -> dict[str, float]:
    """The memory of one device (one rank) in each colocated phase, MiB (`runtime.phases.check_colocated_fit`,
    which the loop applies to the loaded models too) from parameter counts and the model's shape: float32 master
    weights + gradients + AdamW state (÷ N under FSDP2; + the sampling copy when workers train), teachers in the
    compute dtype, and `transient_bytes` (activations, the sampler's cache, a teacher's forward). A
    ColocationError when the largest phase exceeds the device (or runtime.memory_limit_gib)."""
    from .runtime.phases import check_colocated_fit, fsdp_gathered_bytes

    rt = recipe.runtime
    b = _DTYPE_BYTES.get(rt.dtype, 4)
    master = _DTYPE_BYTES[devlib.TRAIN_MASTER_DTYPE]
    extra = transient_bytes(recipe, stage, kind, stu)
    tb = {k: t.num_params * b for k, t in teachers.items() if t.num_params}
    on_ranks = recipe.teachers.placement == "workers"
    if on_ranks:  # all of a rank's teachers are asked at once
        from .distributed.teachers import teacher_bundle

        per: dict[str, int] = {}
        for i, k in enumerate(teachers):
            r = f"teachers on rank {teacher_bundle(i, rt.num_workers)}"
            per[r] = per.get(r, 0) + tb.get(k, 0)
        tb = {r: v for r, v in per.items() if v}
    loop = recipe.expert if stage.startswith("expert-") else recipe.mopd
    lora = _lora_params(recipe, stu, loop.lora) if loop.lora is not None else None
    return check_colocated_fit(
        kind=kind, limit_gib=rt.memory_limit_gib, student_bytes=stu.num_params * master,
        optimizer_factor=2.0, teacher_bytes=tb, teachers_offload=recipe.teachers.offload, placement=rt.placement,
        shards=rt.num_workers if rt.strategy == "fsdp2" else 1,
        # LoRA with the hf engine samples from a merged copy of the weights (train/loop.py)
        driver_copy=rt.strategy != "single" or (lora is not None and recipe.rollout.backend == "hf"),
        activations=extra["activations"], teachers_on_ranks=on_ranks,
        gathered=fsdp_gathered_bytes(stu.num_params, stu.shape, b) if recipe.train.fsdp_cpu_offload else None,
        trainable_bytes=None if lora is None else lora * master,
        sampling=extra["sampling"], scoring=extra["scoring"] if tb else 0)


def stage_memory(recipe: RecipeConfig, stage: str, kind: str, student: str | Path,
                 teachers: Mapping[str, str | Path]) -> dict[str, Any]:
    """`memory_needs` (MiB per phase) and `transient_bytes` for a stage's checkpoints, read without loading a
    tensor: what the pre-flight estimates, for a report beside the measured peaks (tests/device)."""
    stu = _inspect(recipe, "--init", student)
    ts = {k: _inspect(recipe, f"teacher '{k}'", p) for k, p in teachers.items()}
    return {"needs_mib": memory_needs(recipe, stage, kind, stu, ts),
            "terms_mib": {k: v / 2**20 for k, v in transient_bytes(recipe, stage, kind, stu).items()}}


def recipe_memory(recipe: RecipeConfig, kind: str, stage: str = "student") -> dict[str, Any]:
    """`stage_memory` for a recipe whose models are not built yet: its base model (`model.base`, or the tiny model
    as it will be built) as the student and, for the MOPD stage, one teacher of that shape per expert domain —
    what the pre-flight will estimate, before anything runs."""
    stu = _base(recipe)
    ts = {d: stu for d in recipe.expert_domains()} if stage == "student" else {}
    return {"needs_mib": memory_needs(recipe, stage, kind, stu, ts),
            "terms_mib": {k: v / 2**20 for k, v in transient_bytes(recipe, stage, kind, stu).items()}}


def _lora_params(recipe: RecipeConfig, stu: _Model, lora) -> int | None:
    """The adapter parameters a LoRA stage trains (only they get gradients and AdamW state), counted on the model
    built from its config on the meta device; None when the config cannot be read here (then the estimate is
    full fine-tuning's)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        from .models.lora import count_lora_params

        cfg = AutoConfig.from_pretrained(stu.path, trust_remote_code=recipe.model.trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=recipe.model.trust_remote_code)
    except Exception:  # noqa: BLE001 - not resolvable now (a hub id offline): the stage's own load reports it
        return None
    return count_lora_params(model, lora)  # a target_modules that matches nothing: ConfigError, now


# ---------------------------------------------------------------- data


def _check_benchmarks(recipe: RecipeConfig, tokenizer, models: list[_Model],
                      benchmarks: Mapping[str, Any] | None = None) -> None:
    """Every `eval_sources` benchmark: its file, verifier and rows (`evaluation.load_benchmarks`), each prompt
    within data.max_prompt_tokens as the rollout renders it, and prompt + its token budget + 1 within each
    model's positions."""
    from .domains.base import prompt_text
    from .evaluation import eval_sources_of, load_benchmarks
    from .rollout import prompt_ids

    limit = recipe.data.max_prompt_tokens
    new = recipe.eval.max_new_tokens or recipe.rollout.max_new_tokens
    if benchmarks is None:
        benchmarks = {d: load_benchmarks(d, specs, recipe.eval.eval_size)
                      for d, specs in eval_sources_of(recipe).items()}
    for domain, benches in benchmarks.items():
        for b in benches:
            where = f"data.domains[{domain}].eval_sources[{b.spec.name}]"
            budget = b.spec.max_new_tokens or new
            for m in models:
                if m.context is not None and limit + budget + 1 > m.context:
                    raise ConfigError(f"{where}: data.max_prompt_tokens={limit} + max_new_tokens={budget} + 1 "
                                      f"exceeds the {m.context} positions of {m.label} — lower the benchmark's "
                                      "max_new_tokens or data.max_prompt_tokens")
            for i, (e, ids) in enumerate(zip(b.examples, prompt_ids(tokenizer, b.examples, chat=recipe.data.chat))):
                if len(ids) > limit:
                    raise DataError(f"{where}: {b.spec.source} row {i}: prompt of {len(ids)} tokens exceeds "
                                    f"data.max_prompt_tokens={limit} ({prompt_text(e)[:40]!r}…) — raise "
                                    "data.max_prompt_tokens or drop the row")


def _check_prompts(recipe: RecipeConfig, tokenizer, domains: Mapping[str, Any]) -> None:
    """Every prompt fits data.max_prompt_tokens with the run's tokenizer (the rollout's own rule)."""
    from .domains.base import prompt_text
    from .domains.dataset import domain_examples
    from .rollout import prompt_ids

    limit = recipe.data.max_prompt_tokens
    fix = f"raise data.max_prompt_tokens (now {limit})"
    readers = recipe.dataset_readers()
    for spec in recipe.data.domains:
        if spec.name not in domains:
            continue
        if spec.source.startswith("synthetic:"):
            dom = domains[spec.name]
            exs = list(dom.eval_examples()) + list(dom.train_examples(64, random.Random("mopd-preflight")))
            for e, ids in zip(exs, prompt_ids(tokenizer, exs, chat=recipe.data.chat)):
                if len(ids) > limit:
                    raise DataError(f"domain '{spec.name}' ({spec.source}, params {spec.params or {}}): prompt "
                                    f"{prompt_text(e)[:40]!r} has {len(ids)} tokens, over "
                                    f"data.max_prompt_tokens={limit} — {fix} or shorten the task (params)")
            continue
        if recipe.data.filter_overlong_prompts:
            continue  # the domain was built without its over-long rows (recipe.overlong_prompt_filter)
        # the domain's own rows (a shared file's other rows are its other domains'), read with its column map
        rows = [(i, e) for i, e in enumerate(domain_examples(spec.source, spec.params, spec.name,
                                                             shared=len(readers[spec.source]) > 1))
                if e.teacher_id == spec.name]
        # rendered as the rollout renders them (chat template, system prompt, suffix: `data.chat`)
        for (i, e), ids in zip(rows, prompt_ids(tokenizer, [e for _, e in rows], chat=recipe.data.chat)):
            if len(ids) > limit:
                raise DataError(f"{spec.source} row {i}: prompt of {len(ids)} tokens exceeds "
                                f"data.max_prompt_tokens={limit} ({prompt_text(e)[:40]!r}…) — {fix}, drop the row, or "
                                "set data.filter_overlong_prompts=true to drop every such row")


# ---------------------------------------------------------------- output dir


def checkpoint_bytes(num_params: int, dtype: str = "float32") -> int:
    """Disk one training checkpoint needs: weights + AdamW's two moments (float32 master copies whatever the
    compute dtype: `runtime.device.TRAIN_MASTER_DTYPE`) + margin."""
    return num_params * _DTYPE_BYTES.get(dtype, 4) * 3 + MARGIN_BYTES


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _check_output_dir(recipe: RecipeConfig, stage_dir: Path, model: _Model | None) -> None:
    """output_dir writable (probed with a temp file in the nearest existing folder — nothing is left behind)
    and, unless `model` is None, with the free space a checkpoint of it needs."""
    field = f"output_dir={recipe.output_dir}"
    anc = Path(stage_dir)
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"{field}: '{anc}' is a regular file, not a folder — set output_dir to a folder (or "
                          "move the file out of the way)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".mopd-preflight-", dir=anc)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{field}: the disk holding '{anc}' is full ({e.strerror}) — free disk space or "
                                "set output_dir to a larger disk") from None
        raise ConfigError(f"{field} is not writable: cannot create files in '{anc}' ({e.strerror}) — choose a "
                          "writable output_dir or fix its permissions") from None
    if model is None or not model.num_params:
        return
    need = checkpoint_bytes(model.num_params)  # float32 master weights + moments
    free = shutil.disk_usage(anc).free
    if free < need:
        raise DiskFullError(f"{field}: the disk holding '{anc}' has {_mib(free)} free, a checkpoint of this stage "
                            f"needs about {_mib(need)} ({model.num_params:,} parameters × 3 for weights + AdamW "
                            f"state, + {_mib(MARGIN_BYTES)}) — free disk space or set output_dir to a larger disk")
