"""The teacher-score cache (`teachers.score_cache`): a teacher never scores the same row twice.

Keyed per row by (the teacher's `cache_identity` — its weights, tokenizer, temperature, dtype and scoring path —,
what is asked — the sampled token's log-prob, its top-k, the log-probs of given candidate ids —, the row's real
prompt and completion token ids). A resumed stage replays the steps after its checkpoint with the same samples
(all randomness is derived from (seed, stage, step)), and a rerun after a crash replays the step that died: those
rows come from the cache, the teacher is not asked (`CachedTeacher`). A teacher whose identity cannot be known
(an external server without its checkpoint, a Ray actor) returns None and is never cached: a stale score can only
be fed by a key that does not cover what changed, so an unknown teacher gets no key at all.

On disk (`<stage>/teacher_cache/`): one segment file per scoring call that missed, `<teacher key>-<ns>.seg`: a
JSON header line (format version, sha256 of the payload, the row keys) and a `torch.save` payload. Written to a
temp name and renamed, so a crash leaves either the whole segment or none; a segment whose header or checksum is
wrong (a torn or damaged file) is removed with a warning and its rows are scored again. The folder is bounded by
`teachers.score_cache_gb`: past it the least recently used segments go (a hit touches its segment). A cache that
cannot write (a full disk) warns once and stops writing; it never fails the stage. Checkpoints live elsewhere
(`checkpoints/`) and are never touched.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from ..rollout import RolloutBatch
from . import Teacher, TeacherRouter, TeacherScore, WrappingTeacher

log = logging.getLogger("mopd")

FORMAT = 1
_LOADED_SEGMENTS = 16  # segment payloads kept in memory per teacher (the newest: what a replay asks for first)


def _row_key(prefix: bytes, prompt: torch.Tensor, completion: torch.Tensor, support: torch.Tensor | None) -> str:
    h = hashlib.sha256(prefix)
    # the lengths first: no two (prompt, completion) splits of the same ids hash alike
    h.update(f"{prompt.numel()},{completion.numel()},{-1 if support is None else support.numel()}|".encode())
    for ids in (prompt, completion) if support is None else (prompt, completion, support):
        h.update(ids.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


class ScoreCache:
    """Segments of one teacher's rows under `root` (shared by every teacher of the stage; the size bound is over
    all of them). Thread-safe: http teachers score from the router's threads."""

    def __init__(self, root: str | Path, teacher_key: str, max_bytes: int):
        self.root, self.teacher_key, self.max_bytes = Path(root), teacher_key, int(max_bytes)
        self._lock = threading.Lock()
        self._index: dict[str, Path] | None = None   # row key → its segment (read lazily: the stage claims its
        self._loaded: OrderedDict[Path, dict] = OrderedDict()  # folder first, which may move an older one aside)
        self._writable = True
        self.torn = 0  # segments found damaged and ignored

    # -- reading ---------------------------------------------------------------------------------------------
    def _scan(self) -> dict[str, Path]:
        index: dict[str, Path] = {}
        for seg in sorted(self.root.glob(f"{self.teacher_key}-*.seg")):
            header = _read_header(seg)
            if header is None:
                self._drop(seg, "its header is unreadable")
                continue
            index.update(dict.fromkeys(header["keys"], seg))
        return index

    def _payload(self, seg: Path) -> dict | None:
        if seg in self._loaded:
            self._loaded.move_to_end(seg)
            return self._loaded[seg]
        try:
            data = seg.read_bytes()
            head, _, body = data.partition(b"\n")
            header = json.loads(head)
            if header.get("v") != FORMAT or hashlib.sha256(body).hexdigest() != header.get("sha256"):
                raise ValueError("checksum mismatch (a torn or damaged file)")
            payload = torch.load(io.BytesIO(body), weights_only=True)
        except FileNotFoundError:  # evicted meanwhile (by another teacher's bound): a miss
            return None
        except (OSError, ValueError, RuntimeError, EOFError) as e:  # torch.load raises RuntimeError on bad zips
            self._drop(seg, str(e)[:120])
            return None
        self._remember(seg, payload)
        return payload

    def get(self, keys: list[str]) -> dict[int, dict]:
        """Row position → its cached entry, for the keys found."""
        with self._lock:
            if self._index is None:
                self._index = self._scan()
            found, touched = {}, set()
            for i, k in enumerate(keys):
                seg = self._index.get(k)
                if seg is None:
                    continue
                payload = self._payload(seg)
                entry = None if payload is None else payload.get(k)
                if entry is None:
                    self._index.pop(k, None)
                    continue
                found[i] = entry
                touched.add(seg)
            for seg in touched:  # least recently used goes first when the folder is over its bound
                try:
                    os.utime(seg)
                except OSError:
                    pass
            return found

    # -- writing ---------------------------------------------------------------------------------------------
    def put(self, entries: dict[str, dict]) -> None:
        """One segment holding `entries` (row key → entry), written atomically; then the size bound."""
        if not entries or not self._writable:
            return
        buf = io.BytesIO()
        torch.save(entries, buf)
        body = buf.getvalue()
        header = json.dumps({"v": FORMAT, "sha256": hashlib.sha256(body).hexdigest(), "keys": list(entries)})
        with self._lock:
            seg = self.root / f"{self.teacher_key}-{time.time_ns()}-{uuid.uuid4().hex[:8]}.seg"
            tmp = seg.with_name(seg.name + ".tmp")
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(header.encode() + b"\n" + body)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, seg)
            except OSError as e:
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:  # the folder itself is the problem (not a directory, gone, read-only)
                    pass
                self._writable = False
                log.warning("teacher score cache: cannot write %s (%s) — the stage goes on without caching new "
                            "scores", self.root, str(e)[:120])
                return
            if self._index is None:
                self._index = self._scan()
            self._index.update(dict.fromkeys(entries, seg))
            self._remember(seg, entries)
            self._evict()

    def _evict(self) -> None:
        segs = []
        for f in self.root.glob("*.seg"):
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            segs.append((st.st_mtime_ns, st.st_size, f))
        total = sum(s for _, s, _ in segs)
        for _, size, f in sorted(segs, key=lambda s: (s[0], s[2].name)):
            if total <= self.max_bytes:
                break
            f.unlink(missing_ok=True)
            self._loaded.pop(f, None)
            total -= size
        if self._index is not None:
            self._index = {k: s for k, s in self._index.items() if s.exists()}

    def _remember(self, seg: Path, payload: dict) -> None:
        self._loaded[seg] = payload
        self._loaded.move_to_end(seg)
        while len(self._loaded) > _LOADED_SEGMENTS:
            self._loaded.popitem(last=False)

    def _drop(self, seg: Path, why: str) -> None:
        self.torn += 1
        log.warning("teacher score cache: ignoring %s (%s); its rows are scored again", seg, why)
        seg.unlink(missing_ok=True)
        self._loaded.pop(seg, None)
        if self._index is not None:
            self._index = {k: s for k, s in self._index.items() if s != seg}


def _read_header(seg: Path) -> dict | None:
    try:
        with open(seg, "rb") as f:
            header = json.loads(f.readline())
        return header if header.get("v") == FORMAT and isinstance(header.get("keys"), list) else None
    except (OSError, ValueError, AttributeError):
        return None


class CachedTeacher(WrappingTeacher):
    """A teacher behind the score cache: rows found are not scored, the others are scored together by the inner
    teacher and stored. Everything else (turns, residency, hidden states for full_jsd) is the inner teacher's.
    `stats` adds `cache_hits`, `cache_misses` (rows) and `cache_saved_s` (the teacher-seconds those hits cost when
    they were scored) to the inner counters."""

    def __init__(self, inner: Teacher, identity: str, cache: ScoreCache):
        super().__init__(inner)
        self.identity, self.cache = identity, cache
        self.path, self.fingerprint = inner.path, inner.fingerprint
        self.scores_top_k, self.scores_any_ids = inner.scores_top_k, inner.scores_any_ids
        self.gives_hidden = inner.gives_hidden
        self._prefix = identity.encode()
        self._counts = {"cache_hits": 0, "cache_misses": 0, "cache_saved_s": 0.0}

    @property
    def stats(self) -> dict:
        return {**self.inner.stats, **self._counts}

    def hidden(self, batch: RolloutBatch, device):
        return self.inner.hidden(batch, device)  # full_jsd: hidden states are not cached (N×H per row)

    def uncached(self) -> Teacher:
        return self.inner.uncached()

    def keys(self, batch: RolloutBatch, top_k: int, support_ids: torch.Tensor | None) -> list[str]:
        """One key per row: identity, what is asked, the real prompt and completion ids (and the candidate ids)."""
        ask = self._prefix + f"|top_k={top_k}|support={support_ids is not None}|".encode()
        p_ids, p_mask = batch.prompt_ids.cpu(), batch.prompt_mask.cpu().bool()
        c_ids, c_mask = batch.completion_ids.cpu(), batch.completion_mask.cpu().bool()
        sup = None if support_ids is None else support_ids.cpu()
        return [_row_key(ask, p_ids[i][p_mask[i]], c_ids[i][c_mask[i]], None if sup is None else sup[i][c_mask[i]])
                for i in range(batch.size)]

    def score(self, batch: RolloutBatch, top_k: int = 0, support_ids: torch.Tensor | None = None) -> TeacherScore:
        keys = self.keys(batch, top_k, support_ids)
        found = self.cache.get(keys)
        miss = [i for i in range(batch.size) if i not in found]
        if miss:
            sub = batch if len(miss) == batch.size else batch.select(miss)
            kw = {} if support_ids is None else {"support_ids": support_ids[miss] if len(miss) < batch.size
                                                 else support_ids}
            t0 = time.perf_counter()
            out = self.inner.score(sub, top_k, **kw)
            fresh = _split(out, sub.completion_mask, time.perf_counter() - t0)
            self.cache.put({keys[i]: e for i, e in zip(miss, fresh)})
            found.update(zip(miss, fresh))
        self._counts["cache_hits"] += batch.size - len(miss)
        self._counts["cache_misses"] += len(miss)
        self._counts["cache_saved_s"] += sum(float(found[i]["s"]) for i in range(batch.size) if i not in miss)
        return _assemble(found, batch, top_k, support_ids)


def _split(out: TeacherScore, mask: torch.Tensor, seconds: float) -> list[dict]:
    """Per row: its real positions' numbers (on the CPU, dtypes kept: a hit returns the very values) and its
    share of the call's teacher-seconds by tokens."""
    lens = mask.long().sum(-1).tolist()
    total = max(1, sum(lens))
    rows = []
    for i, n in enumerate(lens):
        e = {"logp": out.logp[i, :n].detach().cpu().clone(), "s": seconds * n / total}
        for name, x in (("topk_ids", out.topk_ids), ("topk_logp", out.topk_logp), ("support_logp", out.support_logp)):
            if x is not None:
                e[name] = x[i, :n].detach().cpu().clone()
        rows.append(e)
    return rows


def _assemble(found: dict[int, dict], batch: RolloutBatch, top_k: int, support_ids) -> TeacherScore:
    dev = batch.completion_ids.device
    B, T = batch.completion_ids.shape
    logp = torch.zeros(B, T, dtype=found[0]["logp"].dtype if B else torch.float32)
    tk_ids = torch.zeros(B, T, top_k, dtype=torch.long) if top_k else None
    tk_lp = torch.zeros(B, T, top_k, dtype=logp.dtype) if top_k else None
    sup = torch.zeros(tuple(support_ids.shape), dtype=logp.dtype) if support_ids is not None else None
    for i in range(B):
        e = found[i]
        n = e["logp"].numel()
        logp[i, :n] = e["logp"]
        if top_k:
            tk_ids[i, :n], tk_lp[i, :n] = e["topk_ids"], e["topk_logp"]
        if sup is not None:
            sup[i, :n] = e["support_logp"]
    return TeacherScore(logp.to(dev), None if tk_ids is None else tk_ids.to(dev),
                        None if tk_lp is None else tk_lp.to(dev), None if sup is None else sup.to(dev))


def with_score_cache(router: TeacherRouter, root: str | Path, max_gb: float, salt: dict) -> TeacherRouter:
    """The router with each teacher that knows its identity behind a `CachedTeacher` (the same router object:
    its teachers are replaced). `salt`: the stage's settings that change the numbers beside the teacher's own
    (teachers.temperature, server dtype, …)."""
    salt_s = json.dumps(salt, sort_keys=True, default=str)
    for name, t in list(router.teachers.items()):
        ident = t.cache_identity()
        if ident is None:
            log.info("teacher score cache: '%s' (%s) has no known weights identity — not cached", name, t.path)
            continue
        key = hashlib.sha256(f"{json.dumps(ident, sort_keys=True, default=str)}|{salt_s}".encode()).hexdigest()
        router.teachers[name] = CachedTeacher(t, key, ScoreCache(root, key[:16], int(max_gb * 2**30)))
    return router
