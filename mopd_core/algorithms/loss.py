"""The policy loss: PPO-clip, token-mean over every unmasked token of the batch.

``ρ_t = exp(log π_θ(y_t|·) − ℓ^old_t)``,
``L = −Σ_t w_t · min(ρ_t A_t, clip(ρ_t, 1 − ε_lo, 1 + ε_hi) A_t) / N_tokens``
with ``w_t`` optional token weights (token-share balancing, truncated importance weights) and ``N_tokens`` the
number of unmasked tokens. Gradient flows only through ``logp``.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; AReaL's decoupled loss) for
samples drawn by an older policy ``μ`` (asynchronous rollout, bounded staleness): with ``proximal_logp`` the
trainer's log-probs before this update (``π_prox``),

``ρ_t = exp(log π_θ − log π_prox)``, ``u_t = exp(log π_prox − log μ)`` (a constant),
``L = −Σ_t w_t · c(u_t) · min(ρ_t A_t, clip(ρ_t, 1 − ε_lo, 1 + ε_hi) A_t) / N_tokens``

— the trust region is around ``π_prox``, the off-policy gap is corrected by the importance weight, truncated
at ``C = is_cap``: ``c(u) = min(u, C)`` (``is_mode="truncate"``, truncated IS as verl's ``tis_imp_ratio_cap``)
or ``c(u) = u·[u ≤ C]`` (``is_mode="mask"``, as AReaL's ``behav_imp_weight_cap`` drops such tokens). With
``μ = π_prox`` (the synchronous loop) ``u = 1`` and it is the standard loss above.
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
    proximal_logp: torch.Tensor | None = None,
    is_cap: float | None = None,
    is_mode: str = "truncate",
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
        proximal_logp: optional ``[B, T]`` log-probs of the policy the trust region is around (decoupled PPO,
            module docstring); ``behaviour_logp`` then only enters the importance weight. None = ``behaviour_logp``.
        is_cap, is_mode: the importance weight's cap ``C`` (None = uncapped) and how it applies (``truncate`` |
            ``mask``); only with ``proximal_logp``.

    Returns:
        ``(loss, metrics)``: ``loss`` is a scalar in ``logp``'s dtype; with no unmasked token it is 0 and still
        has a (zero) gradient. ``metrics`` holds python floats, each over unmasked tokens (all 0.0 when there
        are none):

        - ``clip_frac``: fraction of tokens where the clipped term was the active one (strictly smaller than
          the unclipped term, so the clip changed the objective and the token's gradient is 0);
        - ``ratio_mean``, ``ratio_max``: of ``ρ``;
        - ``approx_kl``: the k3 estimator ``mean(ρ − 1 − log ρ)`` of ``KL(π_old ‖ π_θ)`` (non-negative,
          low variance; Schulman 2020);
        - ``loss``: the loss value;
        - with ``proximal_logp``: ``is_weight_mean`` (of ``c(u)``), ``is_capped_frac`` (tokens over the cap) and
          ``behaviour_kl`` (k3 estimate of ``KL(μ ‖ π_prox)``: how stale the samples are).
    """
    bmask = _checked_mask(logp, behaviour_logp, mask, clip_low, clip_high, proximal_logp, is_cap, is_mode)
    adv = advantages.detach().to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand(bmask.shape)
    zero = torch.zeros_like(logp)

    # where (not multiply) keeps nan/-inf at masked positions out of value and gradient.
    anchor = behaviour_logp if proximal_logp is None else proximal_logp
    log_ratio = torch.where(bmask, logp - anchor.detach().to(logp.dtype), zero)
    log_ratio = log_ratio.clamp(min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT)
    adv = torch.where(bmask, adv, zero)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = ratio.clamp(min=1.0 - clip_low, max=1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * torch.where(bmask, token_weights.detach().to(logp.dtype), zero)
    iw = None
    if proximal_logp is not None:
        iw = _importance_weight(proximal_logp, behaviour_logp, bmask, zero, is_cap, is_mode)
        per_token = per_token * torch.where(bmask, iw[0], zero)
    per_token = torch.where(bmask, per_token, zero)
    n_tokens = bmask.sum()
    loss = per_token.sum() / n_tokens.clamp(min=1).to(logp.dtype)
    with torch.no_grad():
        clip_active = bmask & (clipped.detach() < unclipped.detach())
        metrics = _loss_metrics(loss, ratio.detach(), log_ratio.detach(), clip_active, bmask, n_tokens, zero, iw)
    return loss, metrics


def _checked_mask(logp, behaviour_logp, mask, clip_low, clip_high, proximal_logp, is_cap, is_mode) -> torch.Tensor:
    """The boolean mask, after the arguments' checks (one ValueError naming the argument)."""
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
    if is_mode not in ("truncate", "mask"):
        raise ValueError(f"is_mode must be 'truncate' or 'mask', got {is_mode!r}")
    if is_cap is not None and not is_cap > 0:
        raise ValueError(f"is_cap must be > 0 (or None), got {is_cap}")
    bmask = mask if mask.dtype == torch.bool else mask != 0
    if logp.shape != bmask.shape or behaviour_logp.shape != bmask.shape:
        raise ValueError(
            f"logp, behaviour_logp and mask must all be [B, T]; got {tuple(logp.shape)}, "
            f"{tuple(behaviour_logp.shape)}, {tuple(mask.shape)}"
        )
    if proximal_logp is not None and proximal_logp.shape != bmask.shape:
        raise ValueError(f"proximal_logp must be [B, T] like logp; got {tuple(proximal_logp.shape)}")
    return bmask


def _importance_weight(proximal_logp, behaviour_logp, bmask, zero, is_cap, is_mode):
    """Decoupled PPO's ``c(u)`` with ``u = π_prox/μ`` (a constant): ``(c(u), over the cap, log u)``."""
    log_u = torch.where(bmask, (proximal_logp - behaviour_logp).detach().to(zero.dtype), zero)
    u = torch.exp(log_u.clamp(min=-LOG_RATIO_LIMIT, max=LOG_RATIO_LIMIT))
    over = bmask & (u > is_cap) if is_cap is not None else torch.zeros_like(bmask)
    if is_cap is not None:
        u = torch.where(over, u.new_tensor(is_cap) if is_mode == "truncate" else zero, u)
    return u, over, log_u


def _loss_metrics(loss, r, lr, clip_active, bmask, n_tokens, zero, iw) -> dict[str, float]:
    """`policy_loss`'s metrics, each over the unmasked tokens (0.0 without any)."""
    n = n_tokens.clamp(min=1).to(zero.dtype)
    if int(n_tokens) == 0:
        metrics = {"clip_frac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "approx_kl": 0.0, "loss": 0.0}
        if iw is not None:
            metrics.update({"is_weight_mean": 0.0, "is_capped_frac": 0.0, "behaviour_kl": 0.0})
        return metrics
    metrics = {
        "clip_frac": float(clip_active.sum().to(zero.dtype) / n),
        "ratio_mean": float(torch.where(bmask, r, zero).sum() / n),
        "ratio_max": float(r[bmask].max()),
        "approx_kl": float(torch.where(bmask, r - 1.0 - lr, zero).sum() / n),
        "loss": float(loss.detach()),
    }
    if iw is not None:
        u, over, log_u = iw
        metrics.update({
            "is_weight_mean": float(torch.where(bmask, u, zero).sum() / n),
            "is_capped_frac": float(over.sum().to(zero.dtype) / n),
            # k3 of KL(μ ‖ π_prox) with the ratio π_prox/μ, before the cap
            "behaviour_kl": float(torch.where(bmask, log_u.exp() - 1.0 - log_u, zero).sum() / n),
        })
    return metrics
