"""One vLLM sampling request per sample, shared by the in-process (`engines.VllmRollout`) and the served
(`served.ServedRollout`) student engines: its `SamplingParams` and its seed."""

from __future__ import annotations

from typing import Sequence

import torch


def sampling_kwargs(*, max_new_tokens: int, temperature: float, top_p: float, greedy: bool, seed: int,
                    stop_ids: Sequence[int], top_k: int = 0, min_p: float = 0.0) -> dict:
    """The `vllm.SamplingParams` of one request: one sample, behaviour log-prob of the sampled token, every stop
    id (vLLM keeps the stop token in the output, like `HFRollout`'s mask), no detokenisation. top_k / min_p are
    passed only when set (vLLM's "off" value of top_k changed from -1 to 0 across versions)."""
    kw = dict(n=1, max_tokens=max_new_tokens, temperature=0.0 if greedy else temperature,
              top_p=1.0 if greedy else top_p, seed=seed, logprobs=0, stop_token_ids=list(stop_ids),
              detokenize=False)
    if top_k > 0 and not greedy:
        kw["top_k"] = int(top_k)
    if min_p > 0.0 and not greedy:
        kw["min_p"] = float(min_p)
    return kw


def request_seeds(n: int, generator: torch.Generator | None) -> list[int]:
    """One seed per request, drawn from `generator` in example order (vLLM samples each from its own stream)."""
    if generator is None:
        return torch.randint(0, 2**31 - 1, (n,)).tolist()
    return torch.randint(0, 2**31 - 1, (n,), generator=generator, device=generator.device).tolist()
