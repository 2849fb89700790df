"""The objective role: what the scorer asks of the teachers (`signal`) and how a step's samples become the
update's advantage and loss terms (`advantage`). Chosen once per stage by `build_objective`:

- `RewardObjective`: GRPO on the verifiers' rewards (`w_rl`), expert RL — and the base of every other;
- `ScoredObjective`: teachers score the samples (metrics, token shares) without a distillation term (w_kd = 0);
- `SampledKD`: + the sampled token's reverse-KL advantage (`kd_loss: sampled_rkl`);
- `JSDLoss`: the teachers' top-k for a generalized JSD term inside the update (`kd_loss: jsd`);
- `FullJSDLoss`: the teachers' hidden states for the full-vocabulary JSD (`kd_loss: full_jsd`);
- `PlannedKD`: the distillation advantage as a `kd.KDPlan` — dense top-K (`topk_rkl`), reward refresh,
  gap-following and teacher-conflict handling (docs/objectives.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import algorithms as alg
from .. import kd
from .context import StageContext


@dataclass
class Advantage:
    """What the update gets beside the batch: the advantage (`[B,T]`, or `[B,T,S]` over a dense loss's slots),
    the token weights, and the objective's extra terms (`routed` for the top-k JSD, `full`, `plan`)."""

    adv: torch.Tensor
    token_w: torch.Tensor | None
    plan: kd.KDPlan | None = None
    routed: Any = None
    full: kd.FullJSD | None = None


class RewardObjective:
    """GRPO on the verifiers' rewards: `w_rl · A^R` on every completion token."""

    name = "reward"

    def __init__(self, ctx: StageContext) -> None:
        self.ctx, self.cfg, self.names = ctx, ctx.cfg, ctx.names

    def sampler_top_k(self) -> int:
        """How many of the student's top log-probs per position the sampler should record while it draws the
        step's samples (0: none). Only for samples drawn by the weights being updated (the inline source)."""
        return 0

    def signal(self, model, batch, visit) -> dict[str, Any]:
        """What the teachers add to the step's `scored` (`routed`: their scores; None without teachers)."""
        return {"routed": None}

    def rl_advantage(self, scored: dict, batch, mask: torch.Tensor, m: dict) -> torch.Tensor:
        adv = torch.zeros_like(mask)
        if self.cfg.w_rl > 0:
            a_rl = alg.grpo_advantages(scored["rewards"], self.cfg.group_size, scale_by_std=self.cfg.scale_by_std)
            adv = adv + self.cfg.w_rl * a_rl[:, None] * mask
            m["adv/rl_abs_mean"] = float(a_rl.abs().mean())
        return adv

    def group_ids(self, batch) -> torch.Tensor:
        return torch.tensor([self.names.index(e.teacher_id) for e in batch.examples], device=self.ctx.device)

    def advantage(self, scored: dict, batch, mask: torch.Tensor, m: dict) -> Advantage:
        """The step's advantage; its metrics go into `m`."""
        adv = self.rl_advantage(scored, batch, mask, m)
        return Advantage(adv, alg.balance_weights(self.cfg.balance, self.group_ids(batch), mask))


class ScoredObjective(RewardObjective):
    """Teachers score the samples (each token's teacher log-prob, `routed`); the advantage is the reward's, the
    metrics add each domain's share of the tokens and of the advantage mass."""

    name = "scored"
    top_k = 0  # the teachers' own top-k per position (JSD)

    def signal(self, model, batch, visit) -> dict[str, Any]:
        return {"routed": self.ctx.teachers.score(batch, top_k=self.top_k, visit=visit)}

    def kd_term(self, scored: dict, batch, mask, adv, group_ids, m: dict):
        """`(advantage, plan)` with the distillation term added (none here)."""
        return adv, None

    def advantage(self, scored: dict, batch, mask: torch.Tensor, m: dict) -> Advantage:
        adv = self.rl_advantage(scored, batch, mask, m)
        group_ids = self.group_ids(batch)
        adv, plan = self.kd_term(scored, batch, mask, adv, group_ids, m)
        token_w = alg.balance_weights(self.cfg.balance, group_ids, mask)
        m.update(domain_shares(adv, token_w, mask, group_ids, self.names))
        return Advantage(adv, token_w, plan, *self.loss_terms(scored))

    def loss_terms(self, scored: dict) -> tuple[Any, Any]:
        """`(routed, full)`: the update's JSD terms (none here)."""
        return None, None


class SampledKD(ScoredObjective):
    """`+ w_kd · clip(ℓᵀ − ℓ^old)` on each sampled token (reverse KL as an advantage)."""

    name = "sampled_rkl"

    def kd_term(self, scored, batch, mask, adv, group_ids, m):
        teacher = kd.sampled_teacher_logp(scored["routed"], batch, mask)
        a_kd = alg.reverse_kl_advantages(teacher, batch.behaviour_logp, mask, clip=self.cfg.kd_clip)
        m["adv/kd_mean"] = float((a_kd * mask).sum() / mask.sum().clamp(min=1))
        return adv + self.cfg.w_kd * a_kd, None


class JSDLoss(ScoredObjective):
    """A generalized JSD to the teachers over their top-k (+ the sampled token), added to the loss in the update."""

    name = "jsd"

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.top_k = ctx.cfg.jsd_top_k

    def loss_terms(self, scored):
        return scored["routed"], None


class FullJSDLoss(ScoredObjective):
    """JSD over the whole vocabulary, from each local teacher's hidden states and lm_head (one forward each)."""

    name = "full_jsd"

    def signal(self, model, batch, visit):
        routed, full = kd.FullJSD.from_router(self.ctx.teachers, batch, visit)
        return {"routed": routed, "full": full}

    def loss_terms(self, scored):
        return None, scored["full"]


class PlannedKD(ScoredObjective):
    """The distillation advantage as a `kd.KDPlan` the update may recompute (reward refresh), scaled per domain
    (gap-following) and per token (teacher conflict); over the top-K candidates when `dense` (`topk_rkl`)."""

    name = "planned"

    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self.dense = ctx.cfg.kd_loss == "topk_rkl"
        self.conflict = ctx.recipe.teachers.conflict
        self.gaps = kd.restore_gaps(ctx.metrics_path, self.names) if ctx.cfg.gap_following else None

    def sampler_top_k(self) -> int:
        """The dense objective's student top-K, taken from the sampler (`kd.dense_candidates`)."""
        return self.cfg.kd_top_k if self.dense and self.cfg.kd_candidates == "student" else 0

    def signal(self, model, batch, visit):
        if not self.dense:
            return super().signal(model, batch, visit)
        c, ro = self.ctx.cfg, self.ctx.recipe
        routed, *dense = kd.dense_candidates(
            model, batch, self.ctx.teachers, kind=c.kd_candidates, k=c.kd_top_k, temperature=ro.rollout.temperature,
            impl=ro.train.logprob_impl, micro_batch_size=c.micro_batch_size, amp=self.ctx.amp,
            packed=ro.train.packing, visit=visit)
        return {"routed": routed, "dense": dense}

    def kd_term(self, scored, batch, mask, adv, group_ids, m):
        adv, plan, pm, self.gaps = kd.kd_plan(self.cfg, self.conflict, self.ctx.recipe.teachers.conflict_nats,
                                              scored["routed"], scored.get("dense"), batch, mask, adv, group_ids,
                                              self.names, self.gaps)
        m.update(pm)
        return adv, plan


def build_objective(ctx: StageContext) -> RewardObjective:
    """The stage's objective from its config (`check_objective` has refused the impossible combinations)."""
    c = ctx.cfg
    if ctx.teachers is None:
        return RewardObjective(ctx)
    distil = c.w_kd > 0
    if distil and c.kd_loss == "full_jsd":
        return FullJSDLoss(ctx)
    if distil and (c.kd_loss == "topk_rkl" or c.reward_refresh or c.gap_following
                   or ctx.recipe.teachers.conflict != "none"):
        return PlannedKD(ctx)
    return {"jsd": JSDLoss, "sampled_rkl": SampledKD}.get(c.kd_loss, ScoredObjective)(ctx)


def domain_shares(adv, token_w, mask, group_ids, names: list[str]) -> dict[str, float]:
    """`token_share/<d>`: the domain's share of the completion tokens; `grad_share/<d>`: its share of
    Σ w_t·|A_t| (token weights × advantage magnitude, summed over a dense loss's slots) — Open-MOPD's diagnosis
    of a short-answer domain that holds many prompts but few gradient tokens."""
    a = (adv.sum(-1) if adv.dim() == 3 else adv).abs() * mask
    if token_w is not None:
        a = a * token_w
    tok, mass = mask.sum(-1), a.sum(-1)
    out = {}
    for d, n in enumerate(names):
        rows = group_ids == d
        if rows.any():
            out[f"token_share/{n}"] = float(tok[rows].sum() / tok.sum().clamp(min=1))
            out[f"grad_share/{n}"] = float(mass[rows].sum() / mass.sum()) if float(mass.sum()) > 0 else 0.0
    return out
