"""Tiny model/tokenizer, fingerprints, sampling with a KV cache, local teachers and the router."""

from __future__ import annotations

from types import SimpleNamespace as Ex

import pytest
import torch

from mopd_core import algorithms as alg
from mopd_core.config import ModelConfig, TeachersConfig
from mopd_core.errors import PlacementError
from mopd_core.models import (ModelError, build_tiny, build_tiny_tokenizer, check_same_tokenizer, load_model,
                              load_tokenizer, num_parameters, tokenizer_fingerprint)
from mopd_core.rollout import HFRollout, completion_logprobs
from mopd_core.teachers import TeacherError, build_local_router


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    small = ModelConfig(tiny={"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128})
    return build_tiny(small, d / "a", seed=0), build_tiny(small, d / "b", seed=1)


def test_default_tiny_model_size_and_head_dim(tmp_path):
    path = build_tiny(ModelConfig(), tmp_path / "m")
    m = load_model(path)
    assert 1_000_000 <= num_parameters(m) <= 5_000_000
    assert m.config.hidden_size // m.config.num_attention_heads in (32, 64)
    tok = load_tokenizer(path)
    assert tok.decode(tok("rev:abc=")["input_ids"]) == "rev:abc="
    assert len(tok("upper:ab=")["input_ids"]) == len("upper:ab=")  # one id per character
    assert tok("ab<eos>")["input_ids"][-1] == tok.eos_token_id     # EOS is one token, not 5 characters


def test_fingerprint_equal_after_reload_and_differs_for_other_vocab(tiny, tmp_path):
    a = load_tokenizer(tiny[0])
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(build_tiny_tokenizer())
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel(vocab={"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    other = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    with pytest.raises(ModelError, match="teacher 'math'.*fingerprint"):
        check_same_tokenizer(tokenizer_fingerprint(a), tokenizer_fingerprint(other), "math")


def test_load_errors_name_the_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="empty.*config.json"):
        load_model(tmp_path / "empty")


def _engine(path):
    m = load_model(path).eval()
    return m, HFRollout(m, load_tokenizer(path), "cpu")


PROMPTS = ["12+34=", "sort:31425=", "rep3:ab=", "1-1=", "upper:abcd="]


def test_batched_greedy_equals_unpadded_greedy(tiny):
    _, eng = _engine(tiny[0])
    exs = [Ex(prompt=p) for p in PROMPTS]
    batch = eng.generate(exs, max_new_tokens=8, greedy=True)
    for i, e in enumerate(exs):
        one = eng.generate([e], max_new_tokens=8, greedy=True)
        n = one.completion_ids.shape[1]
        assert torch.equal(one.completion_ids[0], batch.completion_ids[i, :n])
        assert torch.equal(one.completion_mask[0], batch.completion_mask[i, :n])


def test_behaviour_logprobs_match_a_full_forward_and_masks_end_at_eos(tiny):
    m, eng = _engine(tiny[0])
    g = torch.Generator().manual_seed(0)
    b = eng.generate([Ex(prompt=p) for p in PROMPTS * 8], max_new_tokens=10, temperature=0.7, generator=g)
    lp = completion_logprobs(m, b, temperature=0.7)
    assert (lp - b.behaviour_logp).abs().max() < 1e-4
    eos = eng.tokenizer.eos_token_id
    for ids, mk in zip(b.completion_ids, b.completion_mask):
        n = int(mk.sum())
        assert mk[:n].all() and not mk[n:].any()  # contiguous, then padding
        assert (ids[: n - 1] != eos).all()          # nothing after an EOS is kept
        if n < ids.shape[0]:
            assert ids[n - 1] == eos


def test_sampling_is_deterministic_per_seed_and_top_p_restricts(tiny):
    _, eng = _engine(tiny[0])
    exs = [Ex(prompt="12+34=")] * 64
    a = eng.generate(exs, max_new_tokens=6, generator=torch.Generator().manual_seed(3))
    b = eng.generate(exs, max_new_tokens=6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.completion_ids, b.completion_ids)
    tight = eng.generate(exs, max_new_tokens=1, top_p=1e-6, generator=torch.Generator().manual_seed(3))
    greedy = eng.generate(exs[:1], max_new_tokens=1, greedy=True)
    assert (tight.completion_ids[:, 0] == greedy.completion_ids[0, 0]).all()  # top_p→0 is greedy


def _batch(path, teacher_ids):
    _, eng = _engine(path)
    exs = [Ex(prompt=p, teacher_id=t) for p, t in zip(PROMPTS * 4, teacher_ids)]
    return eng.generate(exs, max_new_tokens=6, generator=torch.Generator().manual_seed(0))


def test_domain_routing_scores_each_row_with_its_teacher(tiny):
    tids = (["math", "code"] * 10)[:20]
    b = _batch(tiny[0], tids)
    router = build_local_router({"math": tiny[0], "code": tiny[1]}, TeachersConfig(), "cpu")
    router.check(tokenizer_fingerprint(load_tokenizer(tiny[0])), tids)
    s = router.score(b)
    direct = {n: completion_logprobs(load_model(p), b) for n, p in (("math", tiny[0]), ("code", tiny[1]))}
    for i, t in enumerate(tids):
        assert torch.allclose(s.logp[i], direct[t][i], atol=1e-5)
    assert router.stats()["math"]["tokens"] == int(b.completion_mask[0::2].sum())


def test_mixture_routing_matches_the_algorithm(tiny):
    tids = ["math"] * 20
    b = _batch(tiny[0], tids)
    direct = torch.stack([completion_logprobs(load_model(p), b) for p in tiny])
    for kind in ("arithmetic", "geometric"):
        cfg = TeachersConfig(routing="mixture", mixture_kind=kind, mixture_weights={"math": 3, "code": 1})
        s = build_local_router({"math": tiny[0], "code": tiny[1]}, cfg, "cpu").score(b)
        ref = alg.mix_teacher_logprobs(direct, torch.tensor([0.75, 0.25]), kind) * b.completion_mask
        assert torch.allclose(s.logp, ref, atol=1e-5)


def test_router_preflight_errors(tiny):
    router = build_local_router({"math": tiny[0]}, TeachersConfig(), "cpu")
    fp = tokenizer_fingerprint(load_tokenizer(tiny[0]))
    with pytest.raises(TeacherError, match="unknown teacher_id 'poetry'.*known teachers: math"):
        router.check(fp, ["math", "poetry"])
    with pytest.raises(ModelError, match="teacher 'math'"):
        router.check("0" * 16, ["math"])
    with pytest.raises(TeacherError, match="unknown teacher 'x'"):
        build_local_router({"math": tiny[0]}, TeachersConfig(mixture_weights={"x": 1.0}), "cpu")


def test_device_layer_on_cpu():
    from mopd_core.runtime import device as D

    info = D.resolve("auto")
    assert info.kind in ("cpu", "cuda", "npu")
    cpu = D.resolve("cpu")
    assert cpu.dist_backend == "gloo" and cpu.torch_device == torch.device("cpu")
    assert D.memory_stats("cpu")["mem/host_rss_mb"] > 0
    assert D.set_visible_devices("npu", [0, 1]) == {"ASCEND_RT_VISIBLE_DEVICES": "0,1"}
    assert D.resolve("cuda" if torch.cuda.is_available() else "cpu")
    if not D.npu_available():
        with pytest.raises(PlacementError, match="runtime.device=npu"):
            D.resolve("npu")
    with pytest.raises(ValueError, match="runtime.device='tpu'"):
        D.resolve("tpu")
