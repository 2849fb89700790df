"""A discrete-event model of the MOPD pipeline, synchronous vs asynchronous.

Takes per-step phase costs — generation, teacher scoring, the update, the weight hand-over — as measured on one
student server, one teacher server and one training worker, and predicts steps/s and the idle fraction of each
resource for N student servers, M teacher servers and W training workers:

- `sync` — today's loop: generate the whole batch, then score it, then train, then hand the weights over;
- `async` with staleness k — batch b (consumed by update b, which holds weight version b) may start generating
  once the servers hold version ≥ b − k; each batch is cut into `chunks` (GRPO groups) and every chunk is
  scored as soon as it is generated (generation and scoring overlap within and across batches); at most
  `queue_size` chunks wait scored and untrained. k = 0 overlaps only within a step.

Throughput scales as 1/N, 1/M and 1/(W·efficiency) of the one-device costs (`efficiency`: the data-parallel
update's scaling, measured or assumed). The model ignores queue contention inside a server and assumes
generation time per chunk is constant (no long-tail completions) — both make it optimistic for async.

    .venv/bin/python benchmarks/async_model.py --metrics runs/tiny/student/metrics.jsonl [--devices 4,4,8]
    .venv/bin/python benchmarks/async_model.py --gen 1.2 --score 0.4 --train 0.6 --sync 0.1

With `--metrics` the phase costs are the medians of a finished stage's `perf/rollout_s`, `perf/score_s`,
`perf/train_s` (and `perf/weight_sync_s` when present), and the sync prediction is shown beside the measured
median `perf/step_s` — the part of the model a synchronous run can validate.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Costs:
    """Seconds per training step's batch on ONE student server / teacher server / training worker."""

    gen: float
    score: float
    train: float
    sync: float = 0.0


@dataclass(frozen=True)
class Prediction:
    seconds: float           # wall time of `steps` steps
    steps_per_s: float
    trainer_idle: float      # fraction of the wall time the trainer waits for samples or weights
    generator_idle: float
    scorer_idle: float
    max_staleness_seen: int  # the largest (consumer version − generating version) of any chunk


def simulate(c: Costs, *, mode: str = "async", k: int = 1, servers: int = 1, teachers: int = 1, workers: int = 1,
             efficiency: float = 1.0, steps: int = 50, chunks: int = 8, queue_size: int | None = None) -> Prediction:
    """Event-driven: one student-server pool, one teacher pool and the trainer, each doing one thing at a time
    (a pool of N servers is one resource N times as fast). Returns the wall time of `steps` updates."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    if k < 0 or steps < 1 or chunks < 1 or min(servers, teachers, workers) < 1 or not 0 < efficiency <= 1:
        raise ValueError("k >= 0, steps >= 1, chunks >= 1, servers/teachers/workers >= 1, 0 < efficiency <= 1")
    queue = queue_size if queue_size is not None else (k + 1) * chunks
    if queue < chunks:
        raise ValueError(f"queue_size={queue} is below one step's {chunks} chunks: the trainer could never start")
    g, s = c.gen / servers / chunks, c.score / teachers / chunks          # seconds per chunk
    t_train = c.train / (workers * (efficiency if workers > 1 else 1.0))
    gen_free = score_free = train_end = 0.0
    busy_gen = busy_score = busy_train = 0.0
    published = [0.0]          # published[v]: when weight version v (v updates done) reached the servers
    train_start: list[float] = []
    worst = 0
    for b in range(steps):
        if mode == "sync":  # generate all, then score all, then train: nothing overlaps
            ready = train_end + g * chunks + s * chunks
            busy_gen, busy_score = busy_gen + g * chunks, busy_score + s * chunks
        else:
            need = max(b - k, 0)  # batch b may use weights at most k versions older than update b's
            ready = 0.0
            for i in range(chunks):
                idx = b * chunks + i
                # back-pressure: chunk idx waits until chunk idx − queue has left the queue (its update started)
                room = train_start[(idx - queue) // chunks] if idx >= queue else 0.0
                start = max(gen_free, published[need], room)
                gen_free = start + g
                score_free = max(gen_free, score_free) + s  # scored as soon as generated, one chunk at a time
                busy_gen, busy_score = busy_gen + g, busy_score + s
                ready = max(ready, score_free)
                version = bisect.bisect_right(published, start) - 1  # newest version published by `start`
                worst = max(worst, b - version)
        start_t = max(ready, train_end)
        train_start.append(start_t)
        train_end = start_t + t_train + c.sync
        busy_train += t_train
        published.append(train_end)
    total = train_end
    return Prediction(total, steps / total, 1 - busy_train / total, 1 - busy_gen / total, 1 - busy_score / total,
                      worst)


def costs_from_metrics(path: Path) -> tuple[Costs, float]:
    """Median phase seconds of a finished stage's metrics.jsonl, and its median measured step seconds."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not rows:
        raise SystemExit(f"{path}: no metrics rows")

    def med(key: str) -> float:
        vals = [r[key] for r in rows if key in r]
        return statistics.median(vals) if vals else 0.0

    return Costs(med("perf/rollout_s"), med("perf/score_s"), med("perf/train_s"), med("perf/weight_sync_s")), \
        med("perf/step_s")


def table(c: Costs, measured_step: float | None, devices: list[tuple[int, int, int]], efficiency: float,
          steps: int, chunks: int) -> str:
    lines = [f"Phase costs per step on one device: generation {c.gen:.3f} s, scoring {c.score:.3f} s, update "
             f"{c.train:.3f} s, weight hand-over {c.sync:.3f} s; {chunks} chunks (groups) per step, {steps} steps, "
             f"data-parallel efficiency {efficiency:g}.", "",
             "| student servers + teachers + trainers | mode | steps/s | s/step | × sync | trainer idle | "
             "generation idle | scoring idle | max staleness |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n, m, w in devices:
        base = simulate(c, mode="sync", servers=n, teachers=m, workers=w, efficiency=efficiency, steps=steps,
                        chunks=chunks)
        for mode, k in (("sync", 0), ("async", 0), ("async", 1), ("async", 2), ("async", 4)):
            p = base if mode == "sync" else simulate(c, mode=mode, k=k, servers=n, teachers=m, workers=w,
                                                     efficiency=efficiency, steps=steps, chunks=chunks)
            lines.append(f"| {n} + {m} + {w} | {mode if mode == 'sync' else f'async k={k}'} | {p.steps_per_s:.3f} "
                         f"| {1 / p.steps_per_s:.3f} | {p.steps_per_s / base.steps_per_s:.2f} | {p.trainer_idle:.0%} "
                         f"| {p.generator_idle:.0%} | {p.scorer_idle:.0%} | {p.max_staleness_seen} |")
    if measured_step:
        pred = 1 / simulate(c, mode="sync", steps=steps, chunks=chunks).steps_per_s
        lines += ["", f"Validation (1 + 1 + 1, sync): predicted {pred:.3f} s/step, measured median "
                  f"{measured_step:.3f} s/step ({pred / measured_step - 1:+.1%}; the rest of a measured step is "
                  "rewards, advantages and bookkeeping)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", type=Path, help="a finished stage's metrics.jsonl (phase costs = medians)")
    ap.add_argument("--gen", type=float)
    ap.add_argument("--score", type=float)
    ap.add_argument("--train", type=float)
    ap.add_argument("--sync", type=float, default=0.0)
    ap.add_argument("--devices", action="append", default=[],
                    help="N,M,W student servers, teacher servers, trainers (repeatable; default 1,1,1 and 4,4,8)")
    ap.add_argument("--efficiency", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--chunks", type=int, default=32)
    args = ap.parse_args(argv)
    measured = None
    if args.metrics:
        c, measured = costs_from_metrics(args.metrics)
    elif None not in (args.gen, args.score, args.train):
        c = Costs(args.gen, args.score, args.train, args.sync)
    else:
        ap.error("give --metrics, or --gen, --score and --train")
    try:
        devices = [tuple(int(x) for x in d.split(",")) for d in (args.devices or ["1,1,1", "4,4,8"])]
        assert all(len(d) == 3 for d in devices)
    except (ValueError, AssertionError):
        ap.error("--devices takes N,M,W (three integers)")
    print(table(c, measured, devices, args.efficiency, args.steps, args.chunks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
