"""The MOPD stage's compatibility pre-flight (`teachers.compat`): each check passes on a teacher that is the
student, and fails with its one line on a planted mismatch — another chat template, a teacher that never ends a
turn, a nondeterministic replica (dropout on), a temperature other than the student's, a scoring path that is not
the model's distribution, another tokenizer; local and http teachers."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from mopd_core import preflight
from mopd_core.config import ModelConfig, load_config
from mopd_core.models import build_tiny, load_tokenizer
from mopd_core.models.chat import carry_chat_template
from mopd_core.recipe import build_domains
from mopd_core.teachers import LocalTeacher, TeacherRouter
from mopd_core.teachers.compat import CHECKS, CompatError, check_compatibility, template_difference
from mopd_core.teachers.http import HttpTeacher

SMALL = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "chat": True}


def _recipe(tmp_path, *extra):
    return load_config("tiny", ["model.tiny.chat=true", "data.chat.enabled=true", f"output_dir={tmp_path}",
                                "data.max_prompt_tokens=40", *extra])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("compat")
    student = build_tiny(ModelConfig(tiny=SMALL), d / "student", seed=0)
    recipe = _recipe(d)
    return student, recipe, build_domains(recipe)


def _router(student, **kw) -> TeacherRouter:
    return TeacherRouter({d: LocalTeacher(d, student, "cpu", **kw) for d in ("math", "code", "if")})


def _report(world, router, recipe=None, mappable=None):
    student, base, domains = world
    tok = load_tokenizer(student)
    carry_chat_template(tok, (recipe or base).data.chat)
    return check_compatibility(router, tok, recipe or base, domains, torch.device("cpu"), mappable)


def _status(report, teacher, check):
    return next(r for r in report.rows if r.teacher == teacher and r.check == check)


def test_teachers_that_are_the_student_pass_every_check_and_the_table_shows_it(world):
    student, recipe, domains = world
    router = _router(student)
    before = {n: dict(t.stats) for n, t in router.teachers.items()}
    report = preflight.check_compatibility(recipe, router, student, domains)  # raises on any failure
    assert [(r.teacher, r.check) for r in report.rows if r.check in CHECKS] == \
        [(t, c) for t in ("math", "code", "if") for c in ("tokenizer", "chat_template", "temperature", "eos",
                                                         "determinism", "logprob_mode")]
    assert {r.status for r in report.rows} == {"pass"}, report.markdown()
    assert report.failures() == []
    md = report.markdown()
    assert "| math | eos | pass | mean log p(stop) = " in md
    # both renderings of the probe conversation, each with its role markers and generation prompt
    conv = report.renderings["student"]["conversation"]
    assert conv.startswith("<|im_start|>user\n") and "<|im_end|>\n<|im_start|>assistant\n" in conv
    assert report.renderings["teacher 'math'"] == report.renderings["student"]
    assert report.renderings["student"]["prompt"].endswith("<|im_start|>assistant\n")
    json.dumps(report.to_json())  # what the task logs
    assert {n: t.stats for n, t in router.teachers.items()} == before  # the probes are not counted as scoring


def test_another_chat_template_fails_naming_the_role_marker(world):
    router = _router(world[0])
    router.teachers["code"].tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]: {% endif %}")
    with pytest.raises(CompatError) as e:
        preflight.check_compatibility(world[1], router, world[0], world[2])
    lines = str(e.value).splitlines()
    assert lines == [
        "compat: teacher 'code': chat_template: user marker: student '<|im_start|>user\\n' vs teacher '[user]: ' — "
        "distil from a teacher trained with the student's chat template, or set data.chat.chat_template to the one "
        "the teachers use (or teachers.compat.chat_template=warn|skip to train anyway)"]
    assert "[assistant]: " in e.value.report.renderings["teacher 'code'"]["prompt"]  # the table shows both sides


def test_template_difference_names_the_generation_prompt():
    conv = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    mine = {"conversation": "<u>1+1=</u><a>2</a>", "prompt": "<u>1+1=</u><a>"}
    theirs = {"conversation": "<u>1+1=</u><a>2</a>", "prompt": "<u>1+1=</u><a><think>"}
    assert template_difference(conv, mine, theirs) == "generation prompt: student '</u><a>' vs teacher " \
                                                      "'</u><a><think>'"
    assert template_difference(conv, mine, dict(mine)) is None


def test_a_teacher_that_never_ends_a_turn_fails_the_eos_check_with_its_value(world):
    router = _router(world[0], logprob_impl="full")
    t = router.teachers["if"]
    head = t.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight.data.copy_(head.weight.data)
    biased.bias.data.zero_()
    tok = t.tokenizer
    for s in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")):
        biased.bias.data[s] = -60.0  # it never predicts the end of a turn
    t.model.lm_head = biased
    report = _report(world, router)
    row = _status(report, "if", "eos")
    assert row.status == "fail"
    v = float(row.value.split("= ")[1].split(" ")[0])
    assert v < -50
    assert report.failures() == [row.line()]
    assert row.line().startswith(f"compat: teacher 'if': eos: mean log p(stop) = {v:.3g} over 4 probe rows")
    assert "< teachers.compat.min_eos_logprob=-10: the teacher does not end turns where the student does — use " \
           "a teacher that ends its answers with the student's EOS / end-of-turn token" in row.line()
    assert _status(report, "math", "eos").status == "pass"


def test_a_nondeterministic_replica_fails_the_determinism_check(world):
    router = _router(world[0])
    t = router.teachers["math"]
    for m in t.model.modules():
        if m.__class__.__name__.endswith("Attention"):
            m.attention_dropout = 0.5  # dropout on, as a model left in training mode
    t.model.train()
    report = _report(world, router)
    row = _status(report, "math", "determinism")
    assert row.status == "fail" and report.failures() == [row.line()]
    d = float(row.value.split("= ")[1].split(" ")[0])
    assert d > 1e-3
    assert row.line() == (f"compat: teacher 'math': determinism: max |Δ log p| = {d:.3g} between two scorings of "
                          "the same probe > teachers.compat.determinism_tol=0.0001 — make the teacher deterministic "
                          "(eval mode: no dropout; the same kernels and batch for a request; for a server, no "
                          "sampling noise in prompt_logprobs) or raise teachers.compat.determinism_tol (or "
                          "teachers.compat.determinism=warn|skip to train anyway)")


def test_a_temperature_mismatch_fails_and_warn_or_off_let_it_train(world, tmp_path):
    recipe = _recipe(tmp_path, "rollout.temperature=0.7")
    report = _report(world, _router(world[0]), recipe)
    assert report.failures() == [
        f"compat: teacher '{d}': temperature: teacher τ=1, rollout.temperature=0.7: ℓ^old − ℓᵀ would compare "
        "different temperatures — set rollout.temperature=1, or teachers.temperature=0.7 (local teachers; an http "
        "teacher's prompt_logprobs are at τ=1) (or teachers.compat.temperature=warn|skip to train anyway)"
        for d in ("math", "code", "if")]
    warn = _recipe(tmp_path, "rollout.temperature=0.7", "teachers.compat.temperature=warn")
    rep = preflight.check_compatibility(warn, _router(world[0]), world[0], world[2])  # no raise
    assert [r.status for r in rep.rows if r.check == "temperature"] == ["warn"] * 3 and len(rep.warnings()) == 3
    off = _recipe(tmp_path, "rollout.temperature=0.7", "teachers.compat.temperature=skip")
    rep = _report(world, _router(world[0]), off)
    assert [r.value for r in rep.rows if r.check == "temperature"] == \
        ["not checked (teachers.compat.temperature=skip)"] * 3 and not rep.failures()


def test_a_logit_transform_the_forward_does_not_apply_fails_the_logprob_mode_check(world):
    router = _router(world[0])
    router.teachers["code"].model.config.final_logit_softcapping = 1.0  # read by the chunked path, not the forward
    report = _report(world, router)
    row = _status(report, "code", "logprob_mode")
    assert row.status == "fail" and report.failures() == [row.line()]
    assert row.line().startswith("compat: teacher 'code': logprob_mode: max |Δ log p| of the chunked scoring path "
                                 "vs log_softmax of the model's forward: ")
    assert "> teachers.compat.logprob_tol=0.001: not the normalised log-probs of its distribution — serve vLLM " \
           "with --logprobs-mode raw_logprobs" in row.line()


def test_another_tokenizer_needs_mapping_unless_a_mapping_is_given(world):
    router = _router(world[0])
    router.teachers["math"].fingerprint = "0" * 16
    report = _report(world, router)
    assert report.failures() == [
        f"compat: teacher 'math': tokenizer: fingerprint {'0' * 16} ≠ student "
        f"{router.teachers['code'].fingerprint} — needs mapping — use a teacher with the student's tokenizer "
        f"({world[0]}: retrain the expert from the same base) (or teachers.compat.tokenizer=warn|skip to train "
        "anyway)"]
    assert {_status(report, "math", c).status for c in ("eos", "determinism", "logprob_mode")} == {"skip"}
    mapped = _report(world, router, mappable=lambda t: "byte offsets (test)")
    assert not mapped.failures() and "mapped: byte offsets (test)" in _status(mapped, "math", "tokenizer").value


# ---------------------------------------------------------------- http teachers (a fake vLLM server)


class _Server:
    """Just enough of vLLM's OpenAI server: /v1/models, /tokenize (text or chat messages, with the checkpoint's
    template), /detokenize, /v1/completions with prompt_logprobs. `noise`: added to every log-prob, fresh per
    request (a nondeterministic replica); `offset`: added too (a logits mode: not normalised)."""

    def __init__(self, path, noise=0.0, offset=0.0):
        self.tok = load_tokenizer(path)
        self.noise, self.offset = noise, offset
        self.gen = torch.Generator().manual_seed(0)
        srv = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send({"data": [{"id": "fake", "max_model_len": 256}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(srv.answer(self.path, body))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, path, body):
        if path == "/tokenize":
            if "messages" in body:
                return {"tokens": self.tok.apply_chat_template(body["messages"], tokenize=True, return_dict=False,
                                                               add_generation_prompt=body["add_generation_prompt"])}
            return {"tokens": self.tok(body["prompt"], add_special_tokens=False)["input_ids"]}
        if path == "/detokenize":
            return {"prompt": self.tok.decode(body["tokens"])}
        V, k, choices = len(self.tok), body["prompt_logprobs"], []
        for i, ids in enumerate(body["prompt"]):
            # uniform log-probs over the vocabulary, the realized token and the k first ids listed
            lp = -math.log(V) + self.offset + self.noise * float(torch.rand((), generator=self.gen))
            plp = [None] + [{str(t): {"logprob": lp, "rank": 1} for t in [tok, *range(k)]} for tok in ids[1:]]
            choices.append({"index": i, "prompt_logprobs": plp})
        return {"choices": choices}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.mark.parametrize("kind", ["same", "noisy", "logits"])
def test_http_teachers_render_through_the_server_and_fail_when_noisy_or_unnormalised(world, kind):
    student = world[0]
    srv = _Server(student, noise=0.1 if kind == "noisy" else 0.0, offset=5.0 if kind == "logits" else 0.0)
    try:
        t = HttpTeacher("math", srv.url, checkpoint=student, retries=0)
        try:
            report = _report(world, TeacherRouter({"math": t}))
        finally:
            t.close()
    finally:
        srv.close()
    assert report.renderings["teacher 'math'"] == report.renderings["student"]  # the server's own template
    fails = {r.check: r.line() for r in report.rows if r.status == "fail"}
    if kind == "same":
        assert fails == {}, report.markdown()
    elif kind == "noisy":
        assert list(fails) == ["determinism"]
        assert fails["determinism"].startswith("compat: teacher 'math': determinism: max |Δ log p| = ")
    else:  # values above 0: logits, not log-probs (the EOS check passes on them too: it cannot tell)
        assert list(fails) == ["logprob_mode"]
        assert fails["logprob_mode"].startswith("compat: teacher 'math': logprob_mode: logsumexp of its top-5 "
                                                "log-probs (≤ 0): ")


def test_behind_the_score_cache_the_checks_ask_the_model_not_the_cache(world, tmp_path):
    """Every MOPD stage scores through the teacher-score cache (teachers.score_cache): the second scoring of the
    determinism check would be the first one read back. The pre-flight asks the teacher inside, writes nothing
    into the cache and leaves its counters alone."""
    from mopd_core.teachers.cache import with_score_cache

    router = _router(world[0])
    t = router.teachers["math"]
    for m in t.model.modules():
        if m.__class__.__name__.endswith("Attention"):
            m.attention_dropout = 0.5
    t.model.train()
    with_score_cache(router, tmp_path / "cache", 1.0, {})
    before = {n: dict(c.stats) for n, c in router.teachers.items()}
    report = _report(world, router)
    assert [r.line().split(":")[1:3] for r in report.rows if r.status == "fail"] == [[" teacher 'math'",
                                                                                     " determinism"]]
    assert {n: c.stats for n, c in router.teachers.items()} == before
    assert not list((tmp_path / "cache").glob("*.seg"))


def test_a_bridged_teacher_passes_the_tokenizer_check_as_mapped_and_keeps_its_own_template():
    """A cross-tokenizer teacher (teachers.cross_tokenizer) says how it is mapped: the tokenizer row passes naming
    the bridge (not "same fingerprint": it speaks the student's tokens only through the bridge), and its own chat
    template is not a mismatch."""
    from mopd_core.teachers import Teacher
    from mopd_core.teachers.compat import _tokenizer_row

    class Bridged(Teacher):
        name, path, fingerprint = "code", "/m/coder", "student-fp"

        def token_mapping(self):
            return "its own tokenizer abc, mapped by character offsets"

    row = _tokenizer_row("code", "student-fp", Bridged(), None)
    assert row.status == "pass" and row.value.startswith("mapped: its own tokenizer abc")
    plain = Bridged.__mro__[1]  # the base Teacher: scores the student's tokens directly
    assert plain.token_mapping(Bridged()) is None
