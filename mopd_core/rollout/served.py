"""`rollout.backend: served` — the student's rollout engine as separate vLLM OpenAI servers
(used by `runtime.placement: async`; docs/async.md).

    engine = ServedRollout.start(model_dir, run_dir, tokenizer=tok, servers=2, ...)  # N supervised servers
    batch = engine.generate(examples, max_new_tokens=…, generator=gen)   # RolloutBatch, behaviour log-probs
    engine.sync_weights(model_or_state_dict, version=s)                  # the trainer's weights land on every server
    engine.close()                                                       # stops every server it started

The servers are started, health-checked, supervised and stopped by the same `serving.VllmServers` as the teacher
servers (one lifecycle; `role="student server"`), in vLLM's dev mode (`VLLM_SERVER_DEV_MODE=1`),
which adds the RL endpoints used here.

**Weights** (the "safetensors file" transport on CPU): `sync_weights` writes the weights once as an HF checkpoint
folder `<run_dir>/weights/v<version>/` (written under a temporary name, then renamed — a crash never leaves a
half folder that a restart could load), then on every server `POST /collective_rpc {"method": "reload_weights",
"kwargs": {"weights_path": …}}` (vLLM's in-place reload: the worker's `reload_weights` reads the folder through
its model loader and copies into the engine's parameters, fusing q/k/v as at start-up), `POST
/reset_prefix_cache` (cached KV blocks were computed with the old weights) and `POST /update_weight_version`,
so `GET /weight_info` reports the version back. A restarted server is launched on the newest folder, so it comes
back with the current weights. Two folders are kept (the one being written and the last good one).
On GPU/NPU servers the same endpoints take vLLM's NCCL / IPC weight-transfer engines
(`/init_weight_transfer_engine`, `/update_weights`); the CPU build has neither.

**Sampling**: one `POST /v1/completions` per sample — `prompt` = the prompt's token ids (rendered by
`models.chat.PromptFormatter` exactly as `HFRollout`), `seed` = one per request drawn from `generator` in example
order (as `VllmRollout`), `logprobs: 0` + `return_token_ids` for the sampled ids and their log-probs; the servers
run with `--logprobs-mode processed_logprobs` (the distribution sampled from, as the other engines report),
`stop_token_ids` = every stop id. Requests of one call are spread over the servers round-robin and sent
concurrently; with the same weights and seed each server returns the same sample, so the spread does not change
the batch. A call never mixes weight versions: `sync_weights` waits for running calls and holds new ones back
(a readers–writer lock), so every sample's version is the one `version` reports while it ran.

Failure policy (as the http teachers): connection errors, timeouts and 5xx are retried with backoff; a dead or
hung server is restarted by the supervisor (bounded by `rollout.restarts`) and the request sent again; 4xx fails
at once with the server's message.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import InfraError, MopdError
from ..models import generation_config, unwrap
from ..models.chat import formatter_for
from ..models.lora import export_state_dict
from ..serving import VllmServers, required_max_model_len
from . import RolloutBatch, RolloutEngine, assemble_completions, encode_prompts
from .requests import request_seeds, sampling_kwargs

log = logging.getLogger("mopd.rollout")

# one served name whatever folder a server was (re)started on: a request built before a restart stays valid
SERVER_ARGS = ["--logprobs-mode", "processed_logprobs", "--served-model-name", "student"]
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the RL endpoints: /collective_rpc, /update_weight_version, …


class StudentServerError(InfraError):
    """A student server did not answer after retries and restarts (infrastructure: the stage may be retried)."""


class StudentRequestError(MopdError):
    """A student server rejected a request (HTTP 4xx): never retried."""


class _RWLock:
    """Many readers (generate calls) or one writer (a weight update); a waiting writer holds new readers back."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting = 0

    def acquire_read(self) -> None:
        with self._cv:
            while self._writer or self._waiting:
                self._cv.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cv:
            self._readers -= 1
            self._cv.notify_all()

    def acquire_write(self) -> None:
        with self._cv:
            self._waiting += 1
            while self._writer or self._readers:
                self._cv.wait()
            self._waiting -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cv:
            self._writer = False
            self._cv.notify_all()


def _state_dict(model_or_sd) -> Mapping[str, torch.Tensor]:
    if isinstance(model_or_sd, Mapping):
        return model_or_sd
    return export_state_dict(unwrap(model_or_sd))  # a LoRA policy's merged weights: the servers load a plain HF model


class ServedRollout(RolloutEngine):
    """The student sampled on vLLM servers (`servers`: a started `VllmServers` with role "student server";
    `close` stops it when `owns_servers`). `model`: the trainer's module (generation config for the stop ids,
    the source of `sync_weights(None)`); `version`: the weight version the servers hold now."""

    def __init__(self, servers, tokenizer, device, max_prompt_tokens: int | None = None, *, model=None,
                 chat=None, formatter=None, weights_dir: str | Path, version: int = 0,
                 request_timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 0.5,
                 max_concurrency: int = 64, owns_servers: bool = True):
        import httpx

        self.servers, self.tokenizer, self.device = servers, tokenizer, torch.device(device)
        self.model, self.max_prompt_tokens = model, max_prompt_tokens
        self.formatter = formatter_for(tokenizer, formatter if formatter is not None else chat)
        self.names = list(servers.servers)
        self.weights_dir = Path(weights_dir)
        self.version = int(version)
        self.retries, self.backoff_s = int(retries), float(backoff_s)
        self.owns_servers = owns_servers
        self._lock = _RWLock()
        self._recover_lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(request_timeout_s, connect=10.0), trust_env=False,
                                    limits=httpx.Limits(max_connections=max_concurrency,
                                                        max_keepalive_connections=max_concurrency))
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="student-gen")
        self.stats = {"requests": 0, "retries": 0, "restarts": 0, "tokens": 0, "seconds": 0.0, "syncs": 0,
                      "sync_s": 0.0, "sync_bytes": 0}
        self.last_sync: dict | None = None
        self._model_ids = {n: servers.servers[n].model for n in self.names}
        # config and tokenizer files of every version folder: copied once from the folder the servers started on
        # (which may be a checkpoint that rotation deletes later; the servers' current folder changes and older
        # versions are pruned while the trainer writes), then hard-linked into each version
        self._files_src = self.weights_dir / "_files"
        src = Path(servers.servers[self.names[0]].checkpoint)
        if src.is_dir() and not self._files_src.is_dir():
            tmp = self.weights_dir / "._files.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for f in src.iterdir():
                if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt") and \
                        not f.name.endswith(".index.json"):
                    shutil.copy2(f, tmp / f.name)
            tmp.rename(self._files_src)

    @classmethod
    def start(cls, checkpoint: str | Path, run_dir: str | Path, *, tokenizer, device, max_prompt_tokens: int,
              max_new_tokens: int, servers: int = 1, python: str | Path = ".venv-vllm/bin/python",
              dtype: str = "float32", startup_timeout_s: float = 300.0, restarts: int = 2, kv_cache_gib: int = 1,
              version: int = 0, **kw) -> "ServedRollout":
        """Start `servers` vLLM servers on `checkpoint` under `run_dir` (logs in `run_dir/logs/`) and return the
        engine over them; the servers are stopped again if anything fails."""
        run_dir = Path(run_dir)
        ts = VllmServers({f"student-{i}": checkpoint for i in range(servers)}, run_dir,
                            max_seq_len=required_max_model_len(max_prompt_tokens, max_new_tokens) - 1,
                            python=python, max_logprobs=1, dtype=dtype, startup_timeout_s=startup_timeout_s,
                            restarts=restarts, kv_cache_gib=kv_cache_gib, extra_args=SERVER_ARGS, env=SERVER_ENV,
                            role="student server", section="rollout")
        ts.start()
        try:
            eng = cls(ts, tokenizer, device, max_prompt_tokens, weights_dir=run_dir / "weights", version=version,
                      **kw)
            for n in eng.names:
                eng._post(n, "/update_weight_version", {"new_version": str(version)})
            return eng
        except BaseException:
            ts.stop()
            raise

    # -- HTTP ------------------------------------------------------------------------------------------------
    def _url(self, name: str) -> str:
        return self.servers.servers[name].url

    def _recover(self, name: str, why: str) -> None:
        """A failed request: restart the server if it died or hangs (it comes back on the newest weights). One
        thread recovers at a time and the others re-check after it, so a server still starting up is never
        taken for a hung one."""
        sup = self.servers
        with self._recover_lock:
            dead = sup.is_dead(name)
            if not dead and not sup.is_hung(name, timeout_s=10.0):
                return  # healthy (another thread restarted it): the caller just retries
            before = sup.restart_counts[name]
            if not dead:
                sup.kill_hung(name)
            sup.restart(name)  # raises TeacherUnavailable (InfraError) once its restarts are spent
            if sup.restart_counts[name] > before:
                self.stats["restarts"] += 1
                self._model_ids[name] = sup.servers[name].model
                self._post(name, "/update_weight_version", {"new_version": str(self.version)}, recover=False)
                log.warning("student server '%s' restarted after: %s", name, why)

    def _post(self, name: str, path: str, body: dict | None = None, *, params: dict | None = None,
              recover: bool = True) -> Any:
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            try:
                r = self._client.post(self._url(name) + path, json=body, params=params)
                if r.status_code < 400:
                    return r.json() if r.content else None
                if r.status_code < 500:
                    raise StudentRequestError(f"student server '{name}' rejected {path} (HTTP {r.status_code}): "
                                              f"{' '.join(r.text.split())[:300]}")
                last = f"HTTP {r.status_code}: {' '.join(r.text.split())[:200]}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if attempt == self.retries:
                break
            self.stats["retries"] += 1
            if recover:
                self._recover(name, last)
            time.sleep(self.backoff_s * 2 ** attempt)
        log_path = self.servers.log_of(name)
        raise StudentServerError(f"student server '{name}' did not answer {path} after {self.retries} retries "
                                 f"({last}; log: {log_path})")

    # -- weights ---------------------------------------------------------------------------------------------
    def weight_version(self, name: str | None = None) -> str:
        """The version a server reports (`GET /weight_info`)."""
        r = self._client.get(self._url(name or self.names[0]) + "/weight_info")
        r.raise_for_status()
        return str(r.json().get("weight_version"))

    def _write(self, sd: Mapping[str, torch.Tensor], version: int) -> tuple[Path, int]:
        """The weights as an HF checkpoint folder: config/tokenizer files copied from the folder the servers
        started on, `model.safetensors` written from `sd`; renamed into place only when complete."""
        from ..weights.transports import save_safetensors

        src = self._files_src if self._files_src.is_dir() else Path(self.servers.servers[self.names[0]].checkpoint)
        out = self.weights_dir / f"v{version}"
        tmp = self.weights_dir / f".v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in src.iterdir():
            if f.is_file():
                # config and tokenizer files never change between versions: a hard link, not MBs copied per step
                # (a real tokenizer.json is several MB); copied where links are not possible
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        # streamed tensor by tensor from the trainer's memory: no host copy of the whole model first, and views
        # sharing a storage (parameters bound to weight buckets) need no clone
        save_safetensors(sd, tmp / "model.safetensors", {"format": "pt"})
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out, sum(t.numel() * t.element_size() for t in sd.values())

    def write_version(self, model_or_sd, version: int) -> dict:
        """Write weight `version` to disk (`weights_dir/v<version>`) without touching the servers — the trainer's
        half of an asynchronous hand-over (`load_version` is the producer's). Safe while `generate` runs."""
        t0 = time.perf_counter()
        path, nbytes = self._write(_state_dict(model_or_sd), int(version))
        self.stats["sync_bytes"] += nbytes
        return {"version": int(version), "path": str(path), "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def load_version(self, version: int) -> dict:
        """Make every server hold weight `version` (written by `write_version`): waits for running `generate`
        calls, holds new ones back meanwhile."""
        t0 = time.perf_counter()
        path = self.weights_dir / f"v{int(version)}"
        if not (path / "model.safetensors").exists():
            raise RuntimeError(f"weight version {version} was never written ({path})")  # a bug: keep the traceback
        self._lock.acquire_write()
        try:
            for n in self.names:  # a restart from now on loads this folder
                self.servers.servers[n].checkpoint = str(path)
            for n in self.names:
                self._post(n, "/collective_rpc", {"method": "reload_weights",
                                                  "kwargs": {"weights_path": str(path)}})
                self._post(n, "/reset_prefix_cache")
                self._post(n, "/update_weight_version", {"new_version": str(int(version))})
            self.version = int(version)
        finally:
            self._lock.release_write()
        dt = time.perf_counter() - t0
        self.stats["syncs"] += 1
        self.stats["sync_s"] += dt
        # every server reads the whole folder from disk (the bytes the hand-over moves)
        nbytes = (path / "model.safetensors").stat().st_size * len(self.names)
        return {"version": int(version), "servers": len(self.names), "seconds": dt, "bytes": nbytes}

    def prune(self, keep_from: int) -> None:
        """Delete the weight folders older than `keep_from` (never the one the servers hold)."""
        for old in self.weights_dir.glob("v*"):
            if (old.is_dir() and old.name[1:].isdigit() and int(old.name[1:]) < keep_from
                    and int(old.name[1:]) != self.version):
                shutil.rmtree(old, ignore_errors=True)

    def sync_weights(self, model=None, version: int | None = None) -> dict:
        """Hand `model` (a module or a state dict; None = the trainer's module given at construction) to every
        server as weight `version` (None = the current version + 1): `write_version` + `load_version`."""
        t0 = time.perf_counter()
        version = self.version + 1 if version is None else int(version)
        w = self.write_version(model if model is not None else self.model, version)
        self.load_version(version)
        self.prune(version)
        self.last_sync = {"transport": "safetensors", "version": version, "bytes_copied": w["bytes"],
                          "servers": len(self.names), "seconds": time.perf_counter() - t0}
        return self.last_sync

    # -- sampling --------------------------------------------------------------------------------------------
    def stop_ids(self) -> list[int]:
        """As `VllmRollout`: EOS, the generation config's eos ids, the chat template's end-of-turn token."""
        return self.formatter.stop_ids(generation_config(self.model), self.tokenizer)

    def generate(self, examples: Sequence[Any], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, generator: torch.Generator | None = None,
                 batch_size: int | None = None, top_k: int = 0, min_p: float = 0.0,
                 top_logprobs: int = 0) -> RolloutBatch:
        del batch_size, top_logprobs  # the servers batch by themselves; top-k: as `VllmRollout`
        examples = list(examples)
        ids, mask = encode_prompts(self.tokenizer, examples, "cpu", self.max_prompt_tokens, formatter=self.formatter)
        prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        seeds = request_seeds(len(examples), generator)
        stops = self.stop_ids()

        def body(i: int) -> dict:
            kw = sampling_kwargs(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, greedy=greedy,
                                 seed=int(seeds[i]), stop_ids=stops, top_k=top_k, min_p=min_p)
            kw.pop("detokenize")  # a SamplingParams field, not an OpenAI one (the server returns token ids)
            return {**kw, "prompt": prompts[i], "return_token_ids": True, "skip_special_tokens": False}

        def one(i: int) -> tuple[list[int], list[float]]:
            name = self.names[i % len(self.names)]
            out = self._post(name, "/v1/completions", {"model": self._model_ids[name], **body(i)})
            ch = out["choices"][0]
            toks = list(ch.get("token_ids") or [])
            lps = (ch.get("logprobs") or {}).get("token_logprobs")
            if toks and (lps is None or len(lps) != len(toks)):
                # a bug (ours or vLLM's), not the user's input: keeps its traceback
                raise RuntimeError(f"student server '{name}' returned {len(toks)} token ids but log-probs {lps!r}")
            return toks, [float(x) for x in (lps or [])]

        t0 = time.perf_counter()
        self._lock.acquire_read()
        try:
            rows = list(self._pool.map(one, range(len(examples))))
        finally:
            self._lock.release_read()
        self.stats["requests"] += len(rows)
        self.stats["tokens"] += sum(len(t) for t, _ in rows)
        self.stats["seconds"] += time.perf_counter() - t0
        return assemble_completions(self.tokenizer, ids, mask, rows, examples, self.device)

    # -- teardown --------------------------------------------------------------------------------------------
    def manifest(self) -> dict:
        return {**self.servers.manifest(), "version": self.version}

    def close(self) -> None:
        """Release the client; stop the servers this engine started. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()  # idempotent
        if self.owns_servers:
            self.servers.stop()


__all__ = ["SERVER_ARGS", "SERVER_ENV", "ServedRollout", "StudentRequestError", "StudentServerError"]
