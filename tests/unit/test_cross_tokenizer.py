"""Teachers with their own tokenizer (`teachers.cross_tokenizer`, mopd_core/teachers/bridge.py).

- equivalence: the student's own model read through a BPE tokenizer (`RetokenizedCopy`: each BPE token scored as
  the chain of the character model's log-probs) and bridged back gives, in float64, the student's sequence
  log-probs, and its exact per-token log-probs wherever the two tokenizations cut the text alike;
- the mapping on hand-made offsets: a teacher token straddling two student tokens, spans in both directions,
  a teacher chat template with other role markers and end-of-turn token, unicode with a byte-level tokenizer
  (tokens inside one character), a sampled non-canonical tokenization;
- the sampled-token advantage: a span whose ℓᵀ is exact only as a sum gives each of its tokens the span's mean
  gap (`spread_span_gaps`), so the student's own model behind another tokenizer gives 0 advantage everywhere;
- the dense objectives' refusal (one line naming the teacher and the fix, at config load);
- the same-tokenizer path is the very same teacher object (numbers untouched);
- the http path: a vLLM-shaped server (`/v1/models`, `/tokenize`, `/v1/completions` with `prompt_logprobs`,
  scored by the teacher checkpoint in this process) gives the local backend's bridged numbers.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace as Ex

import pytest
import torch

from mopd_core.config import ChatConfig, ModelConfig, TeachersConfig, load_config
from mopd_core.errors import ConfigError, ModelError, TeacherError
from mopd_core.models import (build_bpe_tokenizer, build_tiny, build_tiny_model, build_tiny_tokenizer, load_model,
                              load_tokenizer, save_pretrained, tokenizer_fingerprint)
from mopd_core.models.chat import formatter_for
from mopd_core.rollout import RolloutBatch, score_completions
from mopd_core.teachers import LocalTeacher
from mopd_core.teachers.cache import CachedTeacher, ScoreCache
from mopd_core.teachers.bridge import (Alignment, CrossTokenizerTeacher, TokenBridge, bridge_teachers,
                                       completion_ends, owners, span_cuts)
from mopd_core.teachers.http import build_http_router
from mopd_core.teachers.retokenized import RetokenizedCopy

SMALL = ModelConfig(tiny={"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128})
PROMPTS = ["sort:3142=", "rev:abcd=", "upper:abcd=", "37+5=", "rep3:ab="]
COMPLETIONS = ["1234", "dcba", "ABCD", "42", "ababab", "dcba.", "", "a b  c"]
TEXTS = [p + c for p in PROMPTS for c in COMPLETIONS[:6]] * 5


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return build_tiny(SMALL, tmp_path_factory.mktemp("xtok") / "student", seed=0)


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(TEXTS, vocab_size=140)


def _batch(tok, prompts, completions, stop: list[bool], teacher_id="code") -> RolloutBatch:
    """A batch in `tok`'s ids: left-padded prompts, right-padded completions (+ EOS where `stop`)."""
    p = [tok(x, add_special_tokens=True)["input_ids"] for x in prompts]
    c = [tok(x, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if s else [])
         for x, s in zip(completions, stop)]
    B, P, T = len(p), max(map(len, p)), max(max(map(len, c)), 1)
    pid, pm = torch.full((B, P), tok.pad_token_id), torch.zeros(B, P, dtype=torch.long)
    cid, cm = torch.full((B, T), tok.pad_token_id), torch.zeros(B, T, dtype=torch.long)
    for i, (a, b) in enumerate(zip(p, c)):
        pid[i, P - len(a):], pm[i, P - len(a):] = torch.tensor(a), 1
        if b:
            cid[i, :len(b)], cm[i, :len(b)] = torch.tensor(b), 1
    return RolloutBatch(pid, pm, cid, cm, torch.zeros(B, T),
                        [Ex(prompt=x, teacher_id=teacher_id) for x in prompts], list(completions))


class _F64Teacher(LocalTeacher):
    """A local teacher whose log-probs are float64 end to end (the engine's scorer takes the log-softmax in
    float32): the reference of the equivalence test."""

    @torch.no_grad()
    def score(self, batch: RolloutBatch, top_k: int = 0):
        from mopd_core.rollout import position_ids
        from mopd_core.teachers import TeacherScore

        ids, am, T = batch.input_ids(), batch.attention_mask(), batch.completion_ids.shape[1]
        logits = self.model(input_ids=ids, attention_mask=am, position_ids=position_ids(am)).logits
        lp = torch.log_softmax(logits[:, -T - 1:-1].double(), -1).gather(-1, batch.completion_ids[..., None])[..., 0]
        return TeacherScore(torch.where(batch.completion_mask.bool(), lp, 0.0))


def _rows():
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(COMPLETIONS))]
    return prompts, COMPLETIONS, [i % 3 != 2 for i in range(len(COMPLETIONS))]  # some truncated (no EOS)


def _aligned(bpe, text: str, stopped: bool) -> list[bool]:
    """Per student (character) token: whether one BPE token covers exactly that character (then its value must be
    exact); the EOS always is (the teacher's EOS alone stands for it)."""
    offs = bpe(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    single = {s for s, e in offs if e == s + 1}
    return [k in single for k in range(len(text))] + ([True] if stopped else [])


def test_a_bpe_copy_of_the_student_gives_the_students_log_probs(student, bpe):
    char = load_tokenizer(student)
    base = _F64Teacher("code", student, "cpu", dtype="float64")
    copy = RetokenizedCopy(base, bpe)
    assert copy.fingerprint != tokenizer_fingerprint(char)
    stops = formatter_for(char).stop_ids()
    bridged = bridge_teachers({"code": copy}, char, None, ["code"], stops)["code"]
    assert isinstance(bridged, CrossTokenizerTeacher) and not bridged.scores_top_k
    prompts, comps, stop = _rows()
    batch = _batch(char, prompts, comps, stop)
    ref = base.score(batch).logp
    got = bridged.score(batch).logp
    assert ref.dtype == got.dtype == torch.float64
    mask = batch.completion_mask.bool()
    # every sequence: the teacher's log-prob of the whole completion, in float64
    torch.testing.assert_close(got.sum(-1), ref.sum(-1), rtol=0, atol=1e-10)
    assert not got[~mask].any()
    n_exact = n_other = 0
    for i, (text, s) in enumerate(zip(comps, stop)):
        al = torch.tensor(_aligned(bpe, text, s), dtype=torch.bool)
        n = len(al)
        torch.testing.assert_close(got[i, :n][al], ref[i, :n][al], rtol=0, atol=1e-10)
        n_exact += int(al.sum())
        n_other += int((~al).sum())
    assert n_exact >= 10 and n_other >= 10  # both kinds of token were checked
    # the boundary rule: inside a multi-character BPE token the earlier characters get 0, its last the whole
    ends = [e for _, e in bpe("dcba", add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    assert ends != [1, 2, 3, 4]
    row = comps.index("dcba")
    for k in range(4):
        assert (got[row, k] == 0) == (k + 1 not in ends)


def test_the_student_itself_behind_another_tokenizer_gives_zero_advantage(student, bpe, tmp_path):
    """The bug it catches: ℓᵀ = 0 on a token whose teacher token ends later gives it the advantage −ℓ^old > 0 (and
    the span's last token the whole gap), so a teacher that agrees with the student everywhere still pushes it."""
    from mopd_core.algorithms import reverse_kl_advantages
    from mopd_core.teachers import TeacherRouter
    from mopd_core.train.kd import sampled_teacher_logp

    char = load_tokenizer(student)
    base = _F64Teacher("code", student, "cpu", dtype="float64")
    bridged = bridge_teachers({"code": RetokenizedCopy(base, bpe)}, char, None, ["code"],
                              formatter_for(char).stop_ids())
    prompts, comps, stop = _rows()
    batch = _batch(char, prompts, comps, stop)
    batch.behaviour_logp = base.score(batch).logp  # the student's own log-probs: the teacher agrees everywhere
    mask = batch.completion_mask.bool()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the router's output tensors: float64 like the reference teacher
    cached = CachedTeacher(bridged["code"], "the-copy", ScoreCache(tmp_path, "c" * 16, 10**8))
    try:
        routed = TeacherRouter(bridged).score(batch)
        same = TeacherRouter({"code": base}).score(batch)
        TeacherRouter({"code": cached}).score(batch)
        replay = TeacherRouter({"code": cached}).score(batch)  # every row from the score cache
    finally:
        torch.set_default_dtype(prev)
    # the completions were re-tokenized once: the span ends reused scoring's mapping
    info = bridged["code"].bridge._row.cache_info()
    assert info.misses == len({tuple(r) for r in batch.completion_ids.tolist()}) and info.hits >= 3 * len(comps)
    assert cached.stats["cache_hits"] == len(comps)
    assert torch.equal(replay.span_cut, routed.span_cut)
    torch.testing.assert_close(replay.logp, routed.logp, rtol=0, atol=0)
    cut = routed.span_cut
    assert cut is not None and not cut[~mask].any()
    last = mask.sum(-1) - 1
    assert cut[torch.arange(len(comps))[last >= 0], last[last >= 0]].all()  # every row's last token ends a span
    assert (mask & ~cut).sum() >= 5  # multi-token spans were exercised
    raw = reverse_kl_advantages(routed.logp, batch.behaviour_logp, mask)
    assert raw[mask & ~cut].min() > 0.1  # without the spread: the push this test exists for
    a = reverse_kl_advantages(sampled_teacher_logp(routed, batch, mask), batch.behaviour_logp, mask)
    assert a.abs().max() < 1e-10
    # a same-tokenizer teacher has no spans: its ℓᵀ goes to the advantage untouched
    assert same.span_cut is None and sampled_teacher_logp(same, batch, mask) is same.logp


def test_spread_span_gaps_in_float64():
    from mopd_core.algorithms import spread_span_gaps

    g = torch.Generator().manual_seed(0)
    B, T = 4, 9
    t = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:], mask[2, 1:], mask[3, :] = False, False, False
    cut = torch.rand(B, T, generator=g) < 0.4
    for i in range(B):  # the last real token always ends a span
        n = int(mask[i].sum())
        if n:
            cut[i, n - 1] = True
    out = spread_span_gaps(t, s, cut, mask)
    for i in range(B):  # the float64 loop reference
        start = 0
        for j in range(int(mask[i].sum())):
            if cut[i, j]:
                span = slice(start, j + 1)
                n = j + 1 - start
                gap = float((t[i, span] - s[i, span]).sum()) / n
                want = t[i, span] if n == 1 else s[i, span] + gap
                torch.testing.assert_close(out[i, span], want, rtol=0, atol=1e-12)
                torch.testing.assert_close(out[i, span].sum(), t[i, span].sum(), rtol=0, atol=1e-12)
                start = j + 1
    assert not out[~mask].any()
    one = cut & mask & torch.cat([torch.ones(B, 1, dtype=torch.bool), cut[:, :-1]], 1)  # one-token spans
    assert torch.equal(out[one], t[one])  # bit for bit


def test_reward_refresh_re_splits_each_span_at_the_current_student():
    """Under reward refresh the sampled-token advantage is taken again against the student after each minibatch: a
    bridged teacher's span must then give each of its tokens the span's mean gap at those log-probs, not at the
    rollout's (a split anchored at ℓ^old leaves ℓ^old − ℓ^new inside the span: tokens the last minibatch raised
    are pushed down again). Float64, no clip."""
    from mopd_core.algorithms import reverse_kl_advantages, spread_span_gaps
    from mopd_core.train.kd import KDPlan

    g = torch.Generator().manual_seed(1)
    B, T = 3, 8
    raw = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old, new = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 5:] = False
    cut = torch.zeros(B, T, dtype=torch.bool)
    cut[:, [0, 3, 7]] = True  # spans [0] [1..3] [4..7]
    cut[2, 4] = True  # row 2: [4] and its last real token
    plan = KDPlan(False, raw, torch.ones(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64), None,
                  True, span_cut=cut)
    rows = [0, 1, 2]
    # against ℓ^old: exactly the stored advantage (the first minibatch's)
    at_old = reverse_kl_advantages(spread_span_gaps(raw, old, cut, mask), old, mask)
    torch.testing.assert_close(plan.kd_advantage(old, rows, T, mask), at_old, rtol=0, atol=0)
    got = plan.kd_advantage(new, rows, T, mask)
    for i in range(B):  # the float64 loop reference: every token of a span has the span's current mean gap
        for span in ([0], [1, 2, 3], [4, 5, 6, 7] if i < 2 else [4]):
            want = float((raw[i, span] - new[i, span]).sum()) / len(span)
            torch.testing.assert_close(got[i, span], torch.full((len(span),), want, dtype=torch.float64),
                                       rtol=0, atol=1e-12)
    assert not got[~mask].any()
    # the split anchored at ℓ^old (the earlier behaviour) differs inside the spans by far more than rounding
    stale = reverse_kl_advantages(spread_span_gaps(raw, old, cut, mask), new, mask)
    assert (stale - got)[:, 1:4].abs().max() > 0.1


def test_the_same_tokenizer_is_the_fast_path(student):
    char = load_tokenizer(student)
    t = LocalTeacher("math", student, "cpu")
    out = bridge_teachers({"math": t}, char, None, ["math"], [char.eos_token_id])
    assert out["math"] is t  # the very object: same numbers, no re-tokenization
    assert bridge_teachers({"math": t}, char, None, [], [1])["math"] is t


def test_owners_on_hand_made_offsets():
    # student spans [0,1) [1,3) [3,6); teacher spans [0,2) [2,3) [3,5) [5,6): [0,2) straddles student 0 and 1
    assert owners([1, 3, 6], [2, 3, 5, 6]) == [1, 1, 2, 2]
    # a teacher token spanning all student tokens goes to the last; an empty leading span to the first
    assert owners([1, 3, 6], [0, 6]) == [0, 2]
    # spans end where both cut the text (1 and 2 here), the last token always; equal student ends (a token inside
    # one character) end their span at the last of them, as `owners` charges the first
    assert span_cuts([1, 3, 6], [2, 3, 5, 6]) == [False, True, True]
    assert span_cuts([1, 3, 6], [0, 6]) == [False, False, True]
    assert span_cuts([3, 3, 5], [3, 5]) == [False, True, True] and owners([3, 3, 5], [3, 5]) == [0, 2]
    assert span_cuts([2, 4], [1, 3]) == [False, True]
    al = Alignment(torch.tensor([[1, 1, 2, 2, -1]]))
    t_lp = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -99.0]], dtype=torch.float64)
    out = TokenBridge.to_student(t_lp, al, (1, 4))
    assert out.tolist() == [[0.0, -3.0, -7.0, 0.0]]  # padding (-1) dropped, sums kept


def test_unicode_and_a_non_canonical_sampled_tokenization():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bl = Tokenizer(models.BPE())
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    bl.train_from_iterator(["héllo wörld ✓ naïve"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bl, eos_token="<eos>")
    text = "naïve ✓ wörld"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    got_text, ends = completion_ends(tok, ids)
    assert got_text == text and ends[-1] == len(text) and ends == sorted(ends)
    # spelled byte by byte (a sampled, non-canonical tokenization; "✓" is 3 bytes = 3 tokens): prefix decoding
    by_byte = [tok.convert_tokens_to_ids(ch) for w, _ in bl.pre_tokenizer.pre_tokenize_str(text) for ch in w]
    assert tok.decode(by_byte) == text and by_byte != ids
    t2, ends2 = completion_ends(tok, by_byte)
    assert t2 == text and ends2 == sorted(ends2) and ends2[-1] == len(text) and len(ends2) == len(by_byte)
    # a character teacher's tokens (one per character, ends 1..n) land on the student token holding that char
    own = owners(ends2, list(range(1, len(text) + 1)))
    for j, k in enumerate(own):
        assert ends2[k] >= j + 1 and (k == 0 or ends2[k - 1] < j + 1)


def _chat_pair():
    """The tiny chat tokenizer (ChatML markers) and a BPE teacher with other role markers and end-of-turn."""
    student = build_tiny_tokenizer(chat=True)
    teacher = build_bpe_tokenizer(TEXTS + ["USER: ASSISTANT:"] * 5, vocab_size=140)
    teacher.add_special_tokens({"additional_special_tokens": ["[END]"]})
    teacher.chat_template = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}[END]{% endfor %}"
                             "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    return student, teacher


def test_a_teacher_template_with_other_role_markers():
    student, teacher = _chat_pair()
    chat = ChatConfig(enabled=True)
    sfmt = formatter_for(student, chat)
    br = TokenBridge(student, teacher, chat, sfmt.stop_ids())
    end = teacher.convert_tokens_to_ids("[END]")
    assert br.end_ids == [end]
    ids = student("dcba", add_special_tokens=False)["input_ids"] + [sfmt.end_of_turn_id]
    p = student(["<|im_start|>user\nrev:abcd=<|im_end|>\n<|im_start|>assistant\n"], add_special_tokens=False)
    batch = RolloutBatch(torch.tensor(p["input_ids"]), torch.ones(1, len(p["input_ids"][0]), dtype=torch.long),
                         torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), torch.zeros(1, len(ids)),
                         [Ex(prompt="rev:abcd=", teacher_id="code")], ["dcba"])
    tb, al = br.to_teacher(batch)
    prompt = teacher.decode(tb.prompt_ids[0][tb.prompt_mask[0].bool()])
    assert prompt == "USER: rev:abcd=[END]ASSISTANT:"
    comp = tb.completion_ids[0][tb.completion_mask[0].bool()].tolist()
    assert teacher.decode(comp[:-1]) == "dcba" and comp[-1] == end
    assert al.owner[0, len(comp) - 1] == len(ids) - 1  # the teacher's [END] stands for the student's <|im_end|>


def test_dense_objectives_are_refused_before_compute():
    for kd in ("topk_rkl", "jsd", "full_jsd"):
        with pytest.raises(ConfigError) as e:
            load_config("tiny", ["teachers.cross_tokenizer=[code]", f"mopd.kd_loss={kd}"])
        msg = str(e.value)
        assert "\n" not in msg and "teacher 'code'" in msg and "mopd.kd_loss=sampled_rkl" in msg, msg
    with pytest.raises(ConfigError, match="teachers.conflict=mask compares .* teacher 'code' .*teachers.conflict=none"):
        load_config("tiny", ["teachers.cross_tokenizer=[code]", "mopd.kd_loss=sampled_rkl", "teachers.conflict=mask"])
    with pytest.raises(ConfigError, match="teachers.cross_tokenizer names unknown teacher 'poetry'"):
        load_config("tiny", ["teachers.cross_tokenizer=[poetry]"])


def _bpe_teacher(tmp_path, bpe) -> str:
    model = build_tiny_model(SMALL.tiny, len(bpe), bpe.pad_token_id, bpe.eos_token_id, seed=3)
    return str(save_pretrained(model, bpe, tmp_path / "bpe-teacher"))


def test_open_teachers_bridges_only_the_listed_teacher(student, bpe, tmp_path):
    from mopd_core.teachers.lifecycle import open_teachers

    other = _bpe_teacher(tmp_path, bpe)
    cfg = load_config("tiny", [f"output_dir={tmp_path}"])
    with pytest.raises(ModelError, match="teacher 'code'.*teachers.cross_tokenizer"):
        with open_teachers(cfg, {"math": student, "code": other, "if": student}, student) as ts:
            ts.router.check(tokenizer_fingerprint(load_tokenizer(student)), ["code"])
    cfg = load_config("tiny", [f"output_dir={tmp_path}", "teachers.cross_tokenizer=[code]", "mopd.kd_loss=sampled_rkl"])
    with open_teachers(cfg, {"math": student, "code": other, "if": student}, student) as ts:
        r = ts.router
        assert isinstance(r.teachers["code"], CrossTokenizerTeacher)
        assert isinstance(r.teachers["math"], LocalTeacher)
        r.check(tokenizer_fingerprint(load_tokenizer(student)), ["math", "code", "if"])
        char = load_tokenizer(student)
        prompts, comps, stop = _rows()
        batch = _batch(char, prompts, comps, stop)
        with pytest.raises(TeacherError, match="teacher 'code'.*top-4"):
            r.score(batch, top_k=4)
        s = r.score(batch)
        assert s.logp.shape == batch.completion_ids.shape and torch.isfinite(s.logp).all()
        assert (s.logp[batch.completion_mask.bool()] < 0).any()
        # the router passes the bridged teacher's span ends on (the math and if rows, same tokenizer, have none)
        assert s.span_cut is not None and not s.span_cut[[i for i, e in enumerate(batch.examples)
                                                          if e.teacher_id != "code"]].any()


class _FakeVllm(BaseHTTPRequestHandler):
    """The three endpoints `HttpTeacher` calls, answered as vLLM's OpenAI server does, with `model` scoring."""
    model = tok = None

    def log_message(self, *a):
        pass

    def _send(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send({"data": [{"id": "teacher", "max_model_len": 64}]})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._send({"tokens": self.tok(req["prompt"], add_special_tokens=False)["input_ids"]})
        choices = []
        for i, ids in enumerate(req["prompt"]):
            with torch.no_grad():
                lp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].double(), -1)
            plp = [None] + [{str(t): {"logprob": float(lp[j - 1, t]), "rank": 1}} for j, t in enumerate(ids) if j]
            choices.append({"index": i, "text": "", "prompt_logprobs": plp})
        self._send({"choices": choices})


def test_http_teacher_with_its_own_tokenizer_matches_the_local_one(student, bpe, tmp_path):
    other = _bpe_teacher(tmp_path, bpe)
    _FakeVllm.model, _FakeVllm.tok = load_model(other).eval(), load_tokenizer(other)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVllm)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    char = load_tokenizer(student)
    stops = formatter_for(char).stop_ids()
    try:
        with pytest.raises(ModelError, match="teacher 'code'"):  # not listed: refused as before
            build_http_router({"code": {"url": url, "checkpoint": other}}, TeachersConfig(), char).close()
        router = build_http_router({"code": {"url": url, "checkpoint": other}},
                                   TeachersConfig(cross_tokenizer=["code"]), char)
        remote = bridge_teachers(router.teachers, char, None, ["code"], stops)["code"]
        local = bridge_teachers({"code": LocalTeacher("code", other, "cpu")}, char, None, ["code"], stops)["code"]
        prompts, comps, stop = _rows()
        batch = _batch(char, prompts, comps, stop)
        a, b = remote.score(batch).logp, local.score(batch).logp
        torch.testing.assert_close(a, b.float(), rtol=0, atol=1e-5)
        ref = score_completions(load_model(other), local.bridge.to_teacher(batch)[0]).logp
        torch.testing.assert_close(a.sum(-1), ref.sum(-1), rtol=0, atol=1e-4)
        remote.close()
    finally:
        srv.shutdown()
