"""Hostile inputs: each one a single `error:` line on stderr naming the field/file (and the fix where the
message has one), exit status 2, no traceback — and every run folder that existed before byte-identical after
(a finished SFT stage prepared once for the module, hashed whole before and after each case: a new file or
folder, a renamed or rewritten one all count).

Each case runs `mopd …` as a user would. The cases marked `subprocess` run the real `.venv/bin/mopd` in a
subprocess (one or more per category); the others call the same `mopd_core.cli.main` in this process (same
code path: parse → load config → stage; an exception escaping main() is the traceback a user would see), which
keeps the table cheap. Teacher faults a real vLLM server cannot produce on demand (HTTP 4xx/5xx, a slow
answer, another vocabulary, an empty model list) come from `FakeVLLM`, a stdlib http.server that answers like
vLLM's OpenAI server; the disk-full case uses a real 1 MiB tmpfs when this machine lets us mount one (root),
else a size-limited fake (RLIMIT_FSIZE)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import tiny_overrides
from tests.reliability.common import FakeVLLM, base_env, one_line_error, run_cli, sets, tree_diff, tree_hash

pytestmark = [pytest.mark.timeout(300)]


# ---------------------------------------------------------------- the prepared world


@dataclass
class World:
    root: Path  # the pre-existing run folder: <root>/t/{base,sft} (finished), a regular file <root>/blocker
    sft: Path
    models: Path
    data: Path

    def ov(self, *extra: str) -> list[str]:
        """The tiny config writing into the prepared folder, plus `extra` overrides, as --set arguments."""
        return sets(tiny_overrides(self.root) + list(extra))


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(n: int = 12) -> list[dict]:
    return ([{"prompt": f"{i}+{i}=", "teacher_id": "math", "answer": str(2 * i)} for i in range(n)]
            + [{"prompt": f"rev:{'abcde'[i % 5:]}{i}=", "teacher_id": "code", "answer": "x"} for i in range(n)])


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    from mopd_core import recipe as R
    from mopd_core.config import ModelConfig, TinyModelConfig, load_config
    from mopd_core.models import build_tiny
    from tests.integration.test_http_teachers import _build_other_vocab

    d = tmp_path_factory.mktemp("hostile")
    root = d / "prepared"
    cfg = load_config("tiny", tiny_overrides(root))
    R.setup_runtime(cfg)
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False).model_dir
    (root / "blocker").write_text("a regular file where a folder is expected\n")

    models = d / "models"
    shutil.copytree(sft, models / "truncated")
    w = models / "truncated" / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    shutil.copytree(sft, models / "no-tokenizer")
    for f in (models / "no-tokenizer").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    shutil.copytree(sft, models / "bad-config")
    (models / "bad-config" / "config.json").write_text("{not json")
    _build_other_vocab(models / "other-vocab")
    build_tiny(ModelConfig(tiny=TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128,
                                                max_position_embeddings=16)), models / "short-context")

    data = d / "data"
    data.mkdir()
    _jsonl(data / "empty.jsonl", [])
    good = _rows()
    _jsonl(data / "malformed.jsonl", [good[0], good[1], '{"prompt": "3+3=", "teacher_id": "math", ', *good[2:]])
    _jsonl(data / "no-teacher-id.jsonl", [{k: v for k, v in r.items() if k != "teacher_id"} for r in good])
    _jsonl(data / "unknown-teacher.jsonl", good + [{"prompt": "write a poem", "teacher_id": "poetry",
                                                    "answer": "roses"}])
    _jsonl(data / "over-long.jsonl", good + [{"prompt": "9" * 40 + "+1=", "teacher_id": "math", "answer": "1"}])
    _jsonl(data / "prompt-not-text.jsonl", good + [{"prompt": 1234, "teacher_id": "math", "answer": "1"}])
    (data / "corrupt.parquet").write_bytes(b"PAR1 this is not a parquet file at all")
    (data / "bad.yaml").write_text("name: t\ndata: {domains: [unclosed\n")
    return World(root=root, sft=sft, models=models, data=data)


# ---------------------------------------------------------------- filesystem helpers


def _mount_tmpfs(where: Path, opts: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True)
    return p.returncode == 0


@contextlib.contextmanager
def _readonly_dir(w: World):
    """A folder nobody can write into — for root too: a read-only tmpfs (root ignores chmod); chmod 555 when
    we are not root."""
    d = Path(tempfile.mkdtemp(prefix="mopd-ro-"))
    if _mount_tmpfs(d, "size=1m,ro"):
        try:
            yield {"dir": d, "how": "read-only tmpfs"}
        finally:
            subprocess.run(["umount", str(d)], check=False)
            d.rmdir()
        return
    assert os.geteuid() != 0, "root cannot mount a read-only tmpfs here, and chmod does not stop root"
    d.chmod(0o555)
    try:
        yield {"dir": d, "how": "chmod 555"}
    finally:
        d.chmod(0o755)
        shutil.rmtree(d)


@contextlib.contextmanager
def _small_disk(w: World):
    """An output_dir on a 1 MiB tmpfs that already holds a run (the base model, ~400 KB): the free space is
    less than one SFT checkpoint (weights + AdamW state + final model). Else a size-limited fake: writes past
    600 KB fail (RLIMIT_FSIZE, SIGXFSZ ignored) — the subprocess runs under `prlimit`."""
    d = Path(tempfile.mkdtemp(prefix="mopd-full-"))
    if _mount_tmpfs(d, "size=1m"):
        shutil.copytree(w.root / "t" / "base", d / "t" / "base")
        try:
            yield {"dir": d, "how": "1 MiB tmpfs"}
        finally:
            subprocess.run(["umount", str(d)], check=False)
            d.rmdir()
        return
    shutil.copytree(w.root / "t" / "base", d / "t" / "base")
    try:
        yield {"dir": d, "how": "RLIMIT_FSIZE 600 KB (fake)", "fsize": 600_000}
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def _fake(w: World, **kw):
    with FakeVLLM(w.sft, **kw) as f:
        yield {"url": f.url, "fake": f}


@contextlib.contextmanager
def _nothing(w: World):
    yield {}


@contextlib.contextmanager
def _free_port(w: World):
    from tests.e2e.helpers import free_port

    yield {"url": f"http://127.0.0.1:{free_port()}"}


@contextlib.contextmanager
def _state_copy(w: World, damage: Callable[[Path], Path], expert_steps: int = 0):
    """A copy of the prepared run (plus, with `expert_steps`, an expert-math stage stopped at a checkpoint) in a
    folder of its own, then `damage(copy)` breaks one state file and returns it: the case resumes from it."""
    d = Path(tempfile.mkdtemp(prefix="mopd-state-"))
    shutil.copytree(w.root, d, dirs_exist_ok=True)
    if expert_steps:
        from mopd_core.cli import main as cli_main

        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            rc = cli_main(["stage", "expert", "--domain", "math", "--init", str(w.sft), "--no-progress",
                           *sets(tiny_overrides(d) + [f"expert.steps={expert_steps}", "expert.save_every=2"])])
        assert rc in (0, None), rc
    try:
        yield {"dir": d, "file": damage(d)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _garble(path: Path, text: str | None = None) -> Path:
    path.write_bytes(text.encode() if text is not None else path.read_bytes()[: max(1, path.stat().st_size // 3)])
    return path


def _garble_first_line(path: Path) -> Path:
    lines = path.read_text().splitlines()
    assert len(lines) >= 2, lines  # the damaged line is not the last (a torn last line is dropped on purpose)
    path.write_text("\n".join(['{"step": 1, "loss": 0.5'] + lines[1:]) + "\n")
    return path


def _in_copy(c: dict, *args: str, extra: tuple = ()) -> list[str]:
    return [*args, *sets(tiny_overrides(c["dir"]) + list(extra))]


# ---------------------------------------------------------------- the table


@dataclass
class Case:
    id: str
    category: str
    args: Callable[[World, dict], list[str]]
    needles: Callable[[World, dict], list]  # each a str, or a tuple of alternatives
    via: str = "in-process"
    env: Callable[[World, dict], dict] = field(default=lambda w, c: {})
    setup: Callable = _nothing
    watch: Callable[[World, dict], list[Path]] = field(default=lambda w, c: [])
    # folders of the prepared run a case may create (a fault only the running stage can meet): everything that
    # existed before must still be byte-identical, and nothing may appear elsewhere
    may_create: tuple[str, ...] = ()


def _stage_mopd(w: World, *extra: str) -> list[str]:
    return ["stage", "mopd", "--init", str(w.sft), *[a for d in ("math", "code", "if")
                                                    for a in ("--teacher", f"{d}={w.sft}")], *w.ov(*extra)]


def _http(c: dict, *extra: str) -> list[str]:
    url = c["url"]
    return ["teachers.backend=http", f"teachers.endpoints={{math: '{url}', code: '{url}', if: '{url}'}}",
            "teachers.retries=1", *extra]


def _data(w: World, name: str) -> list[str]:
    src = w.data / name
    return ["stage", "sft", *w.ov(f"data.domains=[{{name: math, source: '{src}', eval_size: 4}}, "
                                  f"{{name: code, source: '{src}', eval_size: 4}}]", "sft.mix=null",
                                  "mopd.mix=null")]


def _expert_init_ov(w: World, *extra: str) -> list[str]:
    return ["stage", "expert", "--domain", "math", "--init", str(w.sft), *w.ov(*extra)]


def _expert_init(w: World, init: Path) -> list[str]:
    return ["stage", "expert", "--domain", "math", "--init", str(init), *w.ov()]


CASES = [
    # -- config: types, ranges, unknown keys and values, impossible combinations
    Case("config-unknown-key", "hostile/config", lambda w, c: ["recipe", *w.ov("mopd.stepz=3")],
         lambda w, c: ["mopd.stepz", "fix the spelling"], via="subprocess"),
    Case("config-wrong-type", "hostile/config", lambda w, c: ["recipe", *w.ov("mopd.steps=many")],
         lambda w, c: ["mopd.steps", "integer"]),
    Case("config-out-of-range", "hostile/config", lambda w, c: ["recipe", *w.ov("sft.lr=-0.1")],
         lambda w, c: ["sft.lr", "greater than 0"]),
    Case("config-unknown-value", "hostile/config", lambda w, c: ["recipe", *w.ov("teachers.routing=random")],
         lambda w, c: ["teachers.routing", "'domain' or 'mixture'"]),
    Case("config-unknown-domain-in-mix", "hostile/config", lambda w, c: ["recipe", *w.ov("mopd.mix={poetry: 1}")],
         lambda w, c: ["mopd.mix", "poetry", "known"]),
    Case("config-head-dim", "hostile/config", lambda w, c: ["recipe", *w.ov("model.tiny.num_heads=3")],
         lambda w, c: ["model.tiny", "num_heads"]),
    Case("config-unknown-preset", "hostile/config", lambda w, c: ["recipe", "--config", "no-such-preset"],
         lambda w, c: ["no-such-preset", "tiny"]),
    Case("config-invalid-yaml", "hostile/config", lambda w, c: ["recipe", "--config", str(w.data / "bad.yaml")],
         lambda w, c: ["bad.yaml", "YAML"]),
    Case("config-override-syntax", "hostile/config", lambda w, c: ["recipe", *w.ov(), "--set", "mopd.steps"],
         lambda w, c: ["mopd.steps", "key.path=value"]),
    Case("config-bad-name", "hostile/config", lambda w, c: ["recipe", *w.ov("name=../escape")],
         lambda w, c: ["name"]),
    # prompt + completion + 1 > the model's context: caught before SFT trains (it once trained anyway)
    Case("config-context-too-long", "hostile/config", lambda w, c: ["recipe", *w.ov("rollout.max_new_tokens=200")],
         lambda w, c: ["max_position_embeddings", "rollout.max_new_tokens"]),
    # nothing to learn from: must fail before the recipe trains SFT and the experts
    Case("config-nothing-to-learn", "hostile/config",
         lambda w, c: ["recipe", *w.ov("mopd.w_kd=0", "mopd.w_rl=0")], lambda w, c: ["w_rl", "w_kd"]),
    # served teachers cannot answer a top-k above their --max-logprobs: a config error, before any server starts
    # (a vLLM python that does not exist: if the combination is not caught first, that is what fails)
    Case("config-jsd-top-k-over-max-logprobs", "hostile/config",
         lambda w, c: _stage_mopd(w, "teachers.backend=http", "mopd.kd_loss=jsd", "mopd.jsd_top_k=32",
                                  "teachers.max_logprobs=20", f"teachers.serve_python={w.models / 'no-python'}"),
         lambda w, c: ["teachers.max_logprobs", "jsd_top_k"]),
    Case("config-endpoints-with-local-backend", "hostile/config",
         lambda w, c: _stage_mopd(w, "teachers.endpoints={math: 'http://127.0.0.1:9', code: 'http://127.0.0.1:9', "
                                     "if: 'http://127.0.0.1:9'}"),
         lambda w, c: ["teachers.backend"]),
    Case("config-device-not-present", "hostile/config",
         lambda w, c: ["stage", "expert", "--domain", "math", "--init", str(w.sft), *w.ov("runtime.device=cuda")],
         lambda w, c: ["runtime.device", "cuda"]),
    # -- data: schemas, empty, malformed lines, unknown teacher_id, over-long prompts, duplicate domains
    Case("data-missing-file", "hostile/data", lambda w, c: _data(w, "nope.jsonl"),
         lambda w, c: ["nope.jsonl", "not found"]),
    Case("data-empty-file", "hostile/data", lambda w, c: _data(w, "empty.jsonl"),
         lambda w, c: ["empty.jsonl", "empty"]),
    Case("data-malformed-line", "hostile/data", lambda w, c: _data(w, "malformed.jsonl"),
         lambda w, c: ["malformed.jsonl", "line 3"], via="subprocess"),
    Case("data-missing-column", "hostile/data", lambda w, c: _data(w, "no-teacher-id.jsonl"),
         lambda w, c: ["no-teacher-id.jsonl", "teacher_id"]),
    Case("data-unknown-teacher-id", "hostile/data", lambda w, c: _data(w, "unknown-teacher.jsonl"),
         lambda w, c: ["unknown-teacher.jsonl", "poetry", "known"]),
    # a row longer than data.max_prompt_tokens: caught at load time, before SFT trains on it
    Case("data-over-long-prompt", "hostile/data", lambda w, c: _data(w, "over-long.jsonl"),
         lambda w, c: ["over-long.jsonl", "max_prompt_tokens"]),
    Case("data-prompt-not-text", "hostile/data", lambda w, c: _data(w, "prompt-not-text.jsonl"),
         lambda w, c: ["prompt-not-text.jsonl", "prompt"]),
    Case("data-corrupt-parquet", "hostile/data", lambda w, c: _data(w, "corrupt.parquet"),
         lambda w, c: ["corrupt.parquet", "parquet"]),
    Case("data-duplicate-domains", "hostile/data",
         lambda w, c: ["recipe", *w.ov("data.domains=[{name: math, source: 'synthetic:math'}, "
                                       "{name: math, source: 'synthetic:code'}]", "sft.mix=null", "mopd.mix=null")],
         lambda w, c: ["data.domains", "duplicate", "math"]),
    # -- models: missing / truncated / mismatched checkpoints and tokenizers
    Case("model-missing-init", "hostile/model", lambda w, c: _expert_init(w, w.models / "nope"),
         lambda w, c: [str(w.models / "nope")]),
    # once: a traceback, and a new stage folder left behind
    Case("model-truncated-safetensors", "hostile/model", lambda w, c: _expert_init(w, w.models / "truncated"),
         lambda w, c: [str(w.models / "truncated"), "model.safetensors"], via="subprocess"),
    Case("model-missing-tokenizer", "hostile/model", lambda w, c: _expert_init(w, w.models / "no-tokenizer"),
         lambda w, c: [str(w.models / "no-tokenizer"), "tokenizer"]),
    Case("model-corrupt-config", "hostile/model", lambda w, c: _expert_init(w, w.models / "bad-config"),
         lambda w, c: [str(w.models / "bad-config"), "config.json"]),
    Case("model-short-context-base", "hostile/model",
         lambda w, c: ["stage", "sft", "--base", str(w.models / "short-context"), *w.ov()],
         lambda w, c: [str(w.models / "short-context"), "max_position_embeddings"]),
    Case("model-teacher-other-tokenizer", "hostile/model",
         lambda w, c: ["stage", "mopd", "--init", str(w.sft), "--teacher", f"math={w.models / 'other-vocab'}",
                       "--teacher", f"code={w.sft}", "--teacher", f"if={w.sft}", *w.ov()],
         lambda w, c: ["teacher 'math'", "tokenizer"]),
    Case("model-teacher-missing", "hostile/model",
         lambda w, c: ["stage", "mopd", "--init", str(w.sft), "--teacher", f"math={w.models / 'gone'}",
                       "--teacher", f"code={w.sft}", "--teacher", f"if={w.sft}", *w.ov()],
         lambda w, c: [str(w.models / "gone")]),
    # -- teachers: unreachable, wrong model, too short max-model-len, HTTP 4xx/5xx, slow ("-fake-vllm": a FakeVLLM
    #    answers, for faults a real server cannot be made to produce on demand)
    Case("teacher-unreachable", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", c["url"], "unreachable", "teachers.endpoints"], via="subprocess",
         setup=_free_port),
    Case("teacher-wrong-vocabulary-fake-vllm", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", c["url"], "tokeniz"], setup=lambda w: _fake(w, id_shift=1)),
    Case("teacher-serves-no-model-fake-vllm", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", c["url"], "no model"], setup=lambda w: _fake(w, models=[])),
    Case("teacher-max-model-len-too-short-fake-vllm", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", "max-model-len 10", "rollout.max_new_tokens"],
         setup=lambda w: _fake(w, max_model_len=10)),
    Case("teacher-http-404-fake-vllm", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", "404"], setup=lambda w: _fake(w, status={"/tokenize": 404})),
    Case("teacher-http-503-fake-vllm", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", "503", "teachers.retries"],
         setup=lambda w: _fake(w, status={"/tokenize": 503})),
    Case("teacher-slow-fake-vllm", "hostile/teacher",
         lambda w, c: _stage_mopd(w, *_http(c, "teachers.request_timeout_s=0.5", "teachers.retries=0")),
         lambda w, c: ["teacher 'math'", "request_timeout_s"], setup=lambda w: _fake(w, delay_s={"/tokenize": 3})),
    # passes the pre-flight, then rejects the first scoring request (a server restarted with a shorter
    # --max-model-len): one line naming the teacher, the lengths and the fix; the new student folder may stay
    Case("teacher-http-400-while-scoring-fake-vllm", "hostile/teacher", lambda w, c: _stage_mopd(w, *_http(c)),
         lambda w, c: ["teacher 'math'", "HTTP 400", "max-model-len is 10", "rollout.max_new_tokens"],
         setup=lambda w: _fake(w, status={"/v1/completions": 400}, body={"/v1/completions": {
             "object": "error", "message": "This model's maximum context length is 10 tokens. However, you "
             "requested 23 tokens in the messages.", "code": 400}}), may_create=("t/student",)),
    Case("teacher-served-without-vllm", "hostile/teacher",
         lambda w, c: _stage_mopd(w, "teachers.backend=http", f"teachers.serve_python={w.models / 'no-python'}"),
         lambda w, c: ["teachers.serve_python", str(w.models / "no-python")]),
    # -- settings that would have no effect in the chosen mode: refused, naming the setting and the mode that reads
    #    it (each used to train with the setting silently dropped, exit 0)
    *[Case(f"ignored-{cid}", "hostile/ignored-setting", (lambda ov: lambda w, c: _stage_mopd(w, *ov))(ov),
           (lambda nd: lambda w, c: list(nd))(nd))
      for cid, ov, nd in [
          ("async-without-async-placement", ["async.max_staleness=2"], ["async", "runtime.placement=async"]),
          ("servers-without-served-rollout", ["rollout.servers=2"], ["rollout.servers", "rollout.backend=served"]),
          ("vllm-option-with-hf-rollout", ["rollout.sleep_level=2"], ["rollout.sleep_level", "rollout.backend=vllm"]),
          ("kd-top-k-with-sampled-rkl", ["mopd.kd_loss=sampled_rkl", "mopd.kd_top_k=4"],
           ["mopd.kd_top_k", "kd_loss=topk_rkl"]),
          ("kd-candidates-with-sampled-rkl", ["mopd.kd_loss=sampled_rkl", "mopd.kd_candidates=teacher"],
           ["mopd.kd_candidates", "topk_rkl"]),
          ("gap-clip-without-gap-following", ["mopd.gap_clip=[0.1,10]"], ["mopd.gap_clip", "gap_following"]),
          ("gap-momentum-without-gap-following", ["mopd.gap_momentum=0.5"], ["mopd.gap_momentum", "gap_following"]),
          ("jsd-beta-with-sampled-rkl", ["mopd.jsd_beta=0.5"], ["mopd.jsd_beta", "kd_loss=jsd"]),
          ("jsd-top-k-with-sampled-rkl", ["mopd.jsd_top_k=4"], ["mopd.jsd_top_k", "kd_loss=jsd"]),
          ("mixture-weights-with-domain-routing", ["teachers.mixture_weights={math: 1, code: 2, if: 1}"],
           ["teachers.mixture_weights", "routing=mixture"]),
          ("mixture-kind-with-domain-routing", ["teachers.mixture_kind=geometric"],
           ["teachers.mixture_kind", "routing=mixture"]),
          ("domain-mixture-with-domain-routing", ["teachers.domain_mixture_weights={math: {math: 1}}"],
           ["teachers.domain_mixture_weights", "routing=mixture"]),
          ("conflict-with-domain-routing", ["teachers.conflict=mask"], ["teachers.conflict", "routing=mixture"]),
          ("eval-temperature-without-mean-at-k", ["eval.temperature=0.5"], ["eval.temperature", "mean_at_k"]),
          ("expert-kd-weight", ["expert.w_kd=1"], ["expert.w_kd", "rewards only"]),
          ("expert-mix", ["expert.mix={math: 1}"], ["expert.mix", "rewards only"]),
          ("expert-kd-loss", ["expert.kd_loss=jsd"], ["expert.kd_loss", "rewards only"]),
          ("ray-address-without-workers", ["runtime.ray_address=127.0.0.1:6379"],
           ["runtime.ray_address", "runtime.strategy=ddp"]),
      ]],
    # -- non-finite and degenerate numbers: refused as the config loads (an infinite lr trained NaN weights and
    #    marked the stage done; a group of one sample makes every GRPO advantage 0)
    *[Case(f"numbers-{cid}", "hostile/numbers", (lambda ov: lambda w, c: _expert_init_ov(w, *ov))(ov),
           (lambda nd: lambda w, c: list(nd))(nd))
      for cid, ov, nd in [
          ("infinite-lr", ["expert.lr=.inf"], ["expert.lr", "finite"]),
          ("nan-lr", ["expert.lr=.nan"], ["expert.lr"]),
          ("infinite-grad-clip", ["expert.grad_clip=.inf"], ["expert.grad_clip", "finite"]),
          ("infinite-clip-high", ["expert.clip_high=.inf"], ["expert.clip_high", "finite"]),
          ("infinite-temperature", ["rollout.temperature=.inf"], ["rollout.temperature", "finite"]),
          ("infinite-kd-clip", ["mopd.kd_clip=.inf"], ["mopd.kd_clip", "finite"]),
          ("group-of-one-with-rewards", ["expert.group_size=1"], ["group_size=1", "advantage"]),
          ("adam-beta-above-one", ["expert.betas=[1.5, 0.9]"], ["betas", "[0, 1)"]),
          ("more-minibatches-than-samples", ["expert.minibatches=1000"], ["minibatches=1000", "samples"]),
          ("warmup-longer-than-training", ["expert.warmup_steps=100"], ["warmup_steps=100", "steps"]),
          ("negative-mix-weight", ["mopd.mix={math: -1, code: 1, if: 1}"], ["mix", "negative"]),
          ("all-zero-mix", ["mopd.mix={math: 0, code: 0, if: 0}"], ["mix", "zero weight"]),
          ("infinite-sft-mix-weight", ["sft.mix={math: .inf, code: 1, if: 1}"], ["sft.mix", "finite"]),
          ("negative-mixture-weight", ["teachers.routing=mixture", "teachers.mixture_weights={math: -1, code: 1}"],
           ["teachers.mixture_weights", "negative"]),
          ("mixture-weight-for-no-domain", ["teachers.routing=mixture",
                                            "teachers.domain_mixture_weights={poetry: {math: 1}}"],
           ["teachers.domain_mixture_weights", "poetry"]),
          ("misspelt-sft-scheduler", ["sft.lr_scheduler=cosine_with_warmupp"],
           ["lr_scheduler", "cosine_with_warmupp", "constant_with_warmup"]),
      ]],
    # a cluster address nobody answers on: one line before the stage writes (ray.init retried past its timeout
    # and ended in a library traceback, with a new stage folder left behind)
    Case("placement-ray-address-refused", "hostile/placement",
         lambda w, c: _expert_init_ov(w, "runtime.strategy=ddp", "runtime.num_workers=2",
                                      f"runtime.ray_address={c['url'].removeprefix('http://')}"),
         lambda w, c: ["runtime.ray_address", "no Ray cluster answers"], setup=_free_port),
    Case("placement-ray-address-not-host-port", "hostile/placement",
         lambda w, c: _expert_init_ov(w, "runtime.strategy=ddp", "runtime.num_workers=2",
                                      "runtime.ray_address=headnode"),
         lambda w, c: ["runtime.ray_address", "HOST:PORT"]),
    # finite but far too large: the next step's loss is not finite — the stage stops there (every step is checked,
    # loss, gradient and weights) instead of finishing; the new stage's folder may stay, without a final model
    Case("numbers-learning-rate-that-diverges", "hostile/numbers",
         # a run of its own (no other case's student); the math teacher the untrained base, so the distillation
         # gradient is not zero (the student as its own teacher gives exactly none under the dense objective)
         lambda w, c: ["stage", "mopd", "--init", str(w.sft), "--teacher", f"math={w.root / 't' / 'base'}",
                       "--teacher", f"code={w.sft}", "--teacher", f"if={w.sft}", *w.ov("mopd.lr=1e37", "name=diverge")],
         lambda w, c: ["non-finite", "lower the lr"], may_create=("diverge",)),
    Case("teacher-for-no-domain", "hostile/teacher",
         lambda w, c: ["stage", "mopd", "--init", str(w.sft), *[a for d in ("math", "code", "if", "poetry")
                                                                 for a in ("--teacher", f"{d}={w.sft}")], *w.ov()],
         lambda w, c: ["poetry", "no domain"]),
    # -- state files damaged between runs (a full disk, a kill mid-copy, a hand edit): one line naming the file
    #    and how to recover, nothing changed
    Case("state-stage-record-garbled", "hostile/state", lambda w, c: _in_copy(c, "stage", "sft"),
         lambda w, c: [str(c["file"]), "run the stage again"],
         setup=lambda w: _state_copy(w, lambda d: _garble(d / "t" / "sft" / "stage.json", '{"status": "do')),
         watch=lambda w, c: [c["dir"]]),
    Case("state-stage-record-not-an-object", "hostile/state", lambda w, c: _in_copy(c, "stage", "sft"),
         lambda w, c: [str(c["file"]), "not a JSON object"],
         setup=lambda w: _state_copy(w, lambda d: _garble(d / "t" / "sft" / "stage.json", "[1, 2]")),
         watch=lambda w, c: [c["dir"]]),
    Case("state-model-identity-garbled", "hostile/state",
         lambda w, c: _in_copy(c, "stage", "expert", "--domain", "math", "--init", str(c["dir"] / "t" / "sft" /
                                                                                        "final")),
         lambda w, c: [str(c["file"]), "delete it"],
         setup=lambda w: _state_copy(w, lambda d: _garble(d / "t" / "sft" / "final" / "mopd_identity.json", "{")),
         watch=lambda w, c: [c["dir"]]),
    Case("state-optimizer-state-truncated", "hostile/state",
         lambda w, c: _in_copy(c, "stage", "expert", "--domain", "math", "--init", str(w.sft),
                               extra=("expert.steps=3", "expert.save_every=2")),
         lambda w, c: [str(c["file"]), "resume from the checkpoint before it"],
         setup=lambda w: _state_copy(w, lambda d: _garble(d / "t" / "expert-math" / "checkpoints" / "step-000002" /
                                                          "loop_state.pt"), expert_steps=2),
         watch=lambda w, c: [c["dir"]]),
    Case("state-metrics-line-garbled", "hostile/state",
         lambda w, c: _in_copy(c, "stage", "expert", "--domain", "math", "--init", str(w.sft),
                               extra=("expert.steps=3", "expert.save_every=2")),
         lambda w, c: [str(c["file"]), "line 1", "delete that line"],
         setup=lambda w: _state_copy(w, lambda d: _garble_first_line(d / "t" / "expert-math" / "metrics.jsonl"),
                                     expert_steps=2),
         watch=lambda w, c: [c["dir"]]),
    # -- filesystem: a file in the way, read-only, disk full
    Case("fs-file-in-the-way", "hostile/filesystem",
         lambda w, c: ["stage", "sft", *sets(tiny_overrides(w.root / "blocker" / "runs"))],
         lambda w, c: [str(w.root / "blocker")], via="subprocess"),
    Case("fs-read-only-output-dir", "hostile/filesystem",
         lambda w, c: ["stage", "sft", *sets(tiny_overrides(c["dir"]))], lambda w, c: [str(c["dir"]), "output_dir"],
         setup=_readonly_dir, watch=lambda w, c: [c["dir"]]),
    Case("fs-disk-full", "hostile/filesystem",
         lambda w, c: ["stage", "sft", *sets(tiny_overrides(c["dir"]))],
         lambda w, c: [str(c["dir"]), ("free", "disk", "space")], via="subprocess", setup=_small_disk,
         watch=lambda w, c: [c["dir"]]),
]


@pytest.mark.parametrize("hc", CASES, ids=[c.id for c in CASES])
def test_hostile_input(world: World, hc: Case, case):
    case["category"] = hc.category
    with hc.setup(world) as ctx:
        watched = [world.root, *hc.watch(world, ctx)]
        before = {str(p): tree_hash(p) for p in watched}
        args = hc.args(world, ctx)
        env = base_env(**hc.env(world, ctx))
        res = run_cli(args, in_process=hc.via == "in-process", env=env, timeout=240, fsize=ctx.get("fsize"))
        after = {str(p): tree_hash(p) for p in watched}
    case["detail"]["via"] = res.via
    tail = [ln for ln in res.stderr.splitlines() if ln.strip()]
    case["message"] = f"[{res.via}, {ctx.get('how', '')}] " if ctx.get("how") else f"[{res.via}] "
    case["message"] += tail[-1][:300] if tail else f"(no stderr, rc={res.rc})"
    needles = hc.needles(world, ctx)
    plain = [n for n in needles if isinstance(n, str)]
    line = one_line_error(res, *plain)
    for alt in (n for n in needles if isinstance(n, tuple)):
        assert any(a in line for a in alt), f"the error names none of {alt}: {line}"
    for p in watched:
        a, b = before[str(p)], after[str(p)]
        if hc.may_create and p == world.root:
            b = {k: v for k, v in b.items() if k in a or not k.startswith(hc.may_create)}
        assert b == a, f"{p} changed: {tree_diff(a, b)}"
