"""The sampler's own top-k (`generate(top_logprobs=k)`, vLLM's `logprobs=k`): the dense top-K objective takes the
student's candidates from it instead of a no-grad scoring pass. In float64 the recorded ids and log-probs are the
scoring pass's, position by position — across the engine's prompt chunks (padded to one width) and with truncated
sampling (the candidates come from the untruncated distribution, as the pass computes them) — and
`kd.dense_candidates` gives the same slots, teacher and old log-probs without running the student."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mopd_core.config import TinyModelConfig
from mopd_core.models import build_tiny_model, build_tiny_tokenizer
from mopd_core.rollout import HFRollout, score_completions
from mopd_core.rollout.graphed import GraphedRollout
from mopd_core.train import kd

K = 4
PROMPTS = ["12+34=", "rev:abcde=", "7-3=", "sort:31425=", "upper:ab=", "rep3:ab=", "9+9=", "rev:xy="]


@pytest.fixture(scope="module")
def model_tok():
    tok = build_tiny_tokenizer()
    m = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=96),
                         len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    return m.double().eval(), tok


def _generate(model, tok, engine=HFRollout, **kw):
    eng = engine(model, tok, "cpu")
    # stop on a few digits too, so rows end at different steps and the chunks have different widths
    eng.stop_ids = lambda: [tok.eos_token_id] + tok.convert_tokens_to_ids(list("0123456789abcdefgh"))
    return eng.generate(PROMPTS, max_new_tokens=8, generator=torch.Generator().manual_seed(3), batch_size=3,
                        top_logprobs=K, **kw)


@pytest.mark.parametrize("engine", [HFRollout, GraphedRollout], ids=["hf", "hf_graphed"])
@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.6, top_k=5)],
                         ids=["tempered", "truncated"])
def test_recorded_top_k_is_the_scoring_pass_top_k(model_tok, kw, engine):
    """`hf_graphed` is the CUDA-graph sampler's engine run eagerly on CPU: the record passes through its own
    `graphed_sample` path."""
    model, tok = model_tok
    batch = _generate(model, tok, engine, **kw)
    cm = batch.completion_mask.bool()
    assert batch.top_ids.shape == batch.top_logp.shape == (*batch.completion_ids.shape, K)
    assert not cm.all(), "rows should stop at different steps (chunk padding is part of what is tested)"
    with torch.no_grad():
        ref = score_completions(model, batch, kw["temperature"], top_k=K)
    assert torch.equal(batch.top_ids[cm], ref.topk_ids[cm])
    # the sampler's log-softmax is float32 whatever the model's dtype (so are the behaviour log-probs): its rounding
    tol = dict(rtol=0, atol=4e-6)
    torch.testing.assert_close(batch.top_logp[cm], ref.topk_logp[cm].to(batch.top_logp.dtype), **tol)
    assert not batch.top_logp[~cm].any() and not batch.top_ids[~cm].any()  # padding records nothing
    if "top_p" not in kw:  # untruncated: the sampled token's behaviour log-prob is the pass's too
        torch.testing.assert_close(batch.behaviour_logp[cm], ref.logp[cm].to(batch.behaviour_logp.dtype), **tol)
    sub = batch.select([1, 4])  # a selection keeps its rows' record
    assert torch.equal(sub.top_ids, batch.top_ids[[1, 4]])
    assert batch.top_logprobs(K + 1) is None and batch.top_logprobs(K).topk_ids is batch.top_ids


class _Router:
    """Stand-in teachers (the candidates' source is what is tested): log-probs a fixed function of the ids."""

    def score(self, batch, top_k=0, visit=None, support_ids=None):
        f = lambda ids: -(ids.double() % 7) / 3  # noqa: E731
        return type("Routed", (), {"logp": f(batch.completion_ids), "support_logp": f(support_ids)})()


def test_dense_candidates_take_the_samplers_top_k_and_skip_the_student_pass(model_tok):
    model, tok = model_tok
    batch = _generate(model, tok, temperature=1.0)
    plain = type(batch)(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                        batch.behaviour_logp, batch.examples, batch.texts)  # the same samples, no record
    calls = []
    hook = model.get_decoder().register_forward_hook(lambda *a: calls.append(1))
    try:
        args = dict(kind="student", k=K, temperature=1.0, impl="chunked", micro_batch_size=None,
                    amp=contextlib.nullcontext, packed=False)
        got = kd.dense_candidates(model, batch, _Router(), **args)
        assert calls == [], "the student ran although the sampler recorded its top-k"
        want = kd.dense_candidates(model, plain, _Router(), **args)
        assert calls, "without a record the student pass must run"
    finally:
        hook.remove()
    _, slots, valid, rl, old, teacher = got
    _, w_slots, w_valid, w_rl, w_old, w_teacher = want
    assert torch.equal(slots, w_slots) and torch.equal(valid, w_valid) and torch.equal(rl, w_rl)
    assert torch.equal(teacher, w_teacher)
    torch.testing.assert_close(old, w_old, rtol=0, atol=4e-6)  # float32 sampler vs float64 pass (as above)
