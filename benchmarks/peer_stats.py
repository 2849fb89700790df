"""Pure helpers shared by `benchmarks/vs_trl.py` and `benchmarks/sample_efficiency.py` (no torch, no I/O):
mean ± std, paired ratios over interleaved repeats, Markdown tables, the first eval point reaching a target, and
the seesaw of a multi-domain run (one domain falling while another rises). Unit-tested in
tests/unit/test_peer_benchmarks.py."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for a single value: no spread can be claimed from one run)."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return float("nan"), None
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def fmt_pm(values: Sequence[float], digits: int = 2, scale: float = 1.0) -> str:
    """`mean ± std` of `values` × `scale` (`mean (n=1)` when there is one value, `–` when none)."""
    m, s = mean_std(values)
    if math.isnan(m):
        return "–"
    if s is None:
        return f"{m * scale:.{digits}f} (n=1)"
    return f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """numerator[i] / denominator[i] for each repeat i: runs of the same repeat ran back to back (A B A B), so
    they saw the same load from the rest of the machine, and the ratio of the pair cancels most of it."""
    if len(numerators) != len(denominators):
        raise ValueError(f"paired_ratios: {len(numerators)} numerators vs {len(denominators)} denominators")
    return [n / d for n, d in zip(numerators, denominators) if d]


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub Markdown table; `align` one character per column (`l`, `r`), default: first left, rest right."""
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("md_table: every row needs one cell per header")
    align = align or ("l" + "r" * (len(headers) - 1))
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join("–" if c is None else str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def first_crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The first x whose y reaches `target` (y ≥ target), None if no point does. Eval points only — no
    interpolation between them, so the answer is a sample count at which the accuracy was actually measured."""
    if len(xs) != len(ys):
        raise ValueError("first_crossing: xs and ys differ in length")
    for x, y in zip(xs, ys):
        if y is not None and y >= target:
            return x
    return None


def seesaw_events(curves: Mapping[str, Sequence[float]], xs: Sequence[float], min_delta: float) -> list[dict]:
    """Eval intervals in which one domain fell by ≥ `min_delta` while another rose by ≥ `min_delta` (the
    seesaw of joint multi-domain RL). `curves` {domain: accuracy per eval point}, all as long as `xs`."""
    doms = list(curves)
    for d in doms:
        if len(curves[d]) != len(xs):
            raise ValueError(f"seesaw_events: curve '{d}' has {len(curves[d])} points, xs has {len(xs)}")
    out = []
    for i in range(1, len(xs)):
        delta = {d: curves[d][i] - curves[d][i - 1] for d in doms}
        fell = [d for d in doms if delta[d] <= -min_delta]
        rose = [d for d in doms if delta[d] >= min_delta]
        for f in fell:
            for r in rose:
                out.append({"from": xs[i - 1], "to": xs[i], "fell": f, "drop": -delta[f], "rose": r,
                            "gain": delta[r]})
    return out


def max_drawdown(ys: Sequence[float]) -> float:
    """The largest fall from a running peak (≥ 0): how much a domain lost after having been better."""
    peak, worst = -math.inf, 0.0
    for y in ys:
        peak = max(peak, y)
        worst = max(worst, peak - y)
    return worst


def trl_timers(trainer_base, callback_base, teacher, sync=lambda: None):
    """TRL's `DistillationTrainer` timed from outside, unchanged: a subclass that times its own `_generate` (the
    student's sampling) and the teacher's `_get_last_hidden_state`, and a `TrainerCallback` that closes each step
    (`update_s` = the rest). `sync()` waits for the device before a clock is read (a no-op on CPU). Returns
    `(TimedTrainer, callback, steps)`: `steps` gets one dict per step (gen_s, score_s, tokens, step_s, update_s)."""
    import time

    cur: dict = {}
    steps: list[dict] = []

    class TimedTrainer(trainer_base):
        def _generate(self, prompts):
            sync()
            t0 = time.perf_counter()
            res = super()._generate(prompts)
            sync()
            cur["gen_s"] += time.perf_counter() - t0
            cur["tokens"] += sum(len(c) for c in res[1])
            return res

        def _get_last_hidden_state(self, unwrapped_model, *a, **k):
            if unwrapped_model is not teacher:
                return super()._get_last_hidden_state(unwrapped_model, *a, **k)
            t0 = time.perf_counter()
            res = super()._get_last_hidden_state(unwrapped_model, *a, **k)
            sync()
            cur["score_s"] += time.perf_counter() - t0
            return res

    class StepTimer(callback_base):
        def on_step_begin(self, *_a, **_k):
            cur.clear()
            cur.update(gen_s=0.0, score_s=0.0, tokens=0, t0=time.perf_counter())

        def on_step_end(self, *_a, **_k):
            sync()
            s = {k: v for k, v in cur.items() if k != "t0"}
            s["step_s"] = time.perf_counter() - cur["t0"]
            s["update_s"] = s["step_s"] - s["gen_s"] - s["score_s"]
            steps.append(s)

    return TimedTrainer, StepTimer(), steps
