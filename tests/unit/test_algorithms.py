"""mopd_core.algorithms against float64 references written here with plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch

from mopd_core.algorithms import (
    balance_weights,
    combine_advantages,
    generalized_jsd,
    grpo_advantages,
    mix_teacher_logprobs,
    policy_loss,
    reverse_kl_advantages,
    token_share_weights,
    topk_support,
)

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _close(actual, expected, dtype):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), **TOL[dtype]
    )


def _logp_rows(gen: torch.Generator, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.log_softmax(torch.randn(*shape, generator=gen, dtype=torch.float64) * 2, dim=-1).to(dtype)


def _mask(gen: torch.Generator, b: int, t: int) -> torch.Tensor:
    m = torch.rand(b, t, generator=gen) < 0.7
    m[0, 0] = True
    return m


# ------------------------------------------------------------------------------------------------------- GRPO


def _ref_grpo(rewards: list[float], g: int, scale: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), g):
        grp = rewards[start : start + g]
        mean = sum(grp) / g
        var = sum((x - mean) ** 2 for x in grp) / (g - 1)  # unbiased
        for x in grp:
            out.append((x - mean) / (math.sqrt(var) + eps) if scale else x - mean)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [True, False])
def test_grpo_matches_reference(dtype, scale):
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(12, generator=gen, dtype=torch.float64)
    adv = grpo_advantages(r.to(dtype), group_size=4, scale_by_std=scale)
    assert adv.shape == (12,) and adv.dtype == dtype
    _close(adv, _ref_grpo(r.tolist(), 4, scale, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_constant_group_is_exactly_zero(dtype):
    # the mean of seven 0.1s is not 0.1 in float32 nor float64: the constant group must still be exactly 0.
    assert (torch.full((7,), 0.1, dtype=dtype).mean() != torch.tensor(0.1, dtype=dtype)).item()
    r = torch.tensor([0.1] * 7 + [1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5] + [7.0] * 7, dtype=dtype)
    adv = grpo_advantages(r, group_size=7)
    zeros = torch.zeros(7, dtype=dtype)
    assert torch.equal(adv[:7], zeros) and torch.equal(adv[14:], zeros)
    assert adv[7] > 0 and adv[8] < 0
    assert torch.equal(grpo_advantages(torch.tensor([1.0, 2.0]), group_size=1), torch.zeros(2))


def test_grpo_stop_gradient_and_bad_group_size():
    r = torch.randn(6, requires_grad=True)
    assert not grpo_advantages(r, 3).requires_grad
    with pytest.raises(ValueError, match="multiple"):
        grpo_advantages(torch.zeros(7), 3)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(4), 0)


# ------------------------------------------------------------------------------------------- reverse-KL adv


@pytest.mark.parametrize("dtype", DTYPES)
def test_reverse_kl_advantages_clip_and_mask(dtype):
    gen = torch.Generator().manual_seed(1)
    tl = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 3
    bl = torch.randn(3, 5, generator=gen, dtype=torch.float64) * 3
    mask = _mask(gen, 3, 5)
    mask[1, 2] = False
    mask[2, 4] = False
    tl[1, 2] = float("-inf")  # garbage at masked positions must not leak
    bl[1, 2] = float("-inf")
    tl[2, 4] = float("nan")
    for clip in (None, 1.5):
        adv = reverse_kl_advantages(tl.to(dtype), bl.to(dtype), mask, clip=clip)
        ref = []
        for i in range(3):
            row = []
            for j in range(5):
                if not mask[i, j]:
                    row.append(0.0)
                    continue
                d = tl[i, j].item() - bl[i, j].item()
                row.append(d if clip is None else max(-clip, min(clip, d)))
            ref.append(row)
        assert adv.dtype == dtype and not adv.requires_grad
        assert torch.isfinite(adv).all()
        assert adv[1, 2].item() == 0.0 and adv[2, 4].item() == 0.0
        _close(adv, ref, dtype)
    clipped = reverse_kl_advantages(tl, bl, mask, clip=1.5)
    assert clipped.abs().max() <= 1.5 and (clipped.abs() == 1.5).any()


def test_combine_advantages():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    a_r = torch.tensor([1.0, -2.0])
    a_d = torch.tensor([[0.5, -0.5, float("nan")], [1.0, 3.0, 3.0]])
    out = combine_advantages(a_r, a_d, mask, w_rl=0.5, w_kd=2.0)
    assert torch.equal(out, torch.tensor([[1.5, -0.5, 0.0], [1.0, 0.0, 0.0]]))


# ------------------------------------------------------------------------------------------------- mixtures


@pytest.mark.parametrize("dtype", DTYPES)
def test_arithmetic_mixture_matches_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    k, b, t = 3, 4, 5
    ls = -torch.rand(k, b, t, generator=gen, dtype=torch.float64) * 6
    w = torch.tensor([0.2, 0.0, 0.8], dtype=torch.float64)
    ls[1, 0, 0] = float("-inf")
    ls[1, 1, 1] = float("nan")  # a zero-weight teacher contributes nothing, not even nan
    out = mix_teacher_logprobs(ls.to(dtype), w.to(dtype), "arithmetic")
    ref = [
        [math.log(sum(w[q].item() * math.exp(ls[q, i, j].item()) for q in range(k) if w[q] > 0)) for j in range(t)]
        for i in range(b)
    ]
    assert out.shape == (b, t) and out.dtype == dtype
    _close(out, ref, dtype)
    # per-sample [B, K] weights
    wb = torch.rand(b, k, generator=gen, dtype=torch.float64) + 0.1
    out_b = mix_teacher_logprobs(ls[[0, 2]].to(dtype), wb[:, [0, 2]].to(dtype), "arithmetic")
    ref_b = []
    for i in range(b):
        z = wb[i, 0].item() + wb[i, 2].item()
        ref_b.append(
            [math.log(sum(wb[i, q].item() / z * math.exp(ls[q, i, j].item()) for q in (0, 2))) for j in range(t)]
        )
    _close(out_b, ref_b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_geometric_mixture_reference_and_one_hot_routing(dtype):
    gen = torch.Generator().manual_seed(3)
    k, b, t = 3, 3, 4
    ls = -torch.rand(k, b, t, generator=gen, dtype=torch.float64) * 6
    w = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    out = mix_teacher_logprobs(ls.to(dtype), w.to(dtype), "geometric")
    ref = [[sum(w[q].item() * ls[q, i, j].item() for q in range(k)) for j in range(t)] for i in range(b)]
    _close(out, ref, dtype)
    # one-hot per-sample weights route row i to teacher route[i]; -inf of unrouted teachers must not give nan
    route = [2, 0, 1]
    onehot = torch.zeros(b, k, dtype=dtype)
    for i, q in enumerate(route):
        onehot[i, q] = 1.0
    ls_inf = ls.clone()
    ls_inf[1, 0, :] = float("-inf")  # teacher 1 on row 0 (routed to teacher 2)
    routed = mix_teacher_logprobs(ls_inf.to(dtype), onehot, "geometric")
    for i, q in enumerate(route):
        assert torch.equal(routed[i], ls_inf[q, i].to(dtype))
    routed_a = mix_teacher_logprobs(ls_inf.to(dtype), onehot, "arithmetic")
    for i, q in enumerate(route):
        _close(routed_a[i], ls_inf[q, i], dtype)


def test_mixture_weight_normalisation_and_errors():
    gen = torch.Generator().manual_seed(4)
    ls = -torch.rand(2, 3, 4, generator=gen)
    for kind in ("arithmetic", "geometric"):
        a = mix_teacher_logprobs(ls, torch.tensor([2.0, 2.0]), kind)
        b = mix_teacher_logprobs(ls, torch.tensor([0.5, 0.5]), kind)
        torch.testing.assert_close(a, b)
        c = mix_teacher_logprobs(ls, [2.0, 2.0], kind)  # plain list is accepted too
        torch.testing.assert_close(a, c)
    with pytest.raises(ValueError, match="non-negative"):
        mix_teacher_logprobs(ls, torch.tensor([1.0, -0.5]), "arithmetic")
    with pytest.raises(ValueError, match="sum to 0"):
        mix_teacher_logprobs(ls, torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]), "geometric")
    with pytest.raises(ValueError, match="arithmetic, geometric"):
        mix_teacher_logprobs(ls, torch.tensor([1.0, 1.0]), "harmonic")


# ---------------------------------------------------------------------------------------------------- JSD


def _ref_kl(p_log: list[float], q_log: list[float]) -> float:
    total = 0.0
    for lp, lq in zip(p_log, q_log):
        if lp == float("-inf"):
            continue
        total += math.exp(lp) * (lp - lq)
    return total


def _ref_jsd(s: torch.Tensor, t: torch.Tensor, beta: float, mask: torch.Tensor) -> float:
    vals = []
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            if not mask[i, j]:
                continue
            sl, tl = s[i, j].tolist(), t[i, j].tolist()
            if beta == 0.0:
                vals.append(_ref_kl(tl, sl))
            elif beta == 1.0:
                vals.append(_ref_kl(sl, tl))
            else:
                m = [beta * math.exp(a) + (1 - beta) * math.exp(c) for a, c in zip(tl, sl)]
                lm = [math.log(x) if x > 0 else float("-inf") for x in m]
                vals.append(beta * _ref_kl(tl, lm) + (1 - beta) * _ref_kl(sl, lm))
    return sum(vals) / len(vals)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_jsd_matches_reference(dtype, beta):
    gen = torch.Generator().manual_seed(5)
    s = _logp_rows(gen, 3, 4, 6)
    t = _logp_rows(gen, 3, 4, 6)
    mask = _mask(gen, 3, 4)
    s_in = s.to(dtype).requires_grad_(True)
    out = generalized_jsd(s_in, t.to(dtype), beta, mask)
    assert out.dim() == 0 and out.dtype == dtype
    _close(out, _ref_jsd(s, t, beta, mask), dtype)
    assert out.item() > 0
    out.backward()
    assert torch.isfinite(s_in.grad).all()
    assert torch.equal(s_in.grad[~mask], torch.zeros_like(s_in.grad[~mask]))


def test_jsd_zero_when_equal_and_nonnegative():
    gen = torch.Generator().manual_seed(6)
    s = _logp_rows(gen, 2, 3, 5)
    mask = torch.ones(2, 3, dtype=torch.bool)
    for beta in (0.0, 0.25, 1.0):
        assert abs(generalized_jsd(s, s.clone(), beta, mask).item()) < 1e-12
    for seed in range(5):
        g = torch.Generator().manual_seed(100 + seed)
        a, b = _logp_rows(g, 2, 3, 5, dtype=torch.float32), _logp_rows(g, 2, 3, 5, dtype=torch.float32)
        for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
            assert generalized_jsd(a, b, beta, mask).item() >= 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_with_zero_probability_entries(beta):
    gen = torch.Generator().manual_seed(7)
    s = _logp_rows(gen, 2, 3, 6)
    t = _logp_rows(gen, 2, 3, 6)
    # entry 5 has probability 0 on both sides everywhere; entry 4 on row [0, 1] only on the side whose zeros
    # keep the divergence finite (the teacher's for forward KL, the student's for reverse KL, either for 0<β<1)
    t[..., 5] = float("-inf")
    s[..., 5] = float("-inf")
    (s if beta == 1.0 else t)[0, 1, 4] = float("-inf")
    t = t - torch.logsumexp(t, -1, keepdim=True)
    s = s - torch.logsumexp(s, -1, keepdim=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    s_nan = s.clone()
    s_nan[1, 2] = float("nan")  # masked garbage
    s_in = s_nan.float().requires_grad_(True)
    out = generalized_jsd(s_in, t.float(), beta, mask)
    assert math.isfinite(out.item())
    _close(out, _ref_jsd(s, t, beta, mask), torch.float32)
    out.backward()
    assert torch.isfinite(s_in.grad).all()
    # the other side's zero makes the divergence genuinely infinite: +inf, never nan
    if beta in (0.0, 1.0):
        s2, t2 = (s.clone(), t.clone())
        (s2 if beta == 0.0 else t2)[1, 1, 0] = float("-inf")
        assert generalized_jsd(s2, t2, beta, mask).item() == float("inf")


def test_jsd_empty_mask_and_bad_beta():
    s = torch.log_softmax(torch.randn(2, 3, 4), -1).requires_grad_(True)
    out = generalized_jsd(s, s.detach().flip(-1), 0.5, torch.zeros(2, 3, dtype=torch.bool))
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(s.grad, torch.zeros_like(s))
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, s, 1.5, torch.ones(2, 3))


# -------------------------------------------------------------------------------------------- top-k support


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_support_rows_sum_to_one_and_values(dtype):
    gen = torch.Generator().manual_seed(8)
    b, t, v, k = 2, 3, 10, 3
    s_full = _logp_rows(gen, b, t, v)
    t_full = _logp_rows(gen, b, t, v)
    t_lp, t_ids = t_full.topk(k, dim=-1)
    sampled = torch.randint(0, v, (b, t), generator=gen)
    sampled[0, 0] = t_ids[0, 0, 1]  # inside the top-k
    sampled[0, 1] = t_full[0, 1].argmin()  # surely outside
    t_samp = t_full.gather(-1, sampled.unsqueeze(-1)).squeeze(-1)

    s_in = s_full.to(dtype).requires_grad_(True)
    ss, ts = topk_support(s_in, t_ids, t_lp.to(dtype), sampled, t_samp.to(dtype))
    assert ss.shape == ts.shape == (b, t, k + 2) and ss.dtype == dtype
    ones = torch.ones(b, t, dtype=torch.float64)
    _close(ss.exp().sum(-1), ones, dtype)
    _close(ts.exp().sum(-1), ones, dtype)
    for i in range(b):
        for j in range(t):
            ids = t_ids[i, j].tolist()
            listed = list(ids)
            dup = sampled[i, j].item() in ids
            if not dup:
                listed.append(sampled[i, j].item())
            for side, full, out in (("s", s_full, ss), ("t", t_full, ts)):
                probs = [math.exp(full[i, j, x].item()) for x in listed]
                ref = [math.log(p) for p in probs[:k]]
                ref.append(float("-inf") if dup else math.log(probs[k]))
                ref.append(math.log(1.0 - sum(probs)))
                got = out[i, j].detach().double()
                if dup:
                    assert got[k].item() == float("-inf"), side
                    got, ref = torch.cat([got[:k], got[k + 1 :]]), ref[:k] + ref[k + 1 :]
                _close(got, ref, dtype)
    assert ts[0, 0, k].item() == float("-inf") and ts[0, 1, k].item() > float("-inf")
    # the JSD over this support is finite and differentiable despite the -inf slot
    loss = generalized_jsd(ss, ts, 0.5, torch.ones(b, t))
    loss.backward()
    assert torch.isfinite(s_in.grad).all() and s_in.grad.abs().sum() > 0


def test_topk_support_without_sampled_and_full_mass():
    gen = torch.Generator().manual_seed(9)
    v = 4
    s_full = _logp_rows(gen, 1, 2, v, dtype=torch.float32).requires_grad_(True)
    t_full = _logp_rows(gen, 1, 2, v, dtype=torch.float32)
    t_lp, t_ids = t_full.topk(v, dim=-1)  # k = V: listed mass is 1 up to rounding
    ss, ts = topk_support(s_full, t_ids, t_lp)
    assert ss.shape == (1, 2, v + 1)
    for x in (ss, ts):
        torch.testing.assert_close(x.exp().sum(-1), torch.ones(1, 2), rtol=0, atol=1e-6)
        assert torch.isfinite(x).all()  # tail floored at eps, not -inf
        assert x[..., -1].exp().max() < 1e-5
    generalized_jsd(ss, ts, 0.0, torch.ones(1, 2)).backward()
    assert torch.isfinite(s_full.grad).all()
    with pytest.raises(ValueError, match="teacher_sampled_logp"):
        topk_support(s_full, t_ids, t_lp, sampled_ids=t_ids[..., 0])


# ------------------------------------------------------------------------------------------------ policy loss


def _ref_policy_loss(logp, old, adv, mask, lo, hi, w=None, beh=None, cap=None, mode="truncate"):
    """PPO-clip in python floats, ratio to `old`; with `beh` (decoupled PPO) each token also weighs
    u = exp(old − beh), truncated to `cap` (or zeroed above it, mode="mask"). Returns (loss, clip fraction)."""
    total, n, clipped = 0.0, 0, 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if not mask[i, j]:
                continue
            a = adv[i, j].item()
            r = math.exp(logp[i, j].item() - old[i, j].item())
            unc = r * a
            clp = min(max(r, 1 - lo), 1 + hi) * a
            u = 1.0 if beh is None else math.exp(old[i, j].item() - beh[i, j].item())
            if cap is not None and u > cap:
                u = cap if mode == "truncate" else 0.0
            total += -min(unc, clp) * u * (1.0 if w is None else w[i, j].item())
            n += 1
            clipped += clp < unc
    return total / n, clipped / n


@pytest.mark.parametrize("dtype", DTYPES)
def test_policy_loss_matches_reference(dtype):
    gen = torch.Generator().manual_seed(10)
    b, t = 3, 6
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    logp = old + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = _mask(gen, b, t)
    w = torch.rand(b, t, generator=gen, dtype=torch.float64) * 2
    lo, hi = 0.2, 0.28
    # garbage at masked positions must change neither the loss, the metrics nor the gradient
    old_g, logp_g, adv_g = old.clone(), logp.clone(), adv.clone()
    old_g[~mask], logp_g[~mask], adv_g[~mask] = float("nan"), float("-inf"), float("inf")
    for weights in (None, w):
        lp = logp_g.to(dtype).clone().requires_grad_(True)
        loss, m = policy_loss(
            lp, old_g.to(dtype), adv_g.to(dtype), mask, lo, hi, None if weights is None else weights.to(dtype)
        )
        ref, ref_clip = _ref_policy_loss(logp, old, adv, mask, lo, hi, weights)
        assert loss.dtype == dtype
        _close(loss, ref, dtype)
        assert set(m) == {"clip_frac", "ratio_mean", "ratio_max", "approx_kl", "loss"}
        assert all(isinstance(x, float) for x in m.values())
        assert m["clip_frac"] == pytest.approx(ref_clip)
        assert 0 < m["clip_frac"] < 1  # the random draw does exercise clipping
        ratios = [math.exp(logp[i, j] - old[i, j]) for i in range(b) for j in range(t) if mask[i, j]]
        assert m["ratio_mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
        assert m["ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
        k3 = [r - 1 - math.log(r) for r in ratios]
        assert m["approx_kl"] == pytest.approx(sum(k3) / len(k3), rel=1e-4, abs=1e-7)
        assert m["loss"] == pytest.approx(ref, rel=1e-5, abs=1e-7)
        loss.backward()
        assert torch.equal(lp.grad[~mask], torch.zeros_like(lp.grad[~mask]))


def test_policy_loss_gradient_sign_and_clipping():
    old = torch.tensor([[-1.0, -2.0, -1.5, -0.5]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    logp = old.clone()
    logp[0, 2] += 1.0  # ratio e ≈ 2.72 ≫ 1.2 with A > 0: clipped, no gradient
    logp[0, 3] -= 1.0  # ratio e^-1 ≈ 0.37 ≪ 0.8 with A < 0: clipped, no gradient
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 4))
    loss.backward()
    g = logp.grad[0]
    assert g[0] < 0  # A > 0 at ratio 1: descending the loss raises logp
    assert g[1] > 0  # A < 0: descending the loss lowers logp
    assert g[0].item() == pytest.approx(-0.25) and g[1].item() == pytest.approx(0.25)
    assert g[2].item() == 0.0 and g[3].item() == 0.0
    assert m["clip_frac"] == pytest.approx(0.5)
    # ratio far outside on the *other* side is not clipped: A > 0 with tiny ratio keeps its gradient
    lp2 = (old - torch.tensor([[1.0, 0.0, 0.0, 0.0]])).requires_grad_(True)
    loss2, m2 = policy_loss(lp2, old, adv, torch.tensor([[1, 0, 0, 0]]))
    loss2.backward()
    assert lp2.grad[0, 0] < 0 and m2["clip_frac"] == 0.0


def test_policy_loss_empty_mask_and_garbage():
    logp = torch.full((2, 3), float("-inf")).requires_grad_(True)
    old = torch.full((2, 3), float("nan"))
    loss, m = policy_loss(logp, old, torch.ones(2), torch.zeros(2, 3))
    assert loss.item() == 0.0 and all(v == 0.0 for v in m.values())
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_decoupled_policy_loss_matches_float64_reference(mode):
    """Decoupled PPO against python floats (value and gradient), the cap counted; proximal = behaviour is the
    standard loss exactly."""
    gen = torch.Generator().manual_seed(11)
    b, t = 4, 7
    beh = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    prox = beh + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.5  # stale samples: μ ≠ π_prox
    logp = (prox + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2).requires_grad_(True)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = _mask(gen, b, t)
    cap = 1.3
    loss, m = policy_loss(logp, beh, adv, mask, 0.2, 0.28, proximal_logp=prox, is_cap=cap, is_mode=mode)
    ref, _ = _ref_policy_loss(logp.detach(), prox, adv, mask, 0.2, 0.28, beh=beh, cap=cap, mode=mode)
    assert loss.item() == pytest.approx(ref, rel=1e-12, abs=1e-14)
    u = torch.exp(prox - beh)[mask]
    assert m["is_capped_frac"] == pytest.approx(float((u > cap).double().mean())) and 0 < m["is_capped_frac"] < 1
    capped = torch.where(u > cap, torch.tensor(cap if mode == "truncate" else 0.0, dtype=u.dtype), u)
    assert m["is_weight_mean"] == pytest.approx(float(capped.mean()))
    assert m["behaviour_kl"] == pytest.approx(float((u - 1 - u.log()).mean())) and m["behaviour_kl"] > 0
    loss.backward()
    # gradient against finite differences of the reference
    g, eps = logp.grad, 1e-6
    for i, j in [(0, 0), (1, 3), (2, 5), (3, 6)]:
        if not mask[i, j]:
            assert g[i, j] == 0
            continue
        hi_lp, lo_lp = logp.detach().clone(), logp.detach().clone()
        hi_lp[i, j] += eps
        lo_lp[i, j] -= eps
        fd = (_ref_policy_loss(hi_lp, prox, adv, mask, 0.2, 0.28, beh=beh, cap=cap, mode=mode)[0]
              - _ref_policy_loss(lo_lp, prox, adv, mask, 0.2, 0.28, beh=beh, cap=cap, mode=mode)[0]) / (2 * eps)
        assert g[i, j].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)
    # no staleness: the decoupled loss is the standard one (weights 1, ratio to the same policy)
    lp = logp.detach().requires_grad_(True)
    same, ms = policy_loss(lp, beh, adv, mask, 0.2, 0.28, proximal_logp=beh, is_cap=cap, is_mode=mode)
    std, _ = policy_loss(lp, beh, adv, mask, 0.2, 0.28)
    assert same.item() == std.item() and ms["is_weight_mean"] == 1.0 and ms["is_capped_frac"] == 0.0
    with pytest.raises(ValueError, match="is_mode must be 'truncate' or 'mask'"):
        policy_loss(lp, beh, adv, mask, proximal_logp=prox, is_mode="clip")
    with pytest.raises(ValueError, match="is_cap must be > 0"):
        policy_loss(lp, beh, adv, mask, proximal_logp=prox, is_cap=0.0)


# ------------------------------------------------------------------------------------------------- balancing


def test_token_share_weights_give_sample_shares():
    gen = torch.Generator().manual_seed(11)
    group_ids = torch.tensor([3, 3, 7, 7, 7, 9, 3, 9])
    lengths = [20, 18, 2, 1, 3, 10, 15, 0]  # group 7 has short answers
    t = 20
    mask = torch.zeros(8, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    w = token_share_weights(group_ids, mask)
    n_tokens = sum(lengths)
    assert w.shape == (8, t) and w.dtype == torch.get_default_dtype()
    assert torch.equal(w[~mask], torch.zeros_like(w[~mask]))
    assert w.sum().item() == pytest.approx(n_tokens, rel=1e-6)
    for g in (3, 7, 9):
        rows = [i for i in range(8) if group_ids[i] == g]
        share = sum(w[i].sum().item() for i in rows) / n_tokens
        assert share == pytest.approx(len(rows) / 8, rel=1e-6)
    # the balanced loss weights group 7 three times its token count would
    adv = torch.randn(8, t, generator=gen)
    loss, _ = policy_loss(torch.zeros(8, t), torch.zeros(8, t), adv, mask, token_weights=w)
    ref = -sum(adv[i, j].item() * w[i, j].item() for i in range(8) for j in range(t) if mask[i, j]) / n_tokens
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_token_share_weights_prompt_share_and_empty_groups():
    group_ids = torch.tensor([0, 0, 1, 2])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    # group 2 has no tokens: dropped, shares of 0 and 1 renormalised from 0.3/0.1 to 0.75/0.25
    w = token_share_weights(group_ids, mask, prompt_share={0: 0.3, 1: 0.1, 2: 0.6})
    assert w.dtype == torch.float64
    assert w[:2].sum().item() == pytest.approx(0.75 * 6)
    assert w[2].sum().item() == pytest.approx(0.25 * 6)
    assert torch.equal(w[3], torch.zeros(4, dtype=torch.float64))
    w_t = token_share_weights(group_ids, mask, prompt_share=torch.tensor([0.3, 0.1, 0.6]))
    torch.testing.assert_close(w, w_t)
    assert torch.equal(token_share_weights(group_ids, torch.zeros(4, 4)), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="no entry"):
        token_share_weights(group_ids, mask, prompt_share={0: 1.0})


def test_balance_weights_dispatch():
    gid, mask = torch.tensor([0, 1]), torch.ones(2, 3)
    assert balance_weights("none", gid, mask) is None
    torch.testing.assert_close(balance_weights("tokens", gid, mask), token_share_weights(gid, mask))
    with pytest.raises(ValueError, match="none, tokens"):
        balance_weights("prompts", gid, mask)
