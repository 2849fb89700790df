"""The recovery role: how much of each expert's gain over SFT the student has recovered, at every eval, and the
optional gate that ends a domain's sampling once it is reached (`mopd.stop_at_recovery`).

recovery_d = (student_d − SFT_d) / (expert_d − SFT_d), each a domain's headline accuracy (greedy on its held-out
split, or its benchmarks' score: `evaluation.domain_value`); SFT_d and expert_d come from the records of those
stages (`RecoveryRefs`, read by `recipe.recovery_references`). NaN where the expert did not move off SFT.

The loop asks the role for its steps (`steps`: it stops yielding once every domain still in the mix has
stopped), hands it every eval (`observe`), and the generator asks it for the mix weights (`mix`: a stopped
domain's weight is 0, so its prompts are no longer sampled). Which domains stopped, and at which step, is written
into the step metrics (`recovery_stop/<domain>`), so a resumed stage restores the gate from its metrics and
replays the same steps. With the async pipeline a step generated before the stop may still hold the domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

from ...evaluation import recovery


@dataclass
class RecoveryRefs:
    """The reference accuracies of one MOPD stage: the SFT model's eval and each domain's expert's eval (its
    stage record's metrics for that domain), and the records they were read from (for logs and stage.json)."""

    sft: dict[str, dict[str, float]] = field(default_factory=dict)     # domain → SFT's metrics on it
    expert: dict[str, dict[str, float]] = field(default_factory=dict)  # domain → its expert's metrics on it
    sources: dict[str, str] = field(default_factory=dict)              # "sft" / "expert-<d>" → stage folder

    @property
    def domains(self) -> list[str]:
        """The domains with both references."""
        return [d for d in self.expert if d in self.sft]


class RecoveryGate:
    """Recovery per domain from each eval (`observe`), and the gate: a domain whose recovery reached its target
    (`targets`, from `mopd.stop_at_recovery`) is no longer sampled. Without references it logs nothing and gates
    nothing; without targets it only logs."""

    def __init__(self, refs: RecoveryRefs | None, targets: Mapping[str, float], names: Sequence[str]):
        self.refs = refs if refs is not None else RecoveryRefs()
        self.targets = dict(targets)
        self.names = list(names)
        self.stopped: dict[str, int] = {}  # domain → the step whose eval stopped it

    def values(self, scores: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """recovery per domain with both references, and `total` over them (`evaluation.recovery`)."""
        doms = [d for d in self.refs.domains if d in scores]
        if not doms:
            return {}
        table = {"student": dict(scores), "sft": self.refs.sft,
                 **{f"expert-{d}": {d: self.refs.expert[d]} for d in doms}}
        return recovery(table, "student", "sft", {d: f"expert-{d}" for d in doms}, domains=doms)

    def observe(self, step: int, scores: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """The metrics of an eval at `step`: `recovery/<domain>` (and `/total`), and `recovery_stop/<domain>` = 1
        for each domain stopped so far — a domain stops at the first eval whose recovery reaches its target."""
        rec = self.values(scores)
        for d, target in self.targets.items():
            v = rec.get(d, math.nan)
            if d not in self.stopped and math.isfinite(v) and v >= target:
                self.stopped[d] = step
        out = {f"recovery/{d}": v for d, v in rec.items() if math.isfinite(v)}
        out.update({f"recovery_stop/{d}": 1.0 for d in self.stopped})
        return out

    def mix(self, weights: Sequence[float]) -> list[float]:
        """The domains' sampling weights with every stopped domain's set to 0 (once all have stopped, the loop
        has ended: only the async generator, running ahead, can still ask — it gets `weights`, never consumed)."""
        out = [0.0 if n in self.stopped else float(w) for n, w in zip(self.names, weights)]
        return out if any(w > 0 for w in out) else list(weights)

    def steps(self, start: int, end: int, weights: Sequence[float]) -> Iterator[int]:
        """The steps to run: start … end − 1, ending early once no domain with a weight in `weights` is left."""
        for s in range(start, end):
            if all(n in self.stopped for n, w in zip(self.names, weights) if w > 0):
                return
            yield s

    def restore(self, rows: Sequence[Mapping[str, float]]) -> None:
        """The stops recorded in a resumed stage's metrics rows (each domain at its first `recovery_stop` row)."""
        for r in rows:
            for d in self.targets:
                if r.get(f"recovery_stop/{d}") and d not in self.stopped:
                    self.stopped[d] = int(r["step"])

    def record(self, final_scores: Mapping[str, Mapping[str, float]], last_step: int) -> dict:
        """What stage.json keeps under `recovery` (nothing when there is nothing to say): recovery at the final
        eval, the targets, each stop's step, the last step trained and the references' folders."""
        final = {d: v for d, v in self.values(final_scores).items() if math.isfinite(v)}  # JSON has no NaN
        if not final and not self.targets:
            return {}
        return {"recovery": {"final": final, "targets": self.targets, "stopped": dict(self.stopped),
                             "last_step": last_step, "references": dict(self.refs.sources)}}
