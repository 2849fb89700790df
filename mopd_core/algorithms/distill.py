"""Distillation signals: teacher mixtures, the top-k shared support, and the generalised JSD.

- :func:`mix_teacher_logprobs` — mixture routing of per-token teacher log-probs (arithmetic or geometric).
- :func:`topk_support` — student and teacher distributions restricted to {teacher top-k ∪ sampled token} plus
  one tail bucket holding the rest of the mass, so that both rows are proper distributions over the same support.
- :func:`generalized_jsd` — TRL-GKD's generalised Jensen–Shannon divergence ``JSD_β`` over such a support.

All functions are pure torch, compute in the input dtype on the input device, and are nan-free when some
entries have probability 0 (``-inf`` log-prob): every ``0 · log 0`` is guarded with ``torch.where`` on both the
value and the gradient path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["MIX_KINDS", "mix_teacher_logprobs", "topk_support", "support_from_gathered", "generalized_jsd"]

MIX_KINDS = ("arithmetic", "geometric")

_NEG_INF = float("-inf")


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


# ----------------------------------------------------------------------------------------------------- mixtures


def _normalised_weights(weights: torch.Tensor | Sequence[float], teacher_logps: torch.Tensor) -> torch.Tensor:
    """Validate and normalise mixture weights; return them shaped ``[K, B or 1, 1]`` to broadcast on ``[K,B,T]``."""
    k = teacher_logps.shape[0]
    if isinstance(weights, torch.Tensor):
        w = weights.detach().to(dtype=teacher_logps.dtype)
    else:
        w = torch.as_tensor(weights, dtype=teacher_logps.dtype, device=teacher_logps.device)
    if w.dim() == 1:
        if w.shape[0] != k:
            raise ValueError(f"weights has {w.shape[0]} entries but teacher_logps has K={k} teachers")
    elif w.dim() == 2:
        if w.shape != (teacher_logps.shape[1], k):
            raise ValueError(
                f"per-sample weights must be [B, K]={(teacher_logps.shape[1], k)}, got {tuple(w.shape)}"
            )
    else:
        raise ValueError(f"weights must be [K] or [B, K], got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("mixture weights must be finite")
    if bool((w < 0).any()):
        raise ValueError("mixture weights must be non-negative")
    total = w.sum(dim=-1, keepdim=True)
    if bool((total <= 0).any()):
        raise ValueError("mixture weights must not sum to 0 (for every row)")
    w = w / total
    if w.dim() == 1:
        return w.view(k, 1, 1)
    return w.transpose(0, 1).unsqueeze(-1)  # [K, B, 1]


def mix_teacher_logprobs(
    teacher_logps: torch.Tensor,
    weights: torch.Tensor | Sequence[float],
    kind: str,
) -> torch.Tensor:
    """Mix K teachers' per-token log-probs of the sampled tokens into one teacher log-prob.

    Args:
        teacher_logps: ``[K, B, T]`` log-prob of each sampled token under each teacher.
        weights: ``[K]`` (one mixture for the batch) or ``[B, K]`` (per sample), non-negative; normalised to sum
            to 1 along K. A non-tensor is created on ``teacher_logps``'s device; a tensor stays where it is
            (it must already be on that device).
        kind: ``"arithmetic"``: ``log Σ_k w_k p_k = logsumexp_k(log w_k + ℓ_k)`` (a teacher with ``w_k = 0``
            contributes nothing, whatever its ``ℓ_k``); ``"geometric"``: ``Σ_k w_k ℓ_k`` with ``0 · ℓ := 0``
            (so ``w_k = 0, ℓ_k = −inf`` is fine). The geometric mixture is an unnormalised log-density:
            it is not renormalised over the vocabulary (only the sampled tokens' scores are known).

    Returns:
        ``[B, T]`` mixed log-probs, dtype of ``teacher_logps``.

    Raises:
        ValueError: unknown ``kind``; weights of the wrong shape, negative, non-finite, or summing to 0.
    """
    if kind not in MIX_KINDS:
        raise ValueError(f"unknown mixture kind {kind!r}; allowed: {', '.join(MIX_KINDS)}")
    if teacher_logps.dim() != 3:
        raise ValueError(f"teacher_logps must be [K, B, T], got shape {tuple(teacher_logps.shape)}")
    w = _normalised_weights(weights, teacher_logps)
    active = (w > 0).expand_as(teacher_logps)
    if kind == "arithmetic":
        # log w_k = -inf for inactive teachers; the where keeps their ℓ_k (maybe nan) out of the sum entirely.
        safe_l = torch.where(active, teacher_logps, torch.zeros_like(teacher_logps))
        terms = torch.where(active, torch.log(w) + safe_l, torch.full_like(teacher_logps, _NEG_INF))
        # A position where every active term is -inf would give nan gradients in logsumexp; substitute 0 there.
        dead = torch.isneginf(terms).all(dim=0, keepdim=True)
        out = torch.logsumexp(torch.where(dead, torch.zeros_like(terms), terms), dim=0)
        return torch.where(dead.squeeze(0), torch.full_like(out, _NEG_INF), out)
    safe_l = torch.where(active, teacher_logps, torch.zeros_like(teacher_logps))
    return (w * safe_l).sum(dim=0)


# ------------------------------------------------------------------------------------------- top-k support


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x < 0``, accurate on both sides of ``−log 2`` (Mächler 2012)."""
    return torch.where(
        x > -math.log(2.0),
        torch.log(-torch.expm1(x)),
        torch.log1p(-torch.exp(x)),
    )


def topk_support(
    student_logp: torch.Tensor,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    sampled_ids: torch.Tensor | None = None,
    teacher_sampled_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probs over the shared support {teacher top-k ∪ sampled token} + a tail bucket.

    Args:
        student_logp: ``[B, T, V]`` student full-vocabulary log-probs (log-softmax of the logits; gradient flows
            through it).
        teacher_topk_ids: ``[B, T, k]`` int64 token ids of the teacher's top-k (valid ids in ``[0, V)``).
        teacher_topk_logp: ``[B, T, k]`` the teacher's log-probs of those tokens.
        sampled_ids: optional ``[B, T]`` sampled token ids; adds one slot per position.
        teacher_sampled_logp: ``[B, T]`` the teacher's log-prob of the sampled token; required with
            ``sampled_ids``.

    Returns:
        ``(student_support_logp, teacher_support_logp)``, both ``[B, T, S]`` with ``S = k (+1 if sampled) + 1``.
        Layout: ``[top-k..., sampled?, tail]``. When the sampled token is already in the top-k its extra slot
        is ``−inf`` on both sides (probability 0), so nothing is counted twice. The tail is
        ``log(1 − Σ p_listed)``, computed stably; its mass is floored at ``finfo(dtype).eps`` (a smaller
        remainder is below the precision of ``1 − Σ p``) and each row is then renormalised with a logsumexp,
        so every row sums to 1 — also when the listed mass reaches or exceeds 1 by rounding (then the listed
        entries are scaled down by at most that rounding error). The floor keeps the tail finite, so the
        forward KL never sees ``p_T > 0, p_S = 0`` in the tail and the gradient stays finite.
    """
    if student_logp.dim() != 3:
        raise ValueError(f"student_logp must be [B, T, V], got shape {tuple(student_logp.shape)}")
    if teacher_topk_ids.shape != teacher_topk_logp.shape or teacher_topk_ids.shape[:2] != student_logp.shape[:2]:
        raise ValueError(
            "teacher_topk_ids and teacher_topk_logp must both be [B, T, k] matching student_logp's [B, T]; got "
            f"{tuple(teacher_topk_ids.shape)}, {tuple(teacher_topk_logp.shape)}, {tuple(student_logp.shape)}"
        )
    ids = teacher_topk_ids.long()
    sampled = None if sampled_ids is None else student_logp.gather(-1, sampled_ids.long().unsqueeze(-1)).squeeze(-1)
    return support_from_gathered(student_logp.gather(-1, ids), sampled, ids, teacher_topk_logp, sampled_ids,
                                 teacher_sampled_logp)


def support_from_gathered(
    student_topk_logp: torch.Tensor,
    student_sampled_logp: torch.Tensor | None,
    teacher_topk_ids: torch.Tensor,
    teacher_topk_logp: torch.Tensor,
    sampled_ids: torch.Tensor | None = None,
    teacher_sampled_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_support` from the student's log-probs already taken at the teacher's top-k ids ``[B, T, k]``
    (and at the sampled token ``[B, T]``), as a chunked scorer returns them without any ``[B, T, V]`` tensor."""
    if student_topk_logp.shape != teacher_topk_ids.shape or teacher_topk_ids.shape != teacher_topk_logp.shape:
        raise ValueError(
            "student_topk_logp, teacher_topk_ids and teacher_topk_logp must all be [B, T, k]; got "
            f"{tuple(student_topk_logp.shape)}, {tuple(teacher_topk_ids.shape)}, {tuple(teacher_topk_logp.shape)}"
        )
    ids = teacher_topk_ids.long()
    dtype = student_topk_logp.dtype
    s_list = [student_topk_logp]
    t_list = [teacher_topk_logp.detach().to(dtype)]
    if sampled_ids is not None:
        if teacher_sampled_logp is None or student_sampled_logp is None:
            raise ValueError("teacher_sampled_logp and the student's sampled log-prob [B, T] are required when "
                             "sampled_ids is given")
        samp = sampled_ids.long().unsqueeze(-1)  # [B, T, 1]
        in_topk = (ids == samp).any(dim=-1, keepdim=True)
        neg_inf = torch.full(samp.shape, _NEG_INF, dtype=dtype, device=student_topk_logp.device)
        t_samp = teacher_sampled_logp.detach().to(dtype).unsqueeze(-1)
        s_list.append(torch.where(in_topk, neg_inf, student_sampled_logp.unsqueeze(-1)))
        t_list.append(torch.where(in_topk, neg_inf, t_samp))
    return _with_tail(torch.cat(s_list, dim=-1)), _with_tail(torch.cat(t_list, dim=-1))


def _with_tail(listed: torch.Tensor) -> torch.Tensor:
    """Append the tail bucket ``log(1 − Σ exp(listed))`` (floored) and renormalise the row in log space."""
    eps = torch.finfo(listed.dtype).eps
    lse = torch.logsumexp(listed, dim=-1, keepdim=True)
    # Clamp before log1mexp (not after) so neither the value nor the gradient sees log(0).
    # (An all -inf row gives lse = -inf; the clamp keeps it, and log1mexp(-inf) = 0 with a zero gradient.)
    tail = _log1mexp(lse.clamp(max=math.log1p(-eps)))
    row = torch.cat([listed, tail], dim=-1)
    return row - torch.logsumexp(row, dim=-1, keepdim=True)


# -------------------------------------------------------------------------------------------------- JSD_β


def _kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``KL(P‖Q) = Σ_s p_s (log p_s − log q_s)`` over the last dim, with ``0 · (…) = 0`` on value and gradient.

    ``p_s > 0`` with ``q_s = 0`` gives ``+inf`` (the divergence is infinite there).
    """
    live = ~torch.isneginf(logp)
    zero = torch.zeros_like(logp)
    safe_p = torch.where(live, logp, zero)
    safe_q = torch.where(live, logq, zero)
    terms = torch.where(live, torch.exp(safe_p) * (safe_p - safe_q), zero)
    return terms.sum(dim=-1)


def generalized_jsd(
    student_logp: torch.Tensor,
    teacher_logp: torch.Tensor,
    beta: float,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Generalised Jensen–Shannon divergence ``JSD_β`` between teacher and student (TRL GKD's definition).

    Per position, with ``S`` = student and ``T`` = teacher rows over the same support:

    - ``β = 0``: forward KL ``KL(T‖S)``;
    - ``β = 1``: reverse KL ``KL(S‖T)``;
    - ``0 < β < 1``: ``β · KL(T‖M) + (1 − β) · KL(S‖M)`` with ``M = β T + (1 − β) S``,
      ``log M = logsumexp(log β + log T, log(1 − β) + log S)``.

    Args:
        student_logp: ``[B, T, S]`` student log-probs over the support (each row normalised); gradient flows here.
        teacher_logp: ``[B, T, S]`` teacher log-probs over the same support (treated as a constant).
        beta: ``0 ≤ β ≤ 1``.
        mask: ``[B, T]``; only positions with ``mask != 0`` count (whatever the rows hold elsewhere).

    Returns:
        Scalar: the mean of the per-position divergence over unmasked positions (0, with a zero gradient, when
        there are none). Entries with probability 0 (``−inf``) are handled without nan on value and gradient.
    """
    beta = float(beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if student_logp.shape != teacher_logp.shape or student_logp.dim() != 3:
        raise ValueError(
            f"student_logp and teacher_logp must both be [B, T, S]; got {tuple(student_logp.shape)}, "
            f"{tuple(teacher_logp.shape)}"
        )
    bmask = _as_bool_mask(mask)
    row_mask = bmask.unsqueeze(-1)
    # Masked rows may hold anything (nan, all -inf): replace them by a harmless finite row so that neither the
    # value nor the gradient picks up nan through them; they are dropped below anyway.
    s = torch.where(row_mask, student_logp, torch.zeros_like(student_logp))
    t = torch.where(row_mask, teacher_logp.detach().to(student_logp.dtype), torch.zeros_like(student_logp))
    if beta == 0.0:
        div = _kl_rows(t, s)
    elif beta == 1.0:
        div = _kl_rows(s, t)
    else:
        both_zero = torch.isneginf(s) & torch.isneginf(t)
        zero = torch.zeros_like(s)
        stacked = torch.stack(
            [
                torch.where(both_zero, zero, t) + math.log(beta),
                torch.where(both_zero, zero, s) + math.log1p(-beta),
            ]
        )
        log_m = torch.logsumexp(stacked, dim=0)
        log_m = torch.where(both_zero, torch.full_like(log_m, _NEG_INF), log_m)
        div = beta * _kl_rows(t, log_m) + (1.0 - beta) * _kl_rows(s, log_m)
    div = torch.where(bmask, div, torch.zeros_like(div))
    n = bmask.sum().clamp(min=1).to(div.dtype)
    return div.sum() / n
