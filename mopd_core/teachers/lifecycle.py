"""The teacher lifecycle in one place: build, check, serve, supervise, stop.

- `open_teachers` — what a MOPD stage scores with: a `TeacherSet` (the router, the servers it started, where the
  teachers came from) for the configured backend, every pre-flight check done before any compute;
  `TeacherSet.close()` releases the scorers' clients and stops the servers it started (also on failure).
- `serve` / `supervise` / `check_endpoints` — the `serve_teachers` stage (the Prefect tasks in
  `tasks/teachers.py` call these; the live `VllmServers` is then handed to the mopd stage as `endpoints`).
- `check_tokenizers` — every teacher speaks the student's tokenizer (before anything is served).

Where the teachers come from (`teachers.backend`, the stage's `endpoints`, `teachers.endpoints`):
- `local`: in-process `LocalTeacher`s, nothing served;
- `http` with `endpoints` (a `serving.VllmServers` — supervised, dead servers are restarted — or a manifest
  path/dict) or `teachers.endpoints`: used as they are, never started or stopped here;
- `http` otherwise: one vLLM server per teacher, started by `open_teachers`, stopped by `TeacherSet.close()`.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import RecipeConfig, TeachersConfig
from ..models import check_same_tokenizer, load_tokenizer, tokenizer_fingerprint
from ..models.chat import carry_chat_template, formatter_for
from ..runtime import device as devlib
from ..serving import VllmServers
from . import TeacherError, TeacherRouter, build_local_router, check_routing
from .bridge import bridge_teachers
from .cache import with_score_cache
from .http import build_http_router, load_manifest


def check_tokenizers(student: str | Path, teachers: Mapping[str, str | Path],
                     where: str = "serve_teachers", own: Sequence[str] = ()) -> tuple[str, dict[str, str]]:
    """Every teacher checkpoint's tokenizer is the student's (one line naming the teacher otherwise), except the
    teachers in `own` (teachers.cross_tokenizer: bridged). Returns the student's fingerprint and each teacher's."""
    student_fp = tokenizer_fingerprint(load_tokenizer(student))
    fps = {}
    for name, path in sorted(teachers.items()):
        fps[name] = tokenizer_fingerprint(load_tokenizer(path))
        if name not in own:
            check_same_tokenizer(student_fp, fps[name], name, where)
    return student_fp, fps


def manifest_of(src) -> dict:
    """What teachers were (url, model, … and restart counts when supervised): from a `VllmServers`, a
    manifest path or `{teacher_id: url | {url, …}}`."""
    if not src:
        return {}
    if isinstance(src, VllmServers):
        return src.manifest()
    if isinstance(src, (str, Path)):
        return load_manifest(src)
    return {k: (v if isinstance(v, dict) else {"url": v}) for k, v in dict(src).items()}


def serve_teachers(checkpoints: Mapping[str, str | Path], cfg: TeachersConfig, run_dir: str | Path, *,
                   max_seq_len: int, student_fingerprint: str | None = None,
                   devices: Mapping[str, str] | None = None, **kw) -> VllmServers:
    """`VllmServers` for the teachers, configured from a TeachersConfig (not started: use it as a context manager
    or call `.start()` then `.stop()`). `max_seq_len` = data.max_prompt_tokens + rollout.max_new_tokens."""
    return VllmServers(
        checkpoints, run_dir, max_seq_len=max_seq_len, python=cfg.serve_python, max_logprobs=cfg.max_logprobs,
        dtype=cfg.server_dtype, startup_timeout_s=cfg.startup_timeout_s, restarts=cfg.restarts,
        gpu_memory_utilization=cfg.gpu_memory_utilization, tensor_parallel_size=cfg.tensor_parallel_size,
        kv_cache_gib=cfg.kv_cache_gib, devices=devices, student_fingerprint=student_fingerprint,
        own_tokenizer=cfg.cross_tokenizer, **kw)


def _serve(recipe: RecipeConfig, teachers: Mapping[str, str | Path], student_tok,
           run_dir: str | Path) -> tuple[VllmServers, TeacherRouter]:
    """Start one vLLM server per teacher under `run_dir`, then pre-flight them; returns (servers, router). The
    servers are stopped again if anything fails."""
    max_seq = recipe.max_seq_len()
    # fingerprints and the checkpoints' position limits are checked here, before any server starts
    servers = serve_teachers(teachers, recipe.teachers, run_dir, max_seq_len=max_seq,
                             student_fingerprint=tokenizer_fingerprint(student_tok))
    servers.start()
    try:
        return servers, build_http_router(servers, recipe.teachers, student_tok, max_seq_len=max_seq)
    except BaseException:
        servers.stop()
        raise


def serve(recipe: RecipeConfig, teachers: Mapping[str, str | Path], student: str | Path, run_dir: str | Path,
          for_mopd: bool = True) -> VllmServers:
    """The `serve_teachers` stage: one vLLM OpenAI server per teacher checkpoint on 127.0.0.1 (free port,
    `--max-logprobs teachers.max_logprobs`, `--max-model-len` = prompt + completion + 1, the configured dtype,
    parallelism and GPU-memory fraction), logs under `<run_dir>/logs/`, manifest `<run_dir>/endpoints.json`.
    Pre-flight before returning: every teacher's tokenizer fingerprint equals the student's (checked before
    any start-up), each server is healthy, tokenizes a probe text like the student and accepts the student's
    longest sequence. Returns the started `VllmServers` — the caller stops it (`.stop()`); pass it to
    `recipe.mopd_stage(endpoints=…)` to train against it with supervised restarts. A previous manifest and logs
    in `run_dir` are removed first, so the folder describes these servers only. `for_mopd=False` (a serving
    check of some teachers, not a distillation run) skips the check that every domain has a teacher."""
    if for_mopd and recipe.teachers.routing == "domain":  # a domain without a teacher fails now, not after start-up
        check_routing(recipe.domain_names(), teachers.keys())
    run_dir = Path(run_dir)
    shutil.rmtree(run_dir / "logs", ignore_errors=True)
    (run_dir / "endpoints.json").unlink(missing_ok=True)
    servers, router = _serve(recipe, teachers, load_tokenizer(student), run_dir)
    router.close()
    return servers


def supervise(servers: VllmServers, seconds: float, poll_s: float = 5.0) -> dict[str, int]:
    """Keep started servers serving for `seconds`: every `poll_s` a dead one is restarted (bounded by
    teachers.restarts; then TeacherUnavailable). Returns the restarts per teacher."""
    deadline = time.monotonic() + float(seconds)
    while True:
        for tid in list(servers.servers):
            if servers.is_dead(tid):
                servers.restart(tid)
        left = deadline - time.monotonic()
        if left <= 0:
            return {tid: servers.restart_counts[tid] for tid in servers.servers}
        time.sleep(min(poll_s, left))


def teachers_mode(cfg: TeachersConfig) -> str:
    """`colocated` (backend local: loaded in-process by the mopd stage), `external` (backend http with
    teachers.endpoints: someone else's servers) or `served` (backend http: one vLLM server per teacher here)."""
    if cfg.backend == "local":
        return "colocated"
    return "external" if cfg.endpoints else "served"


@dataclass
class Provided:
    """What the `serve_teachers` stage made reachable: the servers it started (None unless `served`), the
    endpoint manifest's path and entries, and one line saying what happened."""
    mode: str
    note: str
    servers: VllmServers | None = None
    manifest_path: str | None = None
    manifest: dict = field(default_factory=dict)


def provide(recipe: RecipeConfig, teachers: Mapping[str, str | Path], student: str | Path, run_dir: Path, *,
            for_mopd: bool = True, skip: str | None = None) -> Provided:
    """The `serve_teachers` stage for the configured mode: nothing (`colocated`, or `skip` = why no teacher will be
    needed), servers started and checked under `run_dir` (`served`; the caller stops them), or external endpoints
    checked and their manifest written to `run_dir/endpoints.json` (`external`)."""
    mode = teachers_mode(recipe.teachers)
    t0 = time.perf_counter()
    if mode == "colocated":
        return Provided(mode, "colocated: the mopd stage loads the teachers in-process; nothing is served")
    if skip:
        return Provided(mode, f"no server started: {skip}")
    if mode == "served":
        servers = serve(recipe, teachers, student, run_dir, for_mopd=for_mopd)
        return Provided(mode, f"{len(servers.servers)} vLLM server(s) started and checked in "
                        f"{time.perf_counter() - t0:.0f} s", servers, str(servers.manifest_path), servers.manifest())
    manifest = check_endpoints(recipe, recipe.teachers.endpoints, student)
    p = run_dir / "endpoints.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return Provided(mode, f"{len(manifest)} external endpoint(s) checked (teachers.endpoints)", None, str(p), manifest)


def check_endpoints(recipe: RecipeConfig, endpoints, student: str | Path) -> dict[str, dict]:
    """Pre-flight of existing servers (`teachers.endpoints`, a manifest or a VllmServers): reachable, same
    tokenizer as the student, max-model-len large enough. Returns their manifest `{teacher_id: {url, model,
    fingerprint, max_model_len}}` (plus pid/log/restarts for servers started here)."""
    entries = manifest_of(endpoints)
    router = build_http_router(endpoints, recipe.teachers, load_tokenizer(student), max_seq_len=recipe.max_seq_len())
    try:
        return {tid: {**entries.get(tid, {}), "url": t.url, "model": t.model, "fingerprint": t.fingerprint,
                      "max_model_len": t.max_model_len} for tid, t in router.teachers.items()}
    finally:
        router.close()


@dataclass
class TeacherSet:
    """The teachers of one MOPD stage: the `router` the loop scores with, the `servers` `open_teachers` started
    (stopped by `close`), and `source` — teachers used as they were given (`endpoints` or `teachers.endpoints`;
    never stopped here)."""
    router: TeacherRouter
    backend: str
    servers: VllmServers | None = None
    source: Any = None

    def manifest(self) -> dict:
        """What the teachers were at the stage's end (http: url, model, restarts, …; local on the training
        workers: where each actor ran; local in-process: nothing)."""
        if self.backend != "http":
            return {n: {"path": t.path, **where} for n, t in self.router.teachers.items() if (where := t.placement())}
        return manifest_of(self.servers if self.servers is not None else self.source)

    def close(self) -> None:
        """Release the scorers' clients, then stop the servers started for this set."""
        try:
            self.router.close()
        finally:
            if self.servers is not None:
                self.servers.stop()

    def __enter__(self) -> TeacherSet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_teachers(recipe: RecipeConfig, teachers: Mapping[str, str | Path], student: str | Path,
                  stage_dir: Path | None = None, endpoints=None, local=None) -> TeacherSet:
    """The teachers of a MOPD stage for the configured backend, every pre-flight check done (routing before any
    server starts or model loads; tokenizers, health and lengths before any compute). Servers are started (under
    `<stage_dir>/teachers`) only for `teachers.backend: http` with neither `endpoints` nor `teachers.endpoints`;
    `TeacherSet.close()` stops them.

    `endpoints`: teachers already running — a `serving.VllmServers` (restarts dead servers) or a manifest
    (path or dict `{teacher_id: url | {url, …}}`); used as they are, nothing is started or stopped.
    `local`: for `teachers.backend: local`, the scorers already built elsewhere (`{name: Teacher}`, e.g. on the
    training workers: `distributed.teachers`) instead of in-process `LocalTeacher`s.
    With `teachers.score_cache` and a `stage_dir`, every teacher whose identity is known scores through the cache in
    `<stage_dir>/teacher_cache/` (`teachers.cache`)."""
    if endpoints is not None and recipe.teachers.backend != "http":
        raise TeacherError("teacher endpoints were given but teachers.backend is "
                           f"'{recipe.teachers.backend}' — set teachers.backend=http")
    external = endpoints if endpoints is not None else recipe.teachers.endpoints  # TRL teacher_server_urls style
    if recipe.teachers.routing == "domain":  # before any server starts or model loads
        named = external.keys() if isinstance(external, dict) else (None if external else teachers.keys())
        if named is not None:
            check_routing(recipe.domain_names(), named)
    ts = _open(recipe, teachers, student, stage_dir, endpoints, local, external)
    if recipe.teachers.score_cache and stage_dir is not None:
        t = recipe.teachers
        with_score_cache(ts.router, Path(stage_dir) / "teacher_cache", t.score_cache_gb,
                         {"backend": t.backend, "temperature": t.temperature, "server_dtype": t.server_dtype,
                          "runtime_dtype": recipe.runtime.dtype})
    return ts


def _open(recipe: RecipeConfig, teachers, student, stage_dir, endpoints, local, external) -> TeacherSet:
    dinfo = devlib.resolve(recipe.runtime.device)
    backend = recipe.teachers.backend
    source = endpoints or recipe.teachers.endpoints
    if backend == "local":
        if local is not None:
            t = recipe.teachers
            router = TeacherRouter(dict(local), t.routing, t.mixture_kind, t.mixture_weights, t.domain_mixture_weights)
        else:
            router = build_local_router(dict(teachers), recipe.teachers, dinfo.torch_device, recipe.runtime.dtype,
                                        recipe.train.logprob_impl)
        return TeacherSet(_bridged(router, recipe, student), backend)
    student_tok = load_tokenizer(student)
    if external:
        router = build_http_router(external, recipe.teachers, student_tok, max_seq_len=recipe.max_seq_len())
        return TeacherSet(_bridged(router, recipe, student), backend, source=source)
    servers, router = _serve(recipe, teachers, student_tok, Path(stage_dir or recipe.run_dir()) / "teachers")
    return TeacherSet(_bridged(router, recipe, student), backend, servers=servers, source=source)


def _bridged(router: TeacherRouter, recipe: RecipeConfig, student: str | Path) -> TeacherRouter:
    """The router with each teacher in teachers.cross_tokenizer that has its own tokenizer behind a token bridge
    (`bridge.bridge_teachers`; the others are the same objects). The student's tokenizer and stop ids are the
    loop's: its checkpoint's, with data.chat's template carried."""
    if not recipe.teachers.cross_tokenizer:
        return router
    tok = load_tokenizer(student)
    carry_chat_template(tok, recipe.data.chat)
    stops = formatter_for(tok, recipe.data.chat).stop_ids()
    try:
        router.teachers = bridge_teachers(router.teachers, tok, recipe.data.chat, recipe.teachers.cross_tokenizer,
                                          stops)
    except BaseException:
        router.close()
        raise
    return router
