"""Token-budget micro-batches (`train.max_tokens_per_micro_batch`, `train.microbatch`): the partition covers every
row once and keeps each micro-batch within the budget (a longer row alone); a micro-batch is cut to its own
longest prompt and completion; the loop's update with a budget gives the loss and gradients of the single
padded micro-batch (float64, ≤ 1e-6), with and without the JSD term; `perf/pad_frac`; config, fingerprints and
the pre-flight warning."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from mopd_core import config as C
from mopd_core import recipe as R
from mopd_core.config import ConfigError, MOPDConfig, PolicyLoopConfig, load_config
from mopd_core.rollout import RolloutBatch
from mopd_core.teachers import RoutedScore
from mopd_core.train.loop import policy_update
from mopd_core.train.microbatch import padded_positions, row_lengths, token_budget_micro_batches, trim
from tests.conftest import tiny_overrides

torch.set_num_threads(1)
V = 300
P_LEN = [6, 2, 4, 1, 5, 3, 6, 2]   # real prompt tokens per row (left-padded to 6)
C_LEN = [3, 10, 1, 7, 2, 9, 5, 4]  # real completion tokens per row (right-padded to 10)


def _model():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, head_dim=16)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).double()


def _batch(seed=3):
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(P_LEN), max(P_LEN), max(C_LEN)
    pm = torch.zeros(B, P, dtype=torch.long)
    cm = torch.zeros(B, T, dtype=torch.long)
    for i, (p, c) in enumerate(zip(P_LEN, C_LEN)):
        pm[i, P - p:] = 1
        cm[i, :c] = 1
    ids = torch.randint(1, V, (B, P), generator=g) * pm
    cids = torch.randint(1, V, (B, T), generator=g) * cm
    blp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 6) * cm
    return RolloutBatch(ids, pm, cids, cm, blp, list(range(B)), [""] * B)


# ------------------------------------------------------------------------------------------------- partition


@pytest.mark.parametrize("budget", [1, 8, 12, 20, 33, 64, 1000])
def test_partition_covers_every_row_once_within_the_budget(budget):
    rows = list(range(len(P_LEN)))
    mbs = token_budget_micro_batches(rows, P_LEN, C_LEN, budget)
    assert sorted(r for mb in mbs for r in mb) == rows
    for mb in mbs:
        width = max(P_LEN[r] for r in mb) + max(C_LEN[r] for r in mb)
        assert len(mb) * width <= budget or len(mb) == 1  # a row longer than the budget runs alone
    if budget >= len(rows) * (max(P_LEN) + max(C_LEN)):
        assert len(mbs) == 1


def test_partition_of_random_lengths_and_a_subset_of_rows():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        p = [rng.randint(0, 50) for _ in range(n)]
        c = [rng.randint(1, 200) for _ in range(n)]
        rows = rng.sample(range(n), rng.randint(1, n))
        budget = rng.randint(1, 2000)
        mbs = token_budget_micro_batches(rows, p, c, budget)
        assert sorted(r for mb in mbs for r in mb) == sorted(rows)
        assert all(len(mb) * (max(p[r] for r in mb) + max(c[r] for r in mb)) <= budget or len(mb) == 1
                   for mb in mbs)


def test_trim_cuts_only_columns_that_are_padding_in_every_row():
    b = _batch()
    sub, t = trim(b, [0, 2, 4])  # prompts 6, 4, 5; completions 3, 1, 2
    assert sub.prompt_ids.shape == (3, 6) and sub.completion_ids.shape == (3, 3) and t == 3
    sub, t = trim(b, [2, 4])
    assert sub.prompt_ids.shape == (2, 5) and t == 2
    full = b.select([2, 4])
    assert torch.equal(sub.prompt_ids, full.prompt_ids[:, 1:]) and torch.equal(sub.completion_ids,
                                                                              full.completion_ids[:, :2])
    assert sub.prompt_mask.sum() == full.prompt_mask.sum() and sub.completion_mask.sum() == full.completion_mask.sum()
    assert padded_positions(sub) == (2 * 7, 4 + 1 + 5 + 2)
    assert row_lengths(b) == (P_LEN, C_LEN)


# ------------------------------------------------------------------------------------- same loss as padded


def _update(model, batch, cfg, max_tokens, impl, jsd, packed=False):
    """One policy_update; the optimizer's lr is 0, so the gradients it leaves are the (last minibatch's) ones."""
    g = torch.Generator().manual_seed(7)
    mask = batch.completion_mask.double()
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    tw = torch.rand(mask.shape, generator=g, dtype=torch.float64) + 0.5
    routed = None
    if jsd:
        t_lp = torch.log_softmax(torch.randn(*mask.shape, V, generator=g, dtype=torch.float64), -1)
        top = t_lp.topk(cfg.jsd_top_k, -1)
        routed = RoutedScore(t_lp.gather(-1, batch.completion_ids[..., None]).squeeze(-1) * mask,
                             torch.zeros(batch.size, dtype=torch.long), top.indices, top.values)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    out = policy_update(model, opt, sched, batch, adv, mask, tw, routed, cfg, 0.8, random.Random(5), impl,
                        max_tokens, packed=packed)
    return out, [p.grad.clone() for p in model.parameters()]


def _close(a, b, tol=1e-6):
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err <= tol, err


@pytest.mark.parametrize("impl", ["chunked", "full"])
@pytest.mark.parametrize("jsd", [False, True], ids=["ppo", "ppo+jsd"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_token_budget_update_equals_the_single_padded_micro_batch(impl, jsd, minibatches):
    model, batch = _model(), _batch()
    cls = MOPDConfig if jsd else PolicyLoopConfig
    kw = dict(grad_clip=1e9, minibatches=minibatches, clip_low=0.2, clip_high=0.2)
    if jsd:
        kw.update(kd_loss="jsd", w_kd=0.5, jsd_top_k=4)
    ref, ref_g = _update(model, batch, cls(**kw), None, impl, jsd)  # one padded micro-batch per minibatch
    ref_pad = 1 - (sum(P_LEN) + sum(C_LEN)) / (len(P_LEN) * (max(P_LEN) + max(C_LEN)))
    assert ref["perf/pad_frac"] == pytest.approx(ref_pad) and ref["perf/micro_batches"] == minibatches
    for budget in (3, 24, 40):  # every row alone (all longer than 3), a few rows each, most rows together
        out, g = _update(model, batch, cls(**kw), budget, impl, jsd)
        assert out["perf/micro_batches"] > minibatches and out["perf/pad_frac"] < ref_pad
        for k in ("loss", "entropy", "clip_frac", "approx_kl", "ratio_mean", "grad_norm") + (("jsd",) if jsd else ()):
            assert out[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), k
        for a, b in zip(g, ref_g):
            _close(a, b)
    assert _update(model, batch, cls(**kw), 3, impl, jsd)[0]["perf/pad_frac"] == 0.0  # a row alone has none


def test_without_a_budget_micro_batch_size_keeps_the_full_width():
    model, batch = _model(), _batch()
    out, _ = _update(model, batch, PolicyLoopConfig(grad_clip=1e9, micro_batch_size=3), None, "chunked", False)
    assert out["perf/micro_batches"] == 3
    assert out["perf/pad_frac"] == pytest.approx(1 - (sum(P_LEN) + sum(C_LEN)) / (8 * 16))


# ---------------------------------------------------------------------------------- config and fingerprints


def test_budget_is_validated_and_fingerprinted_only_when_set(tmp_path):
    assert load_config("tiny").train.max_tokens_per_micro_batch == 2048  # the tiny preset's own budget
    cfg = load_config("tiny", tiny_overrides(tmp_path) + ["train.max_tokens_per_micro_batch=null"])
    assert cfg.train.max_tokens_per_micro_batch is None
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["train.max_tokens_per_micro_batch=0"])
    assert "train.max_tokens_per_micro_batch" in str(e.value)
    # unset: the train section fingerprints as it did before the field existed
    assert R.train_fingerprint_part(cfg) == {"logprob_impl": "chunked"}
    other = load_config("tiny", tiny_overrides(tmp_path) + ["train.max_tokens_per_micro_batch=256"])
    assert R.train_fingerprint_part(other) == {"logprob_impl": "chunked", "max_tokens_per_micro_batch": 256}
    inputs = {"init": "stage:abc:3", "teacher.math": "stage:m:3", "teacher.code": "stage:c:3",
              "teacher.if": "stage:i:3"}
    fp = {s: (R.stage_spec(cfg, s, inputs).fingerprint, R.stage_spec(other, s, inputs).fingerprint)
          for s in ("sft", "expert:math", "mopd")}
    assert fp["sft"][0] == fp["sft"][1]
    assert fp["expert:math"][0] != fp["expert:math"][1] and fp["mopd"][0] != fp["mopd"][1]
    assert C.stage_fingerprint(cfg.train) != C.stage_fingerprint(other.train)


def test_preflight_warns_when_the_budget_is_below_the_longest_row(tmp_path, caplog):
    from mopd_core.preflight import _check_config

    longest = load_config("tiny", tiny_overrides(tmp_path)).max_seq_len()
    for budget, warns in ((longest - 1, True), (longest, False)):
        cfg = load_config("tiny", tiny_overrides(tmp_path) + [f"train.max_tokens_per_micro_batch={budget}"])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mopd"):
            _check_config(cfg, "student", R.build_domains(cfg), has_teachers=True)
        msgs = [r.getMessage() for r in caplog.records if "max_tokens_per_micro_batch" in r.getMessage()]
        assert bool(msgs) == warns, msgs
        if warns:
            assert str(longest) in msgs[0] and "\n" not in msgs[0]


# ------------------------------------------------------------------------------------------------- packing


def test_pack_rows_puts_the_real_tokens_back_to_back():
    from mopd_core.rollout import pack_rows

    b = _batch()
    pk = pack_rows(b.select([0, 1]))  # row 0: 6 prompt + 3 completion tokens; row 1: 2 + 10
    assert pk.input_ids.shape == (1, 21) and pk.position_ids[0].tolist() == list(range(9)) + list(range(12))
    assert torch.equal(pk.input_ids[0, :6], b.prompt_ids[0]) and torch.equal(pk.input_ids[0, 9:11],
                                                                              b.prompt_ids[1, -2:])
    assert pk.predict_at.tolist() == [5, 6, 7] + list(range(10, 20))  # the position before each completion token
    m = pk.attention_mask[0, 0]
    assert m[8, :9].all() and not m[9, :9].any() and m[20, 9:].all() and not m[3, 4:].any()  # blocks, causal
    assert pack_rows(b.select([0, 1]), block_mask=False).attention_mask is None


def test_packed_partition_counts_real_tokens():
    rows = list(range(len(P_LEN)))
    for budget in (1, 10, 16, 30, 1000):
        mbs = token_budget_micro_batches(rows, P_LEN, C_LEN, budget, packed=True)
        assert sorted(r for mb in mbs for r in mb) == rows
        assert all(sum(P_LEN[r] + C_LEN[r] for r in mb) <= budget or len(mb) == 1 for mb in mbs)
    # fewer passes than the padded count for the same budget: short rows no longer pay for the longest
    assert len(token_budget_micro_batches(rows, P_LEN, C_LEN, 30, packed=True)) < \
        len(token_budget_micro_batches(rows, P_LEN, C_LEN, 30))


@pytest.mark.parametrize("impl", ["chunked", "full"])
@pytest.mark.parametrize("jsd", [False, True], ids=["ppo", "ppo+jsd"])
def test_packed_update_equals_the_padded_one(impl, jsd):
    """`train.packing`: one forward over each micro-batch's real tokens (block-diagonal mask, positions
    restarting per row) gives the padded computation's loss, metrics and gradients (float64, ≤ 1e-6)."""
    model, batch = _model(), _batch()
    cls = MOPDConfig if jsd else PolicyLoopConfig
    kw = dict(grad_clip=1e9, clip_low=0.2, clip_high=0.2)
    if jsd:
        kw.update(kd_loss="jsd", w_kd=0.5, jsd_top_k=4)
    ref, ref_g = _update(model, batch, cls(**kw), None, impl, jsd)
    for budget in (None, 24):
        out, g = _update(model, batch, cls(**kw), budget, impl, jsd, packed=True)
        assert out["perf/pad_frac"] == 0.0
        for k in ("loss", "entropy", "clip_frac", "approx_kl", "ratio_mean", "grad_norm") + (("jsd",) if jsd else ()):
            assert out[k] == pytest.approx(ref[k], rel=1e-6, abs=1e-9), (budget, k)
        for a, b in zip(g, ref_g):
            _close(a, b)
