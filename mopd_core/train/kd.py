"""The policy loop's distillation objectives beyond the sampled-token advantage (docs/objectives.md): the
candidates of the dense top-K reverse KL, the distillation advantage as a term the update can recompute against
the current student (reward refresh), gap-following and teacher-conflict scales, and the teachers' hidden states
of the full-vocabulary JSD. The math is `algorithms.objectives`; this is the plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import algorithms as alg
from ..config import PolicyLoopConfig
from ..rollout import RolloutBatch, score_completions
from ..stages.folder import read_metrics

ADVANTAGE_KD = ("sampled_rkl", "topk_rkl")  # the kd losses that enter as an advantage (refresh, gap, conflict)


@dataclass
class KDPlan:
    """What `policy_update` needs beyond the step's advantage for the new objectives.

    Sampled token (`dense` False): `teacher [B,T]`; the advantage is `rl_adv + factor · clip(ℓᵀ − ℓ)`.
    Dense (`topk_rkl`): slots `[B,T,S]` = candidates + the sampled token (`alg.candidate_slots`), the
    student's log-probs of them before the update `old_logp`, the teacher's `teacher`; the advantage is
    `rl_adv (on rl_slot) + factor · r(k)`. `refresh`: recompute the kd part with the current student's log-probs
    from the update's own forward before each minibatch after the first (the first sees the weights that produced
    the stored advantage, so refreshing it changes nothing). `span_cut` (sampled token, a teacher of another
    tokenizer): `teacher` holds the raw routed scores, re-split over each span at the log-probs the advantage is
    taken against (`sampled_teacher_logp`'s split at ℓ^old, and at the current student's under refresh, so a
    refreshed span's tokens all get its current mean gap)."""
    dense: bool
    teacher: torch.Tensor
    factor: torch.Tensor                  # [B,T] w_kd · gap scale · conflict keep
    rl_adv: torch.Tensor                  # [B,T] (sampled) or [B,T,S] (dense, GRPO on the rl slot only)
    clip: float | None
    refresh: bool = False
    slot_ids: torch.Tensor | None = None
    old_logp: torch.Tensor | None = None
    kd_valid: torch.Tensor | None = None
    slots: torch.Tensor | None = None     # kd_valid | rl_slot: the slots with a loss
    span_cut: torch.Tensor | None = None  # [B,T] bool (sampled token, bridged teacher): each span's last token

    def kd_advantage(self, student: torch.Tensor, rows, t: int, mask: torch.Tensor) -> torch.Tensor:
        """The factor-weighted kd advantage of `rows` (first `t` positions) against `student` log-probs."""
        if self.dense:
            r = alg.topk_rkl_advantages(student, self.teacher[rows, :t], self.kd_valid[rows, :t], mask, self.clip)
            return self.factor[rows, :t, None] * r
        teacher = self.teacher[rows, :t]
        if self.span_cut is not None:
            teacher = alg.spread_span_gaps(teacher, student, self.span_cut[rows, :t], mask)
        return self.factor[rows, :t] * alg.reverse_kl_advantages(teacher, student, mask, clip=self.clip)

    def advantage(self, student: torch.Tensor, rows, t: int, mask: torch.Tensor) -> torch.Tensor:
        return self.rl_adv[rows, :t] + self.kd_advantage(student, rows, t, mask)


@dataclass
class FullJSD:
    """kd_loss=full_jsd: per teacher its rows' positions, padded hidden states `[n,T,H]` and head."""
    index: torch.Tensor                   # [B] teacher of each row (index into `names`)
    pos: torch.Tensor                     # [B] the row's place in its teacher's `hidden`
    names: list[str]
    hidden: dict[str, torch.Tensor] = field(default_factory=dict)
    heads: dict = field(default_factory=dict)

    @classmethod
    def from_router(cls, router, batch: RolloutBatch, visit=None):
        """`(routed, FullJSD)`: the teachers' ℓᵀ (metrics, a `w_rl` advantage's company) and their hidden states,
        from one forward per teacher."""
        names = list(router.names)
        B, T = batch.completion_ids.shape
        dev = batch.completion_ids.device
        index = torch.zeros(B, dtype=torch.long, device=dev)
        pos = torch.zeros(B, dtype=torch.long, device=dev)
        out = cls(index, pos, names)
        cm = batch.completion_mask.bool()
        routed, states = router.hidden(batch, visit)
        for name, (rows, h, head) in states.items():
            index[rows] = names.index(name)
            pos[rows] = torch.arange(rows.numel(), device=dev)
            m = cm[rows]
            out.hidden[name] = h.new_zeros(m.shape + (h.shape[-1],)).masked_scatter(m.unsqueeze(-1), h)
            out.heads[name] = head
        return routed, out

    def divergence(self, student_hidden: torch.Tensor, student_head, s_transform, rows: list[int], mask: torch.Tensor,
                   beta: float) -> torch.Tensor:
        """Sum over the micro-batch's real positions of JSD_β(teacher ‖ student) over the whole vocabulary.
        `student_hidden [N,H]` row-major over `mask [b,t]` (the micro-batch's rows)."""
        b, t = mask.shape
        hs = student_hidden.new_zeros((b, t, student_hidden.shape[-1])).masked_scatter(mask.unsqueeze(-1),
                                                                                        student_hidden)
        rows_t = torch.as_tensor(rows, device=mask.device)
        total = student_hidden.sum() * 0.0  # connected to the graph when no teacher has a row here
        for k, name in enumerate(self.names):
            sel = (self.index[rows_t] == k).nonzero().squeeze(-1)
            if not sel.numel():
                continue
            m = mask[sel]
            head = self.heads[name]
            h_t = self.hidden[name][self.pos[rows_t[sel]], :t][m]
            div = alg.full_vocab_divergence(
                hs[sel][m], student_head.weight, h_t, head.weight, beta, student_bias=student_head.bias,
                teacher_bias=head.bias, student_scale=s_transform.scale, teacher_scale=head.scale,
                student_softcap=s_transform.softcap, teacher_softcap=head.softcap,
                student_temperature=s_transform.temperature, teacher_temperature=head.temperature)
            total = total + div.sum().to(total.dtype)
        return total


def dense_candidates(model, batch: RolloutBatch, router, *, kind: str, k: int, temperature: float, impl: str,
                     micro_batch_size: int | None, amp, packed: bool, visit=None):
    """Candidates of the dense top-K reverse KL and everybody's log-probs of them, before the update.

    `student`: one no-grad student pass gives its top-K and their log-probs (the old policy of every slot); the
    teachers score those ids. When the sampler recorded the same top-K while it drew the batch
    (`RolloutBatch.top_logprobs`, the same weights: the policy that sampled is the one being updated), that pass
    is skipped — the one forward the dense objective added to the sampled-token one's step. `teacher`: the
    teachers' top-K, then a student pass over the slots. `union`: both (two student passes).
    Returns `(routed, slot_ids, kd_valid, rl_slot, old_logp [B,T,S], teacher_logp [B,T,S])`.
    """
    def student(**kw):
        with torch.no_grad(), amp():
            return score_completions(model, batch, temperature, impl=impl, micro_batch_size=micro_batch_size,
                                     packed=packed, **kw)

    s = None
    if kind in ("student", "union"):
        s = (batch.top_logprobs(k) if kind == "student" else None) or student(top_k=k)
    routed = router.score(batch, top_k=k if kind in ("teacher", "union") else 0, visit=visit,
                          support_ids=None if s is None else s.topk_ids)
    parts_ids, parts_t = [], []
    if s is not None:
        parts_ids.append(s.topk_ids)
        parts_t.append(routed.support_logp)
    if kind in ("teacher", "union"):
        parts_ids.append(routed.topk_ids)
        parts_t.append(routed.topk_logp)
    cand = torch.cat(parts_ids, -1)
    slot_ids, kd_valid, rl_slot = alg.candidate_slots(cand, batch.completion_ids)
    teacher = torch.cat(parts_t + [routed.logp.unsqueeze(-1)], -1).float()
    if kind == "student":  # the scan that found the top-K also scored them and the sampled token
        old = torch.cat([s.topk_logp, s.logp.unsqueeze(-1)], -1)
    else:
        old = student(support_ids=slot_ids).support_logp
    cm = batch.completion_mask.bool().unsqueeze(-1)
    old = torch.where(cm, old.float(), torch.zeros_like(teacher))
    return routed, slot_ids, kd_valid, rl_slot, old, teacher


def sampled_teacher_logp(routed, batch: RolloutBatch, mask) -> torch.Tensor:
    """ℓᵀ of the sampled tokens as the sampled-token advantage uses it: the routed scores, with the spans of a
    teacher of another tokenizer (exact only as sums) re-split so each of their tokens gets the span's mean gap
    (`alg.spread_span_gaps`). Done here, after the score cache: the split depends on this step's ℓ^old."""
    if routed.span_cut is None:
        return routed.logp
    return alg.spread_span_gaps(routed.logp, batch.behaviour_logp, routed.span_cut, mask)


def kd_plan(cfg: PolicyLoopConfig, conflict: str, nats: float, routed, dense, batch: RolloutBatch, mask, adv,
             group_ids, names: list[str], gaps):
    """The step's advantage with the distillation term as a `KDPlan` (dense top-K, reward refresh,
    gap-following, teacher conflict): `(advantage [B,T] or [B,T,S], plan, metrics, running gaps)`. `adv` holds the
    GRPO part `[B,T]`."""
    m: dict[str, float] = {}
    n_tok = mask.sum().clamp(min=1)
    if dense is not None:
        slot_ids, kd_valid, rl_slot, old, teacher = dense
        anchor = old[..., -1]  # the student's log-prob of the sampled token before the update
    else:
        teacher, anchor = sampled_teacher_logp(routed, batch, mask), batch.behaviour_logp
    keep = torch.ones_like(mask)
    if conflict != "none":
        tnames = list(routed.per_teacher)
        per = torch.stack([routed.per_teacher[n][1] for n in tnames])  # mixture: every teacher scored every row
        hit, pick = alg.teacher_conflict(per, anchor, mask, nats)
        if conflict == "mask":
            keep = keep * (~hit).to(keep.dtype)
        elif dense is not None:  # the picked teacher's log-probs of every slot
            per_s = torch.stack([torch.cat([routed.per_teacher_support[n], routed.per_teacher[n][1].unsqueeze(-1)], -1)
                                 for n in tnames]).to(teacher.dtype)
            chosen = per_s.gather(0, pick[None, ..., None].expand((1,) + per_s.shape[1:]))[0]
            teacher = torch.where(hit.unsqueeze(-1), chosen, teacher)
        else:
            teacher = torch.where(hit, per.gather(0, pick[None])[0], teacher)
        m["conflict/frac"] = float(hit.sum() / n_tok)
    if dense is not None:
        a_kd = alg.topk_rkl_advantages(old, teacher, kd_valid, mask, cfg.kd_clip)
    else:
        a_kd = alg.reverse_kl_advantages(teacher, batch.behaviour_logp, mask, clip=cfg.kd_clip)
    m["adv/kd_mean"] = float(((a_kd.sum(-1) if dense is not None else a_kd) * mask).sum() / n_tok)
    scale = torch.ones_like(mask)
    if cfg.gap_following:
        g = alg.domain_gaps(a_kd, group_ids, mask, len(names))
        gaps = alg.ema_gaps(gaps, g.tolist(), cfg.gap_momentum)
        scales = alg.gap_scales(gaps, *cfg.gap_clip)
        scale = torch.tensor(scales, dtype=mask.dtype, device=mask.device)[group_ids].unsqueeze(-1).expand_as(mask)
        for n, gm, sc in zip(names, gaps, scales):
            if gm is not None:
                m[f"gap/m/{n}"], m[f"gap/scale/{n}"] = gm, sc
    factor = cfg.w_kd * scale * keep  # exactly w_kd where no scale or conflict applies
    if dense is None:  # a bridged teacher's raw scores (conflict is refused with it): re-split per use
        raw = routed.logp if routed.span_cut is not None else teacher
        plan = KDPlan(False, raw, factor, adv, cfg.kd_clip, cfg.reward_refresh, span_cut=routed.span_cut)
        return adv + factor * a_kd, plan, m, gaps
    rl_adv = rl_slot.to(adv.dtype) * adv.unsqueeze(-1)  # the GRPO outcome term on the sampled token's slot only
    plan = KDPlan(True, teacher, factor, rl_adv, cfg.kd_clip, cfg.reward_refresh, slot_ids, old, kd_valid,
                     kd_valid | rl_slot)
    m["kd/candidates_per_token"] = float((kd_valid & mask.bool().unsqueeze(-1)).sum() / n_tok)
    return rl_adv + factor.unsqueeze(-1) * a_kd, plan, m, gaps


def restore_gaps(metrics_path: Path, names: list[str]) -> list[float | None]:
    """The running per-domain gaps `gap/m/<domain>` of the last step in metrics.jsonl (already cut back to the
    checkpoint on resume), so a resumed run continues the same EMA."""
    rows = read_metrics(metrics_path)
    last = rows[-1] if rows else None
    if not last:
        return [None] * len(names)
    return [last.get(f"gap/m/{n}") for n in names]
