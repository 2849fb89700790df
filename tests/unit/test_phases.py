"""The colocated memory pre-flight: each phase's need from tensor sizes, per placement and teacher offload."""

from __future__ import annotations

import pytest
import torch

from mopd_core.runtime.phases import ColocationError, check_colocated_fit, fsdp_gathered_bytes

MB = 2**20


def _need(placement, offload, limit_gib=None):
    return check_colocated_fit(kind="cpu", limit_gib=limit_gib, student_bytes=100 * MB, optimizer_factor=2.0,
                               teacher_bytes={"math": 80 * MB, "code": 120 * MB}, teachers_offload=offload,
                               placement=placement)


def test_phase_needs_per_placement():
    # colocated + offload: train 4w; rollout w; score w + the largest teacher
    assert _need("colocated", True) == {"train": 400, "rollout": 100, "score (code)": 220}
    # disaggregated: the training state stays through every phase
    assert _need("disaggregated", True) == {"train": 400, "rollout": 400, "score (code)": 520}
    # no offload: both teachers resident in every phase
    assert _need("colocated", False) == {"train": 600, "rollout": 300, "score (all teachers)": 300}


def test_over_budget_names_phase_and_fix():
    budget = 450 / 1024  # GiB: colocated+offload (max 400 MiB) fits, no offload (600) does not
    _need("colocated", True, budget)
    with pytest.raises(ColocationError) as e:
        _need("colocated", False, budget)
    msg = str(e.value)
    assert "phase 'train' needs 0.586 GiB" in msg and "budget is 0.439 GiB" in msg and "2 teacher(s) all " \
        "resident (teachers.offload=false)" in msg and "\n" not in msg


def test_fsdp2_shards_the_training_state_and_the_error_says_so():
    """Per rank under FSDP2: (weights + grads + AdamW) / N, plus the driver's copy of the weights for rollout."""
    kw = dict(kind="cpu", student_bytes=100 * MB, optimizer_factor=2.0, teacher_bytes={}, teachers_offload=True,
              placement="colocated")
    assert check_colocated_fit(limit_gib=None, shards=4, driver_copy=True, **kw)["train"] == 100 + 100
    assert check_colocated_fit(limit_gib=None, shards=1, **kw)["train"] == 400
    check_colocated_fit(limit_gib=250 / 1024, shards=4, driver_copy=True, **kw)  # fits sharded
    with pytest.raises(ColocationError) as e:
        check_colocated_fit(limit_gib=250 / 1024, shards=1, **kw)
    msg = str(e.value)
    assert "phase 'train' needs 0.391 GiB per device" in msg and "runtime.strategy=fsdp2" in msg
    assert "\n" not in msg


def test_teachers_on_the_ranks_are_counted_per_rank_beside_the_training_state():
    """teachers.placement=workers: each rank's teachers are asked at once (loaded together) while the ranks keep
    their training state, and the driver holds no teacher."""
    kw = dict(kind="cpu", student_bytes=100 * MB, optimizer_factor=2.0, placement="colocated", shards=2,
              driver_copy=True)
    need = check_colocated_fit(limit_gib=None, teacher_bytes={"teachers on rank 0": 160 * MB,
                                                             "teachers on rank 1": 80 * MB},
                               teachers_offload=True, teachers_on_ranks=True, **kw)
    # state = 4w / 2 shards + the driver's copy = 300; score on rank 0 = state + its two teachers
    assert need == {"train": 300, "rollout": 100, "score (teachers on rank 0)": 460}
    resident = check_colocated_fit(limit_gib=None, teacher_bytes={"teachers on rank 0": 160 * MB,
                                                                 "teachers on rank 1": 80 * MB},
                                   teachers_offload=False, teachers_on_ranks=True, **kw)
    assert resident["train"] == 300 + 160  # the heaviest rank's teachers, not all of them
    with pytest.raises(ColocationError, match=r"phase 'score \(teachers on rank 0\)' needs 0.449 GiB"):
        check_colocated_fit(limit_gib=400 / 1024, teacher_bytes={"teachers on rank 0": 160 * MB},
                            teachers_offload=True, teachers_on_ranks=True, **kw)


def test_fsdp_cpu_offload_leaves_only_the_gathered_units_on_the_device():
    """train.fsdp_cpu_offload: shards, gradients and AdamW state on the host; the device holds the units
    gathered at once and their gradients, beside the driver's copy and the activations."""
    kw = dict(kind="cpu", student_bytes=100 * MB, optimizer_factor=2.0, teacher_bytes={}, teachers_offload=True,
              placement="colocated", shards=2, driver_copy=True, activations=10 * MB)
    assert check_colocated_fit(limit_gib=None, **kw)["train"] == 200 + 100 + 10
    assert check_colocated_fit(limit_gib=None, gathered=30 * MB, **kw)["train"] == 60 + 100 + 10
    # what is gathered at once: the root (embeddings + lm_head) and one of the decoder layers, in the compute dtype
    hidden, layers, vocab, per_layer = 64, 4, 1000, 50_000
    n = 2 * vocab * hidden + layers * per_layer
    assert fsdp_gathered_bytes(n, (hidden, layers, vocab), 2) == (2 * vocab * hidden + per_layer) * 2
    assert fsdp_gathered_bytes(n, None, 4) == n * 4  # shape unknown: the whole model


def _saved_bytes_per_token_layer(hidden: int, inter: int, heads: int, kv_heads: int, autocast: bool) -> float:
    """What autograd keeps for the backward of a 2-layer Qwen3 body (saved_tensors_hooks, each storage once, the
    parameters and their bf16 copies left out), per token and layer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, num_hidden_layers=2, vocab_size=128, head_dim=hidden // heads,
                      attn_implementation="sdpa")
    m = AutoModelForCausalLM.from_config(cfg).float().train()
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    casts = {tuple(p.shape) for p in m.parameters() if p.dim() == 2}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and not (t.dtype == torch.bfloat16 and tuple(t.shape) in casts):
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    rows, T = 2, 128
    ids = torch.randint(0, 128, (rows, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        m.model(input_ids=ids)
    return sum(seen.values()) / (rows * T * 2)


@pytest.mark.parametrize("autocast", [True, False])
def test_the_activation_estimate_matches_what_autograd_saves(autocast):
    """The update's activation estimate against the bytes autograd really keeps, on a layer shape the estimate's
    constants were not fitted on (catches an estimate that drifts from transformers' layers — the H200 stage
    measured 1.4× the earlier 34·H count)."""
    from mopd_core.runtime.phases import layer_activation_bytes

    hidden, inter, heads, kv_heads = 192, 640, 6, 2
    measured = _saved_bytes_per_token_layer(hidden, inter, heads, kv_heads, autocast)
    est = layer_activation_bytes(hidden, inter, kv_heads * hidden // heads, dtype_bytes=2 if autocast else 4)
    assert 0.85 < est / measured < 1.15, (est, measured)
