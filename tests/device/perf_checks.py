"""Performance checks for a lent GPU, one prepared run of ≤ 8 minutes on one H200 with the
packages that machine has (torch, transformers, triton; no vLLM, no download):

1. `mfu`: train steps of a random-initialised 1.7B-class Qwen3-shaped model (config built here), bf16, AdamW,
   the loss through our chunked log-probs (`algorithms.logprobs.token_logprobs`, no [tokens, vocab] tensor):
   MFU = (6·N + attention) FLOPs per token × tokens/s ÷ the device's dense bf16 peak (and ÷ a measured bf16
   matmul peak). Goal ≥ 40 %.
2. `logprob_memory`: peak device memory of `token_logprobs` forward + backward at 16k tokens × the real
   vocabulary, `chunked` vs `full`.
3. `handover`: CUDA IPC hand-over of the model's weights to another process (`weights.CudaIpcTransport`, one
   handle per bucket): bytes, pack seconds, seconds from sending the handles to the receiver holding a copy in its
   own parameters (first hand-over: handles opened), and the steady per-update hand-over (the receiver keeps its
   mapping and copies) three ways: re-pack tensor by tensor (the old path), one fused `_foreach_copy_` per bucket
   (`weights.refill_buckets`), and parameters bound to the buckets (`weights.bind_to_buckets`: no re-pack) —
   against the HBM copy floor (the same bytes through one device-to-device `copy_`). Goal: the bound path's
   steady hand-over ≤ 1.5× the floor; the receiver's bytes are checked against the sender's after an update.
4. `mopd_step`: one colocated MOPD step on the device — `HFRollout` sampling, a local teacher's scores, the
   sampled-token reverse-KL advantage and `train.loop.policy_update` — with seconds and peak memory per phase.
5. `sampling`: sampling without vLLM — `HFRollout` against `rollout.backend: hf_graphed` (static KV cache, the
   decode step captured as a CUDA graph) at the 1.7B shape with the real vocabulary, 128 prompts × 512 new tokens
   (ignore_eos): tokens/s of both, capture seconds, token agreement for one seed, log-prob gaps, peak memory.
   Goal: ≥ 8× the 523 tokens/s `HFRollout` sampled at in the first device run.

    python tests/device/perf_checks.py --out perf.json [--budget-s 420]    # on the GPU (run_all.sh calls it)
    python tests/device/perf_checks.py --dry-run --out /tmp/x.json          # tiny shapes on CPU (the unit test)

`--dry-run` runs the same functions at tiny shapes on the CPU (the hand-over through host shared memory, the
transport a device without IPC uses) so the script cannot rot where no GPU is lent; its numbers mean nothing.
Each check is timed against `--budget-s`; one that would not fit is skipped with the reason in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by device name (NVIDIA data sheets; SXM parts)
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
MFU_GOAL, HANDOVER_GOAL = 0.40, 1.5


def qwen3_1p7b(vocab: int = 151_936, tiny: bool = False):
    """A Qwen3-1.7B-shaped config (28 layers, hidden 2048, 16 q / 8 kv heads of 128, MLP 6144, tied embeddings
    off), built locally; `tiny` shrinks every width for the CPU dry run."""
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=min(vocab, 512), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                           tie_word_embeddings=False)
    return Qwen3Config(vocab_size=vocab, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                       tie_word_embeddings=False, rope_theta=1_000_000.0)


def build(cfg, device, dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_mem(device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else float("nan")


def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def device_peak_tflops(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(0)
    return next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)


def measured_matmul_tflops(device, n: int, dtype, reps: int = 20) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12


def model_flops_per_token(cfg, seq: int) -> tuple[float, int]:
    """(training FLOPs per token = 6·N_matmul + causal attention, N_matmul): N_matmul counts every weight a token
    multiplies (layers and lm_head; not the embedding lookup)."""
    h, L, inter, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    n = L * per_layer + v * h
    attn = 6 * 2 * L * q * (seq + 1)  # fwd QKᵀ+AV causal ≈ 2·2·q·(seq+1)/2 per token per layer, ×3 for train
    return 6.0 * n + attn, n


# ---------------------------------------------------------------- 1. MFU


def check_mfu(device, tiny: bool, budget_s: float) -> dict:
    from mopd_core.algorithms.logprobs import LogitTransform, token_logprobs

    cfg = qwen3_1p7b(tiny=tiny)
    dtype = torch.bfloat16 if not tiny else torch.float32
    batch, seq = (4, 4096) if not tiny else (2, 32)
    steps, warm = (6, 2) if not tiny else (2, 1)
    model = build(cfg, device, dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(device).type == "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
    head = model.get_output_embeddings()
    res = {"config": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
           "batch": batch, "seq": seq, "dtype": str(dtype).removeprefix("torch.")}

    def step():
        hidden = model.model(input_ids=ids[:, :-1]).last_hidden_state.reshape(batch * seq, -1)
        lp = token_logprobs(hidden, head.weight, ids[:, 1:].reshape(-1), LogitTransform()).logp
        (-lp.mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak(device)
    t_start = time.perf_counter()
    times = []
    for i in range(warm + steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        if i >= warm:
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget_s:
            break
    per_tok, n = model_flops_per_token(cfg, seq)
    sec = sorted(times)[len(times) // 2] if times else float("nan")
    achieved = per_tok * batch * seq / sec / 1e12
    peak = device_peak_tflops(device)
    meas = measured_matmul_tflops(device, 8192 if not tiny else 64, dtype)
    res.update({"params_matmul": n, "params_total": sum(p.numel() for p in model.parameters()),
                "step_s_median": sec, "steps_timed": len(times), "tokens_per_s": batch * seq / sec,
                "achieved_tflops": achieved, "device_peak_tflops": peak, "measured_matmul_tflops": meas,
                "mfu": achieved / peak if peak else None, "mfu_vs_measured_matmul": achieved / meas,
                "peak_mem_gib": peak_mem(device), "goal_mfu": MFU_GOAL})
    res["goal_met"] = None if res["mfu"] is None else res["mfu"] >= MFU_GOAL
    return res


# ---------------------------------------------------------------- 2. chunked vs full log-prob memory


def check_logprob_memory(device, tiny: bool) -> dict:
    from mopd_core.algorithms.logprobs import LogitTransform, token_logprobs

    N, H, V = (16_384, 2048, 151_936) if not tiny else (64, 32, 500)
    dtype = torch.bfloat16 if not tiny else torch.float32
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(N, H, generator=g) * 0.5).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g) * 0.02).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=g).to(device)
    res = {"tokens": N, "hidden": H, "vocab": V, "dtype": str(dtype).removeprefix("torch.")}
    out = {}
    for impl in ("chunked", "full"):
        hidden.grad = weight.grad = None
        reset_peak(device)
        base = torch.cuda.memory_allocated() / 2**30 if torch.device(device).type == "cuda" else 0.0
        sync(device)
        t0 = time.perf_counter()
        sc = token_logprobs(hidden, weight, targets, LogitTransform(), impl=impl, entropy=True)
        sc.logp.sum().backward()
        sync(device)
        out[impl] = sc.logp.detach().float()
        res[impl] = {"peak_extra_gib": peak_mem(device) - base, "seconds": time.perf_counter() - t0}
        del sc
    res["max_abs_logp_diff"] = float((out["chunked"] - out["full"]).abs().max())
    if torch.device(device).type == "cuda":
        res["memory_ratio_full_over_chunked"] = res["full"]["peak_extra_gib"] / max(res["chunked"]["peak_extra_gib"],
                                                                                     1e-9)
    return res


# ---------------------------------------------------------------- 3. the weight hand-over to another process


def _receiver(kind: str, conn, device: str) -> None:
    """Another process (an engine's worker): allocate its own parameters, then per message map the sender's
    buffers and copy them into its parameters; report the seconds. A list message is a new set of layouts (its
    parameters are reallocated); "checksum" asks for the bytes' sum of its parameters."""
    from mopd_core.weights import BucketLayout, make_transport
    from mopd_core.weights.buckets import allocate

    try:
        own, got = None, None
        while True:
            msg = conn.recv()
            if msg is None:
                break
            if isinstance(msg, list):  # layouts: the receiver's own parameters exist before any hand-over
                own = [allocate(BucketLayout.from_dict(d), device) for d in msg]
                sync(device)
                conn.send("ready")
                continue
            if msg == "checksum":
                conn.send({"checksum": _checksum(own)})
                continue
            t0 = time.perf_counter()
            if msg != "again":  # new handles: map them (an engine does this once; later updates reuse them)
                got = make_transport(kind).receive(msg)
            for dst, b in zip(own, got.buckets.buckets):
                dst.copy_(b.buffer, non_blocking=True)
            sync(device)
            conn.send({"receive_s": time.perf_counter() - t0})
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send({"error": traceback.format_exc()[-2000:]})


def _checksum(buffers) -> int:
    """A sum over the raw bytes of flat buffers (equal bytes ⇒ equal sums; a stale bucket changes it)."""
    return int(sum(int(b.view(torch.uint8).sum(dtype=torch.int64)) for b in buffers))


def _copy_floor(nbytes: int, device) -> float:
    """The HBM copy floor: the same bytes through one device-to-device copy (read + write each byte once)."""
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(flat)
    floors = []
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(flat)
        sync(device)
        floors.append(time.perf_counter() - t0)
    return min(floors)


def _steady(ask, repack, repeats: int, device) -> list[dict]:
    """Per-update hand-overs with the receiver's mapping kept: `repack()` (the sender's half: bytes copied; the
    sender's stream synchronised before the receiver is told, or it could read half-written buckets) then the
    receiver's copy into its parameters."""
    rows = []
    for _ in range(repeats):
        sync_t0 = time.perf_counter()
        copied = repack()
        sync(device)
        rep = ask("again")
        rows.append({"update_s": time.perf_counter() - sync_t0, "receive_s": rep["receive_s"],
                     "bytes_repacked": copied})
    return rows


def check_handover(device, tiny: bool, repeats: int = 3) -> dict:
    """The first hand-over (handles opened) of freshly packed buckets, then three ways to hand over each later
    update: the old tensor-by-tensor re-pack, one fused `_foreach_copy_` per bucket (`refill_buckets`), and
    parameters bound to the bucket storage (`bind_to_buckets`: nothing to re-pack, the receiver's copy is the one
    pass over the bytes) — the goal is judged on the last, the one the trainer uses."""
    from mopd_core.weights import bind_to_buckets, make_transport, pack_buckets, refill_buckets

    is_cuda = torch.device(device).type == "cuda"
    kind = "cuda_ipc" if is_cuda else "shared_memory"
    model = build(qwen3_1p7b(tiny=tiny), device, torch.bfloat16)
    named = {n: t.detach() for n, t in model.named_parameters()}
    nbytes = sum(t.numel() * t.element_size() for t in named.values())
    bucket = 512 << 20 if not tiny else 64 << 10
    floor = _copy_floor(nbytes, device)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(kind, child, str(device)), daemon=True)
    proc.start()

    def ask(msg, timeout: float = 300.0):
        """Send `msg`; the receiver's answer, or an error naming its exit code when it died or hung."""
        parent.send(msg)
        deadline = time.perf_counter() + timeout
        while not parent.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"the receiver process exited (code {proc.exitcode}) before answering")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the receiver did not answer within {timeout:.0f} s")
        rep = parent.recv()
        if isinstance(rep, dict) and "error" in rep:
            raise RuntimeError(f"receiver failed: {rep['error']}")
        return rep

    tr = make_transport(kind)
    try:
        out = _handover_runs(ask, tr, named, model, bucket, repeats, floor, bind_to_buckets, pack_buckets,
                             refill_buckets)
        parent.send(None)
    finally:
        tr.release()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    out.update({"transport": kind, "bytes": nbytes, "copy_floor_s": floor, "copy_floor_gbps": nbytes / floor / 1e9,
                "goal_over_floor": HANDOVER_GOAL})
    out["goal_met"] = out["steady_over_floor"] <= HANDOVER_GOAL if is_cuda else None
    return out


def _handover_runs(ask, tr, named, model, bucket, repeats, floor, bind_to_buckets, pack_buckets,
                   refill_buckets) -> dict:
    t0 = time.perf_counter()
    packed = pack_buckets(named, bucket)
    sync(next(iter(named.values())).device)
    pack_s = time.perf_counter() - t0
    if ask([b.layout.to_dict() for b in packed.buckets]) != "ready":
        raise RuntimeError("the receiver did not allocate its parameters")
    rows = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sent = tr.send(packed)
        rep = ask(sent.message)
        rows.append({"handover_s": time.perf_counter() - t0, "receive_s": rep["receive_s"],
                     "send_s": sent.report.seconds, "bytes_copied_by_transport": sent.report.bytes_copied,
                     "messages": sent.report.messages})

    def per_tensor():  # the path before refill_buckets: a copy kernel per tensor
        with torch.no_grad():
            for b in packed.buckets:
                for e in b.layout.entries:
                    b.buffer[e.offset:e.offset + e.numel].view(e.shape).copy_(named[e.name])
        return packed.nbytes

    # (with shared memory — the CPU dry run — send itself writes the segments, so "again" re-reads stale bytes:
    # the loops only exercise the code there)
    dev = next(iter(named.values())).device
    old = _steady(ask, per_tensor, repeats, dev)
    fused = _steady(ask, lambda: refill_buckets(packed, named), repeats, dev)
    # the trainer's parameters become views of the buckets; the receiver maps their handles once
    bound = bind_to_buckets(model, bucket)
    sync(dev)
    params = {n: p for n, p in model.named_parameters()}
    ask(tr.send(bound).message)
    steady = _steady(ask, lambda: refill_buckets(bound, params), repeats, dev)
    with torch.no_grad():  # an optimizer-like in-place update, handed over: the receiver holds the new bytes
        torch._foreach_add_(list(params.values()), 1.0)
    sync(dev)
    ask("again" if tr.name == "cuda_ipc" else tr.send(bound).message)
    matches = ask("checksum")["checksum"] == _checksum([b.buffer for b in bound.buckets])
    best = min(r["handover_s"] for r in rows)
    sb = min(r["update_s"] for r in steady)
    return {"buckets": len(bound.buckets), "pack_s": pack_s, "runs": rows, "handover_s_best": best,
            "handover_over_floor": best / floor, "pack_plus_handover_over_floor": (pack_s + best) / floor,
            "steady_per_tensor_repack": old, "steady_per_tensor_over_floor": min(r["update_s"] for r in old) / floor,
            "steady_foreach_repack": fused, "steady_foreach_over_floor": min(r["update_s"] for r in fused) / floor,
            "steady": steady, "steady_path": "bind_to_buckets (parameters are views of the buckets)",
            "steady_update_s_best": sb, "steady_over_floor": sb / floor, "receiver_matches_sender": matches}


# ---------------------------------------------------------------- 4. a colocated MOPD step


class _Ex:
    def __init__(self, prompt: str, tid: str):
        self.prompt, self.teacher_id = prompt, tid


def check_mopd_step(device, tiny: bool) -> dict:
    """Sampling, a teacher's scores and the PPO update on one device, through the loop's own functions. The
    character tokenizer of the tiny recipe, the 1.7B-class body with that vocabulary (random weights: the
    samples are noise; the compute per token is the 1.7B model's minus its 151k-wide head)."""
    from mopd_core import algorithms as alg
    from mopd_core.config import MOPDConfig
    from mopd_core.models import build_tiny_tokenizer
    from mopd_core.rollout import HFRollout, score_completions
    from mopd_core.train.loop import lr_lambda, policy_update

    tok = build_tiny_tokenizer()
    cfg = qwen3_1p7b(vocab=len(tok), tiny=tiny)
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    prompts, group, new = (16, 8, 64) if not tiny else (2, 2, 4)
    student = build(cfg, device, torch.float32, seed=0)
    teacher = build(cfg, device, torch.bfloat16 if not tiny else torch.float32, seed=1).eval().requires_grad_(False)
    loop = MOPDConfig(prompts_per_step=prompts, group_size=group, lr=1e-6)
    opt = torch.optim.AdamW(student.parameters(), lr=loop.lr, fused=torch.device(device).type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(0))
    engine = HFRollout(student, tok, device, 32)
    ex = [_Ex(f"{i}+{i + 7}=", "math") for i in range(prompts) for _ in range(group)]
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if torch.device(device).type == "cuda"
           else torch.autocast("cpu", enabled=False))
    res = {"prompts": prompts, "group": group, "max_new_tokens": new}
    gen = torch.Generator(device=device).manual_seed(0)
    for phase in ("sample", "score", "train"):
        reset_peak(device)
        t0 = time.perf_counter()
        with amp:
            if phase == "sample":
                batch = engine.generate(ex, max_new_tokens=new, generator=gen)
            elif phase == "score":
                with torch.no_grad():
                    tl = score_completions(teacher, batch, 1.0).logp
            else:
                mask = batch.completion_mask.float()
                adv = alg.reverse_kl_advantages(tl.float(), batch.behaviour_logp.float(), mask, clip=loop.kd_clip)
                student.train()
                upd = policy_update(student, opt, sched, batch, adv, mask, None, None, loop, 1.0,
                                    __import__("random").Random(0), "chunked", 16384)
        sync(device)
        res[phase] = {"seconds": time.perf_counter() - t0, "peak_mem_gib": peak_mem(device)}
    res["completion_tokens"] = int(batch.completion_mask.sum())
    res["loss"], res["grad_norm"] = upd["loss"], upd["grad_norm"]
    res["finite"] = math.isfinite(upd["loss"]) and math.isfinite(upd["grad_norm"])
    return res


# ---------------------------------------------------------------- 5. sampling without vLLM: eager vs graphed


SAMPLING_GOAL_TOKENS_PER_S = 8 * 523  # 8× HFRollout's 523 tokens/s measured on an H200 at commit 81997e3


def _sampling_prompts(vocab: int, batch: int, width: int, device):
    """Random prompt ids, left-padded to `width`, real lengths from width/4 to width (rows of different widths,
    as a real batch)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, width), generator=g)
    lens = torch.randint(max(1, width // 4), width + 1, (batch,), generator=g)
    mask = (torch.arange(width)[None, :] >= (width - lens)[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def _agreement(a_ids, a_lp, b_ids, b_lp) -> dict:
    """Token agreement of two samplings from one seed over their common length, the first step at which each row
    diverges, and the largest |Δ log-prob| before it (after a divergence the rows condition on other tokens)."""
    T = min(a_ids.shape[1], b_ids.shape[1])
    same = (a_ids[:, :T] == b_ids[:, :T])
    first = torch.where(same.all(1), torch.full_like(same[:, 0], T, dtype=torch.long),
                        (~same).float().argmax(1).long())
    before = torch.arange(T, device=same.device)[None, :] < first[:, None]
    gap = (a_lp[:, :T].double() - b_lp[:, :T].double()).abs()[before]
    return {"tokens_compared": int(same.numel()), "identical_fraction": float(same.float().mean()),
            "rows_identical": int(same.all(1).sum()), "first_divergence_min": int(first.min()),
            "first_divergence_median": float(first.float().median()),
            "max_abs_logp_diff_before_divergence": float(gap.max()) if gap.numel() else None}


def _scorer_gap(model, ids, mask, c_ids, c_lp) -> float:
    """Max |behaviour log-prob − the trainer's `completion_logprobs`| over the samples (both at temperature 1):
    what the PPO ratio sees at step 0."""
    from mopd_core.rollout import RolloutBatch, completion_logprobs

    with torch.no_grad():
        full = torch.ones_like(c_ids)
        lp = completion_logprobs(model, RolloutBatch(ids, mask, c_ids, full, c_lp), 1.0, micro_batch_size=16)
    return float((lp.double() - c_lp.double()).abs().max())


def _graphed_runs(graphed, ids, mask, kw, new: int, device):
    """Two calls: the first builds the cache and captures the step, the second reuses both."""
    runs = []
    for _ in range(2):
        reset_peak(device)
        sync(device)
        t0 = time.perf_counter()
        g_ids, g_mask, g_lp = graphed._sample(ids, mask, **{**kw, "max_new_tokens": new},
                                              generator=torch.Generator(device).manual_seed(0))
        sync(device)
        sec = time.perf_counter() - t0
        runs.append({"seconds": sec, "tokens": int(g_mask.sum()), "tokens_per_s": int(g_mask.sum()) / sec,
                     "capture_s": graphed.decoder.capture_s, "peak_mem_gib": peak_mem(device)})
    return runs, (g_ids, g_lp)


def check_sampling(device, tiny: bool) -> dict:
    """`HFRollout` (eager, launch-bound) against `GraphedRollout` (`rollout.backend: hf_graphed`: static KV cache,
    the decode step captured as a device graph) on the Qwen3-1.7B shape with the real vocabulary, bf16, random
    weights, 128 prompts × 512 new tokens with ignore_eos (every row full length). Eager runs only `eager_new`
    tokens (at ~0.1-0.2 s a step 512 would take minutes): its tokens/s is measured there and is, if anything,
    optimistic (its attention reads a shorter cache). Both engines sample from the same seed; the agreement is
    measured over the eager tokens."""
    from mopd_core.rollout import HFRollout
    from mopd_core.rollout.graphed import GraphedRollout

    cfg = qwen3_1p7b(tiny=tiny)
    dtype = torch.bfloat16 if not tiny else torch.float32
    B, P, new, eager_new = (128, 64, 512, 32) if not tiny else (4, 6, 8, 8)
    model = build(cfg, device, dtype).eval()
    ids, mask = _sampling_prompts(cfg.vocab_size, B, P, device)
    kw = dict(max_new_tokens=eager_new, eos_id=[], pad_id=0)  # no stop id: ignore_eos
    res = {"batch": B, "prompt_width": P, "max_new_tokens": new, "eager_new_tokens": eager_new,
           "vocab": cfg.vocab_size, "dtype": str(dtype).removeprefix("torch."),
           "goal_tokens_per_s": SAMPLING_GOAL_TOKENS_PER_S}
    eager = HFRollout(model, None, device)
    eager._sample(ids, mask, **{**kw, "max_new_tokens": 2}, generator=torch.Generator(device).manual_seed(1))  # warm
    sync(device)
    t0 = time.perf_counter()
    e_ids, _, e_lp = eager._sample(ids, mask, **kw, generator=torch.Generator(device).manual_seed(0))
    sync(device)
    e_s = time.perf_counter() - t0
    res["eager"] = {"seconds": e_s, "tokens": B * eager_new, "tokens_per_s": B * eager_new / e_s}
    graphed = GraphedRollout(model, None, device, ignore_eos=True)
    try:
        runs, (g_ids, g_lp) = _graphed_runs(graphed, ids, mask, kw, new, device)
    except Exception:  # noqa: BLE001 - the capture failed here: say why, and measure the static cache uncaptured
        res["capture_error"] = traceback.format_exc()[-3000:]
        graphed.close()
        graphed = GraphedRollout(model, None, device, ignore_eos=True, capture=False)
        runs, (g_ids, g_lp) = _graphed_runs(graphed, ids, mask, kw, new, device)
    res["graphed_capture"] = graphed.capture
    res["graphed"] = {"first_call": runs[0], "steady": runs[1], "builds": graphed.builds,
                      "tokens_per_s": runs[1]["tokens_per_s"], "decode_step_ms": 1e3 * runs[1]["seconds"] / new}
    res["speedup_vs_eager"] = runs[1]["tokens_per_s"] / res["eager"]["tokens_per_s"]
    res["agreement"] = _agreement(e_ids, e_lp, g_ids, g_lp)
    res["behaviour_vs_scorer_max_abs_logp"] = {
        "eager": _scorer_gap(model, ids, mask, e_ids, e_lp),
        "graphed": _scorer_gap(model, ids, mask, g_ids, g_lp)}
    res["goal_met"] = res["graphed"]["tokens_per_s"] >= SAMPLING_GOAL_TOKENS_PER_S if not tiny else None
    graphed.close()
    return res


# ---------------------------------------------------------------- driver


def run(device: str, tiny: bool, budget_s: float, only: list[str] | None = None) -> dict:
    t_all = time.perf_counter()
    # seconds each check needs on an H200 (measured: none yet — estimates with margin); a check starts only
    # when that much budget is left
    need = {"mfu": 150, "logprob_memory": 40, "handover": 60, "mopd_step": 90, "sampling": 60}
    checks = {"mfu": lambda left: check_mfu(device, tiny, min(left - 20, 150)),
              "logprob_memory": lambda left: check_logprob_memory(device, tiny),
              "handover": lambda left: check_handover(device, tiny),
              "mopd_step": lambda left: check_mopd_step(device, tiny),
              "sampling": lambda left: check_sampling(device, tiny)}
    out: dict = {"device": device, "dry_run": tiny, "budget_s": budget_s, "checks": {}}
    if torch.device(device).type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = True  # what a trainer on Hopper runs with (fp32 master + bf16)
    for name, fn in checks.items():
        if only and name not in only:
            continue
        left = budget_s - (time.perf_counter() - t_all)
        if not tiny and left < need[name]:
            out["checks"][name] = {"skipped": f"{left:.0f} s of the {budget_s:.0f} s budget left, needs ~{need[name]}"}
            continue
        t0 = time.perf_counter()
        try:
            out["checks"][name] = {**fn(left), "wall_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - one failing check must not hide the others' numbers
            out["checks"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:],
                                   "wall_s": time.perf_counter() - t0}
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        print(f"[perf_checks] {name}: {json.dumps(out['checks'][name], default=str)[:400]}", flush=True)
    out["wall_s"] = time.perf_counter() - t_all
    out["ok"] = not any("error" in c for c in out["checks"].values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (the code path only)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--only", default="", help="comma-separated subset of mfu,logprob_memory,handover,mopd_step,"
                    "sampling")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        print("[perf_checks] no CUDA device: nothing measured (use --dry-run for the CPU code path)")
        Path(args.out).write_text(json.dumps({"skipped": "no CUDA device"}) + "\n")
        return 0
    res = run(device, args.dry_run, args.budget_s, [x for x in args.only.split(",") if x] or None)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
