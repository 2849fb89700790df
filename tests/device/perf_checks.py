"""Performance checks for a lent accelerator, one prepared run (`tests/device/run_all.sh`, ≤ 7 minutes with the
pytest files on one H200) with the packages that machine has (torch, transformers, triton; no vLLM, no download;
pydantic, trl and datasets carried as wheels). Device-specific calls go through `mopd_core.runtime.device` only,
so the same script runs on an Ascend NPU. In run order (`PLAN`; the new checks first):

1. `stage`: `configs/gpu_scale.yaml` through `recipe.mopd_stage` (tests/device/gpu_scale_stage.py) — a
   Qwen3-1.7B-shaped student and three teachers built on the device, a 151,936-entry tokenizer, 2 steps of
   8 prompts × 4 samples × 2,048 tokens (ignore_eos), colocated; per step and phase the seconds, per phase the peak
   device memory beside the pre-flight's estimate. The captured sampler (`rollout.backend=hf_graphed`) when this
   checkout has it, else the eager one at EAGER_FALLBACK_NEW_TOKENS (said in the result).
2. `mfu`: the 1.7B-shaped train step through the loop's own `policy_update` (float32 master weights, bf16 autocast,
   chunked log-probs, token-budget micro-batches, AdamW as the loop builds it) with compiled decoder layers
   (`models.compile_decoder_layers`, `train.compile`), at 4,096 and 16,384 tokens per sequence, then the eager
   layers at 4,096: MFU = (6·N + 12·L·q·seq) FLOPs per token (PaLM's convention) × tokens/s ÷ the datasheet's dense
   bf16 peak, and ÷ a bf16 matmul peak measured in the same run. Goal ≥ 45 %.
3. `trl`: TRL's `DistillationTrainer` (use_vllm=False, gradient checkpointing, bf16) on the same model shape,
   vocabulary and samples per step: s/step split into generation / teacher / update, tokens/s, peak memory; out
   of memory is reported with the size.
4. `logprob_memory`: peak device memory of `token_logprobs` forward + backward at 16k tokens × the real
   vocabulary, `chunked` vs `full`.
5. `handover`: CUDA IPC hand-over of the model's weights to another process (`weights.CudaIpcTransport`, one
   handle per bucket): bytes, pack seconds, seconds from sending the handles to the receiver holding a copy in its
   own parameters (first hand-over: handles opened), and the steady per-update hand-over (the receiver keeps its
   mapping and copies) three ways: re-pack tensor by tensor (the old path), one fused `_foreach_copy_` per bucket
   (`weights.refill_buckets`), and parameters bound to the buckets (`weights.bind_to_buckets`: no re-pack) —
   against the HBM copy floor (the same bytes through one device-to-device `copy_`). Goal: the bound path's
   steady hand-over ≤ 1.5× the floor; the receiver's bytes are checked against the sender's after an update.
6. `mopd_step`: one colocated MOPD step on the device — `HFRollout` sampling, a local teacher's scores, the
   sampled-token reverse-KL advantage and the loop's `policy_update` — with seconds and peak memory per phase.
7. `sampling`: sampling without vLLM — `HFRollout` against `rollout.backend: hf_graphed` (static KV cache, the
   decode step captured as a CUDA graph) at the 1.7B shape with the real vocabulary, 128 prompts × 512 new tokens
   (ignore_eos): tokens/s of both, capture seconds, token agreement for one seed, log-prob gaps, peak memory.
   Goal: ≥ 8× the 523 tokens/s `HFRollout` sampled at in the first device run.

    python tests/device/perf_checks.py --out perf.json [--budget-s 300] [--only stage,mfu]   # on the accelerator
    python tests/device/perf_checks.py --dry-run --out /tmp/x.json          # tiny shapes on CPU (the unit test)

`--dry-run` runs the same functions at tiny shapes on the CPU (the hand-over through host shared memory, the
transport a device without IPC uses; the compiled layers through dynamo's eager backend) so the script cannot rot
where no accelerator is lent; its numbers mean nothing. A check starts only when its `need` is left of
`--budget-s` (else it is skipped with the reason in the JSON) and runs within its own cap.
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
for _p in (ROOT, ROOT / "tests" / "device", ROOT / "benchmarks"):  # mopd_core; gpu_scale_stage; peer_stats
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by device name (NVIDIA data sheets; SXM parts)
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
MFU_GOAL, HANDOVER_GOAL = 0.45, 1.5


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


def _kind(device) -> str:
    from mopd_core.runtime.device import kind_of

    return kind_of(device)


# device-specific calls only through mopd_core.runtime.device: the same script runs on cuda and npu
def sync(device) -> None:
    from mopd_core.runtime.device import synchronize

    synchronize(_kind(device))


def peak_mem(device) -> float:
    from mopd_core.runtime.device import peak_allocated_bytes

    return peak_allocated_bytes(_kind(device)) / 2**30 if _kind(device) != "cpu" else float("nan")


def reset_peak(device) -> None:
    from mopd_core.runtime import device as devlib

    k = _kind(device)
    devlib.synchronize(k)
    devlib.empty_cache(k)
    devlib.reset_peak_memory_stats(k)


def device_peak_tflops(device) -> float | None:
    from mopd_core.runtime.device import device_name

    if _kind(device) == "cpu":
        return None
    name = device_name(_kind(device))
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
    """(training FLOPs per token = 6·N_matmul + attention, N_matmul): N_matmul counts every weight a token
    multiplies (layers and lm_head; not the embedding lookup). Attention by the PaLM convention (as torchtitan and
    Megatron report MFU): 12·L·q·seq, QKᵀ and AV counted as if not causal."""
    h, L, inter, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    n = L * per_layer + v * h
    attn = 6 * 2 * L * q * (seq + 1)  # fwd QKᵀ + AV: 2·2·q·(seq+1) per token per layer (not halved), ×3 train
    return 6.0 * n + attn, n


# ---------------------------------------------------------------- 1. MFU


def _policy_update():
    """The loop's update function (`train/update.py` once the loop is split into roles, else `train/loop.py`)."""
    try:
        from mopd_core.train.update import policy_update
    except ImportError:
        from mopd_core.train.loop import policy_update
    return policy_update


def _update_batch(rows: int, seq: int, vocab: int, device, prompt: int = 64):
    """A `RolloutBatch` of `rows` sequences of `seq` tokens (`prompt` prompt + the rest completion, no padding), the
    behaviour log-probs of a uniform model (log 1/V: a random-init model's, so the PPO ratios start near 1)."""
    from mopd_core.rollout import RolloutBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=g).to(device)
    prompt = min(prompt, seq // 4)
    T = seq - prompt
    ones = torch.ones(rows, seq, dtype=torch.long, device=device)
    return RolloutBatch(ids[:, :prompt], ones[:, :prompt], ids[:, prompt:], ones[:, prompt:],
                        torch.full((rows, T), -math.log(vocab), device=device), [None] * rows, [""] * rows)


def mfu_run(model, device, cfg, rows: int, seq: int, steps: int, warm: int, budget_s: float,
            max_tokens: int) -> dict:
    """`steps` timed calls of the loop's `policy_update` (after `warm` untimed ones) on `rows` × `seq` tokens, under
    the loop's autocast; MFU from the median step."""
    import random

    from mopd_core.config import MOPDConfig
    from mopd_core.runtime import device as devlib

    policy_update = _policy_update()
    kind = _kind(device)
    batch = _update_batch(rows, seq, cfg.vocab_size, device)
    mask = batch.completion_mask.float()
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).to(device)
    loop = MOPDConfig(prompts_per_step=rows, group_size=1, lr=1e-6)
    # the optimizer run_policy_loop builds (its defaults: foreach AdamW on an accelerator), a constant schedule
    opt = torch.optim.AdamW(model.parameters(), lr=loop.lr, betas=tuple(loop.betas), weight_decay=loop.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    dtype = "bfloat16" if kind != "cpu" else "float32"
    reset_peak(device)
    times, t_start, first_s = [], time.perf_counter(), None
    for i in range(warm + steps):
        sync(device)
        t0 = time.perf_counter()
        with devlib.autocast(kind, dtype):
            upd = policy_update(model, opt, sched, batch, adv, mask, None, None, loop, 1.0, random.Random(i),
                                "chunked", max_tokens)
        sync(device)
        dt = time.perf_counter() - t0
        first_s = dt if first_s is None else first_s
        if i >= warm:
            times.append(dt)
        if time.perf_counter() - t_start > budget_s:
            break
    per_tok, n = model_flops_per_token(cfg, seq)
    sec = sorted(times)[len(times) // 2] if times else float("nan")
    achieved = per_tok * rows * seq / sec / 1e12
    peak = device_peak_tflops(device)
    res = {"rows": rows, "seq": seq, "tokens_per_step": rows * seq, "micro_batches": upd["perf/micro_batches"],
           "first_step_s": first_s, "step_s_median": sec, "steps_timed": len(times), "tokens_per_s": rows * seq / sec,
           "achieved_tflops": achieved, "mfu": achieved / peak if peak else None, "peak_mem_gib": peak_mem(device),
           "loss": upd["loss"], "grad_norm": upd["grad_norm"]}
    del opt, sched
    return res


def _mfu_lengths(model, device, cfg, plan, compiled: bool, budget_s: float, t_all: float, tiny: bool) -> list[dict]:
    """One `mfu_run` per (rows, seq, token budget) of `plan` while the check's budget lasts; a length that runs out
    of memory is run again with gradient checkpointing (`checkpointing: true` in its row)."""
    from mopd_core.runtime import device as devlib

    steps, warm = (3, 1) if not tiny else (1, 1)
    runs = []
    for rows, seq, budget_tok in plan:
        left = budget_s - (time.perf_counter() - t_all)
        if left < (35 if not tiny else 0):
            runs.append({"seq": seq, "skipped": f"{left:.0f} s of the check's budget left"})
            continue
        try:
            runs.append({**mfu_run(model, device, cfg, rows, seq, steps, warm, left, budget_tok),
                         "compiled": compiled, "checkpointing": False})
        except torch.OutOfMemoryError:
            model.zero_grad(set_to_none=True)
            devlib.empty_cache(_kind(device))
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            runs.append({**mfu_run(model, device, cfg, rows, seq, steps, warm, left, budget_tok),
                         "compiled": compiled, "checkpointing": True})
            model.gradient_checkpointing_disable()
    return runs


def check_mfu(device, tiny: bool, budget_s: float) -> dict:
    """The 1.7B-shaped train step through the loop's own `policy_update` (chunked log-probs, token-budget
    micro-batches, PPO loss, grad clip, AdamW step) on float32 master weights under bf16 autocast — as
    run_policy_loop runs it — with the decoder layers compiled for training (`models.compile_decoder_layers`, what
    `train.compile` asks for), at 4,096 and at 16,384 tokens per sequence; then, budget permitting, the eager
    update at 4,096 for the compiled layers' gain. Should compiling fail, the error is reported and both lengths
    run eager."""
    from mopd_core.models import compile_decoder_layers
    from mopd_core.runtime import device as devlib

    cfg = qwen3_1p7b(tiny=tiny)
    kind = _kind(device)
    t_all = time.perf_counter()
    model = build(cfg, device, torch.float32).train()  # float32 master weights, as the loop loads them
    n_total = sum(p.numel() for p in model.parameters())
    compiled = compile_decoder_layers(model, kind, backend=None if not tiny else "eager")
    # (rows, seq, token budget of one micro-batch): 16k tokens a forward at both lengths
    plan = [(4, 4096, 16384), (2, 16384, 16384)] if not tiny else [(2, 32, 64), (1, 64, 64)]
    compile_error = None
    try:
        runs = _mfu_lengths(model, device, cfg, plan, compiled > 0, budget_s, t_all, tiny)
    except Exception as e:  # noqa: BLE001 - a compiler failure must not cost the eager figures
        if not compiled:
            raise
        compile_error = f"{type(e).__name__}: {str(e)[:500]}"
        del model
        devlib.empty_cache(kind)
        model = build(cfg, device, torch.float32).train()
        runs = _mfu_lengths(model, device, cfg, plan, False, budget_s, t_all, tiny)
        compiled = 0
    if compiled and budget_s - (time.perf_counter() - t_all) > 30:  # the same update, eager layers
        del model
        devlib.empty_cache(kind)
        model = build(cfg, device, torch.float32).train()
        runs += _mfu_lengths(model, device, cfg, plan[:1], False, budget_s, t_all, tiny)
    del model
    meas = measured_matmul_tflops(device, 8192 if not tiny else 64, torch.bfloat16 if not tiny else torch.float32)
    for r in runs:
        if "achieved_tflops" in r:
            r["mfu_vs_measured_matmul"] = r["achieved_tflops"] / meas
    best = {r["seq"]: r["mfu"] for r in runs if r.get("compiled") and r.get("mfu") is not None}
    return {"config": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "vocab": cfg.vocab_size},
            "params_total": n_total, "params_matmul": model_flops_per_token(cfg, 1)[1],
            "master_dtype": "float32", "compute_dtype": "bfloat16" if not tiny else "float32",
            "layers_compiled": compiled, **({"compile_error": compile_error} if compile_error else {}),
            "flops_convention": "6N + 12·L·q·seq (PaLM)", "device_peak_tflops": device_peak_tflops(device),
            "measured_matmul_tflops": meas, "runs": runs, "goal_mfu": MFU_GOAL,
            "goal_met": None if kind == "cpu" or len(best) < 2 else all(v >= MFU_GOAL for v in best.values())}


# ---------------------------------------------------------------- 2. chunked vs full log-prob memory


def check_logprob_memory(device, tiny: bool) -> dict:
    from mopd_core.algorithms.logprobs import LogitTransform, token_logprobs
    from mopd_core.runtime.device import allocated_bytes

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
        base = allocated_bytes(_kind(device)) / 2**30
        sync(device)
        t0 = time.perf_counter()
        sc = token_logprobs(hidden, weight, targets, LogitTransform(), impl=impl, entropy=True)
        sc.logp.sum().backward()
        sync(device)
        out[impl] = sc.logp.detach().float()
        res[impl] = {"peak_extra_gib": peak_mem(device) - base, "seconds": time.perf_counter() - t0}
        del sc
    res["max_abs_logp_diff"] = float((out["chunked"] - out["full"]).abs().max())
    if _kind(device) != "cpu":
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

    from mopd_core.runtime.device import handover_transport

    is_cuda = _kind(device) != "cpu"  # an accelerator: judged against the goal (npu: through host shared memory)
    kind = handover_transport(_kind(device), same_process=False)
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
    from mopd_core.runtime import device as devlib

    policy_update = _policy_update()
    tok = build_tiny_tokenizer()
    cfg = qwen3_1p7b(vocab=len(tok), tiny=tiny)
    cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
    prompts, group, new = (16, 8, 64) if not tiny else (2, 2, 4)
    student = build(cfg, device, torch.float32, seed=0)
    teacher = build(cfg, device, torch.bfloat16 if not tiny else torch.float32, seed=1).eval().requires_grad_(False)
    loop = MOPDConfig(prompts_per_step=prompts, group_size=group, lr=1e-6)
    opt = torch.optim.AdamW(student.parameters(), lr=loop.lr)  # as run_policy_loop builds it
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    engine = HFRollout(student, tok, device, 32)
    ex = [_Ex(f"{i}+{i + 7}=", "math") for i in range(prompts) for _ in range(group)]
    amp = devlib.autocast(_kind(device), "bfloat16" if _kind(device) != "cpu" else "float32")
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


# ---------------------------------------------------------------- 5. the gpu_scale preset's MOPD stage

from gpu_scale_stage import TINY as TINY_STAGE  # noqa: E402 - tests/device is on sys.path (above)

# without the captured sampler (rollout.backend=hf_graphed) the eager one samples the stage's 2,048 tokens far too
# slowly for one device call: the preset then runs with this budget, and says so
EAGER_FALLBACK_NEW_TOKENS = 256


def fast_rollout_backend() -> str | None:
    """The captured-graph sampler's backend name when this checkout has it, else None."""
    import typing

    from mopd_core.config import RolloutConfig

    names = typing.get_args(RolloutConfig.model_fields["backend"].annotation)
    return "hf_graphed" if "hf_graphed" in names else None


def scratch_dir(need_gib: float) -> Path:
    """A fresh folder on the first of GPU_SCALE_DIR, /dev/shm, the temp dir with `need_gib` free, else on the one
    with the most free space."""
    import shutil
    import tempfile

    cands = [c for c in (os.environ.get("GPU_SCALE_DIR"), "/dev/shm", tempfile.gettempdir()) if c and Path(c).is_dir()]
    free = {c: shutil.disk_usage(c).free / 2**30 for c in cands}
    pick = next((c for c in cands if free[c] >= need_gib), max(cands, key=free.get))
    return Path(tempfile.mkdtemp(prefix="mopd-gpu-scale-", dir=pick))


def _stage_overrides(device, tiny: bool, where: Path, fast: str | None) -> tuple[list[str], str | None]:
    """The preset's overrides for this run: where it writes, the device, the sampler — `fast` (also in the dry run:
    the same engine, uncaptured on the CPU), else the eager one capped at EAGER_FALLBACK_NEW_TOKENS (the note says
    so)."""
    over, note = [f"output_dir={where}"], None
    if os.environ.get("GPU_SCALE_STEPS"):  # a short lease: fewer steps (the first carries the compile warm-up)
        over.append(f"mopd.steps={int(os.environ['GPU_SCALE_STEPS'])}")
    if fast is not None:
        over.append(f"rollout.backend={fast}")
    if tiny:
        return TINY_STAGE + over, None
    over.append(f"runtime.device={_kind(device)}")
    if fast is None:
        over.append(f"rollout.max_new_tokens={EAGER_FALLBACK_NEW_TOKENS}")
        note = (f"rollout.backend=hf (no captured sampler here, or it failed): completions capped at "
                f"{EAGER_FALLBACK_NEW_TOKENS} tokens to fit the device call")
    return over, note


def check_stage(device, tiny: bool) -> dict:
    """`configs/gpu_scale.yaml` through `recipe.mopd_stage` (tests/device/gpu_scale_stage.py): the Qwen3-1.7B-shaped
    student and three teachers built on the device, 2 steps of 8 prompts × 4 samples × 2,048 tokens, per phase
    seconds and peak memory beside the pre-flight's estimate. The fastest in-process sampler this checkout has; with
    only the eager one — or when the stage fails with the fast one before its first step ends (the error is kept) —
    completions of EAGER_FALLBACK_NEW_TOKENS (named in the result)."""
    import shutil

    from gpu_scale_stage import run_stage

    from mopd_core.config import load_config

    fast, fast_error = fast_rollout_backend(), None
    while True:
        where = scratch_dir(50 if not tiny else 0)  # 4 built models (bf16) + final/ and the last checkpoint (fp32)
        over, note = _stage_overrides(device, tiny, where, fast)
        cfg = load_config("gpu_scale", over)
        try:
            res = run_stage(cfg, device=None if tiny else device)
            break
        except Exception as e:  # noqa: BLE001 - the captured sampler failed: measure the stage with the eager one
            if fast is None or tiny:
                raise
            fast_error, fast = f"{fast}: {type(e).__name__}: {str(e)[:400]}", None
        finally:
            shutil.rmtree(where, ignore_errors=True)
    return {"overrides": over[1:] if not tiny else [], "rollout_backend": cfg.rollout.backend,
            "max_new_tokens": cfg.rollout.max_new_tokens, "prompts": cfg.mopd.prompts_per_step,
            "group": cfg.mopd.group_size, "steps_configured": cfg.mopd.steps, **({"note": note} if note else {}),
            **({"fast_rollout_error": fast_error} if fast_error else {}), **res}


# ---------------------------------------------------------------- 6. TRL's DistillationTrainer on the same device

TRL_NEW_TOKENS = int(os.environ.get("TRL_NEW_TOKENS", "512"))
TRL_STEPS = int(os.environ.get("TRL_STEPS", "2"))  # 1 on a short lease: that step then carries the warm-up


def check_trl(device, tiny: bool, budget_s: float) -> dict:
    """TRL's `DistillationTrainer` (use_vllm=False: HF generation; its recommended memory options — gradient
    checkpointing, bf16 mixed precision over float32 weights, Liger kernels when importable) with the stage's model
    shape, vocabulary, chat template and samples per step (8 prompts × 4), β = 1 (reverse KL, the closest to our
    sampled-token reverse KL), 2 steps: seconds per step split into generation / teacher / update (timers around
    its own methods, as benchmarks/vs_trl.py), tokens/s and peak device memory. Completions of TRL_NEW_TOKENS
    (its eager HF generation of 2,048 tokens would not fit the device call), every row to that length
    (`min_new_tokens`, as our ignore_eos). Out of memory: the row says so with the size."""
    try:
        from trl import DistillationConfig, DistillationTrainer
    except ImportError as e:
        return {"skipped": f"trl is not importable here ({e}); carry its wheel (tests/device/fetch_wheels.sh)"}
    import importlib.util
    import tempfile

    from datasets import Dataset
    from transformers import TrainerCallback

    from mopd_core.config import load_config
    from mopd_core.models import build_tiny_model, build_tiny_tokenizer

    from gpu_scale_stage import TINY

    cfg = load_config("gpu_scale", TINY if tiny else [])
    t = cfg.model.tiny
    prompts, group = cfg.mopd.prompts_per_step, cfg.mopd.group_size
    new = TRL_NEW_TOKENS if not tiny else cfg.rollout.max_new_tokens
    tok = build_tiny_tokenizer(chat=True, vocab_size=t.vocab_size)
    student = build_tiny_model(t, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0, device=device)
    teacher = build_tiny_model(t, len(tok), tok.pad_token_id, tok.eos_token_id, seed=1, device=device)
    teacher = teacher.to(torch.bfloat16 if not tiny else torch.float32).eval()
    liger = importlib.util.find_spec("liger_kernel") is not None and not tiny
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i + 7}="}]} for i in range(prompts) for _ in range(group)]
    out_dir = tempfile.mkdtemp(prefix="trl-")
    targs = DistillationConfig(
        output_dir=out_dir, max_steps=TRL_STEPS, per_device_train_batch_size=prompts * group,
        gradient_accumulation_steps=1,
        learning_rate=cfg.mopd.lr, lr_scheduler_type="constant", max_grad_norm=cfg.mopd.grad_clip, beta=1.0,
        temperature=cfg.rollout.temperature, max_completion_length=new, generation_kwargs={"min_new_tokens": new},
        bf16=not tiny, gradient_checkpointing=True, use_liger_kernel=liger, use_cpu=tiny, shuffle_dataset=False,
        report_to="none", save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    from peer_stats import trl_timers  # benchmarks/: the same timers benchmarks/vs_trl.py puts around TRL

    Timed, step_timer, steps = trl_timers(DistillationTrainer, TrainerCallback, teacher, lambda: sync(device))

    size = f"{prompts}×{group} samples × {new} new tokens, {sum(p.numel() for p in student.parameters()) / 1e9:.2f} B"
    res = {"trainer": "trl.DistillationTrainer", "trl": __import__("trl").__version__, "use_vllm": False,
           "gradient_checkpointing": True, "bf16": not tiny, "liger": liger, "beta": 1.0, "size": size,
           "max_new_tokens": new}
    reset_peak(device)
    try:
        trainer = Timed(model=student, teacher_model=teacher, args=targs,
                        train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[step_timer])
        trainer.train()
    except torch.OutOfMemoryError as e:
        res["oom"] = f"out of memory at {size}: {str(e).splitlines()[0][:200]}"
    finally:
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
    for st in steps:
        st["tokens_per_s"] = st["tokens"] / st["step_s"]
    res.update({"steps": steps, "peak_mem_gib": peak_mem(device)})
    if steps:
        last = steps[-1]  # the first step carries the warm-up
        res.update({"step_s": last["step_s"], "tokens_per_s": last["tokens_per_s"],
                    "gen_tokens_per_s": last["tokens"] / max(last["gen_s"], 1e-9)})
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


# (name, seconds a check needs to start on an H200, its own cap) in run order: the new checks first. Estimates
# with margin, measured at none yet; a check starts only when `need` is left of the whole budget.
PLAN = [("stage", 120, 240), ("mfu", 90, 130), ("trl", 45, 90), ("sampling", 60, 90), ("handover", 40, 60),
        ("logprob_memory", 20, 40), ("mopd_step", 60, 90)]


def run(device: str, tiny: bool, budget_s: float, only: list[str] | None = None,
        out_path: str | None = None) -> dict:
    import gc

    from mopd_core.runtime import device as devlib

    t_all = time.perf_counter()
    checks = {"stage": lambda cap: check_stage(device, tiny),
              "mfu": lambda cap: check_mfu(device, tiny, cap),
              "trl": lambda cap: check_trl(device, tiny, cap),
              "logprob_memory": lambda cap: check_logprob_memory(device, tiny),
              "handover": lambda cap: check_handover(device, tiny),
              "mopd_step": lambda cap: check_mopd_step(device, tiny),
              "sampling": lambda cap: check_sampling(device, tiny)}
    kind = _kind(device)
    out: dict = {"device": device, "dry_run": tiny, "budget_s": budget_s, "checks": {}}
    if kind != "cpu":
        out["device_name"] = devlib.device_name(kind)
        torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls: what a trainer runs with
    plan = {name: (need, cap) for name, need, cap in PLAN}
    for name in only or list(plan):  # `only` also orders: the checks that matter most on a short lease first
        need, cap = plan[name]
        left = budget_s - (time.perf_counter() - t_all)
        if not tiny and left < need:
            out["checks"][name] = {"skipped": f"{left:.0f} s of the {budget_s:.0f} s budget left, needs ~{need}"}
            continue
        t0 = time.perf_counter()
        try:
            out["checks"][name] = {**checks[name](min(cap, left)), "wall_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - one failing check must not hide the others' numbers
            out["checks"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:],
                                   "wall_s": time.perf_counter() - t0}
        gc.collect()
        devlib.empty_cache(kind)
        if out_path is not None:  # after every check: a run killed later keeps what finished
            Path(out_path).write_text(json.dumps({**out, "partial": True}, indent=1, default=str) + "\n")
        print(f"[perf_checks] {name} ({time.perf_counter() - t0:.0f} s): "
              f"{json.dumps(out['checks'][name], default=str)[:600]}", flush=True)
    out["wall_s"] = time.perf_counter() - t_all
    out["ok"] = not any("error" in c for c in out["checks"].values())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (the code path only)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--only", default="", help="comma-separated checks, run in this order (default: all, in PLAN "
                    "order): " + ",".join(n for n, *_ in PLAN))
    args = ap.parse_args(argv)
    only = [x for x in args.only.split(",") if x] or None
    unknown = sorted(set(only or ()) - {n for n, *_ in PLAN})
    if unknown:
        ap.error(f"--only: {', '.join(unknown)} not among {', '.join(n for n, *_ in PLAN)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from mopd_core.runtime.device import resolve

    if args.dry_run:
        device = "cpu"
    elif resolve("auto").kind != "cpu":  # npu, then cuda (the device layer chooses)
        device = str(resolve("auto").torch_device)
    else:
        print("[perf_checks] no accelerator: nothing measured (use --dry-run for the CPU code path)")
        Path(args.out).write_text(json.dumps({"skipped": "no accelerator"}) + "\n")
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    res = run(device, args.dry_run, args.budget_s, only, args.out)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
