"""`teachers.backend: http` — teachers served by vLLM's OpenAI server, scored with `prompt_logprobs`.

One request per chunk of sequences: `POST /v1/completions` with `prompt` = a list of token-id lists (each row's
real prompt ids + its completion ids up to the mask), `max_tokens: 1`, `prompt_logprobs: k`. vLLM answers, per
prompt position j ≥ 1, `{token_id: {logprob, rank, decoded_token}}` for the top-k plus the realized token, so
completion token t of a row with P real prompt tokens is entry `P + t`. Numbers equal the `local` backend's
(same weights, same float32 forward) within ~1e-6 on the tiny model.

Failure policy (one line each, naming the teacher):
- transient (connection refused/reset, timeouts, HTTP 5xx): retried with exponential backoff, `retries` times,
  then `TeacherUnavailable` (an `InfraError`: Prefect retries the stage, which resumes);
- HTTP 4xx: at once, never retried — `TeacherRequestError` (a `MopdError`) with the server's message (a sequence
  over max-model-len names the length and the server's limit);
- server process gone (a `supervisor` from `serving.VllmServers` says so): restart it (bounded) and re-score
  the whole batch — a batch never gets a partial teacher signal;
- an endpoint that does not answer at all when the router is built (pre-flight): `TeacherError` — a wrong URL
  or a server not started is the user's to fix.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlparse

import torch

from ..models import ModelError, checkpoint_files_identity, load_tokenizer, tokenizer_fingerprint
from ..rollout import RolloutBatch
from ..serving import ServerUnavailable, Supervisor
from . import Teacher, TeacherError, TeacherRouter, TeacherScore

# Text whose ids must match between the student tokenizer and every teacher server (`POST /tokenize`):
# every printable ASCII character, words, the synthetic domains' prompt shapes.
PROBE_TEXT = ("The quick brown fox jumps over the lazy dog. 0123456789 37+45= sort:31425= rev:abcde= "
              "upper:abcd= rep3:ab= !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ ABCDEFGHIJKLMNOPQRSTUVWXYZ")


# A teacher server did not answer (after retries and restarts): one class with the supervisor's own error, so a
# restart refused by `VllmServers` and a request given up here are caught alike.
TeacherUnavailable = ServerUnavailable


class TeacherRequestError(TeacherError):
    """A teacher server rejected a request (HTTP 4xx): never retried."""


def _is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def _one_line(text: str, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[:limit] + "…"


class HttpTeacher(Teacher):
    """A teacher behind a vLLM OpenAI-compatible server. Same interface as `LocalTeacher`:
    `name`, `path`, `fingerprint`, `stats`, `score(batch, top_k=0) -> TeacherScore`."""

    def __init__(self, name: str, url: str, *, model: str | None = None, checkpoint: str | Path | None = None,
                 fingerprint: str | None = None, temperature: float = 1.0, max_concurrency: int = 4,
                 request_batch_size: int = 8, request_timeout_s: float = 120.0, retries: int = 3,
                 backoff_s: float = 0.5, connect_retries: int = 2, restarts: int = 0,
                 supervisor: Supervisor | None = None, max_model_len: int | None = None,
                 tokenizer: str | Path | None = None):
        import httpx

        self.name, self.url = name, url.rstrip("/")
        self.checkpoint = str(checkpoint) if checkpoint else None
        self.temperature = float(temperature)
        self.max_concurrency = max(1, int(max_concurrency))
        self.request_batch_size = max(1, int(request_batch_size))
        self.retries, self.backoff_s, self.restarts = int(retries), float(backoff_s), int(restarts)
        self.supervisor = supervisor
        if abs(self.temperature - 1.0) > 1e-9:
            # vLLM computes prompt_logprobs from the raw logits (its sampler's temperature is never applied to
            # prompt tokens), so a τ≠1 teacher would silently get τ=1 numbers.
            raise TeacherError(f"teacher '{name}': teachers.temperature={temperature} is not supported by the http "
                               "backend (vLLM's prompt_logprobs ignore temperature) — use 1.0 or backend=local")
        self.stats = {"seconds": 0.0, "tokens": 0, "calls": 0, "requests": 0, "retries": 0, "restarts": 0}
        self._lock = threading.Lock()
        self._client = httpx.Client(
            timeout=httpx.Timeout(request_timeout_s, connect=min(10.0, request_timeout_s)),
            limits=httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency),
            trust_env=not _is_loopback(self.url))  # never route 127.0.0.1 through an HTTP proxy
        self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix=f"teacher-{name}")
        info = self._models(connect_retries)
        self.model = model or info["id"]
        self.max_model_len = max_model_len or info.get("max_model_len")
        self.fingerprint = fingerprint
        # its own tokenizer (the checkpoint's, or the manifest's `tokenizer` path): a teacher in
        # teachers.cross_tokenizer is re-tokenized with it (`bridge.TokenBridge`)
        tok_src = tokenizer or (self.checkpoint if fingerprint is None else None)
        self.tokenizer = load_tokenizer(tok_src) if tok_src else None
        if self.fingerprint is None and self.tokenizer is not None:
            self.fingerprint = tokenizer_fingerprint(self.tokenizer)

    @property
    def path(self) -> str:
        """What the router names in messages: the served checkpoint when known, else the URL."""
        return f"{self.checkpoint} @ {self.url}" if self.checkpoint else self.url

    def cache_identity(self) -> dict | None:
        """The served checkpoint's files (when the manifest names it), the served model name, tokenizer and
        temperature; None for an endpoint whose weights are not known here (`teachers.endpoints` without a
        checkpoint): such a teacher is never cached."""
        files = checkpoint_files_identity(self.checkpoint) if self.checkpoint else None
        if files is None:
            return None
        return {"kind": "http", "weights": files, "model": self.model, "tokenizer": self.fingerprint,
                "temperature": self.temperature}

    # -- plumbing --------------------------------------------------------------------------------------------
    def _models(self, connect_retries: int) -> dict:
        import httpx

        last = None
        for attempt in range(connect_retries + 1):
            try:
                r = self._client.get(f"{self.url}/v1/models", timeout=10.0)
                if r.status_code >= 500:
                    last = f"HTTP {r.status_code}"
                else:
                    r.raise_for_status()
                    data = r.json().get("data") or []
                    if not data:
                        raise TeacherError(f"teacher '{self.name}' at {self.url} serves no model (GET /v1/models "
                                           "is empty)")
                    return data[0]
            except httpx.HTTPStatusError as e:
                raise TeacherError(f"teacher '{self.name}' at {self.url}: GET /v1/models answered HTTP "
                                   f"{e.response.status_code} — is this a vLLM OpenAI server?") from None
            except (httpx.TransportError, ValueError) as e:
                last = _one_line(f"{type(e).__name__}: {e}", 120)
            if attempt < connect_retries:
                time.sleep(self.backoff_s * 2 ** attempt)
        # pre-flight: an endpoint the user gave that does not answer is a wrong URL or a server not started (the
        # user's to fix); one of our supervised servers that stops answering is infrastructure
        cls = TeacherUnavailable if self.supervisor is not None else TeacherError
        raise cls(f"teacher '{self.name}' unreachable at {self.url} ({last}, {connect_retries + 1} tries) — start "
                  "its server or fix teachers.endpoints")

    def _dead(self) -> bool:
        sup = self.supervisor
        return bool(sup is not None and sup.is_dead(self.name))

    def _hung(self) -> bool:
        """A supervised server that times out a request and does not answer /health is hung: kill it, so the
        dead-server path restarts it instead of retrying into the same silence."""
        sup = self.supervisor
        if sup is None or not sup.is_hung(self.name):
            return False
        sup.kill_hung(self.name)
        return True

    def _post(self, path: str, payload: dict, seq_len: int | None = None) -> dict:
        """POST with retries for transient failures only; 4xx raises at once."""
        import httpx

        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.stats["retries"] += 1
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
            with self._lock:
                self.stats["requests"] += 1
            try:
                r = self._client.post(f"{self.url}{path}", json=payload)
            except httpx.TransportError as e:  # refused, reset, timeouts, protocol errors
                last = _one_line(f"{type(e).__name__}: {e}", 120)
                if isinstance(e, httpx.TimeoutException) and self._hung():
                    raise TeacherUnavailable(f"teacher '{self.name}' server at {self.url} stopped answering (request "
                                             f"timed out, /health silent too: killed for a restart)") from None
                if self._dead():
                    raise TeacherUnavailable(f"teacher '{self.name}' server at {self.url} died ({last})") from None
                continue
            if r.status_code >= 500:
                last = f"HTTP {r.status_code}: {_one_line(r.text, 120)}"
                continue
            if r.status_code >= 400:
                raise self._request_error(r, seq_len)
            return r.json()
        raise TeacherUnavailable(f"teacher '{self.name}' at {self.url} failed {self.retries + 1} times ({last}) — "
                                 "raise teachers.retries/request_timeout_s or check the server log")

    def _request_error(self, r, seq_len: int | None) -> TeacherRequestError:
        try:
            body = r.json()
            msg = body.get("message") or (body.get("error") or {}).get("message") or r.text
        except ValueError:
            msg = r.text
        msg = _one_line(msg, 240)
        m = re.search(r"maximum (?:context|model) length is (\d+)", msg) or re.search(r"max_model_len[^\d]*(\d+)", msg)
        limit = int(m.group(1)) if m else self.max_model_len
        if seq_len is not None and (m or "length" in msg.lower() or "context" in msg.lower()):
            return TeacherRequestError(
                f"teacher '{self.name}' ({self.url}) rejected a sequence of {seq_len} tokens (+1 scored): its "
                f"max-model-len is {limit} (HTTP {r.status_code}: {msg}) — serve it with --max-model-len > "
                f"{seq_len} or lower data.max_prompt_tokens/rollout.max_new_tokens")
        return TeacherRequestError(f"teacher '{self.name}' ({self.url}) rejected the request: HTTP {r.status_code}: "
                                   f"{msg}")

    # -- checks ----------------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        out = self._post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": False})
        return list(out["tokens"])

    def check_tokenizer(self, student_tokenizer, probe: str = PROBE_TEXT, whose: str = "the student") -> None:
        """Compare the server's token ids of a probe text (plus the special tokens) with the student's (a teacher
        with its own tokenizer: with that tokenizer's, `whose` = how the message names it)."""
        text = probe + "".join(t for t in (student_tokenizer.eos_token, student_tokenizer.pad_token) if t)
        want = student_tokenizer(text, add_special_tokens=False)["input_ids"]
        got = self.tokenize(text)
        if got != want:
            i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            fix = ("teachers must share the student's tokenizer" if whose == "the student" else
                   "serve the checkpoint whose tokenizer the manifest names")
            raise ModelError(f"teacher '{self.name}' ({self.url}) tokenizes the probe text differently from "
                             f"{whose} (first difference at token {i}: server {got[i:i + 3]} vs {want[i:i + 3]}; "
                             f"{len(got)} vs {len(want)} ids): {fix}")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                    chat_template_kwargs: dict | None = None) -> str | None:
        """The server's own rendering (its chat template, or its --chat-template): vLLM's `/tokenize` with
        `messages`, then `/detokenize`. None when the server renders no template (it answers 4xx)."""
        try:
            ids = self._post("/tokenize", {"model": self.model, "messages": messages,
                                           "add_generation_prompt": add_generation_prompt,
                                           **({"chat_template_kwargs": chat_template_kwargs}
                                              if chat_template_kwargs else {})})["tokens"]
        except TeacherRequestError:
            return None
        return str(self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"])

    def check_max_len(self, seq_len: int) -> None:
        """Every sequence is scored whole plus one generated token: max-model-len must be > seq_len."""
        if self.max_model_len is not None and seq_len + 1 > self.max_model_len:
            raise TeacherError(f"teacher '{self.name}' ({self.url}) has max-model-len {self.max_model_len}, the "
                               f"student needs {seq_len} + 1 (prompt + completion + 1 scored): serve it with "
                               f"--max-model-len ≥ {seq_len + 1} or shorten data.max_prompt_tokens/"
                               "rollout.max_new_tokens")

    # -- scoring ---------------------------------------------------------------------------------------------
    def score(self, batch: RolloutBatch, top_k: int = 0) -> TeacherScore:
        """Per-token log-probs of every completion token (and its top-k). Retries transient failures; if the
        server process died, the supervisor restarts it and the whole batch is scored again."""
        t0 = time.perf_counter()
        if self.supervisor is not None:
            self.url = (self.supervisor.url_of(self.name) or self.url).rstrip("/")  # moved after a restart?
        attempt = 0
        while True:
            try:
                out = self._score_once(batch, top_k)
                break
            except TeacherUnavailable as e:
                sup = self.supervisor
                if sup is None or not sup.is_dead(self.name):
                    raise
                if attempt >= self.restarts:
                    log_path = sup.log_of(self.name)
                    where = f"; log: {log_path}" if log_path else ""
                    spent = (f"its {self.restarts} restart(s) are spent" if self.restarts
                             else "no restart is allowed")
                    raise TeacherUnavailable(f"{e}; {spent} (teachers.restarts={self.restarts}{where})") from None
                attempt += 1
                self.url = sup.restart(self.name).rstrip("/")
                with self._lock:
                    self.stats["restarts"] += 1
        self.stats["seconds"] += time.perf_counter() - t0
        self.stats["tokens"] += int(batch.completion_mask.sum())
        self.stats["calls"] += 1
        return out

    def _score_once(self, batch: RolloutBatch, top_k: int) -> TeacherScore:
        dev = batch.completion_ids.device
        B, T = batch.completion_ids.shape
        p_ids, p_mask = batch.prompt_ids.cpu(), batch.prompt_mask.cpu().bool()
        c_ids, c_len = batch.completion_ids.cpu(), batch.completion_mask.cpu().long().sum(-1)
        rows = []
        for i in range(B):
            prompt = p_ids[i][p_mask[i]].tolist()
            rows.append((prompt, c_ids[i, :int(c_len[i])].tolist()))
        k = max(1, int(top_k))
        chunks = [list(range(s, min(B, s + self.request_batch_size))) for s in range(0, B, self.request_batch_size)]
        futures = [self._pool.submit(self._score_chunk, [rows[i] for i in ch], k, top_k) for ch in chunks]
        results, first_error = [], None
        for f in futures:  # wait for all: no request outlives this call, errors surface in order
            try:
                results.append(f.result())
            except Exception as e:  # noqa: BLE001 — re-raised below, first one wins
                results.append(None)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        logp = torch.zeros(B, T, dtype=torch.float32)
        tk_ids = torch.zeros(B, T, top_k, dtype=torch.long) if top_k else None
        tk_lp = torch.zeros(B, T, top_k, dtype=torch.float32) if top_k else None
        for ch, res in zip(chunks, results):
            for i, (lp, ids, lps) in zip(ch, res):
                n = len(lp)
                logp[i, :n] = torch.tensor(lp, dtype=torch.float32)
                if top_k and n:
                    tk_ids[i, :n] = torch.tensor(ids, dtype=torch.long)
                    tk_lp[i, :n] = torch.tensor(lps, dtype=torch.float32)
        return TeacherScore(logp.to(dev), tk_ids.to(dev) if top_k else None, tk_lp.to(dev) if top_k else None)

    def _score_chunk(self, rows: list[tuple[list[int], list[int]]], k: int, top_k: int):
        payload = {"model": self.model, "prompt": [p + c for p, c in rows], "max_tokens": 1,
                   "prompt_logprobs": k, "temperature": self.temperature, "n": 1}
        seq_len = max(len(p) + len(c) for p, c in rows)
        out = self._post("/v1/completions", payload, seq_len=seq_len)
        choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != len(rows):
            raise TeacherError(f"teacher '{self.name}' ({self.url}) answered {len(choices)} choices for "
                               f"{len(rows)} prompts")
        res = []
        for (prompt, comp), ch in zip(rows, choices):
            plp = ch.get("prompt_logprobs")
            if plp is None or len(plp) != len(prompt) + len(comp):
                raise TeacherError(f"teacher '{self.name}' ({self.url}) returned no/short prompt_logprobs "
                                   f"({None if plp is None else len(plp)} for {len(prompt) + len(comp)} tokens)")
            lp, ids, lps = [], [], []
            for t, tok in enumerate(comp):
                entry = plp[len(prompt) + t] or {}
                hit = entry.get(str(tok), entry.get(tok))
                if hit is None:
                    raise TeacherError(f"teacher '{self.name}' ({self.url}) omitted the realized token {tok} from "
                                       "prompt_logprobs")
                lp.append(float(hit["logprob"]))
                if top_k:
                    items = sorted(((int(tid), v) for tid, v in entry.items()),
                                   key=lambda kv: (-float(kv[1]["logprob"]), kv[0]))
                    items = [kv for kv in items if not (kv[0] == tok and kv[1].get("rank", 1) > top_k)][:top_k]
                    if len(items) < top_k:
                        raise TeacherError(f"teacher '{self.name}' returned {len(items)} < top_k={top_k} "
                                           "log-probs: serve it with --max-logprobs ≥ top_k")
                    ids.append([kv[0] for kv in items])
                    lps.append([float(kv[1]["logprob"]) for kv in items])
            res.append((lp, ids, lps))
        return res

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def __repr__(self) -> str:
        return f"HttpTeacher({self.name!r}, {self.url!r}, model={self.model!r})"


def load_manifest(path: str | Path) -> dict[str, dict]:
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise TeacherError(f"cannot read the teacher endpoint manifest '{p}': {_one_line(str(e), 120)}") from None


def _entries(endpoints_or_manifest) -> tuple[dict[str, dict], Any]:
    """Normalise `{id: url}`, `{id: {url, …}}`, a manifest path or a `serving.VllmServers` into entries and
    supervisor."""
    supervisor = None
    src = endpoints_or_manifest
    if isinstance(src, Supervisor):  # serving.VllmServers
        supervisor, src = src, src.manifest()
    elif isinstance(src, (str, Path)):
        src = load_manifest(src)
    if not isinstance(src, Mapping) or not src:
        raise TeacherError("no teacher endpoints: give teachers.endpoints {teacher_id: url} or a manifest")
    out = {}
    for tid, v in src.items():
        if isinstance(v, str):
            v = {"url": v}
        if not isinstance(v, Mapping) or not v.get("url"):
            raise TeacherError(f"teacher '{tid}': endpoint entry {v!r} has no url")
        out[tid] = dict(v)
    return out, supervisor


def build_http_router(endpoints_or_manifest, cfg, student_tokenizer, *, supervisor=None,
                      max_seq_len: int | None = None) -> TeacherRouter:
    """A `TeacherRouter` over HTTP teachers, with every pre-flight check done before any compute:
    each endpoint reachable (short bounded retry), the server's `/tokenize` ids of a probe text equal the
    student's, the checkpoint's tokenizer fingerprint (when the manifest names one) equals the student's, and
    max-model-len > `max_seq_len` (the student's prompt + completion budget) when given.

    `endpoints_or_manifest`: `{teacher_id: url}`, a manifest `{teacher_id: {url, model, fingerprint, max_model_len,
    checkpoint, …}}` (dict or JSON path) or a `serving.VllmServers` (which also supervises restarts).
    `cfg` is a TeachersConfig."""
    from ..models import check_same_tokenizer

    entries, sup = _entries(endpoints_or_manifest)
    supervisor = supervisor or sup
    student_fp = tokenizer_fingerprint(student_tokenizer)
    teachers: dict[str, HttpTeacher] = {}
    try:
        for tid, e in entries.items():
            t = HttpTeacher(
                tid, e["url"], model=e.get("model"), checkpoint=e.get("checkpoint"), fingerprint=e.get("fingerprint"),
                temperature=cfg.temperature, max_concurrency=cfg.max_concurrency,
                request_batch_size=cfg.request_batch_size, request_timeout_s=cfg.request_timeout_s,
                retries=cfg.retries, restarts=cfg.restarts if supervisor is not None else 0,
                supervisor=supervisor, max_model_len=e.get("max_model_len"),
                tokenizer=e.get("tokenizer") or (e.get("checkpoint") if tid in cfg.cross_tokenizer else None))
            teachers[tid] = t
            if tid in cfg.cross_tokenizer and t.tokenizer is not None and t.fingerprint != student_fp:
                # its own tokenizer (bridged by `open_teachers`): the server must speak that one
                t.check_tokenizer(t.tokenizer, whose=f"its own tokenizer ({t.fingerprint})")
            else:
                t.check_tokenizer(student_tokenizer)
                if t.fingerprint is None:
                    t.fingerprint = student_fp  # an external endpoint without checkpoint: the probe is the check
                check_same_tokenizer(student_fp, t.fingerprint, tid, f" ({t.path})")
            if max_seq_len is not None:
                t.check_max_len(max_seq_len)
    except Exception as e:
        for t in teachers.values():
            t.close()
        if isinstance(e, TeacherUnavailable) and supervisor is None:
            # an endpoint the user gave that fails its pre-flight (5xx, timeouts) is theirs to fix, before compute;
            # only a server we supervise failing later is infrastructure
            raise TeacherError(str(e)) from None
        raise
    return TeacherRouter(teachers, cfg.routing, cfg.mixture_kind, cfg.mixture_weights, cfg.domain_mixture_weights)
