"""Token-share balancing (``mopd.balance: none | tokens``).

With a token-mean loss, a domain with short answers holds few of the batch's tokens and so little of the loss
(Open-MOPD: instruction following had 20% of the prompts but ~1% of the tokens). Token-share weights rescale
each group's tokens so that its share of the total weight equals its share of samples (or a given target
share), while the weights still sum to the number of unmasked tokens, so the loss scale is unchanged.

For group ``g`` with ``n_g`` unmasked tokens and target share ``s_g`` (over the groups that have tokens,
renormalised to sum 1), every unmasked token of ``g`` gets weight ``w_g = s_g · N / n_g`` where
``N = Σ_g n_g``. Then ``Σ_g n_g w_g = N`` and group ``g``'s share of it is ``s_g``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["BALANCE_KINDS", "token_share_weights", "balance_weights"]

BALANCE_KINDS = ("none", "tokens")


@torch.no_grad()
def token_share_weights(
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    prompt_share: Mapping[int, float] | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-token weights that give each group its target share of a token-mean loss.

    Args:
        group_ids: ``[B]`` integer group (teacher/domain) of each sample; any integer values.
        mask: ``[B, T]``; positions with ``mask != 0`` are scored tokens.
        prompt_share: target share per group id: a mapping ``{group_id: share}`` or a 1-D tensor indexed by
            group id. Shares must be non-negative; they are renormalised over the groups present in the batch
            that have tokens. ``None``: each group's share of the batch's samples.
        dtype: output dtype; default ``mask``'s dtype if floating, else ``torch.get_default_dtype()``.

    Returns:
        ``[B, T]`` detached weights on ``mask``'s device: 0 at masked positions; constant within a group; summing
        to the number of unmasked tokens (all zeros when there are none). Groups without tokens are dropped
        and the other groups' shares renormalised.

    Raises:
        ValueError: bad shapes; a group in the batch missing from ``prompt_share``; a negative share; or every
            group that has tokens having target share 0.
    """
    if group_ids.dim() != 1 or mask.dim() != 2 or group_ids.shape[0] != mask.shape[0]:
        raise ValueError(
            f"group_ids must be [B] and mask [B, T]; got {tuple(group_ids.shape)}, {tuple(mask.shape)}"
        )
    if dtype is None:
        dtype = mask.dtype if mask.is_floating_point() else torch.get_default_dtype()
    bmask = mask if mask.dtype == torch.bool else mask != 0
    out = torch.zeros(bmask.shape, dtype=dtype, device=bmask.device)
    if bmask.numel() == 0:
        return out

    uniq, inverse = torch.unique(group_ids, return_inverse=True)  # inverse: [B] -> index into uniq
    n_groups = uniq.shape[0]
    tokens_per_sample = bmask.sum(dim=1).to(dtype)  # [B]
    tokens = torch.zeros(n_groups, dtype=dtype, device=bmask.device).index_add_(0, inverse, tokens_per_sample)
    if prompt_share is None:
        share = torch.zeros(n_groups, dtype=dtype, device=bmask.device).index_add_(
            0, inverse, torch.ones_like(tokens_per_sample)
        )
    elif isinstance(prompt_share, torch.Tensor):
        table = prompt_share.detach()
        ids = uniq.long()
        if table.dim() != 1 or bool((ids < 0).any()) or bool((ids >= table.shape[0]).any()):
            raise ValueError(
                f"prompt_share tensor must be 1-D and indexed by group id; ids {uniq.tolist()} do not fit "
                f"shape {tuple(table.shape)}"
            )
        share = table[ids].to(dtype)
    else:
        ids = uniq.tolist()
        missing = [g for g in ids if g not in prompt_share]
        if missing:
            raise ValueError(f"prompt_share has no entry for group ids {missing}")
        share = torch.tensor([float(prompt_share[g]) for g in ids], dtype=dtype, device=bmask.device)
    if bool((share < 0).any()) or not bool(torch.isfinite(share).all()):
        raise ValueError("prompt_share values must be finite and non-negative")

    share = torch.where(tokens > 0, share, torch.zeros_like(share))  # drop groups without tokens
    total_share = share.sum()
    total_tokens = tokens.sum()
    if float(total_tokens) == 0:
        return out
    if float(total_share) <= 0:
        raise ValueError("every group that has tokens has target share 0")
    share = share / total_share
    per_group = torch.where(tokens > 0, share * total_tokens / tokens.clamp(min=1), torch.zeros_like(share))
    per_sample = per_group[inverse]  # [B]
    return torch.where(bmask, per_sample.unsqueeze(-1).expand(bmask.shape), out)


def balance_weights(
    kind: str,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    prompt_share: Mapping[int, float] | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Token weights for the policy loss by balancing mode.

    Args:
        kind: ``"none"`` → ``None`` (plain token mean); ``"tokens"`` → :func:`token_share_weights`.
        group_ids, mask, prompt_share: as in :func:`token_share_weights`.

    Returns:
        ``None`` or ``[B, T]`` weights to pass as ``policy_loss(..., token_weights=...)``.
    """
    if kind == "none":
        return None
    if kind == "tokens":
        return token_share_weights(group_ids, mask, prompt_share=prompt_share)
    raise ValueError(f"unknown balance kind {kind!r}; allowed: {', '.join(BALANCE_KINDS)}")
