"""Benchmark: the tiny recipe's MOPD stage with a cross-tokenizer code teacher, beside the same-tokenizer stage.

For every seed, from ONE set of trained stages of that seed (`--stages DIR`, with `{seed}` in it: `sft/final`,
`expert-<domain>/final` and their `stage.json` evals, e.g. a `benchmarks/tiny_recipe.py` run's `seed<N>/tiny`),
two MOPD stages run on the same preset, seed and thread count:

- `same`:  the recipe's student — all three teachers share the student's character tokenizer;
- `cross`: `teachers.cross_tokenizer=[code]`, the code teacher an EXACT RE-TOKENIZED COPY of the code expert
  (`teachers.retokenized.RetokenizedCopy`: a BPE tokenizer trained here on code-domain text, each BPE token scored
  as the chain of the expert's character log-probs) — a genuinely different tokenization whose knowledge is the
  code expert's, not a separately trained different-tokenizer model. Its samples are re-tokenized by the bridge
  and its log-probs mapped back by character offsets (`teachers/bridge.py`);
- `trained`: `teachers.cross_tokenizer=[code]`, the code teacher a SEPARATELY TRAINED MODEL OF ANOTHER TOKENIZER
  FAMILY: a tiny Llama of the same shape with a BPE tokenizer (trained here on all domains' texts) and its own
  initial weights, taken through the recipe's own SFT and code GRPO stages (`<output-dir>/seed<N>/bpe-family/`,
  trained once per seed and reused). Its knowledge is its own, so the bar's code expert is this teacher.

The bar per seed and variant is the tiny recipe's: student ≥ 90 % of each expert on that expert's domain (greedy
held-out accuracy), student > SFT on every domain. Also written: an exactness check (on the code domain's
held-out prompts with their reference answers: the bridged copy's sequence log-probs vs the expert's, the share
of student tokens whose boundaries align and their per-token difference), teacher seconds per step, stage
seconds and the load average (the machine is shared).

    .venv/bin/python benchmarks/cross_tokenizer.py --stages runs/bench/seed{seed}/tiny --seeds 0,1,2 \
        [--repeats 0,1,2] [--variants same,cross,trained] [--jobs 2] [--set k=v ...] [--output-dir runs/xtok] \
        [--what "one line: what was run"] [--collect]

`--repeats`: MOPD repeats from the same trained stages of a seed (other sampling streams: the stage name seeds
them), for a spread when training stages per seed does not fit the time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STUDENT_RATIO = 0.90
BPE_VOCAB = 200
OUT = ROOT / "benchmarks/results/cross_tokenizer.json"


def code_bpe(cfg, seed: int):
    """The code teacher's tokenizer: BPE over the tiny alphabet, trained on 4,000 code-domain training texts."""
    from mopd_core import recipe as R
    from mopd_core.models import build_bpe_tokenizer

    dom = R.build_domains(cfg, ["code"])["code"]
    exs = dom.train_examples(4000, random.Random(f"{seed}/xtok-bpe"))
    return build_bpe_tokenizer([e.prompt + e.answer for e in exs], vocab_size=BPE_VOCAB)


def other_family_expert(args, seed: int, out: Path) -> tuple[Path, dict]:
    """The `trained` variant's code teacher: the recipe's SFT and code-expert stages from a base of another
    tokenizer family (a BPE over all domains' texts, its own init seed), in `<out>/bpe-family/`. Reruns reuse the
    finished stages (the stages' own fingerprints)."""
    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from mopd_core.models import build_bpe_tokenizer, build_tiny_model, load_tokenizer, save_pretrained

    fam = load_config(args.config, [f"output_dir={out / 'bpe-family'}", *args.overrides, f"seed={seed}"])
    t0 = time.perf_counter()
    base = fam.run_dir() / "base"
    if not (base / "config.json").exists():
        # prompts and answers as separate texts: no merge learnt across the boundary, so a prompt tokenized
        # alone is a prefix of prompt + answer (what a real family's pre-tokenizer ensures; trained on the joined
        # strings, every math row would merge "=" with the answer and SFT would train on another context)
        texts = [t for d in R.build_domains(fam).values()
                 for e in d.train_examples(2000, random.Random(f"{seed}/xtok-family/{d.name}"))
                 for t in (e.prompt, e.answer)]
        bpe = build_bpe_tokenizer(texts, vocab_size=BPE_VOCAB)
        # another init seed than the student's base: a model that shares nothing with the student but the data
        save_pretrained(build_tiny_model(fam.model.tiny, len(bpe), bpe.pad_token_id, bpe.eos_token_id,
                                         seed=10_000 + seed), bpe, base)
    sft = R.sft_stage(fam, base, progress=False)
    expert = R.expert_stage(fam, "code", sft.model_dir, progress=False)
    info = {"sft": {k: v["greedy"] for k, v in sft.eval.items()},
            "expert": {k: v["greedy"] for k, v in expert.eval.items()},
            "vocab": len(load_tokenizer(expert.model_dir)), "train_s": round(time.perf_counter() - t0, 1)}
    return expert.model_dir, info


def exactness(cfg, expert, copy) -> dict:
    """The bridged copy vs the expert on the code eval prompts + reference answers (+ EOS)."""
    import torch

    from mopd_core import recipe as R
    from mopd_core.models.chat import formatter_for
    from mopd_core.rollout import RolloutBatch
    from mopd_core.teachers.bridge import bridge_teachers

    tok = expert.tokenizer
    exs = R.build_domains(cfg, ["code"])["code"].eval_examples()[:64]
    p = [tok(e.prompt)["input_ids"] for e in exs]
    c = [tok(e.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for e in exs]
    B, P, T = len(exs), max(map(len, p)), max(map(len, c))
    pid, pm = torch.full((B, P), tok.pad_token_id), torch.zeros(B, P, dtype=torch.long)
    cid, cm = torch.full((B, T), tok.pad_token_id), torch.zeros(B, T, dtype=torch.long)
    for i, (a, b) in enumerate(zip(p, c)):
        pid[i, P - len(a):], pm[i, P - len(a):] = torch.tensor(a), 1
        cid[i, :len(b)], cm[i, :len(b)] = torch.tensor(b), 1
    batch = RolloutBatch(pid, pm, cid, cm, torch.zeros(B, T), exs, [e.answer for e in exs])
    bridged = bridge_teachers({"code": copy}, tok, cfg.data.chat, ["code"], formatter_for(tok).stop_ids())["code"]
    with torch.no_grad():
        ref, got = expert.score(batch).logp, bridged.score(batch).logp
    aligned = torch.zeros(B, T, dtype=torch.bool)
    bpe_tokens = 0
    for i, e in enumerate(exs):
        offs = copy.tokenizer(e.answer, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        bpe_tokens += len(offs)
        single = {s for s, t in offs if t == s + 1}
        for k in range(len(e.answer)):
            aligned[i, k] = k in single
        aligned[i, len(e.answer)] = True  # EOS ↔ EOS
    mask = cm.bool()
    return {"rows": B, "student_tokens": int(mask.sum()), "teacher_tokens": bpe_tokens + B,
            "aligned_share": round(float(aligned[mask].float().mean()), 4),
            "max_abs_seq_diff": float((got.sum(-1) - ref.sum(-1)).abs().max()),
            "max_abs_aligned_token_diff": float((got - ref)[aligned & mask].abs().max()),
            "mean_seq_logp": float(ref.sum(-1).mean())}


def _stage_eval(d: Path) -> dict:
    return {k: v["greedy"] for k, v in json.loads((d / "stage.json").read_text())["eval"].items()}


def run_one(args) -> int:
    import torch

    from mopd_core import recipe as R
    from mopd_core.config import load_config
    from mopd_core.runtime import device as devlib
    from mopd_core.teachers import build_local_router
    from mopd_core.teachers.retokenized import RetokenizedCopy

    seed, variant, rep = args.worker, args.variant, args.rep
    cross, trained = variant == "cross", variant == "trained"
    out = Path(args.output_dir) / f"seed{seed}"
    # every variant on the one objective a cross-tokenizer teacher allows (what the committed results ran)
    cfg = load_config(args.config, [f"output_dir={out}", "mopd.kd_loss=sampled_rkl", *args.overrides,
                                    f"seed={seed}",
                                    *(["teachers.cross_tokenizer=[code]"] if cross or trained else [])])
    R.setup_runtime(cfg)
    stages = Path(args.stages.format(seed=seed))
    sft = stages / "sft" / "final"
    experts = {d: stages / f"expert-{d}" / "final" for d in cfg.domain_names()}
    load0 = os.getloadavg()[0]
    scorers, exact, family = None, None, None
    if trained:
        experts["code"], family = other_family_expert(args, seed, out)
    if cross:
        bpe = code_bpe(cfg, seed)
        dinfo = devlib.resolve(cfg.runtime.device)
        router = build_local_router(experts, cfg.teachers, dinfo.torch_device, cfg.runtime.dtype,
                                    cfg.train.logprob_impl)
        scorers = dict(router.teachers)
        scorers["code"] = RetokenizedCopy(scorers["code"], bpe)
        exact = exactness(cfg, router.teachers["code"], scorers["code"])
        exact["bpe_vocab"] = len(bpe)
    t0 = time.perf_counter()
    # a repeat r > 0: the same stage under another name, so only its sampling streams differ (a stage's randomness
    # derives from (seed, stage name, step)); the eval set and the trained stages stay those of `seed`
    name = {"cross": "student-xtok", "trained": "student-xtok-trained"}.get(variant, "student") \
        + (f"-rep{rep}" if rep else "")
    res = R.mopd_stage(cfg, sft, experts, progress=False, stage_name=name, scorers=scorers)
    wall = time.perf_counter() - t0
    info = json.loads((res.stage_dir / "stage.json").read_text())
    steps = info.get("steps") or cfg.mopd.steps
    result = {
        "seed": seed, "repeat": rep, "variant": variant, "student": {k: v["greedy"] for k, v in res.eval.items()},
        "sft": _stage_eval(stages / "sft"),
        "experts": {d: (family["expert"][d] if family and d == "code" else _stage_eval(stages / f"expert-{d}")[d])
                    for d in experts},
        "other_family": family,
        "mopd_seconds": round(wall, 1), "steps": steps,
        "teacher_s_per_step": {n: round(s["seconds"] / max(1, steps), 4)
                               for n, s in (info.get("teacher_stats") or {}).items()},
        "load_avg_start": round(load0, 2), "load_avg_end": round(os.getloadavg()[0], 2),
        "threads": torch.get_num_threads(), "stages": str(stages), "exactness": exact,
    }
    result["bar"] = check_bar(result)
    Path(args.worker_out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0


def check_bar(r: dict) -> dict:
    rows = {}
    for d, e in r["experts"].items():
        s, b = r["student"][d], r["sft"][d]
        rows[d] = {"ratio": round(s / e, 4) if e else None, "ratio_ok": s >= STUDENT_RATIO * e, "beats_sft": s > b}
    return {"domains": rows, "pass": all(v["ratio_ok"] and v["beats_sft"] for v in rows.values())}


def _ms(vals):
    return (statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0)


def markdown(rows: list[dict], meta: dict) -> str:
    doms = list(rows[0]["experts"]) if rows else []
    L = ["# Cross-tokenizer code teacher in the tiny recipe's MOPD stage", "",
         f"{meta['what']}", "",
         f"Machine: {meta['machine']}; torch threads per run: {meta['threads']}; load average during the runs "
         f"(shared 2-core machine): {meta['load']}. Training seeds: {meta['seeds']}; MOPD repeats: "
         f"{meta['repeats']}.", "",
         "Greedy held-out accuracy (%), per seed and variant; bar: student ≥ 90 % of each expert on its domain and "
         "> SFT on every domain.", "",
         "| seed | repeat | variant | " + " | ".join(f"SFT {d}" for d in doms) + " | "
         + " | ".join(f"expert {d}" for d in doms) + " | " + " | ".join(f"student {d}" for d in doms)
         + " | student/expert | bar | MOPD s | code teacher s/step |",
         "|" + "---|" * (3 * len(doms) + 7)]
    for r in rows:
        ratio = " / ".join("–" if r['bar']['domains'][d]['ratio'] is None else
                           f"{r['bar']['domains'][d]['ratio'] * 100:.0f}%" for d in doms)
        L.append(f"| {r['seed']} | {r.get('repeat', 0)} | {r['variant']} | "
                 + " | ".join(f"{r['sft'][d] * 100:.1f}" for d in doms) + " | "
                 + " | ".join(f"{r['experts'][d] * 100:.1f}" for d in doms) + " | "
                 + " | ".join(f"{r['student'][d] * 100:.1f}" for d in doms)
                 + f" | {ratio} | {'PASS' if r['bar']['pass'] else 'FAIL'} | {r['mopd_seconds']:.0f} | "
                 f"{r['teacher_s_per_step'].get('code', float('nan')):.3f} |")
    for v in sorted({r["variant"] for r in rows}):
        sel = [r for r in rows if r["variant"] == v]
        cells = []
        for d in doms:  # over seeds × repeats
            m, s = _ms([r["student"][d] * 100 for r in sel])
            cells.append(f"{d} {m:.1f} ± {s:.1f}")
        L += ["", f"- `{v}` student, mean ± std over {len(sel)} run(s): " + ", ".join(cells)
              + f"; passes: {sum(r['bar']['pass'] for r in sel)}/{len(sel)}"]
    fams = [r for r in rows if r.get("other_family")]
    if fams:
        L += ["", "## The other-family code teacher (`trained`)", "",
              "A tiny Llama of the student's shape with its own BPE tokenizer and init, through the recipe's SFT and "
              "code GRPO stages; greedy held-out accuracy (%) of its stages.", "",
              "| seed | BPE vocab | its SFT " + " / ".join(doms) + " | its code expert " + " / ".join(doms)
              + " | its training s |", "|---|---:|---|---|---:|"]
        for r in fams:
            f = r["other_family"]
            L.append(f"| {r['seed']} | {f['vocab']} | " + " / ".join(f"{f['sft'][d] * 100:.1f}" for d in doms)
                     + " | " + " / ".join(f"{f['expert'][d] * 100:.1f}" for d in doms) + f" | {f['train_s']:.0f} |")
    ex = [r["exactness"] for r in rows if r.get("exactness")]
    if ex:
        e = ex[0]
        L += ["", "## Exactness of the bridge (cross variant, code eval prompts + reference answers + EOS)", "",
              f"- {e['rows']} rows, {e['student_tokens']} student (character) tokens, {e['teacher_tokens']} teacher "
              f"(BPE, vocab {e['bpe_vocab']}) tokens; {e['aligned_share'] * 100:.1f} % of student tokens have both "
              "boundaries shared with the teacher's tokenization.",
              f"- max |Δ| of the sequence log-prob (bridged copy vs the expert): "
              f"{max(x['max_abs_seq_diff'] for x in ex):.2e} nats (mean sequence log-prob "
              f"{e['mean_seq_logp']:.3f}); max |Δ| per aligned token: "
              f"{max(x['max_abs_aligned_token_diff'] for x in ex):.2e} (float32 scoring)."]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--stages", required=False, help="trained stages of a seed, `{seed}` substituted")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default="same,cross", help="any of same, cross (the code expert re-tokenized), "
                    "trained (a code expert of another tokenizer family, trained here)")
    ap.add_argument("--repeats", default="0", help="MOPD repeats per seed from the same trained stages (0 = the "
                    "stage as the recipe names it; r > 0: other sampling streams)")
    ap.add_argument("--rep", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--output-dir", default=str(ROOT / "runs/xtok"))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--what", default="", help="one line saying exactly what was run (written to the table)")
    ap.add_argument("--collect", action="store_true", help="only rebuild the table from the workers' JSON")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker is not None:
        return run_one(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    root = Path(args.output_dir)
    repeats = [int(r) for r in args.repeats.split(",")]
    jobs = [(s, r, v) for s in seeds for r in repeats for v in variants]
    outs = {j: root / f"seed{j[0]}" / (f"{j[2]}.json" if not j[1] else f"{j[2]}-rep{j[1]}.json") for j in jobs}
    if not args.collect:
        pending, running = list(jobs), {}
        while pending or running:
            while pending and len(running) < args.jobs:
                j = pending.pop(0)
                outs[j].parent.mkdir(parents=True, exist_ok=True)
                log = open(outs[j].with_suffix(".log"), "w")
                cmd = [sys.executable, __file__, "--config", args.config, "--stages", args.stages, "--output-dir",
                       str(root), "--worker", str(j[0]), "--rep", str(j[1]), "--variant", j[2], "--worker-out",
                       str(outs[j]), *[f"--set={o}" for o in args.overrides]]
                running[j] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)
                print(f"seed {j[0]} repeat {j[1]} {j[2]}: started", flush=True)
            time.sleep(5)
            for j, (p, log) in list(running.items()):
                if p.poll() is not None:
                    log.close()
                    print(f"seed {j[0]} repeat {j[1]} {j[2]}: exit {p.returncode}", flush=True)
                    del running[j]
    rows = [json.loads(outs[j].read_text()) for j in jobs if outs[j].exists()]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tiny_recipe import machine_info

    mi = machine_info()
    loads = [x for r in rows for x in (r["load_avg_start"], r["load_avg_end"])]
    meta = {"what": args.what, "machine": f"{mi['cpu_model']} ({mi['cpu_count']} cores), torch {mi['torch']}",
            "threads": sorted({r["threads"] for r in rows}),
            "load": f"{min(loads):.1f}–{max(loads):.1f}" if loads else "n/a",
            "seeds": sorted({r["seed"] for r in rows}), "repeats": sorted({r.get("repeat", 0) for r in rows})}
    Path(args.out).write_text(json.dumps({"meta": meta, "machine": mi, "runs": rows}, indent=2))
    Path(args.out).with_suffix(".md").write_text(markdown(rows, meta))
    print(Path(args.out).with_suffix(".md").read_text())
    failed = [j for j in jobs if not outs[j].exists()]
    return 1 if failed or not all(r["bar"]["pass"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
