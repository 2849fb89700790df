"""weights/: bucketing round trips bit-exact, transports hand over
the exact bits (in-process without a copy). Cross-process transports are in
tests/integration/test_weight_transports.py; CUDA IPC in tests/device/test_cuda_ipc.py."""

from __future__ import annotations


import pytest
import torch

from mopd_core.weights import (BucketError, InProcessTransport, SafetensorsTransport, SharedMemoryTransport,
                               TransportError, make_transport, pack_buckets, plan_buckets, single_tensor_buckets)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bit-exact comparison, NaN and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Mixed dtypes, special float values, non-contiguous inputs, a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 5, generator=g)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = float("nan"), float("inf"), -0.0, 1e-45  # NaN, inf, -0, denormal
    return {
        "w": w,
        "w_t": torch.randn(4, 7, generator=g).t(),                           # transposed (non-contiguous)
        "w_slice": torch.randn(8, 9, generator=g)[::2, 1::3],                # strided slice
        "bf": torch.randn(3, 11, generator=g).to(torch.bfloat16),
        "half": torch.randn(13, generator=g).to(torch.float16),
        "steps": torch.randint(-2**40, 2**40, (5,), generator=g, dtype=torch.int64),
        "mask": torch.rand(7, 3, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "i8": torch.randint(-128, 127, (9,), generator=g, dtype=torch.int8),
        "bf_t": torch.randn(5, 6, generator=g).to(torch.bfloat16).t(),
    }


# ---------------------------------------------------------------- bucketing

@pytest.mark.parametrize("bucket_bytes", [1, 16, 64, 100, 1 << 20])
def test_bucket_round_trip_bit_exact_mixed_dtypes(bucket_bytes):
    state = mixed_state()
    packed = pack_buckets(state, bucket_bytes)
    out = packed.tensors()
    assert list(out) != [] and set(out) == set(state)
    for name, t in state.items():
        assert same_bits(out[name], t), name
        assert out[name].is_contiguous()
    for b in packed.buckets:
        # one dtype per bucket, bounded size unless a single tensor is larger than the bound
        assert {e.dtype for e in b.layout.entries} == {b.layout.dtype}
        assert b.nbytes <= bucket_bytes or len(b.layout.entries) == 1
        # entries tile the buffer exactly, in order
        offs = [(e.offset, e.numel) for e in b.layout.entries]
        assert offs[0][0] == 0 and all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(offs, offs[1:]))
        assert sum(n for _, n in offs) == b.buffer.numel()


def test_bucket_views_are_zero_copy_and_grouping_is_by_dtype():
    state = mixed_state()
    packed = pack_buckets(state, 1 << 20)
    # one bucket per dtype when everything fits
    assert sorted(b.layout.dtype for b in packed.buckets) == sorted(
        {"float32", "bfloat16", "float16", "int64", "bool", "float64", "int8"})
    views = packed.tensors()
    f32 = next(b for b in packed.buckets if b.layout.dtype == "float32")
    start, end = f32.buffer.data_ptr(), f32.buffer.data_ptr() + f32.nbytes
    for e in f32.layout.entries:
        v = views[e.name]
        if v.numel():  # (an empty tensor has no address)
            assert v.data_ptr() == start + 4 * e.offset and v.data_ptr() < end
    f32.buffer.fill_(7.0)  # writing the buffer shows through every view: they share storage
    assert torch.all(views["w_t"] == 7.0) and torch.all(packed.get("w") == 7.0)


def test_bucket_greedy_split_and_oversize():
    f = torch.zeros  # 4-byte elements
    state = {"a": f(10), "b": f(10), "c": f(10), "big": f(100), "d": f(5)}
    lays = plan_buckets(((n, tuple(t.shape), t.dtype, t.device) for n, t in state.items()), bucket_bytes=80)
    assert [[e.name for e in lay.entries] for lay in lays] == [["a", "b"], ["c"], ["big"], ["d"]]
    assert [lay.nbytes for lay in lays] == [80, 40, 400, 20]
    with pytest.raises(BucketError, match="'big' \\(400 bytes\\) is larger than bucket_bytes=80"):
        plan_buckets([("big", (100,), torch.float32, "cpu")], 80, oversize="error")
    with pytest.raises(BucketError, match="positive"):
        pack_buckets(state, 0)
    with pytest.raises(BucketError, match="duplicate"):
        pack_buckets([("a", f(1)), ("a", f(2))])
    with pytest.raises(BucketError, match="no tensor named"):
        pack_buckets(state).get("nope")


def test_bucketing_200_tensor_model_uses_50x_fewer_handles():
    # a 200-tensor layout (22 Llama layers × 9 + embed + lm_head) on the meta device: no memory touched
    specs = [("embed_tokens.weight", (32000, 1024), torch.bfloat16, "meta")]
    for i in range(22):
        for n, s in [("q", (1024, 1024)), ("k", (256, 1024)), ("v", (256, 1024)), ("o", (1024, 1024)),
                     ("gate", (2816, 1024)), ("up", (2816, 1024)), ("down", (1024, 2816)),
                     ("in_norm", (1024,)), ("post_norm", (1024,))]:
            specs.append((f"layers.{i}.{n}.weight", s, torch.bfloat16, "meta"))
    specs.append(("lm_head.weight", (32000, 1024), torch.bfloat16, "meta"))
    assert len(specs) == 200
    lays = plan_buckets(specs, bucket_bytes=512 << 20)
    assert sum(len(lay.entries) for lay in lays) == 200
    assert 200 / len(lays) >= 50, len(lays)
    meta = {n: torch.empty(s, dtype=dt, device="meta") for n, s, dt, _ in specs}
    packed = pack_buckets(meta, 512 << 20)  # works on meta tensors too (shapes only)
    assert len(packed) == len(lays) and len(single_tensor_buckets(meta)) == 200


# ---------------------------------------------------------------- transfer plan

def test_inprocess_transport_zero_copy_same_storage():
    state = mixed_state()
    tr = InProcessTransport()
    sent = tr.send(state)
    got = tr.receive(sent.message)
    assert sent.report.bytes_copied == 0 and got.report.bytes_copied == 0
    assert sent.report.messages == len(state) and got.report.tensors == len(state)
    for n, t in state.items():
        assert got.tensors[n] is t or got.tensors[n].data_ptr() == t.data_ptr()
    packed = pack_buckets(state)
    got_b = tr.receive(tr.send(packed).message)
    assert got_b.report.bytes_copied == 0 and got_b.report.messages == len(packed)
    ptrs = {b.buffer.data_ptr() for b in packed.buckets}
    for n, t in got_b.tensors.items():
        assert same_bits(t, state[n])
        assert t.numel() == 0 or any(t.data_ptr() == b.buffer.data_ptr() + e.offset * b.buffer.element_size()
                                     for b in packed.buckets for e in b.layout.entries if e.name == n)
    assert ptrs  # buckets really existed


@pytest.mark.parametrize("bucketed", [True, False])
def test_safetensors_transport_round_trip(tmp_path, bucketed):
    state = mixed_state(1)
    payload = pack_buckets(state, 256) if bucketed else state
    tr = SafetensorsTransport(tmp_path)
    sent = tr.send(payload)
    got = SafetensorsTransport(tmp_path).receive(sent.message)
    assert set(got.tensors) == set(state)
    for n, t in state.items():
        assert same_bits(got.tensors[n], t), n
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert sent.report.bytes_copied == (tmp_path / "weights.safetensors").stat().st_size >= nbytes
    assert sent.report.messages == 1 and got.report.bytes_total == nbytes
    assert (got.buckets is not None) == bucketed
    with pytest.raises(TransportError, match="does not exist"):
        tr.receive(str(tmp_path / "missing.safetensors"))


def test_shared_memory_transport_same_process(tmp_path):
    state = mixed_state(2)
    packed = pack_buckets(state, 128)
    tr = SharedMemoryTransport(tmp_path / "shm")
    sent = tr.send(packed)
    segs = [s for s in sent.message["segments"] if s]
    assert sent.report.messages == len(segs) == sum(b.nbytes > 0 for b in packed.buckets)
    assert sent.report.bytes_copied == packed.nbytes
    got = SharedMemoryTransport().receive(sent.message)
    assert got.report.bytes_copied == 0
    for n, t in state.items():
        assert same_bits(got.tensors[n], t), n
    tr.release()
    assert not any((tmp_path / "shm").iterdir())
    with pytest.raises(TransportError, match="missing"):
        tr.receive(sent.message)


def test_make_transport_and_cuda_ipc_refuses_cpu():
    assert make_transport("inprocess").name == "inprocess"
    with pytest.raises(TransportError, match="unknown transport"):
        make_transport("carrier-pigeon")
    with pytest.raises(TransportError, match="needs CUDA tensors"):
        make_transport("cuda_ipc").send({"w": torch.zeros(2)})
