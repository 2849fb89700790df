"""Parameters bound to bucket storage (`weights.bind_to_buckets`) against the eager re-pack: after optimizer steps
the receiving side gets the same bytes, the parameters stay views of the buckets, and an update moves each byte
once (`refill_buckets` copies 0 bytes where bound, one fused copy per bucket where not). The CUDA IPC and HBM
timing of the same path is tests/device/perf_checks.py `handover`."""

from __future__ import annotations

import pytest
import torch

from mopd_core.weights import (SafetensorsTransport, SharedMemoryTransport, bind_to_buckets, buckets_bound,
                               pack_buckets, refill_buckets)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                            torch.nn.Linear(32, 16, bias=False), torch.nn.LayerNorm(16))
    m.add_module("half_head", torch.nn.Linear(16, 8).to(torch.bfloat16))  # a second dtype: its own buckets
    return m


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (4, 5), generator=g)
    h = model[:5](x)
    loss = h.pow(2).mean() + model.half_head(h.to(torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_adamw", "for_loop_adamw"])
def test_bound_parameters_train_like_unbound_ones_and_stay_views(foreach):
    ref, bound = _model(), _model()
    packed = bind_to_buckets(bound, bucket_bytes=2048)
    assert len(packed) > 2 and {b.layout.dtype for b in packed.buckets} == {"float32", "bfloat16"}
    assert buckets_bound(packed, bound)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=foreach) for m in (ref, bound)]
    for s in range(3):
        _step(ref, opts[0], s)
        _step(bound, opts[1], s)
    assert buckets_bound(packed, bound)  # optimizer.step() wrote in place: still views of the buckets
    views = packed.tensors()
    for n, p in ref.named_parameters():
        assert torch.equal(_bits(p), _bits(dict(bound.named_parameters())[n])), n  # the same training
        assert torch.equal(_bits(p), _bits(views[n])), n  # the buckets hold the current weights
    assert refill_buckets(packed, dict(bound.named_parameters())) == 0


def test_an_update_moves_each_byte_once_and_the_receiver_gets_the_eager_bytes(tmp_path):
    eager_model, bound_model = _model(), _model()
    packed = bind_to_buckets(bound_model, bucket_bytes=4096)
    total = packed.nbytes
    assert total == sum(p.numel() * p.element_size() for p in bound_model.parameters())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager_model, bound_model)]
    eager_tr, bound_tr = SharedMemoryTransport(tmp_path / "a"), SharedMemoryTransport(tmp_path / "b")
    eager_buckets = None
    try:
        for s in range(2):
            _step(eager_model, opts[0], s)
            _step(bound_model, opts[1], s)
            # eager: re-pack the parameters (a copy of every byte), then the transport's copy
            named = {n: p for n, p in eager_model.named_parameters()}
            if eager_buckets is None:
                eager_buckets = pack_buckets(named, 4096)
                repacked = total
            else:
                repacked = refill_buckets(eager_buckets, named)
            e_sent = eager_tr.send(eager_buckets)
            # bound: nothing to re-pack; the transport's copy is the only one
            b_repacked = refill_buckets(packed, dict(bound_model.named_parameters()))
            b_sent = bound_tr.send(packed)
            assert repacked == total and e_sent.report.bytes_copied == total  # 2 passes over the bytes
            assert b_repacked == 0 and b_sent.report.bytes_copied == total   # 1 pass
            e_got, b_got = SharedMemoryTransport().receive(e_sent.message), SharedMemoryTransport().receive(
                b_sent.message)
            assert e_got.report.bytes_copied == b_got.report.bytes_copied == 0
            assert set(e_got.tensors) == set(b_got.tensors) == {n for n, _ in bound_model.named_parameters()}
            for n, t in e_got.tensors.items():
                assert torch.equal(_bits(t), _bits(b_got.tensors[n])), n
    finally:
        eager_tr.release()
        bound_tr.release()


def test_unbinding_is_detected_and_refill_copies_once_per_bucket():
    model = _model()
    packed = bind_to_buckets(model, bucket_bytes=4096)
    model.float()  # a dtype cast gives the bf16 parameters new storage: they no longer live in the buckets
    assert not buckets_bound(packed, model)
    named = {n: p.to(torch.bfloat16) if n.startswith("half_head") else p for n, p in model.named_parameters()}
    copied = refill_buckets(packed, named)
    moved = sum(e.nbytes for b in packed.buckets for e in b.layout.entries if e.name.startswith("half_head"))
    assert copied == moved > 0
    for n, t in packed.tensors().items():
        assert torch.equal(_bits(t), _bits(named[n])), n


def test_bound_views_write_to_safetensors_without_a_clone(tmp_path):
    from safetensors.torch import load_file

    model = _model()
    bind_to_buckets(model, bucket_bytes=1 << 20)
    sd = {n: p.detach() for n, p in model.named_parameters()}  # views sharing one storage per dtype
    sent = SafetensorsTransport(tmp_path).send(sd)
    loaded = load_file(sent.message)
    assert set(loaded) == set(sd)
    for n, t in sd.items():
        assert loaded[n].dtype == t.dtype and torch.equal(_bits(loaded[n]), _bits(t)), n
