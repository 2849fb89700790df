"""Teacher seconds per MOPD step with and without the teacher-score cache (`teachers.score_cache`), for fresh,
resumed and replayed steps, and the saving of prefilling a group's shared prompt once (`teachers.share_prefix`).

    .venv/bin/python benchmarks/teacher_cache.py [--steps 4] [--repeats 3] [--threads 1]
        [--out benchmarks/results/teacher_cache]

The tiny preset's MOPD stage (32 prompts × 8 samples a step, 3 local teachers, 10-token completions) from a
student and three teachers built locally (random weights: this measures cost, not learning), `--steps` steps,
checkpoints every 2. Per repeat:

- `uncached`: `teachers.score_cache=false`, steps 1..S — the reference numbers and teacher seconds;
- `fresh`: the same stage with the cache (empty at start): every row scored, and stored;
- `resumed_hit` / `resumed_new`: the cached stage interrupted after step 3 (its checkpoint is step 2), then run
  again: step 3 is replayed from the checkpoint (its rows are in the cache), step 4 is new;
- `replayed`: the whole stage run again in a new folder holding only the first run's `teacher_cache/` (a rerun
  after a crash that lost the checkpoints, or the same stage on another machine with the cache copied): every
  step's rows are in the cache.

"Teacher seconds" per step is the sum of `teacher/<t>/score_s` (time inside the teachers' `score`); `perf/score_s`
is the router's wall time, cache look-ups and writes included; `perf/teacher_cache_saved_s` is what the hits cost
when they were scored. Each cached step's loss, gradient norm, KD advantage and teacher log-probs are compared
with the uncached run's same step (the same numbers to float tolerance is the claim).

The shared-prefix rows score step 1's batch with the three teachers, `share_prefix` off and on, `--repeats` × 5
calls each after a warm-up, and report the largest log-prob difference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

COMPARED = ("loss", "grad_norm", "adv/kd_mean", "adv/mean", "reward/mean")
KINDS = {"uncached": "no cache (reference)", "fresh": "cache, fresh (empty)",
         "resumed_hit": "cache, resumed: the step replayed from the checkpoint",
         "resumed_new": "cache, resumed: the step after it (new)", "replayed": "cache, whole stage replayed"}



def _rows(stage_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (stage_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _teacher_s(row: dict) -> float:
    return sum(v for k, v in row.items() if k.startswith("teacher/") and k.endswith("/score_s"))


def _step(row: dict, kind: str, ref: dict | None) -> dict:
    out = {"kind": kind, "step": row["step"], "teacher_s": _teacher_s(row), "score_wall_s": row["perf/score_s"],
           "saved_s": row.get("perf/teacher_cache_saved_s", 0.0),
           "hits": sum(v for k, v in row.items() if k.endswith("/cache_hits")),
           "misses": sum(v for k, v in row.items() if k.endswith("/cache_misses"))}
    if ref is not None:
        out["max_abs_diff"] = max(abs(row[k] - ref[k]) for k in COMPARED if k in row)
        out["teacher_logp_diff"] = max((abs(v - ref[k]) for k, v in row.items()
                                        if k.startswith(("teacher_logp/", "reverse_kl/")) and k in ref), default=0.0)
    return out


def _run(cfg, student, teachers, stop_after: int | None = None):
    from mopd_core import recipe as R

    from tests.conftest import StageStopped, interrupted_mopd_stage  # the test's own interruption

    if stop_after is None:
        return R.mopd_stage(cfg, student, teachers, progress=False)
    try:
        interrupted_mopd_stage(cfg, student, teachers, stop_after)
    except StageStopped:
        pass


def one_repeat(base, student, teachers, work: Path, steps: int) -> list[dict]:
    def cfg_for(name: str, cache: bool):
        c = base.model_copy(update={"output_dir": str(work / name)}, deep=True)
        c.teachers.score_cache = cache
        return c

    unc = _run(cfg_for("uncached", False), student, teachers)
    ref = {r["step"]: r for r in _rows(unc.stage_dir)}
    out = [_step(r, "uncached", None) for r in ref.values()]
    fresh = _run(cfg_for("fresh", True), student, teachers)
    out += [_step(r, "fresh", ref[r["step"]]) for r in _rows(fresh.stage_dir)]

    c = cfg_for("resumed", True)
    _run(c, student, teachers, stop_after=3)  # steps 1..3 ran, the last checkpoint is step 2
    res = _run(c, student, teachers)
    out += [_step(r, "resumed_hit" if r["step"] == 3 else "resumed_new", ref[r["step"]])
            for r in _rows(res.stage_dir) if r["step"] >= 3]

    c = cfg_for("replayed", True)
    stage = Path(c.output_dir) / c.name / fresh.stage_dir.name
    stage.mkdir(parents=True)
    shutil.copytree(fresh.stage_dir / "teacher_cache", stage / "teacher_cache")
    rep = _run(c, student, teachers)
    out += [_step(r, "replayed", ref[r["step"]]) for r in _rows(rep.stage_dir)]
    return out


def shared_prefix(base, student, teachers, repeats: int) -> dict:
    import torch

    from mopd_core.domains import build_domain
    from mopd_core.models import load_model, load_tokenizer
    from mopd_core.rollout import HFRollout
    from mopd_core.teachers import build_local_router

    import random

    rng = random.Random(0)
    doms = [build_domain(n, f"synthetic:{n}", eval_size=8) for n in teachers]
    G, n_prompts = base.mopd.group_size, base.mopd.prompts_per_step
    prompts = [e for d in doms for e in d.train_examples(-(-n_prompts // 3), rng)][:n_prompts]
    examples = [e for e in prompts for _ in range(G)]  # contiguous groups, as the loop's generator lays them out
    batch = HFRollout(load_model(student), load_tokenizer(student), "cpu", base.data.max_prompt_tokens).generate(
        examples, max_new_tokens=base.rollout.max_new_tokens, generator=torch.Generator().manual_seed(0))
    res = {}
    for share in (False, True):
        cfg = base.teachers.model_copy(update={"share_prefix": share})
        router = build_local_router(teachers, cfg, "cpu")
        router.score(batch)  # warm-up
        ts, lp = [], None
        for _ in range(repeats * 5):
            t0 = time.perf_counter()
            lp = router.score(batch).logp
            ts.append(time.perf_counter() - t0)
        res["shared" if share else "per_row"] = {"median_s": statistics.median(ts), "min_s": min(ts),
                                                 "max_s": max(ts), "n": len(ts), "logp": lp}
    diff = float((res["shared"].pop("logp") - res["per_row"].pop("logp")).abs().max())
    return {**res, "rows": batch.size, "distinct_prompts": n_prompts, "group_size": G,
            "prompt_tokens": int(batch.prompt_mask.sum()), "completion_tokens": int(batch.completion_mask.sum()),
            "max_abs_logp_diff": diff,
            "saving": 1 - res["shared"]["median_s"] / res["per_row"]["median_s"]}


def _summary(rows: list[dict]) -> dict:
    out = {}
    for kind in KINDS:
        sel = [r for r in rows if r["kind"] == kind]
        per_rep = {}
        for r in sel:
            per_rep.setdefault(r["repeat"], []).append(r)
        means = [statistics.mean(x["teacher_s"] for x in v) for v in per_rep.values()]
        walls = [statistics.mean(x["score_wall_s"] for x in v) for v in per_rep.values()]
        saved = [statistics.mean(x["saved_s"] for x in v) for v in per_rep.values()]
        out[kind] = {"steps": sorted({r["step"] for r in sel}), "teacher_s_per_step": means,
                     "score_wall_s_per_step": walls, "saved_s_per_step": saved,
                     "hits": sum(r["hits"] for r in sel), "misses": sum(r["misses"] for r in sel),
                     "max_abs_diff": max((r.get("max_abs_diff", 0.0) for r in sel), default=0.0),
                     "teacher_logp_diff": max((r.get("teacher_logp_diff", 0.0) for r in sel), default=0.0)}
    return out


def _fmt(xs: list[float]) -> str:
    m = statistics.mean(xs)
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {sd:.3f}"


def write_md(path: Path, res: dict) -> None:
    s, sp, meta = res["summary"], res["shared_prefix"], res["meta"]
    lines = [
        "# Teacher-score cache: teacher seconds per MOPD step",
        "",
        f"`benchmarks/teacher_cache.py` — {meta['when']}, {meta['machine']}, torch {meta['torch']}, "
        f"{meta['threads']} torch thread(s); load average (1 min) {meta['load_start']} at the start, "
        f"{meta['load_end']} at the end (a shared 2-core machine: absolute seconds move with the load, compare rows "
        f"of one run). Tiny preset MOPD stage, {meta['rows_per_step']} rows a step (32 prompts × 8), 3 local "
        f"teachers, {meta['steps']} steps, {meta['repeats']} repeats (mean ± sd over repeats of the per-step mean).",
        "",
        "| steps | which | teacher s / step | router wall s / step | saved s / step (cache) | rows hit / missed | "
        "max diff vs uncached (loss, grad norm, advantages, reward) | max diff (teacher log-prob / reverse-KL "
        "metrics) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k, v in s.items():
        lines.append(f"| {', '.join(map(str, v['steps']))} | {KINDS[k]} | {_fmt(v['teacher_s_per_step'])} | "
                     f"{_fmt(v['score_wall_s_per_step'])} | {_fmt(v['saved_s_per_step'])} | {v['hits']:.0f} / "
                     f"{v['misses']:.0f} | {v['max_abs_diff']:.2g} | {v['teacher_logp_diff']:.2g} |")
    over = {k: statistics.mean(w - t for w, t in zip(v["score_wall_s_per_step"], v["teacher_s_per_step"]))
            for k, v in s.items()}
    lines += [
        "",
        "The resumed run was interrupted after step 3 (last checkpoint: step 2): its step 3 was scored before the "
        "interruption and comes from the cache, its step 4 is new. The replayed run reads the first run's cache "
        "only. A diff of 0 is bit-equal: a hit returns the "
        "very numbers the teacher gave, and the stage is deterministic.",
        "",
        f"The cache's own cost per step (router wall − teacher seconds): {over['uncached']:.3f} s without it, "
        f"{over['fresh']:.3f} s on a fresh step (keys, serialising and fsync-ing the step's rows), "
        f"{over['replayed']:.3f} s on a replayed one (keys and look-ups). Fresh and uncached teacher seconds differ "
        "by the machine's load, not by the cache, which scores the same rows (per repeat, uncached: "
        f"{', '.join(f'{x:.2f}' for x in s['uncached']['teacher_s_per_step'])} s/step; fresh: "
        f"{', '.join(f'{x:.2f}' for x in s['fresh']['teacher_s_per_step'])}).",
        "",
        "## Shared prompt prefilled once per group (`teachers.share_prefix`, local teachers)",
        "",
        f"Step 1's batch: {sp['rows']} rows = {sp['distinct_prompts']} prompts × {sp['group_size']}, "
        f"{sp['prompt_tokens']} prompt and {sp['completion_tokens']} completion tokens, 3 teachers, "
        f"{sp['per_row']['n']} calls each after a warm-up.",
        "",
        "| scoring | median s / step | min | max |",
        "|---|---|---|---|",
        f"| every row's prompt prefilled (default) | {sp['per_row']['median_s']:.3f} | {sp['per_row']['min_s']:.3f} | "
        f"{sp['per_row']['max_s']:.3f} |",
        f"| each prompt prefilled once, KV cache shared by its group | {sp['shared']['median_s']:.3f} | "
        f"{sp['shared']['min_s']:.3f} | {sp['shared']['max_s']:.3f} |",
        "",
        f"Saving {100 * sp['saving']:.0f} % of the teachers' time; largest log-prob difference "
        f"{sp['max_abs_logp_diff']:.2g} (float32; `tests/unit/test_teacher_cache.py` checks the hidden states in "
        "float64). The tiny preset's prompts are as short as its completions; the saving grows with the prompt's "
        "share of the tokens (long system prompts, few-shot prompts, long problems).",
        "",
        "vLLM servers (`teachers.backend: http`): vLLM 0.32.0 (installed in `.venv-vllm`) turns the prefix cache "
        "off for reading in every request with `prompt_logprobs` (`SamplingParams.skip_reading_prefix_cache` "
        "defaults to True then; the OpenAI server does not expose it), so each row's prompt is prefilled; the "
        "score cache above is what saves server time (docs/teachers.md).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "teacher_cache"))
    ap.add_argument("--md-only", action="store_true", help="rewrite <out>.md from <out>.json, run nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.md_only:  # the summary is recomputed from the per-step rows
        res = json.loads(out.with_suffix(".json").read_text())
        for r in res["steps"]:  # rows of a run before the resumed steps were told apart
            if r["kind"] == "resumed":
                r["kind"] = "resumed_hit" if r["step"] == 3 else "resumed_new"
        res["summary"] = _summary(res["steps"])
        out.with_suffix(".json").write_text(json.dumps(res, indent=2))
        write_md(out.with_suffix(".md"), res)
        return 0
    if args.steps < 4:
        ap.error("--steps must be ≥ 4 (the resumed run stops after step 3 and resumes from step 2's checkpoint)")

    import torch

    from mopd_core.config import load_config
    from mopd_core.models import build_tiny, quiet_hf

    quiet_hf()
    torch.set_num_threads(args.threads)
    load_start = round(os.getloadavg()[0], 2)
    work = Path(tempfile.mkdtemp(prefix="teacher_cache_"))
    base = load_config("tiny", [f"runtime.num_threads={args.threads}", "runtime.device=cpu",
                                f"mopd.steps={args.steps}", "mopd.save_every=2", "mopd.eval_size=4"])
    names = base.domain_names()
    teachers = {n: str(build_tiny(base.model, work / "models" / n, seed=i)) for i, n in enumerate(names)}
    student = str(build_tiny(base.model, work / "models" / "student", seed=7))
    rows = []
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for r in one_repeat(base, student, teachers, work / f"rep{rep}", args.steps):
            rows.append({**r, "repeat": rep})
        print(f"repeat {rep + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    sp = shared_prefix(base, student, teachers, args.repeats)
    res = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                    "torch": torch.__version__, "threads": args.threads, "steps": args.steps,
                    "repeats": args.repeats, "rows_per_step": base.mopd.prompts_per_step * base.mopd.group_size,
                    "load_start": load_start, "load_end": round(os.getloadavg()[0], 2),
                    "wall_s": round(time.perf_counter() - t0, 1)},
           "summary": _summary(rows), "shared_prefix": sp, "steps": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    write_md(out.with_suffix(".md"), res)
    shutil.rmtree(work, ignore_errors=True)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
