"""The policy loss (DESIGN §3): PPO-clip, token-mean over every unmasked token of the batch.

``ρ_t = exp(log π_θ(y_t|·) − ℓ^old_t)``,
``L = −Σ_t w_t · min(ρ_t A_t, clip(ρ_t, 1 − ε_lo, 1 + ε_hi) A_t) / N_tokens``
with ``w_t`` optional token weights (token-share balancing, truncated importance weights) and ``N_tokens`` the
number of unmasked tokens. Gradient flows only through ``logp``.
"""

from __future__ import annotations

import torch

__all__ = ["policy_loss", "LOG_RATIO_LIMIT"]

#: ``log ρ`` is clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` (as verl does) so a stale or broken token cannot
#: overflow to ``inf`` (and ``inf · 0 = nan``). Beyond it the ratio is far outside any clip range.
LOG_RATIO_LIMIT = 20.0


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss with a token mean over the whole batch.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the current policy (requires grad).
        behaviour_logp: ``[B, T]`` log-probs under the policy that sampled them (treated as a constant).
        advantages: ``[B, T]``, or ``[B]`` broadcast over T (treated as a constant).
        mask: ``[B, T]``; positions with ``mask != 0`` count. Masked positions contribute exactly 0 to the loss
            and the gradient whatever the inputs hold there (``-inf``/``nan`` included).
        clip_low, clip_high: ``ε_lo, ε_hi`` — the ratio is clipped to ``[1 − ε_lo, 1 + ε_hi]``.
        token_weights: optional ``[B, T]`` multiplier of each token's loss before the sum (constant). The
            denominator stays the number of unmasked tokens; weights that sum to that count keep the scale.

    Returns:
        ``(loss, metrics)``: ``loss`` is a scalar in ``logp``'s dtype; with no unmasked token it is 0 and still
        has a (zero) gradient. ``metrics`` holds python floats, each over unmasked tokens (all 0.0 when there
        are none):

        - ``clip_frac``: fraction of tokens where the clipped term was the active one (strictly smaller than
          the unclipped term, so the clip changed the objective and the token's gradient is 0);
        - ``ratio_mean``, ``ratio_max``: of ``ρ``;
        - ``approx_kl``: the k3 estimator ``mean(ρ − 1 − log ρ)`` of ``KL(π_old ‖ π_θ)`` (non-negative,
          low variance; Schulman 2020);
        - ``loss``: the loss value.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    bmask = mask if mask.dtype == torch.bool else mask != 0
    if logp.shape != bmask.shape or behaviour_logp.shape != bmask.shape:
        raise ValueError(
            f"logp, behaviour_logp and mask must all be [B, T]; got {tuple(logp.shape)}, "
            f"{tuple(behaviour_logp.shape)}, {tuple(mask.shape)}"
        )
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand(bmask.shape)
    zero = torch.zeros_like(logp)

    # where (not multiply) keeps nan/-inf at masked positions out of value and gradient.
    log_ratio = torch.where(bmask, logp - behaviour_logp.detach().to(logp.dtype), zero)
    log_ratio = log_ratio.clamp(min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT)
    adv = torch.where(bmask, adv, zero)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(min=1.0 - clip_low, max=1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(bmask, token_weights.detach().to(logp.dtype), zero)
    per_token = torch.where(bmask, per_token, zero)
    n_tokens = bmask.sum()
    loss = per_token.sum() / n_tokens.clamp(min=1).to(logp.dtype)

    with torch.no_grad():
        n = n_tokens.clamp(min=1).to(logp.dtype)
        r = ratio.detach()
        lr = log_ratio.detach()
        clip_active = bmask & (clipped.detach() < unclipped.detach())
        if int(n_tokens) > 0:
            metrics = {
                "clip_frac": float(clip_active.sum().to(logp.dtype) / n),
                "ratio_mean": float(torch.where(bmask, r, zero).sum() / n),
                "ratio_max": float(r[bmask].max()),
                "approx_kl": float(torch.where(bmask, r - 1.0 - lr, zero).sum() / n),
                "loss": float(loss.detach()),
            }
        else:
            metrics = {"clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "approx_kl": 0.0, "loss": 0.0}
    return loss, metrics
