"""Advantages: GRPO group-normalised rewards, sampled-token reverse-KL distillation, their combination.

Every advantage is stop-gradient: the functions run under ``torch.no_grad()`` and return detached tensors.
They compute in the input's floating dtype, on the input's device, and never move tensors between devices.

Shapes: ``B`` samples, ``T`` completion positions. ``mask`` is ``[B, T]`` (bool or 0/1 numbers); a position is
scored when ``mask != 0``.
"""

from __future__ import annotations

import torch

__all__ = ["grpo_advantages", "reverse_kl_advantages", "spread_span_gaps", "combine_advantages"]


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


@torch.no_grad()
def grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages, one per sample: ``A = (r − mean_g r) / (std_g r + eps)``.

    Args:
        rewards: ``[N]``; consecutive blocks of ``group_size`` samples share a prompt (``N = P · group_size``).
            Integer/bool rewards are computed in ``torch.get_default_dtype()``; floats in their own dtype.
        group_size: ``G ≥ 1`` samples per prompt.
        scale_by_std: divide by ``std_g + eps`` (GRPO); ``False`` gives ``r − mean_g r`` (Dr. GRPO style).
        eps: added to the std before dividing.

    ``std_g`` is the *unbiased* (Bessel-corrected, ``correction=1``) standard deviation of the group, the
    ``torch.std`` default that TRL and verl use. A group whose rewards are all equal gets exactly 0 (also when
    rounding makes its mean differ from its members); ``group_size == 1`` therefore always gives 0.

    Returns:
        ``[N]`` detached advantages, dtype of ``rewards`` (or the default float dtype), same device.

    Raises:
        ValueError: ``group_size < 1``, ``rewards`` not 1-D, or ``N`` not a multiple of ``group_size``.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.numel()
    if n % group_size != 0:
        raise ValueError(f"len(rewards)={n} is not a multiple of group_size={group_size}")
    r = rewards.detach()
    if not r.is_floating_point():
        r = r.to(torch.get_default_dtype())
    g = r.view(-1, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    constant = (g.amax(dim=1, keepdim=True) == g.amin(dim=1, keepdim=True))
    adv = torch.where(constant, torch.zeros_like(centred), centred)
    return adv.reshape(n)


@torch.no_grad()
def reverse_kl_advantages(
    teacher_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = None,
) -> torch.Tensor:
    """Sampled-token reverse-KL distillation advantage ``A^D_t = clip(ℓᵀ_t − ℓ^old_t, −c, c)``.

    Args:
        teacher_logp: ``[B, T]`` teacher log-prob of each sampled token (routed or mixed).
        behaviour_logp: ``[B, T]`` log-prob of the same token under the policy that sampled it.
        mask: ``[B, T]``; unscored positions come out exactly ``0`` whatever the inputs hold there
            (``-inf``/``nan`` included — masking uses ``torch.where``, not multiplication).
        clip: ``c > 0`` or ``None`` (no clipping; then an unmasked ``ℓᵀ = −inf`` gives ``−inf``).

    Returns:
        ``[B, T]`` detached advantages in the inputs' dtype. Its negation, averaged over tokens, is the usual
        per-token estimate of ``KL(π_old ‖ π_T)`` on the sampled tokens.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}")
    diff = teacher_logp.detach() - behaviour_logp.detach()
    if clip is not None:
        diff = diff.clamp(min=-clip, max=clip)
    return torch.where(_as_bool_mask(mask), diff, torch.zeros_like(diff))


@torch.no_grad()
def spread_span_gaps(
    teacher_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    span_end: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """ℓᵀ re-split inside spans whose teacher log-prob is exact only as a sum (a teacher with another tokenizer):
    each of a span's ``n`` tokens gets ``ℓ^old_t + (Σ_span ℓᵀ − Σ_span ℓ^old) / n``, so its sampled-token
    advantage ``ℓᵀ − ℓ^old`` is the span's mean gap. Without it a token whose teacher log-prob was charged to a
    later token (``ℓᵀ = 0``) gets ``−ℓ^old > 0``: whatever was sampled inside the span is reinforced and the span's
    last token carries the whole gap.

    Args:
        teacher_logp, behaviour_logp: ``[B, T]``.
        span_end: ``[B, T]`` bool, True at each span's last token (a one-token span: True there; the row's last
            scored token must be one).
        mask: ``[B, T]``; masked positions are in no span and come out ``0``.

    Returns:
        ``[B, T]`` detached, in ``teacher_logp``'s dtype; every span's sum equals ``Σ_span ℓᵀ`` (up to rounding) and
        one-token spans are returned unchanged.
    """
    m = _as_bool_mask(mask)
    zero = torch.zeros_like(teacher_logp)
    t = torch.where(m, teacher_logp.detach(), zero)
    s = torch.where(m, behaviour_logp.detach().to(t.dtype), zero)
    ends = (span_end.bool() & m).long()
    span = ends.cumsum(-1) - ends  # a position's span: the number of span ends before it (≤ its index)
    gap = zero.scatter_add(1, span, t - s)
    n = zero.scatter_add(1, span, m.to(t.dtype))
    spread = s + (gap / n.clamp(min=1)).gather(1, span)
    return torch.where(m & (n.gather(1, span) > 1), spread, t)  # a one-token span: ℓᵀ itself, bit for bit


@torch.no_grad()
def combine_advantages(
    rl_advantages: torch.Tensor | None,
    kd_advantages: torch.Tensor | None,
    mask: torch.Tensor,
    w_rl: float = 1.0,
    w_kd: float = 1.0,
) -> torch.Tensor:
    """Combined per-token advantage ``A_t = w_rl · A^R + w_kd · A^D_t``.

    Args:
        rl_advantages: ``[B]`` (one per sample, broadcast over T), ``[B, T]``, or ``None`` (term omitted).
        kd_advantages: ``[B, T]`` or ``None`` (term omitted).
        mask: ``[B, T]``; masked positions are exactly 0.
        w_rl, w_kd: weights of the two terms.

    Returns:
        ``[B, T]`` detached advantages (dtype of the first given term; zeros of the default dtype if both are
        ``None``).
    """
    bmask = _as_bool_mask(mask)
    total: torch.Tensor | None = None
    if rl_advantages is not None:
        a = rl_advantages.detach()
        if a.dim() == 1:
            a = a.unsqueeze(-1)
        total = w_rl * a.expand(bmask.shape)
    if kd_advantages is not None:
        d = w_kd * kd_advantages.detach()
        total = d if total is None else total + d.to(total.dtype)
    if total is None:
        total = torch.zeros(bmask.shape, device=bmask.device)
    return torch.where(bmask, total, torch.zeros_like(total))
