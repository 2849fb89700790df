"""Benchmark: peak memory of one train micro-step and one local-teacher scoring call, `full` vs `chunked` log-probs.

For V ∈ {32,000; 151,936} × T ∈ {1,024; 4,096; 16,384} (one completion of T tokens after a 16-token prompt, a
one-layer Llama of hidden 64 built locally from a config), each cell in a fresh subprocess:

- `train`: forward + log-probs + entropy + backward (`rollout.score_completions(..., entropy=True)`, loss −Σ logp);
- `teacher`: one scoring call under `no_grad` (what `LocalTeacher.score` runs), and `chunked+top8` with the
  teacher top-8 of `kd_loss: jsd` (that one and the teacher's `trl` cell at the smallest T only);
- impls: `full` (the model's logits, log-softmax over [T,V]), `chunked` (ours: `train.logprob_impl: chunked`)
  and `trl` (TRL's `ChunkedLogProbFunction` called directly on the same hidden states, with the 32,768-wide
  vocabulary tiles its trainers use).

The number is the peak RSS over the model: VmHWM after the step minus VmRSS just before it (the peak is reset
through /proc/self/clear_refs after a 16-token warm-up, so one-time allocations are not counted). A `full` cell
whose estimate exceeds --max-gib (default 8) is skipped and says how much it would need. Writes
`benchmarks/results/train_memory.{json,md}` (or --out).

    .venv/bin/python benchmarks/train_memory.py [--vocab 32000,151936] [--tokens 1024,4096,16384] [--threads 1]
        [--max-gib 8] [--out PATH] [--report JSON]

The whole grid took 19 min on the shared 2-core machine at 1 thread (the V=151,936, T=16,384 cells ~4 min each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HIDDEN, PROMPT = 64, 16
# (step, impl, every T or only the smallest). Without top-k a teacher's chunked call *is* TRL's function under
# no_grad (narrower tiles), and top-k adds [T,8]: both are shown at the smallest T only, to keep the run short.
CELLS = [("train", "full", True), ("train", "chunked", True), ("train", "trl", True),
         ("teacher", "full", True), ("teacher", "chunked", True), ("teacher", "chunked+top8", False),
         ("teacher", "trl", False)]
TRL_VOCAB_CHUNK = 32768  # trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE, what TRL's own trainers pass


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def full_estimate_gib(phase: str, V: int, T: int) -> float:
    """fp32 [T,V] tensors alive at the peak of the full path: train ~4 (logits, log-softmax, their gradients —
    measured: +2.3 GiB at V=151,936, T=1,024 in benchmarks/results/train_memory.md), teacher ~3 (logits,
    log-softmax, exp)."""
    return (4 if phase == "train" else 3) * T * V * 4 / 2**30


def run_cell(phase: str, impl: str, V: int, T: int, threads: int) -> dict:
    """In this (fresh) process: build the model, warm up, reset the peak, run one step, report."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mopd_core.models import last_hidden_state
    from mopd_core.rollout import RolloutBatch, position_ids, score_completions

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=HIDDEN, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=128,
                                         max_position_embeddings=PROMPT + T + 1, tie_word_embeddings=False))
    model.train(phase == "train")

    def batch(n):
        g = torch.Generator().manual_seed(1)
        return RolloutBatch(torch.randint(0, V, (1, PROMPT), generator=g), torch.ones(1, PROMPT, dtype=torch.long),
                            torch.randint(0, V, (1, n), generator=g), torch.ones(1, n, dtype=torch.long),
                            torch.zeros(1, n))

    def step(b):
        ctx = torch.enable_grad() if phase == "train" else torch.no_grad()
        with ctx:
            if impl == "trl":
                from trl.kernels.chunked_logprob import ChunkedLogProbFunction

                am = b.attention_mask()
                h = last_hidden_state(model, b.input_ids(), am, position_ids(am))[:, -b.completion_ids.shape[1] - 1:-1]
                lp, ent, *_ = ChunkedLogProbFunction.apply(h.reshape(-1, HIDDEN), model.lm_head.weight, None,
                                                           b.completion_ids.reshape(-1), 1.0, TRL_VOCAB_CHUNK, None,
                                                           1.0, ("entropy",))
                ent = ent.detach()
            else:
                sc = score_completions(model, b, 1.0, impl=impl.split("+")[0], entropy=phase == "train",
                                       top_k=8 if impl.endswith("top8") else 0)
                lp, ent = sc.logp, sc.entropy
            if phase == "train":
                (-lp.sum() / lp.numel()).backward()
                model.zero_grad(set_to_none=False)  # gradients stay allocated, as in accumulation
            return float(lp.detach().sum()), None if ent is None else float(ent.sum())

    step(batch(16))  # warm-up: lazy init, gradient buffers
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    lp_sum, ent_sum = step(batch(T))
    seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    return {"phase": phase, "impl": impl, "V": V, "T": T, "peak_mib": round((peak - before) / 1024, 1),
            "rss_before_mib": round(before / 1024, 1), "seconds": round(seconds, 2), "logp_sum": lp_sum,
            "entropy_sum": ent_sum}


def _fmt(c: dict | None) -> str:
    if c is None:
        return "–"
    if "skipped" in c:
        return c["skipped"]
    return f"{c['peak_mib']:,.0f}"


def report(cells: list[dict], machine: dict, threads: int, wall: float) -> tuple[str, list[dict]]:
    idx = {(c["phase"], c["impl"], c["V"], c["T"]): c for c in cells}
    Vs = sorted({c["V"] for c in cells})
    Ts = sorted({c["T"] for c in cells})
    lines = [
        "# Peak memory of log-probs: full vs chunked vs TRL",
        "",
        f"Peak RSS over the model in MiB (VmHWM after the step − VmRSS before it), one completion of T tokens, a "
        f"one-layer Llama of hidden {HIDDEN}, each cell a fresh process. Machine: {machine.get('cpu_model')}, "
        f"{machine.get('cpu_count')} cores (shared), {threads} torch thread(s), torch {machine.get('torch')}, "
        f"trl {machine.get('trl')}; total wall {wall:.0f} s. `chunked` = `train.logprob_impl: chunked` "
        f"(vocabulary tiles of {machine.get('vocab_chunk')}), `trl` = TRL's `ChunkedLogProbFunction` on the same "
        f"hidden states with the {TRL_VOCAB_CHUNK}-wide tiles of its trainers. With gradient, `chunked` *is* TRL's "
        "function (own code only for top-k and the JSD support), so its lower peak is the narrower tile: on the "
        "torch path every tile op allocates a tile-sized temporary. `full` cells estimated above the memory cap are "
        "skipped, naming what they would need. The machine was shared with training jobs, so seconds are loose.",
        "",
        "| step | V | T | full | chunked | chunked+top8 | TRL | chunked / TRL | full / chunked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in ("train", "teacher"):
        for V in Vs:
            for T in Ts:
                f, c, k, t = (idx.get((phase, i, V, T)) for i in ("full", "chunked", "chunked+top8", "trl"))
                ok = [x is not None and "peak_mib" in x for x in (f, c, t)]
                r_trl = f"{c['peak_mib'] / t['peak_mib']:.2f}" if ok[1] and ok[2] and t["peak_mib"] > 0 else "–"
                r_full = f"{f['peak_mib'] / c['peak_mib']:.1f}×" if ok[0] and ok[1] and c["peak_mib"] > 0 else "–"
                lines.append(f"| {phase} | {V:,} | {T:,} | {_fmt(f)} | {_fmt(c)} | "
                             f"{_fmt(k) if phase == 'teacher' else '–'} | {_fmt(t)} | {r_trl} | {r_full} |")
    goals = []
    for phase in ("train", "teacher"):
        for V in Vs:
            for T in Ts:
                c, t = idx.get((phase, "chunked", V, T)), idx.get((phase, "trl", V, T))
                if c and t and "peak_mib" in c and "peak_mib" in t:
                    goals.append({"goal": f"{phase} V={V} T={T}: chunked ≤ TRL + 10 %", "value": c["peak_mib"],
                                  "threshold": round(1.1 * t["peak_mib"], 1),
                                  "ok": c["peak_mib"] <= 1.1 * t["peak_mib"]})
    f, c = idx.get(("train", "full", 151936, 1024)), idx.get(("train", "chunked", 151936, 1024))
    if f and c and "peak_mib" in f and "peak_mib" in c:
        goals.append({"goal": "train V=151936 T=1024: chunked ≥ 4× below full", "value": c["peak_mib"],
                      "threshold": round(f["peak_mib"] / 4, 1), "ok": 4 * c["peak_mib"] <= f["peak_mib"]})
    lines += ["", "Goals:", ""] + [f"- {'PASS' if g['ok'] else 'FAIL'} {g['goal']}: {g['value']:,.0f} "
                                              f"(bound {g['threshold']:,.0f})" for g in goals]
    # growth: chunked train from the smallest to the largest T, beside what T·H and T·V scaling would predict
    growth = []
    for V in Vs:
        a, b = idx.get(("train", "chunked", V, Ts[0])), idx.get(("train", "chunked", V, Ts[-1]))
        if a and b and "peak_mib" in a and "peak_mib" in b:
            growth.append(f"V={V:,}: {a['peak_mib']:,.0f} → {b['peak_mib']:,.0f} MiB for T {Ts[0]:,} → {Ts[-1]:,}")
    lines += ["", "Growth with T (train, chunked): " + "; ".join(growth) + ". The full path's [T,V] fp32 logits "
              "alone would be " + ", ".join(f"{Ts[-1] * V * 4 / 2**30:.1f} GiB at V={V:,}" for V in Vs) +
              f" for T={Ts[-1]:,}; chunked grows by the T·H activations and at most one "
              f"[{4096} × tile] buffer, and V enters only through the [V,H] weight and its gradient.", ""]
    return "\n".join(lines), goals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="32000,151936")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-gib", type=float, default=8.0, help="skip a full cell whose estimate exceeds this")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_memory.json"))
    ap.add_argument("--report", metavar="JSON", help="only rewrite the Markdown table of an earlier run's JSON")
    ap.add_argument("--cell", nargs=4, metavar=("PHASE", "IMPL", "V", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cell:
        phase, impl, V, T = args.cell
        print(json.dumps(run_cell(phase, impl, int(V), int(T), args.threads)))
        return 0

    if args.report:
        data = json.loads(Path(args.report).read_text())
        md, _ = report(data["cells"], data["machine"], data["machine"]["threads"], data["wall_s"])
        Path(args.report).with_suffix(".md").write_text(md)
        print(md)
        return 0
    import torch
    import trl
    from tiny_recipe import machine_info

    from mopd_core.algorithms.logprobs import VOCAB_CHUNK

    machine = {**machine_info(), "trl": trl.__version__, "threads": args.threads, "vocab_chunk": VOCAB_CHUNK}
    del torch
    Vs = [int(v) for v in args.vocab.split(",")]
    Ts = [int(t) for t in args.tokens.split(",")]
    cells, t_all = [], time.perf_counter()
    for V in Vs:
        for T in Ts:
            for phase, impl, every_t in CELLS:
                if not every_t and T != Ts[0]:
                    continue
                need = full_estimate_gib(phase, V, T)
                if impl == "full" and need > args.max_gib:
                    cells.append({"phase": phase, "impl": impl, "V": V, "T": T,
                                  "skipped": f"skipped: would need ~{need:.0f} GiB"})
                    print(f"{phase:7} {impl:12} V={V:6} T={T:5}: skipped (~{need:.1f} GiB)", flush=True)
                    continue
                p = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--cell", phase, impl,
                                    str(V), str(T)], capture_output=True, text=True, cwd=ROOT)
                if p.returncode:
                    raise SystemExit(f"cell {phase}/{impl} V={V} T={T} failed:\n{p.stderr[-2000:]}")
                cell = json.loads(p.stdout.strip().splitlines()[-1])
                cells.append(cell)
                print(f"{phase:7} {impl:12} V={V:6} T={T:5}: {cell['peak_mib']:8.0f} MiB  {cell['seconds']:6.1f} s",
                      flush=True)
    wall = time.perf_counter() - t_all
    md, goals = report(cells, machine, args.threads, wall)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "hidden": HIDDEN, "prompt_tokens": PROMPT,
                               "trl_vocab_chunk": TRL_VOCAB_CHUNK, "wall_s": round(wall, 1), "cells": cells,
                               "goals": goals}, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(g["ok"] for g in goals) else 1


if __name__ == "__main__":
    sys.exit(main())
