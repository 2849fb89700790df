"""The MOPD objectives (`algorithms.objectives`, the loop's `_kd_plan` / `policy_update`) against float64
references: Open-MOPD's dense top-K reverse KL (reward, per-candidate PPO loss and its gradient; K=1 on the sampled
token is the sampled-token form), gap-following (equal gaps: bit-equal advantages), reward refresh (one minibatch:
bit-equal to no refresh), teacher conflict (none: unchanged), the full-vocabulary JSD (β=0/1 = forward/reverse KL
with gradients) — and neither candidate gather nor the full JSD holds a `[tokens, vocab]` tensor beyond one tile."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mopd_core import algorithms as alg
from mopd_core.algorithms import logprobs as LP
from mopd_core.config import ConfigError, MOPDConfig, load_config
from mopd_core.rollout import RolloutBatch
from mopd_core.teachers import RoutedScore
from mopd_core.train import loop as L
from tests.conftest import tiny_overrides

torch.set_num_threads(1)
D = torch.float64


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _logp(*shape, seed=0):
    return torch.log_softmax(_rand(*shape, seed=seed) * 2, -1)


# ------------------------------------------------------------------------------------------ dense top-K RKL


def test_candidate_slots_dedupe_union_and_place_the_rl_slot():
    cand = torch.tensor([[[5, 7, 7, 2], [1, 2, 3, 4]]])  # union with a repeated id; sampled in / not in it
    sampled = torch.tensor([[7, 9]])
    ids, valid, rl = alg.candidate_slots(cand, sampled)
    assert ids.tolist() == [[[5, 7, 7, 2, 7], [1, 2, 3, 4, 9]]]
    assert valid.tolist() == [[[True, True, False, True, False], [True, True, True, True, False]]]
    assert rl.tolist() == [[[False, True, False, False, False], [False, False, False, False, True]]]


def test_topk_rkl_advantages_match_a_float64_reference():
    B, T, S = 2, 3, 5
    s, t = _logp(B, T, 9, seed=1)[..., :S], _logp(B, T, 9, seed=2)[..., :S]
    valid = torch.rand(B, T, S, generator=torch.Generator().manual_seed(3)) > 0.3
    valid[..., 0] = True
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=D)
    got = alg.topk_rkl_advantages(s, t, valid, mask, clip=0.5)
    ref = torch.zeros(B, T, S, dtype=D)
    for b in range(B):
        for i in range(T):
            if not mask[b, i]:
                continue
            ks = [k for k in range(S) if valid[b, i, k]]
            z = sum(math.exp(s[b, i, k]) for k in ks)
            for k in ks:
                ref[b, i, k] = max(-0.5, min(0.5, float(t[b, i, k] - s[b, i, k]))) * math.exp(s[b, i, k]) / z
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-14)


def _dense_reference(logp, old, adv, slots, mask, lo, hi, tw):
    total = logp.new_zeros(())
    for b in range(logp.shape[0]):
        for i in range(logp.shape[1]):
            if not mask[b, i]:
                continue
            for k in range(logp.shape[2]):
                if slots[b, i, k]:
                    r = torch.exp(logp[b, i, k] - old[b, i, k])
                    a = adv[b, i, k]
                    total = total - tw[b, i] * torch.minimum(r * a, r.clamp(1 - lo, 1 + hi) * a)
    return total / mask.sum()


def test_dense_policy_loss_and_its_gradient_match_a_float64_reference():
    B, T, S = 2, 4, 3
    logp = (_logp(B, T, 7, seed=4)[..., :S]).requires_grad_()
    old = (logp.detach() + 0.3 * _rand(B, T, S, seed=5))
    adv, tw = _rand(B, T, S, seed=6), _rand(B, T, seed=7).abs() + 0.5
    slots = _rand(B, T, S, seed=8) > -0.5
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=D)
    loss, met = alg.dense_policy_loss(logp, old, adv, slots, mask, 0.2, 0.3, token_weights=tw)
    ref = _dense_reference(logp, old, adv, slots, mask, 0.2, 0.3, tw)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-14)
    g, = torch.autograd.grad(loss, logp)
    gr, = torch.autograd.grad(_dense_reference(logp, old, adv, slots, mask, 0.2, 0.3, tw), logp)
    torch.testing.assert_close(g, gr, rtol=0, atol=1e-14)
    assert 0 < met["clip_frac"] < 1


def test_dense_topk_with_k1_on_the_sampled_token_equals_the_sampled_token_form():
    """One candidate, the sampled token: p̃ = 1, r = clip(ℓᵀ − ℓ^old), one PPO term — the loop's sampled_rkl loss
    (w_rl · GRPO + w_kd · reverse-KL advantage through `policy_loss`), value and gradient."""
    B, T = 3, 5
    sampled = torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(9))
    logp = (_logp(B, T, 50, seed=10).gather(-1, sampled[..., None])[..., 0]).requires_grad_()
    old = logp.detach() + 0.1 * _rand(B, T, seed=11)
    t_lp = _logp(B, T, 50, seed=12).gather(-1, sampled[..., None])[..., 0]
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=D)
    a_rl = _rand(B, seed=13)[:, None] * mask
    w_kd, clip = 0.7, 1.5
    ids, valid, rl = alg.candidate_slots(sampled[..., None], sampled)
    r = alg.topk_rkl_advantages(torch.stack([old, old], -1), torch.stack([t_lp, t_lp], -1), valid, mask, clip)
    adv = rl.to(D) * a_rl[..., None] + w_kd * r
    dense, _ = alg.dense_policy_loss(torch.stack([logp, logp], -1), torch.stack([old, old], -1), adv, valid | rl,
                                     mask, 0.2, 0.2)
    ref_adv = a_rl + w_kd * alg.reverse_kl_advantages(t_lp, old, mask, clip=clip)
    sampled_form, _ = alg.policy_loss(logp, old, ref_adv, mask, 0.2, 0.2)
    torch.testing.assert_close(dense, sampled_form, rtol=0, atol=1e-15)
    torch.testing.assert_close(torch.autograd.grad(dense, logp)[0], torch.autograd.grad(sampled_form, logp)[0],
                               rtol=0, atol=1e-15)


# ------------------------------------------------------------------------------- plan: gap, conflict, refresh


def _step(seed=0, B=6, T=4, mixture=False):
    g = torch.Generator().manual_seed(seed)
    cm = torch.ones(B, T, dtype=torch.long)
    cm[1, 3:] = 0
    cm[4, 2:] = 0
    cids = torch.randint(1, 20, (B, T), generator=g) * cm
    blp = -torch.rand(B, T, generator=g, dtype=D) * 3 * cm
    batch = RolloutBatch(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.long), cids, cm, blp,
                         [None] * B, [""] * B)
    per = {n: (torch.arange(B), -torch.rand(B, T, generator=g, dtype=D) * 3 * cm) for n in ("a", "b")}
    t_lp = per["a"][1] if not mixture else torch.logaddexp(per["a"][1], per["b"][1]) - math.log(2)
    return batch, RoutedScore(t_lp * cm, torch.zeros(B, dtype=torch.long), per_teacher=per)


def _plan(cfg, batch, routed, group_ids, conflict="none", nats=1.0, gaps=None):
    mask = batch.completion_mask.to(D)
    adv = 0.5 * _rand(batch.size, seed=3)[:, None] * mask
    return L._kd_plan(cfg, conflict, nats, routed, None, batch, mask, adv, group_ids, ["x", "y"],
                      gaps if gaps is not None else [None, None])


def test_gap_scales_follow_the_running_gap_and_equal_gaps_change_nothing_bit_for_bit():
    assert alg.gap_scales([0.3, 0.3, None], 0.05, 20) == [1.0, 1.0, 1.0]
    assert alg.gap_scales([1.0, 3.0], 0.05, 20) == [0.5, 1.5]
    assert alg.gap_scales([1e-4, 10.0], 0.05, 20) == [0.05, 2.0 * 10.0 / (10.0 + 1e-4)]
    assert alg.ema_gaps([None, 2.0, 1.0], [1.0, 4.0, math.nan], 0.9) == [1.0, 0.9 * 2.0 + 0.1 * 4.0, 1.0]
    a = torch.tensor([[1.0, -3.0], [2.0, 0.0], [5.0, 5.0]], dtype=D)
    g = alg.domain_gaps(a, torch.tensor([0, 0, 1]), torch.tensor([[1, 1], [1, 0], [0, 0]]), 3)
    assert g[0].item() == pytest.approx(2.0) and math.isnan(g[1].item()) and math.isnan(g[2].item())

    batch, routed = _step()
    group = torch.tensor([0, 1, 0, 1, 0, 1])
    off = MOPDConfig(w_kd=0.8)
    on = off.model_copy(update={"gap_following": True})
    a0, *_ = _plan(off, batch, routed, group)
    # equal gaps — each domain holds the same rows — scale exactly 1: the advantages of gap-following off, bit for bit
    twin, twin_routed = _step()
    for x in (twin.completion_ids, twin.completion_mask, twin.behaviour_logp, twin_routed.logp):
        x[3:] = x[:3]
    t_off, *_ = _plan(off, twin, twin_routed, torch.tensor([0, 0, 0, 1, 1, 1]))
    t_on, _, m, _ = _plan(on, twin, twin_routed, torch.tensor([0, 0, 0, 1, 1, 1]), gaps=[0.25, 0.25])
    assert m["gap/m/x"] == m["gap/m/y"] and m["gap/scale/x"] == m["gap/scale/y"] == 1.0
    assert torch.equal(t_on, t_off)
    a2, _, m2, _ = _plan(on, batch, routed, torch.zeros(6, dtype=torch.long))  # one domain: its gap is the mean
    assert m2["gap/scale/x"] == 1.0 and torch.equal(a2, a0)
    # and against the loop's own default path (no plan): the same bits
    mask = batch.completion_mask.to(D)
    adv = 0.5 * _rand(batch.size, seed=3)[:, None] * mask
    assert torch.equal(a0, adv + 0.8 * alg.reverse_kl_advantages(routed.logp, batch.behaviour_logp, mask, clip=5.0))
    # unequal gaps scale each domain's kd part by clip(m_d / mean m)
    a3, _, m3, gaps = _plan(on, batch, routed, group)
    kd0, kd3 = a0 - adv, a3 - adv
    for d, name in enumerate("xy"):
        rows = group == d
        torch.testing.assert_close(kd3[rows], m3[f"gap/scale/{name}"] * kd0[rows], rtol=1e-14, atol=0)
    assert gaps == [m3["gap/m/x"], m3["gap/m/y"]] and m3["gap/scale/x"] != 1.0


def test_teacher_conflict_none_is_unchanged_mask_zeroes_and_consensus_takes_the_smallest_advantage():
    batch, routed = _step(seed=1, mixture=True)
    group = torch.zeros(6, dtype=torch.long)
    cfg = MOPDConfig(w_kd=1.0, kd_clip=None)
    base, *_ = _plan(cfg, batch, routed, group)
    none, *_ = _plan(cfg.model_copy(update={"gap_following": False}), batch, routed, group, conflict="none")
    assert torch.equal(base, none)
    mask = batch.completion_mask.to(D)
    adv = 0.5 * _rand(batch.size, seed=3)[:, None] * mask
    la, lb, s = routed.per_teacher["a"][1], routed.per_teacher["b"][1], batch.behaviour_logp
    aa, ab = la - s, lb - s
    ref_conflict = ((aa > 0) != (ab > 0)) & ((aa != 0) & (ab != 0)) & ((la - lb).abs() > 0.5) & mask.bool()
    assert ref_conflict.any() and (~ref_conflict & mask.bool()).any()
    masked, _, m, _ = _plan(cfg, batch, routed, group, conflict="mask", nats=0.5)
    assert m["conflict/frac"] == pytest.approx(float(ref_conflict.sum() / mask.sum()))
    torch.testing.assert_close(masked, torch.where(ref_conflict, adv, base), rtol=0, atol=0)
    cons, *_ = _plan(cfg, batch, routed, group, conflict="consensus", nats=0.5)
    smallest = torch.where(aa.abs() <= ab.abs(), aa, ab)
    torch.testing.assert_close(cons, torch.where(ref_conflict, adv + smallest, base), rtol=0, atol=1e-15)


V = 40


def _model():
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, head_dim=8)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).double()


def _update(cfg, plan, adv, batch, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mask = batch.completion_mask.to(D)
    out = L.policy_update(model, opt, sched, batch, adv, mask, None, None, cfg, 1.0, random.Random(1), "chunked",
                          plan=plan)
    return out, [p.detach().clone() for p in model.parameters()]


def _lm_batch(B=4, T=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    cm = torch.ones(B, T, dtype=torch.long)
    cm[0, 3:] = 0
    cids = torch.randint(1, V, (B, T), generator=g) * cm
    return RolloutBatch(torch.randint(1, V, (B, 3), generator=g), torch.ones(B, 3, dtype=torch.long), cids, cm,
                        torch.zeros(B, T, dtype=D), [None] * B, [""] * B)


@pytest.mark.parametrize("dense", [False, True], ids=["sampled", "topk"])
def test_reward_refresh_with_one_minibatch_is_no_refresh_and_with_two_uses_the_current_student(dense):
    batch = _lm_batch()
    model = _model()
    mask = batch.completion_mask.to(D)
    with torch.no_grad():
        sc = L.score_completions(model, batch, 1.0, top_k=3)
    batch.behaviour_logp = sc.logp.to(D)
    t_lp = _logp(*mask.shape, V, seed=5)
    a_rl = 0.3 * _rand(batch.size, seed=6)[:, None] * mask
    if dense:
        ids, valid, rl = alg.candidate_slots(sc.topk_ids, batch.completion_ids)
        old = torch.cat([sc.topk_logp, sc.logp[..., None]], -1).to(D)
        teacher = t_lp.gather(-1, ids)
        plan = L.kd.KDPlan(True, teacher, 0.9 * torch.ones_like(mask), rl.to(D) * a_rl[..., None], 2.0, True, ids,
                           old, valid, valid | rl)
    else:
        teacher = t_lp.gather(-1, batch.completion_ids[..., None])[..., 0] * mask
        plan = L.kd.KDPlan(False, teacher, 0.9 * torch.ones_like(mask), a_rl, 2.0, True)
        old = batch.behaviour_logp
    every = list(range(batch.size))
    adv = plan.advantage(old, every, mask.shape[1], mask)  # the stored advantage: against the sampling student
    # refreshing against the student that made it gives it back (float64, bit for bit up to the scorer's rounding)
    with torch.no_grad():
        sc2 = L.score_completions(model, batch, 1.0, support_ids=plan.slot_ids if dense else None)
    again = plan.advantage((sc2.support_logp if dense else sc2.logp).to(D), every, mask.shape[1], mask)
    torch.testing.assert_close(again, adv, rtol=0, atol=1e-6)
    one = MOPDConfig(minibatches=1, grad_clip=1e9)
    _, p_on = _update(one, plan, adv, batch, _model())
    plan.refresh = False
    _, p_off = _update(one, plan, adv, batch, _model())
    assert all(torch.equal(a, b) for a, b in zip(p_on, p_off))  # K = 1: refresh never runs
    two = MOPDConfig(minibatches=2, grad_clip=1e9)
    out_off, q_off = _update(two, plan, adv, batch, _model())
    plan.refresh = True
    out_on, q_on = _update(two, plan, adv, batch, _model())
    assert out_on["refresh/kd_adv_change"] > 0 and "refresh/kd_adv_change" not in out_off
    assert any(not torch.equal(a, b) for a, b in zip(q_on, q_off))


# ------------------------------------------------------------------------------------------ full-vocab JSD


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_full_vocab_jsd_matches_forward_reverse_kl_and_jsd_references_with_gradients(beta):
    N, H, Ht = 9, 6, 5
    hs, ws = _rand(N, H, seed=1).requires_grad_(), _rand(V, H, seed=2).requires_grad_()
    ht, wt = _rand(N, Ht, seed=3), _rand(V, Ht, seed=4)
    got = alg.full_vocab_divergence(hs, ws, ht, wt, beta, student_temperature=0.8, teacher_temperature=1.2)
    ls, lt = torch.log_softmax(hs @ ws.T / 0.8, -1), torch.log_softmax(ht @ wt.T / 1.2, -1)
    if beta == 0.0:
        ref = (lt.exp() * (lt - ls)).sum(-1)  # forward KL(T‖S)
    elif beta == 1.0:
        ref = (ls.exp() * (ls - lt)).sum(-1)  # reverse KL(S‖T)
    else:
        ref = torch.stack([alg.generalized_jsd(ls[i:i + 1, None], lt[i:i + 1, None], beta, torch.ones(1, 1))
                           for i in range(N)])
    torch.testing.assert_close(got.to(D), ref, rtol=0, atol=5e-6)  # TRL's tiles compute in float32
    for a, b in zip(torch.autograd.grad(got.sum(), (hs, ws)), torch.autograd.grad(ref.sum(), (hs, ws))):
        torch.testing.assert_close(a.to(D), b, rtol=0, atol=5e-5)


# ------------------------------------------------------------------------------------------ no [T, V] tensor


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_candidate_gather_and_full_jsd_never_hold_more_than_one_tile_of_tokens_by_vocabulary(monkeypatch):
    from trl.kernels import chunked_divergence as CD
    from trl.kernels import chunked_logprob as CL

    N, H, Vb, K = 64, 8, 512, 4
    monkeypatch.setattr(LP, "TOKEN_CHUNK", 16)
    monkeypatch.setattr(LP, "VOCAB_CHUNK", 64)
    monkeypatch.setattr(CD, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(CL, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(CD, "VOCAB_CHUNK_SIZE", 64)
    tile = 16 * 64
    hs, w = _rand(N, H, seed=1).float().requires_grad_(), _rand(Vb, H, seed=2).float().requires_grad_()
    targets = torch.randint(0, Vb, (N,))
    with _Largest() as seen, torch.no_grad():  # the student's top-K: the candidates and their log-probs
        top = LP.token_logprobs(hs, w, targets, top_k=K)
    assert seen.largest <= tile < N * Vb
    slots = torch.cat([top.topk_ids, targets[:, None]], -1)
    with _Largest() as seen:  # the update's log-probs of the slots, forward and backward
        sc = LP.token_logprobs(hs, w, targets, support_ids=slots)
        sc.support_logp.sum().backward()
    assert seen.largest <= max(tile, w.numel()) < N * Vb
    with _Largest() as seen:
        alg.full_vocab_divergence(hs, w, _rand(N, H, seed=3).float(), w.detach(), 0.5).sum().backward()
    assert seen.largest <= max(tile, w.numel()) < N * Vb


# ----------------------------------------------------------------------------------------------- config


def test_config_defaults_keep_fingerprints_and_bad_combinations_fail_in_one_line(tmp_path):
    from mopd_core import recipe as R
    from mopd_core.preflight import _check_config

    cfg = load_config("tiny", tiny_overrides(tmp_path))
    dumped = cfg.mopd.model_dump()
    assert not {"kd_top_k", "kd_candidates", "gap_following", "gap_clip", "gap_momentum",
                "reward_refresh"} & set(dumped)
    assert "conflict" not in cfg.teachers.model_dump(include=R.TEACHER_RESULT_FIELDS)
    set_ = load_config("tiny", tiny_overrides(tmp_path) + ["mopd.kd_loss=topk_rkl", "mopd.gap_following=true"])
    ids = {"init": "stage:abc:3", "teacher.math": "stage:m:3", "teacher.code": "stage:c:3", "teacher.if": "s:i:3"}
    assert R.stage_spec(set_, "mopd", ids).fingerprint != R.stage_spec(cfg, "mopd", ids).fingerprint
    doms = {d: None for d in cfg.domain_names()}
    bad = [(["mopd.reward_refresh=true"], "mopd.minibatches=1"),
           (["mopd.reward_refresh=true", "mopd.minibatches=2", "mopd.kd_loss=jsd"], "direct loss"),
           (["mopd.kd_loss=topk_rkl", "teachers.backend=http"], "prompt_logprobs"),
           (["mopd.kd_loss=topk_rkl", "mopd.kd_candidates=union", "teachers.routing=mixture"], "mixture"),
           (["mopd.kd_loss=full_jsd", "teachers.backend=http"], "full_jsd"),
           (["teachers.conflict=mask"], "teachers.routing"),  # refused as the config loads
           (["mopd.kd_loss=topk_rkl", "runtime.strategy=ddp", "runtime.num_workers=2"], "strategy=single")]
    for extra, words in bad:
        with pytest.raises(ConfigError, match=words) as e:
            c = load_config("tiny", tiny_overrides(tmp_path) + extra)
            _check_config(c, "mopd", doms, True)
        assert "\n" not in str(e.value)


def test_a_resumed_run_continues_the_running_gaps_from_metrics(tmp_path):
    p = tmp_path / "metrics.jsonl"
    assert L.kd.restore_gaps(p, ["x", "y"]) == [None, None]
    p.write_text('{"step": 1, "gap/m/x": 0.5}\n{"step": 2, "gap/m/x": 0.25, "gap/m/y": 2.0}\n')
    assert L.kd.restore_gaps(p, ["x", "y", "z"]) == [0.25, 2.0, None]


def test_a_teacher_that_cannot_score_arbitrary_ids_is_refused_by_name():
    from mopd_core.teachers import Teacher, TeacherError, TeacherRouter

    class Server(Teacher):  # what an http teacher is: sampled token and its own top-k only
        name, path, stats = "math", "http://x", {}

        def score(self, batch, top_k=0):
            raise AssertionError("must not be asked")

    batch = _lm_batch(B=2)
    batch.examples = [type("E", (), {"teacher_id": "math"})()] * 2
    with pytest.raises(TeacherError, match="teacher 'math' cannot score the student's candidate tokens"):
        TeacherRouter({"math": Server()}).score(batch, support_ids=torch.zeros(2, 5, 3, dtype=torch.long))
