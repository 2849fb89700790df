"""The fast paths equal the paths they replaced, and the GPU performance script's code path
runs at tiny shapes on the CPU so that it cannot rot where no device is lent."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mopd_core.config import TinyModelConfig
from mopd_core.models import build_tiny_model, build_tiny_tokenizer
from mopd_core.rollout import encode_prompts, sample

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_tok():
    tok = build_tiny_tokenizer()
    m = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128), len(tok),
                         tok.pad_token_id, tok.eos_token_id, seed=0).eval()
    return m, tok


@pytest.mark.parametrize("kw", [dict(), dict(greedy=True), dict(temperature=0.7, top_p=0.8, top_k=20)],
                         ids=["sample", "greedy", "truncated"])
def test_preallocated_kv_cache_is_bit_identical_to_dynamic_cache(model_tok, kw):
    model, tok = model_tok
    prompts = ["12+34=", "rev:abcde=", "7-3=", "sort:31425=", "upper:ab=", "rep3:ab="]
    ids, mask = encode_prompts(tok, prompts, "cpu")  # left-padded: rows of different prompt lengths
    # several stop ids, so that rows stop at different steps (a random model rarely picks EOS)
    stops = [tok.eos_token_id] + tok.convert_tokens_to_ids(list("0123"))
    outs = {}
    for kv in ("dynamic", "preallocated"):
        g = torch.Generator().manual_seed(5)
        outs[kv] = sample(model, ids, mask, max_new_tokens=8, eos_id=stops, pad_id=tok.pad_token_id, generator=g,
                          kv_cache=kv, **kw)
    for a, b in zip(outs["dynamic"], outs["preallocated"]):
        assert torch.equal(a, b)
    c_mask = outs["preallocated"][1]
    assert 0 < int(c_mask.sum()) < c_mask.numel() or kw.get("greedy")  # some rows stopped early (not all)


def test_preallocated_layer_grows_past_its_capacity_like_dynamic_cache():
    from transformers.cache_utils import DynamicLayer

    from mopd_core.rollout.kvcache import PreallocLayer

    pre, dyn = PreallocLayer()(), DynamicLayer()
    pre.capacity = 3
    g = torch.Generator().manual_seed(0)
    for n in (2, 1, 2, 1):  # 2 + 1 fill the buffer, then it grows
        k, v = torch.randn(2, 3, n, 4, generator=g), torch.randn(2, 3, n, 4, generator=g)
        a, b = pre.update(k, v), dyn.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert pre.get_seq_length() == dyn.get_seq_length() == 6


def test_sample_refuses_an_unknown_kv_cache(model_tok):
    model, tok = model_tok
    ids, mask = encode_prompts(tok, ["1+1="], "cpu")
    with pytest.raises(ValueError, match="kv_cache"):
        sample(model, ids, mask, max_new_tokens=2, eos_id=tok.eos_token_id, pad_id=0, kv_cache="static")


def _perf_checks():
    spec = importlib.util.spec_from_file_location("perf_checks", ROOT / "tests" / "device" / "perf_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flops_count_of_the_device_script_matches_a_hand_count():
    pc = _perf_checks()
    cfg = pc.qwen3_1p7b()
    per_tok, n = pc.model_flops_per_token(cfg, 4096)
    # Qwen3-1.7B: 28 × (q 2048·2048 + k,v 2·2048·1024 + o 2048·2048 + MLP 3·2048·6144) + lm_head 151936·2048
    assert n == 28 * (2048 * 2048 * 2 + 2 * 2048 * 1024 + 3 * 2048 * 6144) + 151_936 * 2048
    assert 1.6e9 < n < 1.8e9
    assert per_tok == 6 * n + 6 * 2 * 28 * 2048 * 4097


@pytest.mark.dryrun
def test_device_perf_script_runs_its_code_path_on_cpu(tmp_path):
    # as run_all.sh runs it (a script: its hand-over receiver is spawned from it), then its summary as run_all.sh
    # writes it: every GPU check's code at tiny shapes on the CPU
    out = tmp_path / "perf.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "device" / "perf_checks.py"), "--dry-run", "--out",
                           str(out)], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    checks = res["checks"]
    assert set(checks) == {n for n, *_ in _perf_checks().PLAN}
    assert res["ok"], {k: v.get("error") for k, v in checks.items()}
    # the gpu_scale stage through recipe.mopd_stage: both steps, every completion at the budget (ignore_eos)
    st = checks["stage"]
    assert [s["step"] for s in st["steps"]] == [1, 2] and all(math.isfinite(s["loss"]) for s in st["steps"])
    assert {v for s in st["steps"] for k, v in s.items() if k.startswith("length/")} == {st["max_new_tokens"]}
    assert set(st["estimate_mib"]["preflight"]) == {"train", "rollout", "score"}
    # MFU through policy_update: both lengths with the (eager-backend) compiled layers, then the eager layers
    mfu = checks["mfu"]
    assert mfu["layers_compiled"] == 2
    assert [(r["seq"], r["compiled"]) for r in mfu["runs"]] == [(32, True), (64, True), (32, False)]
    assert all(r["steps_timed"] >= 1 and r["achieved_tflops"] > 0 and math.isfinite(r["loss"]) for r in mfu["runs"])
    # TRL's DistillationTrainer: two steps of the stage's samples, every completion at the budget
    trl = checks["trl"]
    assert len(trl["steps"]) == 2 and all(s["tokens"] == 4 * 24 for s in trl["steps"]) and "oom" not in trl
    assert checks["logprob_memory"]["max_abs_logp_diff"] < 1e-5  # chunked = full
    ho = checks["handover"]
    assert ho["transport"] == "shared_memory" and ho["bytes"] > 0 and len(ho["runs"]) == 3
    assert all(r["messages"] == ho["buckets"] for r in ho["runs"])
    assert len(ho["steady"]) == 3 and ho["steady_update_s_best"] > 0
    # the parameters bound to the buckets: nothing re-packed per update, and the receiver holds the sender's bytes
    assert all(r["bytes_repacked"] == 0 for r in ho["steady"]) and ho["receiver_matches_sender"]
    assert all(r["bytes_repacked"] == ho["bytes"] for r in ho["steady_foreach_repack"])
    st = checks["mopd_step"]
    assert st["finite"] and st["completion_tokens"] > 0 and math.isfinite(st["loss"])
    sa = checks["sampling"]  # eager HFRollout vs the graphed engine's step run uncaptured: the same tokens
    assert sa["graphed_capture"] is False and sa["agreement"]["identical_fraction"] == 1.0
    assert sa["graphed"]["steady"]["tokens"] == sa["batch"] * sa["max_new_tokens"]  # ignore_eos: full length
    assert sa["agreement"]["max_abs_logp_diff_before_divergence"] < 1e-5

    # run_all.sh's last part: device_checks.{json,md} from the run's folder
    run = tmp_path / "run"
    run.mkdir()
    (run / "perf.json").write_text(out.read_text())
    sys.path.insert(0, str(ROOT / "tests" / "device"))
    import summarize

    assert summarize.main([str(run), str(tmp_path / "results"), "0", "0"]) == 0
    md = (tmp_path / "results" / "device_checks.md").read_text()
    for heading in ("MOPD stage at real size", "MFU through the loop's `policy_update`", "TRL `DistillationTrainer`"):
        assert heading in md
    doc = json.loads((tmp_path / "results" / "device_checks.json").read_text())
    assert doc["machine"]["torch"] == torch.__version__ and doc["perf"]["checks"].keys() == checks.keys()


def test_compiled_decoder_layers_train_like_eager_ones_and_keep_names():
    """`models.compile_decoder_layers` (train.compile) wraps each decoder layer's forward: compiled in training mode,
    eager in eval mode (samplers, evaluation), parameter names unchanged. The eager dynamo backend on the CPU runs
    the same wrapping and tracing (inductor's code generation is the accelerator's)."""
    import copy

    from mopd_core.models import compile_decoder_layers

    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, arch="qwen3"), 50, 0, 1,
                             seed=0).train()
    comp = copy.deepcopy(model)
    assert compile_decoder_layers(comp, "cpu") == 0  # nothing on the CPU unless a backend is asked for
    assert compile_decoder_layers(comp, "cpu", backend="eager") == 2
    assert list(comp.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    for m in (model, comp):
        m(input_ids=ids).logits.double().square().mean().backward()
    for (name, a), b in zip(model.named_parameters(), comp.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    model.eval(), comp.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, comp(input_ids=ids).logits)


def test_colocated_estimate_adds_the_sampler_cache_and_the_teacher_forward():
    from mopd_core.runtime.phases import check_colocated_fit, forward_activation_bytes, kv_cache_bytes

    # Qwen3-1.7B: 28 layers × 8 KV heads × 128, bf16: 114,688 bytes a position
    assert kv_cache_bytes(1, 1, 28, 8 * 128, 2) == 114_688
    assert forward_activation_bytes(10, 4, 6, 2) == 10 * (12 + 18) * 2
    kw = dict(kind="cpu", limit_gib=1e6, student_bytes=2**30, optimizer_factor=2.0, teacher_bytes={"t": 2**29},
              teachers_offload=True, placement="colocated")
    base, more = check_colocated_fit(**kw), check_colocated_fit(**kw, sampling=2**20, scoring=2**21)
    assert more["rollout"] == base["rollout"] + 1 and more["score (t)"] == base["score (t)"] + 2
    assert more["train"] == base["train"]
