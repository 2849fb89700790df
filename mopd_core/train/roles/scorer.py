"""The scorer role: a step's samples get their rewards (the domains' verifiers) and the teachers' signal the
objective asks for (`objective.signal`), filling `Produced.scored`. With truncated sampling the behaviour
log-probs are first recomputed by the trainer (`update.recompute_behaviour_logp`)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from ...domains.base import domain_rewards
from ...evaluation import truncated_flags
from ...rollout import RolloutBatch
from .. import update as update_mod  # looked up at call time (tests replace it)
from ..pipeline import Produced
from .context import StageContext

_STAT_METRICS = (("seconds", "score_s"), ("tokens", "tokens"), ("requests", "requests"), ("retries", "retries"),
                 ("restarts", "restarts"), ("cache_hits", "cache_hits"), ("cache_misses", "cache_misses"),
                 ("cache_saved_s", "cache_saved_s"))


class Scorer:
    """Rewards + teacher scores of one step. `visit`: the phase scheduler's per-teacher turn (None when scoring
    runs off the trainer's thread: the async pipeline)."""

    def __init__(self, ctx: StageContext, model, objective, stop_ids, visit=None) -> None:
        self.ctx, self.model, self.objective, self.visit = ctx, model, objective, visit
        self.stop_ids = stop_ids  # a completion that ends without one of them was cut off by the budget
        # only domains whose rewards depend on it (zero_if_truncated) need the flags
        self.flag_cut_offs = any(d.uses_truncation for d in ctx.domains.values())

    def score(self, p: Produced) -> None:
        """Rewards and teacher scores of the step's samples (`p.scored`)."""
        ctx, sc = self.ctx, p.scored
        ro, c0 = ctx.recipe.rollout, ctx.clock.now()
        if ro.truncates:  # off (the defaults): no extra forward, the engine's log-probs as they are
            t0 = time.perf_counter()
            p.batch, sc["trunc"] = update_mod.recompute_behaviour_logp(
                self.model, p.batch, ro.temperature, ctx.recipe.train.logprob_impl, ctx.cfg.micro_batch_size,
                ctx.amp, packed=ctx.recipe.train.packing)
            sc["trunc"]["perf/behaviour_logp_s"] = time.perf_counter() - t0
        batch = p.batch
        cut_off = truncated_flags(batch, ro.max_new_tokens, self.stop_ids) if self.flag_cut_offs else None
        sc["rewards"] = torch.tensor(rewards(ctx.domains, batch, cut_off), dtype=torch.float32, device=ctx.device)
        t0 = time.perf_counter()
        teachers = ctx.teachers
        before = teachers.stats() if teachers is not None else {}
        sc.update(self.objective.signal(self.model, batch, self.visit))
        sc["t_score"] = time.perf_counter() - t0
        sc["teacher_stats"] = teacher_stat_deltas(before, teachers.stats()) if teachers is not None else {}
        p.times["score"] = [c0, ctx.clock.now()]


def rewards(domains, batch: RolloutBatch, truncated: list[bool] | None = None) -> list[float]:
    """Each row's reward from its domain; `truncated` flags reach the verifiers (zero_if_truncated)."""
    out = [0.0] * batch.size
    by_dom = defaultdict(list)
    for i, e in enumerate(batch.examples):
        by_dom[e.teacher_id].append(i)
    for d, rows in by_dom.items():
        rs = domain_rewards(domains[d], [batch.examples[i] for i in rows], [batch.texts[i] for i in rows],
                            None if truncated is None else [truncated[i] for i in rows])
        for i, r in zip(rows, rs):
            out[i] = float(r)
    return out


def teacher_stat_deltas(before: dict, after: dict) -> dict[str, float]:
    """teacher/<t>/{score_s,tokens,requests,retries,restarts,cache_hits,cache_misses,cache_saved_s}: this step's
    share of each teacher's counters; with the score cache also `perf/teacher_cache_saved_s`, the teacher-seconds
    the step's cache hits saved, all teachers together."""
    out = {}
    for t, st in after.items():
        b = before.get(t, {})
        for key, name in _STAT_METRICS:
            if key in st:
                out[f"teacher/{t}/{name}"] = float(st[key] - b.get(key, 0))
    saved = [v for k, v in out.items() if k.endswith("/cache_saved_s")]
    if saved:
        out["perf/teacher_cache_saved_s"] = sum(saved)
    return out
