"""The published MOPD objectives beyond the sampled-token reverse KL (docs/objectives.md).

- Dense top-K reverse KL (Open-MOPD, arXiv 2608.19098, Algorithm 1; `training/verl` of BytedTsinghua-SIA/
  Open-MOPD, ``top_k_strategy=only_stu``): per position a candidate set ``C_t`` (the student's top-K, the
  teacher's top-K or their union), the per-candidate reward
  ``r_t(k) = sg(clip(ℓᵀ(k) − ℓˢ(k))) · p̃ˢ(k)`` with ``p̃ˢ`` the student's probabilities renormalised over
  ``C_t``, and a PPO-clip term per candidate (its own ratio ``π_θ(k)/π_old(k)``) summed over the candidates;
  the GRPO outcome advantage sits only on the sampled token's slot. :func:`candidate_slots`,
  :func:`topk_rkl_advantages`, :func:`dense_policy_loss`.
- Gap-following (Open-MOPD's M2 "multiply" direction): a per-domain scale ``clip(m_d / mean(m), lo, hi)`` of
  the distillation advantage from the running per-domain teacher–student gap ``m_d``. :func:`domain_gaps`,
  :func:`ema_gaps`, :func:`gap_scales`.
- Teacher conflict in mixtures (Open-MOPD's M3, redefined on the sign of the teachers' advantages):
  :func:`teacher_conflict`.
- Exact full-vocabulary divergences (TRL GKD's ``JSD_β`` from both models' hidden states, chunked):
  :func:`full_vocab_divergence`.

Pure torch, stop-gradient where the docstrings say so, in the input's dtype on the input's device.
"""

from __future__ import annotations

import math

import torch

from .loss import LOG_RATIO_LIMIT

__all__ = ["CANDIDATE_KINDS", "CONFLICT_POLICIES", "candidate_slots", "topk_rkl_advantages", "dense_policy_loss",
           "domain_gaps", "ema_gaps", "gap_scales", "teacher_conflict", "full_vocab_divergence"]

CANDIDATE_KINDS = ("student", "teacher", "union")
CONFLICT_POLICIES = ("none", "mask", "consensus")


def _bool(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# --------------------------------------------------------------------------------------------- candidates


def candidate_slots(cand_ids: torch.Tensor, sampled_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slots of the dense loss: the candidates, then the sampled token.

    Args:
        cand_ids: ``[B, T, C]`` candidate ids (the student's or the teacher's top-K, or both side by side for the
            union: a repeated id counts once, at its first slot).
        sampled_ids: ``[B, T]`` the sampled tokens.

    Returns:
        ``(slot_ids [B, T, C+1], kd_valid [B, T, C+1], rl_slot [B, T, C+1])``: ``kd_valid`` marks the distinct
        candidates (never the last slot); ``rl_slot`` marks exactly one slot per position — the candidate equal to
        the sampled token if there is one, else the last slot (the sampled token itself), so the GRPO outcome
        term acts on the sampled token alone. A last slot that is neither (the sampled token is a candidate)
        carries no loss.
    """
    if cand_ids.dim() != 3 or cand_ids.shape[:2] != sampled_ids.shape:
        raise ValueError(f"cand_ids must be [B, T, C] over sampled_ids [B, T]; got {tuple(cand_ids.shape)}, "
                         f"{tuple(sampled_ids.shape)}")
    ids = cand_ids.long()
    C = ids.shape[-1]
    # first occurrence of each id along the candidates: no earlier slot holds the same id
    same = ids.unsqueeze(-1) == ids.unsqueeze(-2)  # [B,T,C,C]: same[..., i, j] = ids_i == ids_j
    earlier = torch.ones(C, C, dtype=torch.bool, device=ids.device).tril(-1)  # j < i
    first = ~(same & earlier).any(-1)
    hit = first & (ids == sampled_ids.long().unsqueeze(-1))  # at most one: only first occurrences count
    slot_ids = torch.cat([ids, sampled_ids.long().unsqueeze(-1)], -1)
    kd_valid = torch.cat([first, torch.zeros_like(first[..., :1])], -1)
    rl_slot = torch.cat([hit, ~hit.any(-1, keepdim=True)], -1)
    return slot_ids, kd_valid, rl_slot


def topk_rkl_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kd_valid: torch.Tensor,
                        mask: torch.Tensor, clip: float | None = None) -> torch.Tensor:
    """Open-MOPD's dense reward ``r_t(k) = clip(ℓᵀ_t(k) − ℓˢ_t(k), −c, c) · p̃ˢ_t(k)`` (stop-gradient).

    Args:
        student_logp: ``[B, T, S]`` the student's log-probs of the slots (full-vocabulary log-softmax values).
        teacher_logp: ``[B, T, S]`` the teacher's log-probs of the same ids.
        kd_valid: ``[B, T, S]`` the candidate slots; ``p̃ˢ = softmax(ℓˢ)`` over them.
        mask: ``[B, T]`` completion positions.
        clip: ``c`` (None = no clip), as ``mopd.kd_clip`` clips the sampled-token advantage.

    Returns:
        ``[B, T, S]``, exactly 0 off the candidates and at masked positions. With one candidate, the sampled
        token, it is the sampled-token reverse-KL advantage ``clip(ℓᵀ − ℓˢ)``.
    """
    with torch.no_grad():
        valid = _bool(kd_valid) & _bool(mask).unsqueeze(-1)
        s = student_logp.detach()
        zero = torch.zeros_like(s)
        gap = torch.where(valid, teacher_logp.detach().to(s.dtype) - s, zero)
        if clip is not None:
            gap = gap.clamp(-clip, clip)
        logits = torch.where(valid, s, torch.full_like(s, -math.inf))
        # a position without candidates (masked) gives an all -inf row: softmax would be nan there
        dead = ~valid.any(-1, keepdim=True)
        w = torch.softmax(torch.where(dead, zero, logits), dim=-1)
        return torch.where(valid, gap * w, zero)


def dense_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, slots: torch.Tensor,
                      mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
                      token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip per slot, summed over the slots, token mean over positions (Open-MOPD's loss on ``[B, T, K]``).

    ``L = −Σ_t w_t Σ_k [slot] · min(ρ_tk A_tk, clip(ρ_tk, 1 − ε_lo, 1 + ε_hi) A_tk) / N_tokens`` with
    ``ρ_tk = exp(ℓ_θ(k) − ℓ_old(k))``. With one slot per position it is :func:`~.loss.policy_loss`.

    Args:
        logp: ``[B, T, S]`` current log-probs of the slots (gradient flows here only).
        old_logp: ``[B, T, S]`` the log-probs of the policy before the update (constant).
        advantages: ``[B, T, S]`` (constant).
        slots: ``[B, T, S]`` which slots carry a loss (candidates ∪ the GRPO slot).
        mask: ``[B, T]`` completion positions; ``N_tokens`` counts them.
        token_weights: optional ``[B, T]`` (token-share balancing).

    Returns:
        ``(loss, metrics)`` — ``clip_frac``, ``ratio_mean``, ``approx_kl`` over the live slots; ``loss``.
    """
    bm = _bool(mask)
    live = _bool(slots) & bm.unsqueeze(-1)
    zero = torch.zeros_like(logp)
    log_ratio = torch.where(live, logp - old_logp.detach().to(logp.dtype), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    adv = torch.where(live, advantages.detach().to(logp.dtype), zero)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    per_slot = torch.where(live, -torch.minimum(unclipped, clipped), zero)
    per_token = per_slot.sum(-1)
    if token_weights is not None:
        per_token = per_token * torch.where(bm, token_weights.detach().to(logp.dtype), torch.zeros_like(per_token))
    loss = per_token.sum() / bm.sum().clamp(min=1).to(logp.dtype)
    with torch.no_grad():
        n = live.sum().clamp(min=1).to(logp.dtype)
        metrics = {"clip_frac": float((live & (clipped < unclipped)).sum() / n),
                   "ratio_mean": float(torch.where(live, ratio, zero).sum() / n),
                   "approx_kl": float(torch.where(live, ratio - 1.0 - log_ratio, zero).sum() / n),
                   "loss": float(loss.detach())}
    return loss, metrics


# ------------------------------------------------------------------------------------------ gap-following


def domain_gaps(kd_adv: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, n_groups: int) -> torch.Tensor:
    """``[n_groups]`` per-domain teacher–student gap of this batch: the mean over the domain's completion tokens of
    ``|Σ_k A^D_t(k)|`` (Open-MOPD's per-token reward magnitude, ``reward_abs_mean``); nan for a domain without
    tokens. ``kd_adv``: ``[B, T]`` (sampled token) or ``[B, T, S]`` (dense) distillation advantage."""
    with torch.no_grad():
        a = kd_adv.detach()
        a = a.sum(-1) if a.dim() == 3 else a
        bm = _bool(mask)
        per_row = torch.where(bm, a.abs(), torch.zeros_like(a)).sum(-1)
        tok = bm.sum(-1).to(a.dtype)
        g = group_ids.long()
        num = torch.zeros(n_groups, dtype=a.dtype, device=a.device).index_add_(0, g, per_row)
        den = torch.zeros(n_groups, dtype=a.dtype, device=a.device).index_add_(0, g, tok)
        return torch.where(den > 0, num / den.clamp(min=1), torch.full_like(num, math.nan))


def ema_gaps(running: list[float | None], batch: list[float], momentum: float) -> list[float | None]:
    """``m_d ← μ·m_d + (1 − μ)·g_d`` per domain; the first observation sets ``m_d = g_d``; a domain absent from the
    batch (``g_d`` nan) keeps its value."""
    out = []
    for m, g in zip(running, batch):
        if g is None or math.isnan(g):
            out.append(m)
        else:
            out.append(g if m is None else momentum * m + (1.0 - momentum) * g)
    return out


def gap_scales(running: list[float | None], lo: float, hi: float) -> list[float]:
    """Per-domain scale ``clip(m_d / mean(m), lo, hi)``, the mean over the domains with a gap so far; exactly 1.0
    for every domain when all known gaps are equal (so equal gaps leave the advantages bit for bit) and for a
    domain without a gap yet."""
    known = [m for m in running if m is not None]
    if not known or max(known) == min(known):
        return [1.0] * len(running)
    mean = sum(known) / len(known)
    if mean <= 0:
        return [1.0] * len(running)
    return [1.0 if m is None else min(max(m / mean, lo), hi) for m in running]


# ---------------------------------------------------------------------------------------- teacher conflict


def teacher_conflict(per_teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor,
                     nats: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a mixture's teachers pull the sampled token in opposite directions.

    Each teacher's advantage is ``a_k = ℓ_k − ℓˢ`` at the sampled token. A token is *in conflict* when the ``a_k``
    differ in sign and their spread ``max_k ℓ_k − min_k ℓ_k`` exceeds ``nats`` (Open-MOPD's M3 uses the spread
    alone; the sign condition keeps tokens where every teacher agrees on the direction, only not on the size).

    Returns:
        ``(conflict [B, T] bool (False at masked positions), pick [B, T] long)`` — ``pick`` the teacher whose
        advantage has the smallest magnitude (the most conservative signal; `consensus` uses its target there).
    """
    with torch.no_grad():
        a = per_teacher_logp.detach() - student_logp.detach().to(per_teacher_logp.dtype).unsqueeze(0)  # [K,B,T]
        pos, neg = (a > 0).any(0), (a < 0).any(0)
        spread = per_teacher_logp.amax(0) - per_teacher_logp.amin(0)
        conflict = pos & neg & (spread > nats) & _bool(mask)
        return conflict, a.abs().argmin(0)


# ------------------------------------------------------------------------------------ full-vocabulary JSD


def full_vocab_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                          teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, beta: float, *,
                          student_bias: torch.Tensor | None = None, teacher_bias: torch.Tensor | None = None,
                          student_scale: float = 1.0, teacher_scale: float = 1.0,
                          student_softcap: float | None = None, teacher_softcap: float | None = None,
                          student_temperature: float = 1.0, teacher_temperature: float = 1.0) -> torch.Tensor:
    """Per-token ``JSD_β`` over the whole vocabulary (β = 0 forward KL(T‖S), 1 reverse KL(S‖T), else the mixture
    ``M = β T + (1 − β) S`` — TRL GKD's definition, as :func:`~.distill.generalized_jsd`) from both models' final
    hidden states ``[N, H_s]``, ``[N, H_t]`` and their ``lm_head`` weights ``[V, H]``.

    TRL's ``ChunkedDivergenceFunction`` (the kernel of its ``DistillationTrainer``; a Triton kernel on CUDA/XPU,
    torch elsewhere) does the work on ``[4096 tokens × 32768 vocab]`` tiles, recomputed in backward: neither model's
    ``[N, V]`` logits exist. It takes one temperature for both models; a different teacher temperature folds into
    the logit scale (exact while no soft-capping sits between the scale and the temperature). The gradient flows to
    the student's hidden states and weight only. Returns ``[N]`` (float32).
    """
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    if student_temperature != teacher_temperature and (student_softcap is not None or teacher_softcap is not None):
        raise ValueError("different student/teacher temperatures with final_logit_softcapping cannot be folded into "
                         "the logit scale; use teachers.temperature = rollout.temperature")
    # fold both temperatures into the scales: scale → (no softcap) → /T is the same as (scale/T) → /1
    t = student_temperature
    if student_softcap is None and teacher_softcap is None:
        student_scale, teacher_scale, t = student_scale / student_temperature, teacher_scale / teacher_temperature, 1.0
    div, _ = ChunkedDivergenceFunction.apply(student_hidden, student_weight, student_bias, teacher_hidden.detach(),
                                             teacher_weight.detach(),
                                             None if teacher_bias is None else teacher_bias.detach(), float(beta), t,
                                             student_scale, student_softcap, teacher_scale, teacher_softcap)
    return div
