"""The teacher-score cache (`teachers.cache`) and the shared-prompt prefill (`rollout.shared`):

- prefix-shared scoring equals per-sample scoring in float64 (log-probs, top-k, candidate ids);
- through the cache a fresh, a replayed (same process) and a resumed (a new cache over the same folder) step give
  the numbers of the uncached teacher, and a replay or resume asks the teacher nothing;
- a torn or damaged segment is ignored with a warning and its rows are scored again;
- the key covers the weights and the settings: a planted stale cache is caught — with a key that leaves the
  weights out the test sees the old teacher's numbers, with the real key it never does;
- the folder stays within its bound (least recently used first) and the step metrics carry hits, misses and the
  teacher-seconds saved."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from mopd_core.config import ModelConfig, TeachersConfig, TinyModelConfig
from mopd_core.models import (build_tiny, build_tiny_model, build_tiny_tokenizer, last_hidden_state, load_model,
                              save_pretrained)
from mopd_core.rollout import RolloutBatch, position_ids, score_completions
from mopd_core.rollout.shared import score_shared_prefix, shared_prefix_hidden
from mopd_core.teachers import LocalTeacher, TeacherRouter
from mopd_core.teachers.cache import CachedTeacher, ScoreCache, with_score_cache
from mopd_core.train.roles.scorer import teacher_stat_deltas

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}


class _Ex:
    def __init__(self, tid):
        self.teacher_id = tid


def _grouped_batch(pad: int, V: int, G: int = 3, T: int = 6, seed: int = 0) -> RolloutBatch:
    """Three prompts of different lengths (left-padded), G completions each, some ending early."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]
    B, P = len(prompts) * G, max(map(len, prompts))
    pid, pm = torch.full((B, P), pad), torch.zeros(B, P, dtype=torch.long)
    for i in range(B):
        p = prompts[i // G]
        pid[i, P - len(p):], pm[i, P - len(p):] = torch.tensor(p), 1
    cid = torch.randint(5, V - 1, (B, T), generator=g)
    cm = torch.ones(B, T, dtype=torch.long)
    cm[1, 3:], cm[4, 1:], cm[8, 5:] = 0, 0, 0
    cid[cm == 0] = pad
    return RolloutBatch(pid, pm, cid, cm, torch.zeros(B, T), [_Ex("math")] * B)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return [build_tiny(ModelConfig(tiny=SMALL), root / f"t{i}", seed=i) for i in range(2)]


def _router(path, **kw) -> TeacherRouter:
    return TeacherRouter({"math": LocalTeacher("math", path, "cpu", **kw)})


def test_shared_prefix_scoring_equals_per_sample_scoring_in_float64():
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(**SMALL), len(tok), tok.pad_token_id, tok.eos_token_id).double().eval()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    sup = torch.randint(0, len(tok), (*b.completion_ids.shape, 4), generator=torch.Generator().manual_seed(1))
    T = b.completion_ids.shape[1]
    with torch.no_grad():
        # the forward in float64: the hidden states each completion token is predicted from
        full = last_hidden_state(model, b.input_ids(), b.attention_mask(), position_ids(b.attention_mask()))
        shared = shared_prefix_hidden(model, b)
        assert shared.dtype == torch.float64
        m = b.completion_mask.bool()
        torch.testing.assert_close(shared[m], full[:, -T - 1:-1][m], atol=1e-12, rtol=0)
        # then the head in float32 (algorithms.logprobs), as every scorer
        for impl in ("chunked", "full"):
            ref = score_completions(model, b, 0.7, impl=impl, top_k=3, support_ids=sup)
            # micro-batches of 6 rows: one group split over two of them still prefills its prompt in each
            for mbs in (None, 6, 4):
                got = score_shared_prefix(model, b, 0.7, impl=impl, top_k=3, support_ids=sup, micro_batch_size=mbs)
                torch.testing.assert_close(got.logp, ref.logp, atol=1e-6, rtol=0)
                torch.testing.assert_close(got.topk_logp, ref.topk_logp, atol=1e-6, rtol=0)
                assert torch.equal(got.topk_ids, ref.topk_ids)
                torch.testing.assert_close(got.support_logp, ref.support_logp, atol=1e-6, rtol=0)
    assert (ref.logp[b.completion_mask == 0] == 0).all() and (got.logp[b.completion_mask == 0] == 0).all()


def test_a_local_teacher_with_share_prefix_scores_like_the_unshared_one(paths):
    tok = build_tiny_tokenizer()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    plain = _router(paths[0]).score(b, top_k=2)
    shared = _router(paths[0], share_prefix=True).score(b, top_k=2)
    torch.testing.assert_close(shared.logp, plain.logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(shared.topk_logp, plain.topk_logp, atol=1e-5, rtol=0)


def _cached(path, cache_dir, **kw) -> TeacherRouter:
    return with_score_cache(_router(path, **kw), cache_dir, 1.0, {"stage": "test"})


@pytest.mark.parametrize("top_k,support", [(0, False), (3, False), (0, True)])
def test_cached_scores_equal_uncached_for_fresh_replayed_and_resumed_steps(paths, tmp_path, top_k, support):
    tok = build_tiny_tokenizer()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    sup = (torch.randint(0, len(tok), (*b.completion_ids.shape, 4), generator=torch.Generator().manual_seed(2))
           if support else None)
    kw = {} if sup is None else {"support_ids": sup}
    ref = _router(paths[0]).score(b, top_k=top_k, **kw)

    def same(s):
        torch.testing.assert_close(s.logp, ref.logp, atol=0, rtol=0)  # a hit returns the very values
        if top_k:
            assert torch.equal(s.topk_ids, ref.topk_ids)
            torch.testing.assert_close(s.topk_logp, ref.topk_logp, atol=0, rtol=0)
        if sup is not None:
            torch.testing.assert_close(s.support_logp, ref.support_logp, atol=0, rtol=0)

    router = _cached(paths[0], tmp_path / "cache")
    t = router.teachers["math"]
    assert isinstance(t, CachedTeacher)
    same(router.score(b, top_k=top_k, **kw))  # fresh: every row scored by the teacher
    assert t.stats["calls"] == 1 and t.stats["cache_misses"] == b.size and t.stats["cache_hits"] == 0
    same(router.score(b, top_k=top_k, **kw))  # replayed in the same process: the teacher is not asked
    assert t.stats["calls"] == 1 and t.stats["cache_hits"] == b.size and t.stats["cache_saved_s"] > 0

    resumed = _cached(paths[0], tmp_path / "cache")  # a new process over the same folder
    same(resumed.score(b, top_k=top_k, **kw))
    rt = resumed.teachers["math"]
    assert rt.stats["calls"] == 0 and rt.stats["cache_hits"] == b.size

    if top_k == 0 and sup is None:  # asking for more than was stored is a miss, not a partial answer
        assert resumed.score(b, top_k=2).topk_ids is not None and rt.stats["calls"] == 1


def test_a_step_with_some_new_rows_scores_only_those(paths, tmp_path):
    tok = build_tiny_tokenizer()
    a, c = _grouped_batch(tok.pad_token_id, len(tok), seed=0), _grouped_batch(tok.pad_token_id, len(tok), seed=5)
    router = _cached(paths[0], tmp_path / "cache")
    router.score(a)
    mixed = RolloutBatch(*(torch.cat([x[:4], y[4:]]) for x, y in zip(
        (a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask, a.behaviour_logp),
        (c.prompt_ids, c.prompt_mask, c.completion_ids, c.completion_mask, c.behaviour_logp))), a.examples)
    before = router.stats()["math"]
    got = router.score(mixed)
    after = router.stats()["math"]
    assert after["cache_hits"] - before["cache_hits"] == 4
    assert after["cache_misses"] - before["cache_misses"] == mixed.size - 4
    assert after["tokens"] - before["tokens"] == int(mixed.completion_mask[4:].sum())  # only the new rows
    torch.testing.assert_close(got.logp, _router(paths[0]).score(mixed).logp, atol=1e-6, rtol=0)


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_a_torn_segment_is_ignored_with_a_warning_and_scored_again(paths, tmp_path, caplog, damage):
    tok = build_tiny_tokenizer()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    ref = _router(paths[0]).score(b).logp
    _cached(paths[0], tmp_path / "cache").score(b)
    (seg,) = (tmp_path / "cache").glob("*.seg")
    data = seg.read_bytes()
    cut = data.index(b"\n") + 1
    seg.write_bytes({"truncate": data[:cut + (len(data) - cut) // 2],
                     "flip": data[:-9] + bytes([data[-9] ^ 0xFF]) + data[-8:],
                     "header": b"{not json" + data[cut - 1:]}[damage])
    (tmp_path / "cache" / "x-1.seg.tmp").write_bytes(b"half a write")  # a crash before the rename: never read
    router = _cached(paths[0], tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="mopd"):
        got = router.score(b)
    assert "teacher score cache: ignoring" in caplog.text and seg.name in caplog.text
    st = router.stats()["math"]
    assert st["cache_misses"] == b.size and st["calls"] == 1  # scored again, not served from the damaged file
    torch.testing.assert_close(got.logp, ref, atol=0, rtol=0)
    assert not seg.exists()


def _retrained(src, dst):
    """`dst` holds the weights of `src` (another teacher) — the same file names and sizes: a teacher retrained in
    place."""
    m = load_model(src)
    from mopd_core.models import load_tokenizer

    save_pretrained(m, load_tokenizer(src), dst)


def test_a_planted_stale_cache_is_caught_by_the_weights_in_the_key(paths, tmp_path, monkeypatch):
    tok = build_tiny_tokenizer()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    teacher = tmp_path / "teacher"
    _retrained(paths[0], teacher)
    old = _cached(teacher, tmp_path / "cache").score(b).logp  # the cache now holds teacher 0's scores
    _retrained(paths[1], teacher)  # the teacher at the same path is retrained: new weights, same sizes
    new = _router(teacher).score(b).logp
    assert (new - old).abs().max() > 1e-2

    # planted: a key without the weights (what a path- or config-only key would be) feeds the stale scores …
    real = LocalTeacher.cache_identity
    monkeypatch.setattr(LocalTeacher, "cache_identity", lambda self: {k: v for k, v in real(self).items()
                                                                      if k != "weights"})
    _retrained(paths[0], teacher)
    _cached(teacher, tmp_path / "planted").score(b)  # teacher 0's numbers under a weights-free key
    _retrained(paths[1], teacher)
    leaked = _cached(teacher, tmp_path / "planted").score(b).logp
    torch.testing.assert_close(leaked, old, atol=0, rtol=0)  # this is the bug the check below would see
    assert not torch.allclose(leaked, new, atol=1e-4)
    monkeypatch.undo()

    # … the real key covers the weights: the retrained teacher misses and scores afresh
    router = _cached(teacher, tmp_path / "cache")
    torch.testing.assert_close(router.score(b).logp, new, atol=0, rtol=0)
    assert router.stats()["math"]["cache_hits"] == 0


def test_the_key_changes_with_every_setting_that_changes_the_numbers(paths, tmp_path):
    def key(path=paths[0], salt=None, **kw):
        r = with_score_cache(_router(path, **kw), tmp_path, 1.0, salt or {"stage": "test"})
        return r.teachers["math"].identity

    base = key()
    assert key() == base  # the same teacher and settings: the same key (a rerun hits)
    assert len({base, key(path=paths[1]), key(temperature=0.5), key(share_prefix=True), key(logprob_impl="full"),
                key(dtype="float64"), key(salt={"stage": "test", "server_dtype": "bfloat16"})}) == 7


def test_http_teachers_key_on_their_checkpoint_files_and_unknown_ones_are_not_cached(paths, tmp_path):
    from mopd_core.models import checkpoint_files_identity
    from mopd_core.teachers.http import HttpTeacher

    teacher = tmp_path / "teacher"
    _retrained(paths[0], teacher)
    first = checkpoint_files_identity(teacher)
    _retrained(paths[1], teacher)
    assert checkpoint_files_identity(teacher) != first  # rewritten in place, same sizes: another identity
    assert checkpoint_files_identity(tmp_path / "nope") is None

    t = HttpTeacher.__new__(HttpTeacher)  # no server: only the identity is asked
    t.checkpoint, t.model, t.fingerprint, t.temperature, t.name = None, "m", "fp", 1.0, "math"
    t.url = "http://127.0.0.1:1"
    assert t.cache_identity() is None  # an external endpoint whose weights are unknown here
    router = with_score_cache(TeacherRouter({"math": t}), tmp_path / "c", 1.0, {})
    assert router.teachers["math"] is t  # left uncached
    t.checkpoint = str(teacher)
    assert t.cache_identity()["weights"] == checkpoint_files_identity(teacher)


def test_the_folder_stays_within_its_bound_least_recently_used_first(tmp_path):
    entry = {"logp": torch.zeros(4000), "s": 0.1}  # ~16 kB a segment
    c = ScoreCache(tmp_path, "k" * 16, max_bytes=60_000)
    for i in range(3):
        c.put({f"row{i}": entry})
    segs = sorted(tmp_path.glob("*.seg"), key=lambda p: p.stat().st_mtime_ns)
    os.utime(segs[0], ns=(segs[-1].stat().st_mtime_ns + 10**9,) * 2)  # row0's segment was just hit
    c.put({"row3": entry})
    c.put({"row4": entry})
    left = {p.name for p in tmp_path.glob("*.seg")}
    assert sum(p.stat().st_size for p in tmp_path.glob("*.seg")) <= 60_000
    assert segs[0].name in left and segs[1].name not in left  # the least recently used went first
    fresh = ScoreCache(tmp_path, "k" * 16, max_bytes=60_000)
    assert set(fresh.get(["row0", "row1", "row4"])) == {0, 2}


def test_a_cache_that_cannot_write_warns_once_and_the_scores_still_come(paths, tmp_path, caplog):
    tok = build_tiny_tokenizer()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the folder should be")
    router = _cached(paths[0], blocker)
    with caplog.at_level(logging.WARNING, logger="mopd"):
        got = router.score(b).logp
        router.score(b)
    assert caplog.text.count("cannot write") == 1
    torch.testing.assert_close(got, _router(paths[0]).score(b).logp, atol=0, rtol=0)


def test_step_metrics_carry_hits_misses_and_seconds_saved(paths, tmp_path):
    tok = build_tiny_tokenizer()
    b = _grouped_batch(tok.pad_token_id, len(tok))
    router = _cached(paths[0], tmp_path / "cache")
    s0 = router.stats()
    router.score(b)
    s1 = router.stats()
    router.score(b)
    m1, m2 = teacher_stat_deltas(s0, s1), teacher_stat_deltas(s1, router.stats())
    assert m1["teacher/math/cache_misses"] == b.size and m1["teacher/math/cache_hits"] == 0
    assert m2["teacher/math/cache_hits"] == b.size and m2["teacher/math/score_s"] == 0
    assert m2["perf/teacher_cache_saved_s"] == m2["teacher/math/cache_saved_s"] > 0
    assert m2["teacher/math/cache_saved_s"] == pytest.approx(m1["teacher/math/score_s"], rel=0.5)


def test_open_teachers_puts_the_cache_in_the_stage_folder_when_enabled(tiny_cfg, paths, tmp_path):
    from mopd_core.teachers import lifecycle as L

    teachers = {d: paths[0] for d in tiny_cfg.domain_names()}
    with L.open_teachers(tiny_cfg, teachers, paths[0], tmp_path / "stage") as ts:
        assert all(isinstance(t, CachedTeacher) for t in ts.router.teachers.values())
        assert {t.cache.root for t in ts.router.teachers.values()} == {tmp_path / "stage" / "teacher_cache"}
    off = tiny_cfg.model_copy(update={"teachers": TeachersConfig(score_cache=False)})
    with L.open_teachers(off, teachers, paths[0], tmp_path / "stage") as ts:
        assert not any(isinstance(t, CachedTeacher) for t in ts.router.teachers.values())
