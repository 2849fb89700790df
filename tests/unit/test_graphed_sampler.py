"""`rollout.backend: hf_graphed` on CPU: the static-cache sampler (the captured decode step's code, run uncaptured
here — device graphs need a GPU/NPU; tests/device/perf_checks.py `sampling` runs the capture) gives the eager
`HFRollout`'s samples and log-probs for the same seed, in float64: stop ids, ignore_eos, truncation, greedy,
grouped key/value heads, reuse of its cache across calls and its rebuild when the weights move."""

from __future__ import annotations

import pytest
import torch

from mopd_core.config import RolloutConfig, TinyModelConfig
from mopd_core.models import build_tiny_model, build_tiny_tokenizer
from mopd_core.rollout import HFRollout, encode_prompts, sample
from mopd_core.rollout.graphed import GraphedRollout, StaticDecoder, graphed_sample

PROMPTS = ["12+34=", "rev:abcde=", "7-3=", "sort:31425=", "upper:ab=", "rep3:ab="]


def _model(heads: int = 4, kv_heads: int | None = None, impl: str = "sdpa"):
    tok = build_tiny_tokenizer()
    m = build_tiny_model(TinyModelConfig(hidden_size=128, num_layers=2, num_heads=heads, intermediate_size=128),
                         len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    if kv_heads is not None:  # grouped key/value heads (Qwen3-1.7B: 16 query heads over 8): rebuild that shape
        from transformers import AutoModelForCausalLM

        cfg = m.config
        cfg.num_key_value_heads = kv_heads
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    elif impl != "sdpa":
        m.config._attn_implementation = impl
    return m.double().eval(), tok


@pytest.fixture(scope="module")
def model_tok():
    return _model(heads=4, kv_heads=2)


def _stops(tok):
    # several stop ids, so that rows stop at different steps (a random model rarely picks EOS)
    return [tok.eos_token_id] + tok.convert_tokens_to_ids(list("0123"))


@pytest.mark.parametrize("kw", [dict(), dict(greedy=True), dict(temperature=0.7, top_p=0.8, top_k=20)],
                         ids=["sample", "greedy", "truncated"])
def test_static_decoder_gives_the_eager_samples_and_logprobs(model_tok, kw):
    model, tok = model_tok
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")  # left-padded: rows of different prompt lengths
    g_ref = torch.Generator().manual_seed(5)
    ref = sample(model, ids, mask, max_new_tokens=10, eos_id=_stops(tok), pad_id=tok.pad_token_id, generator=g_ref,
                 **kw)
    dec = StaticDecoder(model, ids.shape[0], ids.shape[1] + 10, "cpu", capture=False)
    g = torch.Generator().manual_seed(5)
    got = graphed_sample(dec, ids, mask, max_new_tokens=10, eos_id=_stops(tok), pad_id=tok.pad_token_id,
                         generator=g, **kw)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-10)
    c_mask = got[1]
    assert 0 < int(c_mask.sum()) < c_mask.numel() or kw.get("greedy")  # some rows stopped early (not all)
    assert torch.equal(g.get_state(), g_ref.get_state())  # the same draws: later calls continue alike


def test_ignore_eos_runs_every_row_to_the_budget_with_the_eager_tokens(model_tok):
    model, tok = model_tok
    eager = HFRollout(model, tok, "cpu")
    graphed = GraphedRollout(model, tok, "cpu", ignore_eos=True)
    assert graphed.capture is False  # cpu: the same step, uncaptured
    a = eager._sample(*encode_prompts(tok, PROMPTS, "cpu"), max_new_tokens=12, eos_id=[], pad_id=tok.pad_token_id,
                      generator=torch.Generator().manual_seed(3))
    b = graphed.generate(PROMPTS, max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    assert b.completion_mask.all() and b.completion_ids.shape == (len(PROMPTS), 12)
    assert torch.equal(a[0], b.completion_ids)
    torch.testing.assert_close(b.behaviour_logp, a[2], rtol=0, atol=1e-10)
    # the stop ids were drawn somewhere and did not stop the row
    assert bool(torch.isin(b.completion_ids, torch.tensor(_stops(tok))).any())


def test_engine_matches_hf_rollout_across_calls_and_rebuilds_when_weights_move(model_tok):
    model, tok = model_tok
    eager, graphed = HFRollout(model, tok, "cpu"), GraphedRollout(model, tok, "cpu")
    ga, gb = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    for prompts in (PROMPTS, PROMPTS[::-1], PROMPTS[:3] + PROMPTS[:3]):  # the same batch size: one cache reused
        a = eager.generate(prompts, max_new_tokens=8, generator=ga)
        b = graphed.generate(prompts, max_new_tokens=8, generator=gb)
        assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
        torch.testing.assert_close(b.behaviour_logp, a.behaviour_logp, rtol=0, atol=1e-10)
        assert a.texts == b.texts
    assert graphed.builds == 1
    # an update in place (the optimizer's) keeps the cache; samples follow the new weights
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    a = eager.generate(PROMPTS, max_new_tokens=8, generator=torch.Generator().manual_seed(2))
    b = graphed.generate(PROMPTS, max_new_tokens=8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.completion_ids, b.completion_ids) and graphed.builds == 1
    # parameters moved to new memory (an offload and back): a new cache (and graph, on a device)
    for p in model.parameters():
        p.data = p.data.clone()
    b = graphed.generate(PROMPTS, max_new_tokens=8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.completion_ids, b.completion_ids) and graphed.builds == 2
    # another batch size, a budget past the rounded capacity: rebuilt; sleep frees it
    graphed.generate(PROMPTS[:2], max_new_tokens=8, generator=torch.Generator().manual_seed(2))
    assert graphed.builds == 3
    graphed.sleep()
    assert graphed.decoder is None
    with torch.no_grad():
        for p in model.parameters():
            p.div_(1.5)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_implementations_and_plain_heads(impl):
    model, tok = _model(heads=4, kv_heads=None, impl=impl)
    # float32 for eager attention: its float64 additive mask overflows to -inf in its float32 softmax, and
    # transformers' own eager path then gives NaN on fully padded rows (the reference, not the sampler)
    model = model.float() if impl == "eager" else model
    assert model.config._attn_implementation == impl
    ids, mask = encode_prompts(tok, PROMPTS, "cpu")
    ref = sample(model, ids, mask, max_new_tokens=6, eos_id=_stops(tok), pad_id=tok.pad_token_id,
                 generator=torch.Generator().manual_seed(4))
    dec = StaticDecoder(model, ids.shape[0], 64, "cpu", capture=False)
    got = graphed_sample(dec, ids, mask, max_new_tokens=6, eos_id=_stops(tok), pad_id=tok.pad_token_id,
                         generator=torch.Generator().manual_seed(4))
    assert torch.equal(ref[0], got[0])
    torch.testing.assert_close(got[2], ref[2], rtol=0, atol=1e-10 if impl == "sdpa" else 1e-5)


def test_refuses_what_it_cannot_capture_naming_the_backend():
    from mopd_core.errors import PlacementError

    model, tok = _model(heads=4)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(PlacementError, match="rollout.backend=hf_graphed .*flash_attention_2.*rollout.backend=hf"):
        StaticDecoder(model, 2, 64, "cpu", capture=False)


def test_build_rollout_selects_it_from_the_config():
    from mopd_core.rollout.engines import build_rollout

    model, tok = _model(heads=4)
    recipe = RolloutConfig(backend="hf_graphed", ignore_eos=True)
    eng = build_rollout(recipe, model, tok, "cpu")
    assert isinstance(eng, GraphedRollout) and eng.ignore_eos and not eng.capture
    assert eng.sync_weights(model)["bytes_copied"] == 0


def test_capture_graph_warms_up_on_a_side_stream_and_captures_without_the_autocast_cache(monkeypatch):
    """`runtime.device.capture_graph` against a recording stand-in for `torch.cuda` (graph capture itself needs
    a GPU): warm-up on a side stream, then one capture inside the device's graph context, with autocast's
    weight-cast cache off in both (a cached cast would be captured as a stale tensor)."""
    import contextlib

    from mopd_core.runtime import device as devlib

    log = []

    class FakeCuda:  # a stand-in for the device module: records the calls the capture recipe makes
        class CUDAGraph:
            pass

        class Stream:
            def wait_stream(self, other):
                log.append("side waits")

        @staticmethod
        def current_stream():
            return FakeCuda.Stream()

        @staticmethod
        @contextlib.contextmanager
        def stream(s):
            log.append("on side stream")
            yield
            log.append("off side stream")

        @staticmethod
        def synchronize():
            log.append("sync")

        @staticmethod
        @contextlib.contextmanager
        def graph(g):
            log.append("capture begins")
            yield
            log.append("capture ends")

    monkeypatch.setattr(devlib, "_module", lambda kind: FakeCuda if kind == "cuda" else None)
    assert devlib.graphs_supported("cuda") and not devlib.graphs_supported("cpu")

    def fn():
        log.append(("run", torch.is_autocast_cache_enabled()))
        return torch.ones(2)

    assert torch.is_autocast_cache_enabled()
    graph, out = devlib.capture_graph("cuda", fn, warmup=2)
    assert isinstance(graph, FakeCuda.CUDAGraph) and torch.equal(out, torch.ones(2))
    runs = [i for i, e in enumerate(log) if isinstance(e, tuple)]
    assert [log[i] for i in runs] == [("run", False)] * 3
    assert log.index("on side stream") < runs[0] < runs[1] < log.index("off side stream") < log.index("sync") \
        < log.index("capture begins") < runs[2] < log.index("capture ends")
    assert torch.is_autocast_cache_enabled()  # restored
