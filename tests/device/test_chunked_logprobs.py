"""`train.logprob_impl: chunked` on a real accelerator: TRL's `ChunkedLogProbFunction` (its Triton kernel on CUDA)
where TRL is installed, else our own tiles (the lent device image has no TRL) — log-probs, entropy, teacher top-k
and gradients against the full `[N,V]` float64 reference computed on the same device, at a real vocabulary
(151,936), plus the peak device memory of both paths (`max_memory_allocated`, recorded). The CPU equivalent is
`tests/unit/test_logprobs.py`."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from device_common import record, require

pytestmark = pytest.mark.device

N, H, V = 2048, 256, 151_936


def _peak(dev, fn):
    mod = torch.cuda if dev.type == "cuda" else torch.npu  # one of the two, by `require`
    mod.synchronize()
    mod.reset_peak_memory_stats()
    base = mod.memory_allocated()
    out = fn()
    mod.synchronize()
    return out, (mod.max_memory_allocated() - base) / 2**20


def test_chunked_equals_the_float64_reference_and_holds_less_memory():
    from mopd_core.algorithms.logprobs import LogitTransform, token_logprobs

    dev = torch.device(require())
    g = torch.Generator(device="cpu").manual_seed(0)
    h64 = torch.randn(N, H, generator=g, dtype=torch.float64).to(dev)
    w64 = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.05).to(dev)
    targets = torch.randint(0, V, (N,), generator=g).to(dev)
    tr = LogitTransform(0.7)
    h64.requires_grad_(True), w64.requires_grad_(True)
    lp64 = torch.log_softmax((h64 @ w64.t()) / tr.temperature, -1)
    ref = lp64.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(lp64.exp() * lp64).sum(-1).detach()
    ref_top = lp64.detach().topk(8, -1)
    ref.sum().backward()
    ref = ref.detach()
    del lp64
    res = {"trl": importlib.util.find_spec("trl") is not None, "device": dev.type}
    for impl in ("chunked", "full"):
        h = h64.detach().float().requires_grad_(True)
        w = w64.detach().float().requires_grad_(True)

        def step():
            out = token_logprobs(h, w, targets, tr, impl=impl, entropy=True)
            out.logp.sum().backward()
            return out

        out, mib = _peak(dev, step)
        with torch.no_grad():
            top = token_logprobs(h, w, targets, tr, impl=impl, top_k=8)
        scale = lambda x: x.double().abs().max().clamp(min=1)  # noqa: E731
        errs = {"logp": float((out.logp.detach().double() - ref).abs().max() / scale(ref)),
                "entropy": float((out.entropy.double() - ref_ent).abs().max() / scale(ref_ent)),
                "topk": float((top.topk_logp.double() - ref_top.values).abs().max() / scale(ref_top.values)),
                "grad_h": float((h.grad.double() - h64.grad).abs().max() / scale(h64.grad)),
                "grad_w": float((w.grad.double() - w64.grad).abs().max() / scale(w64.grad))}
        res[impl] = {"peak_mib": round(mib, 1), **errs}
        # TF32 may be on for fp32 matmuls on CUDA (relative ~1e-3 on the projection): 1e-3, not the CPU's 1e-6
        assert max(errs.values()) < 1e-3, (impl, errs)
    record("chunked_logprobs", **res)
    assert res["chunked"]["peak_mib"] * 4 < res["full"]["peak_mib"], res
