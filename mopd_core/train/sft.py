"""Mixed-domain SFT with TRL's `SFTTrainer` (prompt–completion data, loss on the completion only).

TRL appends the EOS token to each completion, so the SFT model learns to stop — the RL loop and the verifiers
rely on it. With `data.chat` the rows are pre-tokenised by `models.chat.PromptFormatter` (the prompt ids every
other consumer sees) and each completion ends with the chat template's end-of-turn token instead. TRL's own
checkpoints (`<stage>/trainer/checkpoint-N`) carry optimizer/scheduler/RNG state, so an interrupted SFT resumes
where it stopped.
"""

from __future__ import annotations

import errno
import json
import math
import random
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..config import RecipeConfig
from ..domains.base import thaw
from ..errors import DataError
from ..evaluation import evaluate_model
from ..models import disk_full_error, load_model, load_tokenizer, save_pretrained
from ..models.chat import carry_chat_template, check_prompt_kind, formatter_for, preview
from ..runtime import device as devlib
from .checkpoint import checkpoint_step, claim_stage, finished, read_stage, trainer_checkpoints, write_stage
from .loop import NonFiniteLossError, sample_prompts
from .progress import StageProgress


@dataclass
class SFTResult:
    final_dir: Path
    eval: dict
    history: list
    reused: bool = False  # found finished and returned as it is (nothing trained)


def sft_examples(recipe: RecipeConfig, domains: Mapping[str, object]) -> list[dict]:
    cfg = recipe.sft
    names = list(domains)
    weights = recipe.mix_weights(cfg, "sft", names)
    n = cfg.num_examples or max(1, cfg.steps * cfg.batch_size)
    rng = random.Random(f"{recipe.seed}/sft")
    rows = []
    for e in sample_prompts(domains, weights, n, rng):
        check_prompt_kind(e, recipe.data.chat)
        # the data's own SFT completion where it has one (a demonstration that differs from the verifier's
        # reference, e.g. a weak demonstrator), else the reference answer
        completion = e.fields.get("completion", e.answer)
        if completion is None:
            raise DataError(f"SFT needs a reference answer: domain '{e.teacher_id}' example "
                            f"{preview(e.prompt, 30)!r} has none — add an `answer` (or `completion`) column or drop "
                            "the domain from sft.mix")
        # chat messages as plain dicts (a row must pickle to the SFT workers and load into a `datasets` table)
        prompt = e.prompt if isinstance(e.prompt, str) else thaw(e.prompt)
        rows.append({"prompt": prompt, "completion": completion})
    rng.shuffle(rows)
    return rows


def sft_dataset_rows(rows: list[dict], tokenizer, chat=None) -> list[dict]:
    """What TRL's `SFTTrainer` trains on. Chat off (`data.chat.enabled: false`): the prompt/completion rows as
    they are (TRL tokenises them and appends EOS — unchanged from before chat formatting existed). Chat on:
    pre-tokenised rows, `input_ids` = the formatter's prompt ids (the very ids rollout, teachers and eval see) +
    the completion's ids ending with the template's end-of-turn token, and `completion_mask` marking the
    completion (TRL keeps such rows as they are and, with `completion_only_loss`, trains on the completion only).
    TRL's own conversational path would re-render the prompt with its own template call and end the completion
    with whatever that renders after the turn; pre-tokenising keeps one rendering for every consumer."""
    fmt = formatter_for(tokenizer, chat)
    if not fmt.enabled:
        return rows
    prompts = fmt.batch_ids([r["prompt"] for r in rows])
    out = []
    for r, p in zip(rows, prompts):
        c = fmt.completion_ids(r["completion"])
        out.append({"input_ids": p + c, "completion_mask": [0] * len(p) + [1] * len(c)})
    return out


def run_sft(*, recipe: RecipeConfig, base_path: str | Path, domains: Mapping[str, object], stage_dir: str | Path,
            fingerprint: str, progress: bool = True, trainer=None) -> SFTResult:
    """`trainer(base_path, rows, stage_dir, domains) -> (history, state_dict, where)`: the training run in other
    processes (`runtime.strategy` ddp/fsdp2: `distributed.sft`, one per device, each calling `train_process`);
    this process then loads the trained weights, saves `final/` and evaluates."""
    stage_dir = Path(stage_dir)
    cfg = recipe.sft
    info = read_stage(stage_dir)
    if finished(info, fingerprint, cfg.steps, stage_dir):
        return SFTResult(stage_dir / "final", info.get("eval", {}), [], reused=True)
    rows = sft_examples(recipe, domains)  # validates data before any compute
    dinfo = devlib.resolve(recipe.runtime.device)
    info = claim_stage(stage_dir, fingerprint, {"stage": "sft", "init": str(base_path)})
    if finished(info, fingerprint, cfg.steps, stage_dir):  # brought back from aside
        return SFTResult(stage_dir / "final", info.get("eval", {}), [], reused=True)
    tokenizer = load_tokenizer(base_path)
    # float32 master weights; the Trainer's bf16/fp16 flags below make runtime.dtype the compute dtype (autocast)
    model = load_model(base_path, dinfo.torch_device, devlib.TRAIN_MASTER_DTYPE)
    history: list[dict] = []
    where = None
    if cfg.steps > 0 and trainer is None:
        history = _train(recipe, model, tokenizer, rows, stage_dir, dinfo, progress, domains)
    elif cfg.steps > 0:
        history, state, where = trainer(base_path, rows, stage_dir, domains)
        model.load_state_dict(state)
    carry_chat_template(tokenizer, recipe.data.chat)
    final_dir = save_pretrained(model, tokenizer, stage_dir / "final")
    ev = evaluate_model(model, tokenizer, domains, recipe.eval, dinfo.torch_device,
                        recipe.eval.max_new_tokens or recipe.rollout.max_new_tokens, recipe.seed,
                        chat=recipe.data.chat)
    info = read_stage(stage_dir) or {}
    info.update({"status": "done", "final_dir": str(final_dir), "eval": ev, "steps": cfg.steps,
                 "num_examples": len(rows), **({"distributed": where} if where else {})})
    write_stage(stage_dir, info)
    return SFTResult(final_dir, ev, history)


def train_process(recipe: RecipeConfig, base_path: str | Path, rows: list[dict], stage_dir: str | Path, domains,
                  world: int) -> tuple[list[dict], dict | None, dict]:
    """One of `world` processes of a distributed SFT (torch.distributed's RANK/WORLD_SIZE/MASTER_* already in
    the environment: the Trainer's accelerate state joins them, gloo on CPU, nccl/hccl on devices): the same
    `SFTTrainer` run, `sft.batch_size` split over the processes, DDP or FSDP2 (`runtime.strategy`). The main
    process writes metrics and TRL's checkpoints; returns (history, the trained weights on CPU — main process
    only, else None, how accelerate ran it)."""
    dinfo = devlib.resolve(recipe.runtime.device)
    model = load_model(base_path, dinfo.torch_device, devlib.TRAIN_MASTER_DTYPE)
    trainer = _train(recipe, model, load_tokenizer(base_path), rows, Path(stage_dir), dinfo, False, domains,
                     world=world, return_trainer=True)
    history, tr = trainer
    state = tr.accelerator.get_state_dict(tr.model)  # gathers FSDP shards (a collective: every process calls it)
    acc = tr.accelerator
    how = {"distributed_type": str(acc.distributed_type).split(".")[-1], "num_processes": acc.num_processes,
           "fsdp_version": _fsdp_version(acc)}
    if not tr.is_world_process_zero():
        return history, None, how
    return history, {k: v.detach().cpu().clone() for k, v in state.items()}, how


def _fsdp_version(acc):
    """accelerate's state has a `fsdp_plugin` only under FSDP (accelerate 1.x, checked on 1.16)."""
    plugin = getattr(acc.state, "fsdp_plugin", None)  # lib: accelerate 1.x
    return getattr(plugin, "fsdp_version", None)  # lib: accelerate 1.x


def _no_split(model) -> list[str]:
    return list(getattr(model, "_no_split_modules", None) or [])  # lib: transformers 5.x


def _train(recipe, model, tokenizer, rows, stage_dir: Path, dinfo, progress: bool, domains, world: int = 1,
           return_trainer: bool = False):
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cfg = recipe.sft
    metrics_path = stage_dir / "metrics.jsonl"
    history: list[dict] = []
    bar = StageProgress("sft", cfg.steps, enabled=progress)

    class _Track(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs:
                return
            loss = float(logs["loss"])
            if not state.is_world_process_zero:  # the main process records; every process stops on NaN
                if not math.isfinite(loss):
                    raise NonFiniteLossError(f"sft: non-finite loss at step {state.global_step}")
                return
            row = {"step": state.global_step, "loss": loss, "lr": float(logs.get("learning_rate", 0.0)),
                   "grad_norm": float(logs.get("grad_norm", 0.0) or 0.0),
                   **devlib.memory_stats(dinfo.kind)}
            step = state.global_step
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps and world == 1:
                ev = evaluate_model(model, tokenizer, domains, recipe.eval, dinfo.torch_device,
                                    recipe.eval.max_new_tokens or recipe.rollout.max_new_tokens, recipe.seed,
                                    cfg.eval_size, chat=recipe.data.chat)
                row.update({f"eval/{d}/{k}": v for d, r in ev.items() for k, v in r.items()})
            if not math.isfinite(loss):
                raise NonFiniteLossError(
                    f"sft: non-finite loss at step {state.global_step}; stopped — last good checkpoint: "
                    f"{_last_trainer_ckpt(stage_dir) or 'none'} (lower sft.lr or check the data)")
            history.append(row)
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.update(state.global_step, row)

    max_len = recipe.max_seq_len() + 1  # + the EOS TRL appends (chat: the end-of-turn token)
    fsdp = {}
    # accelerate's FSDP2 (one unit per decoder layer) exists for accelerators only: on CPU its MULTI_CPU state runs
    # DDP whatever the Trainer asks (distributed.sft warns; the RL/MOPD workers shard with torch FSDP2 on CPU too)
    if world > 1 and recipe.runtime.strategy == "fsdp2" and dinfo.kind != "cpu":
        fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config={
            "fsdp_version": 2, "reshard_after_forward": True,
            "transformer_layer_cls_to_wrap": _no_split(model)})
    args = SFTConfig(
        output_dir=str(stage_dir / "trainer"), max_steps=cfg.steps,
        per_device_train_batch_size=cfg.batch_size // world,  # sft.batch_size stays the global batch
        learning_rate=cfg.lr, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=int(cfg.warmup_ratio * cfg.steps),
        weight_decay=cfg.weight_decay, logging_steps=cfg.logging_steps, save_steps=max(cfg.steps // 4, 50),
        save_total_limit=2, report_to=[], seed=recipe.seed, data_seed=recipe.seed,
        use_cpu=dinfo.kind == "cpu", dataloader_num_workers=0, max_length=max_len,
        completion_only_loss=True, disable_tqdm=True, bf16=recipe.runtime.dtype == "bfloat16",
        fp16=recipe.runtime.dtype == "float16", dataset_num_proc=None, save_only_model=False,
        gradient_checkpointing=recipe.train.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if recipe.train.gradient_checkpointing else None,
        ddp_find_unused_parameters=False if world > 1 else None, **fsdp)
    data = Dataset.from_list(sft_dataset_rows(rows, tokenizer, recipe.data.chat))
    trainer = SFTTrainer(model=model, args=args, train_dataset=data,
                         processing_class=tokenizer, callbacks=[_Track()])
    trainer.remove_callback(PrinterCallback)  # our callback logs; the printer would dump raw dicts
    resume = _last_trainer_ckpt(stage_dir)
    if resume and trainer.is_world_process_zero():
        _truncate(metrics_path, checkpoint_step(resume))
    try:
        with _lm_head_tile_width(model.get_output_embeddings().weight.shape[0]):
            trainer.train(resume_from_checkpoint=resume)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # the Trainer writes checkpoint-N in place: drop the one it did not finish, so the previous checkpoints
        # stay the ones a rerun resumes from
        for d in trainer_checkpoints(stage_dir):
            if not (d / "trainer_state.json").exists():
                shutil.rmtree(d, ignore_errors=True)
        raise disk_full_error(stage_dir / "trainer", "an SFT trainer checkpoint", e) from e
    finally:
        bar.close()
    return (history, trainer) if return_trainer else history


@contextmanager
def _lm_head_tile_width(vocab: int):
    """TRL's fused LM head (`trl.trainer.utils.add_fused_lm_head`) allocates a `[4096, 32768]` projection tile on
    every forward and backward whatever the vocabulary. For a vocabulary under 32k only `vocab` columns are used,
    and on CPU (no caching allocator) the 512 MiB buffer costs ~0.2 s a call: 30 % of an SFT step of the tiny model
    (cProfile of 40 steps on the 2-core EPYC: 18.3 s of 61.7 s in `torch.empty`; sys time 44.8 → 7.0 s capped).
    The tile's width is a module constant read at call time; cap it at the vocabulary while training.
    Same tiles, so the same numbers (one vocab tile either way); no effect on vocabularies of 32k and more."""
    try:
        import trl.trainer.utils as trl_utils
    except ImportError:  # pragma: no cover - TRL is a dependency
        yield
        return
    orig = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)  # private TRL constant (trl 1.16), may go
    if not isinstance(orig, int) or vocab >= orig:
        yield
        return
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = vocab
    try:
        yield
    finally:
        trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = orig


def _last_trainer_ckpt(stage_dir: Path) -> str | None:
    # trainer_state.json is the Trainer's last write of a checkpoint: one without it is incomplete
    cks = [d for d in trainer_checkpoints(stage_dir) if (d / "trainer_state.json").exists()]
    return str(cks[-1]) if cks else None


def _truncate(path: Path, upto: int) -> None:
    if path.exists():
        keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= upto]
        path.write_text("".join(x + "\n" for x in keep))
