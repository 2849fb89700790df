"""When each step's generation, scoring and update ran — the picture of how much the asynchronous pipeline
overlaps them (`runtime.placement: async`) and, in the synchronous loop, the proof that nothing does.

The policy loop appends one row per step to `<stage>/timeline.jsonl`:
`{"step", "version", "generate": [t0, t1], "score": [t0, t1], "train": [t0, t1]}`, seconds on one monotonic clock
since the loop (re)started. `summary` turns rows into busy fractions per lane and the share of the wall time in
which two or more lanes were busy at once; `plot` draws the lanes as a Gantt chart (PNG, for MLflow and the
Prefect artifact).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable, Sequence

LANES = ("generate", "score", "train")


class Clock:
    """One origin for every thread of a stage (the generator and scorer stamp their own intervals)."""

    def __init__(self) -> None:
        self.origin = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.origin


def read(path: str | Path) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def append(path: str | Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _union(iv: Iterable[Sequence[float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in iv if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def summary(rows: Sequence[dict]) -> dict[str, float]:
    """Busy fraction of each lane over the rows' wall time, and `overlap_frac`: the share of that wall time in
    which at least two lanes were busy (0 for the synchronous loop, up to 1 when all three run at once)."""
    spans = [iv for r in rows for lane in LANES if (iv := r.get(lane))]
    if not spans:
        return {}
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    wall = max(t1 - t0, 1e-9)
    out = {"wall_s": t1 - t0}
    events = []
    for lane in LANES:
        u = _union(r[lane] for r in rows if r.get(lane))
        out[f"{lane}_busy_frac"] = sum(b - a for a, b in u) / wall
        events += [(a, 1) for a, _ in u] + [(b, -1) for _, b in u]
    # sweep: time with ≥ 2 lanes busy (ends sort before starts at the same instant: touching is not overlapping)
    busy, last, both = 0, t0, 0.0
    for t, d in sorted(events, key=lambda e: (e[0], e[1])):
        if busy >= 2:
            both += t - last
        busy, last = busy + d, t
    out["overlap_frac"] = both / wall
    return out


def plot(rows: Sequence[dict], path: str | Path, title: str = "") -> Path | None:
    """Gantt chart: one lane per phase, one bar per step (labelled with its step, coloured by the weight version
    that generated it in the generate/score lanes)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 2.6))
    cmap = plt.get_cmap("tab10")
    for y, lane in enumerate(reversed(LANES)):
        for r in rows:
            iv = r.get(lane)
            if not iv:
                continue
            colour = cmap(int(r["step"] if lane == "train" else r.get("version", 0)) % 10)
            ax.barh(y, iv[1] - iv[0], left=iv[0], height=0.7, color=colour, edgecolor="black", linewidth=0.3)
            if len(rows) <= 40:
                ax.text((iv[0] + iv[1]) / 2, y, str(r["step"]), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(LANES)), list(reversed(LANES)))
    ax.set_xlabel("seconds since the loop started (bars: steps; generate/score coloured by weight version)")
    s = summary(rows)
    ax.set_title((title + ": " if title else "") + f"overlap {100 * s.get('overlap_frac', 0):.0f} % of the wall "
                 f"time; busy: " + ", ".join(f"{lane} {100 * s.get(lane + '_busy_frac', 0):.0f} %"
                                             for lane in LANES), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["LANES", "Clock", "append", "plot", "read", "summary"]
