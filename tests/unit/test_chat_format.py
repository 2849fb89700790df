"""Prompt formatting (`models.chat`), one path for every consumer: the same messages become the same token ids in
SFT rows (also after TRL's dataset preparation), the hf and vLLM rollouts, local teacher scoring, the http teacher's
request and eval; generation stops on the chat template's end-of-turn id, which is not EOS; with `data.chat` left
at its default the tiny recipe tokenises and fingerprints exactly as before the formatter existed."""

from __future__ import annotations

import hashlib
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from mopd_core import recipe as R
from mopd_core.config import ChatConfig, EvalConfig, ModelConfig, load_config
from mopd_core.domains.base import Example, FrozenFields
from mopd_core.errors import ConfigError
from mopd_core.models import (IM_END, IM_START, build_tiny, build_tiny_model, build_tiny_tokenizer, load_model,
                              load_tokenizer, tokenizer_fingerprint)
from mopd_core.models.chat import PromptFormatter, check_prompt_kind, stop_token_ids
from mopd_core.rollout import HFRollout, encode_prompts, prompt_ids, sample
from tests.integration.test_http_teachers import _Stub

SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 128}
CHAT = ChatConfig(enabled=True, system_prompt="Be brief.", user_suffix=" Answer:")
# one prompt as a dataset row holds it: frozen {"role", "content"} mappings (domains.base.Example's contract)
MSG_EX = Example(prompt=(FrozenFields({"role": "user", "content": "12+3="}),), teacher_id="math", answer="15")
STR_EX = Example(prompt="rev:abc=", teacher_id="code", answer="cba")

# Recorded from the code before chat formatting existed (commit b9673e6): the default tiny tokenizer, the default
# tiny model's initial weights and the default tiny recipe's stage fingerprints must stay exactly these. The mopd
# one changed once on purpose: configs/tiny.yaml's MOPD stage took a cosine learning-rate decay (46bc8ebb1624f9b6
# before it); the other stages, whose settings did not change, keep theirs.
DEFAULT_VOCAB_SHA = "7f0789557ad13b8a"
DEFAULT_TOKENIZER_FP = "3e9586199fe9f7d4"
DEFAULT_INIT_SHA = "17c19ba17786c1cc"
DEFAULT_BASE = "tiny:78379937bba4854b"
DEFAULT_FPS = {"sft": "b61a77126ef16126", "expert:math": "b89c39535d5180d4", "mopd": "b68a4f53c147d70d",
               "evaluate": "132506b98b63acb6"}
INPUTS = {"init": "stage:abc:3", "teacher.math": "stage:m:3", "teacher.code": "stage:c:3", "teacher.if": "stage:i:3",
          "base": "stage:b:0"}


def _fps(cfg) -> dict[str, str]:
    return {s: R.stage_spec(cfg, s, INPUTS).fingerprint for s in DEFAULT_FPS}


@pytest.fixture(scope="module")
def chat_tiny(tmp_path_factory):
    path = build_tiny(ModelConfig(tiny={**SMALL, "chat": True}), tmp_path_factory.mktemp("m") / "chat", seed=0)
    return path, load_model(path).eval(), load_tokenizer(path)


# ---------------------------------------------------------------- the default stays bit for bit


def test_default_tiny_tokenizer_model_and_fingerprints_are_unchanged():
    tok = build_tiny_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16] == DEFAULT_VOCAB_SHA
    assert tokenizer_fingerprint(tok) == DEFAULT_TOKENIZER_FP
    assert tok.chat_template is None and "\n" not in tok.get_vocab()
    cfg = load_config("tiny")
    m = build_tiny_model(cfg.model.tiny, len(tok), tok.pad_token_id, tok.eos_token_id, seed=0)
    h = hashlib.sha256()
    for k, v in sorted(m.state_dict().items()):
        h.update(k.encode() + v.detach().numpy().tobytes())
    assert h.hexdigest()[:16] == DEFAULT_INIT_SHA
    assert _fps(cfg) == DEFAULT_FPS and R.base_identity(cfg) == DEFAULT_BASE
    assert R.base_identity(cfg) == R.base_identity(load_config("tiny", ["model.tiny.chat=false"]))
    # chat left off changes nothing whatever else data.chat says (it is not read then)
    off = load_config("tiny", ["data.chat.system_prompt=hi", "data.chat.user_suffix=x"])
    assert "chat" not in cfg.data.model_dump() and "chat" not in cfg.model.tiny.model_dump()
    assert _fps(off) == DEFAULT_FPS


def test_chat_settings_are_part_of_every_stage_identity_when_enabled():
    on = load_config("tiny", ["data.chat.enabled=true", "model.tiny.chat=true"])
    fps = _fps(on)
    assert all(fps[s] != DEFAULT_FPS[s] for s in DEFAULT_FPS), fps
    assert on.data.model_dump()["chat"]["enabled"] is True and on.model.tiny.model_dump()["chat"] is True
    other = load_config("tiny", ["data.chat.enabled=true", "model.tiny.chat=true", "data.chat.user_suffix=Answer"])
    assert all(_fps(other)[s] != fps[s] for s in DEFAULT_FPS)
    assert R.base_identity(on) != R.base_identity(load_config("tiny"))  # another vocabulary, another init


def test_raw_prompts_tokenise_as_before_and_messages_need_chat():
    tok = build_tiny_tokenizer()
    prompts = ["37+5=", "rev:abcd=", "upper:ab="]
    assert prompt_ids(tok, prompts) == [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    assert prompt_ids(tok, [SimpleNamespace(prompt=p) for p in prompts]) == prompt_ids(tok, prompts)
    with pytest.raises(ConfigError, match=r"^domain 'math': prompt is a list of chat messages .* set "
                                          r"data\.chat\.enabled=true") as e:
        prompt_ids(tok, [STR_EX, MSG_EX])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="data.chat.enabled"):
        check_prompt_kind(MSG_EX, ChatConfig())
    check_prompt_kind(MSG_EX, CHAT)
    check_prompt_kind(STR_EX, None)
    with pytest.raises(ConfigError, match=r"has no chat template — set data\.chat\.chat_template .* "
                                          r"model\.tiny\.chat=true"):
        PromptFormatter(tok, CHAT)


# ---------------------------------------------------------------- the formatter and the tiny chat tokenizer


def test_tiny_chat_tokenizer_extends_the_default_vocabulary(chat_tiny):
    _, model, tok = chat_tiny
    default = build_tiny_tokenizer().get_vocab()
    vocab = tok.get_vocab()
    assert all(vocab[k] == v for k, v in default.items()) and len(vocab) == len(default) + 3
    assert model.config.vocab_size == len(vocab)
    nl, ims, ime = vocab["\n"], vocab[IM_START], vocab[IM_END]
    assert tok("a\nb", add_special_tokens=False)["input_ids"] == [vocab["a"], nl, vocab["b"]]
    assert tok(f"{IM_START}x{IM_END}", add_special_tokens=False)["input_ids"] == [ims, vocab["x"], ime]
    assert tok.decode([vocab["a"], ime, nl], skip_special_tokens=True) == "a\n"
    assert ime != tok.eos_token_id and {ims, ime} <= set(tok.all_special_ids)


def test_formatter_renders_system_suffix_template_and_caches(chat_tiny, tmp_path, monkeypatch):
    _, _, tok = chat_tiny
    fmt = PromptFormatter(tok, CHAT)
    assert fmt.messages(STR_EX) == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "rev:abc= Answer:"}]
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n12+3= Answer:<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert fmt.text(MSG_EX) == want
    assert fmt.ids(MSG_EX) == tok(want, add_special_tokens=False)["input_ids"]
    own = Example(prompt=(FrozenFields({"role": "system", "content": "S"}), FrozenFields({"role": "user",
                                                                                        "content": "q"})),
                  teacher_id="if")
    assert fmt.messages(own)[0] == {"role": "system", "content": "S"}  # the data's own system prompt is kept
    ime = tok.convert_tokens_to_ids(IM_END)
    assert fmt.turn_end_ids == [ime] and fmt.end_of_turn_id == ime
    assert fmt.stop_ids() == [tok.eos_token_id, ime]
    assert fmt.completion_ids("15") == tok("15", add_special_tokens=False)["input_ids"] + [ime]
    # once per prompt: a second encoding of the same prompts renders nothing
    calls = []
    real = type(tok).apply_chat_template
    monkeypatch.setattr(type(tok), "apply_chat_template", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    first = fmt.batch_ids([MSG_EX, STR_EX, MSG_EX])
    n = len(calls)
    assert fmt.batch_ids([STR_EX, MSG_EX]) == [first[1], first[0]] and len(calls) == n
    monkeypatch.undo()
    # a template file overrides the tokenizer's (base models); kwargs reach the template
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eot }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    over = PromptFormatter(tok, ChatConfig(enabled=True, chat_template=str(f), chat_template_kwargs={"eot": "|"}))
    assert over.text("hi") == "[user]hi|[assistant]"
    assert over.end_of_turn_id is None and over.turn_end_ids == [tok.convert_tokens_to_ids("|"), tok.eos_token_id]
    with pytest.raises(ConfigError, match=r"data\.chat\.chat_template: cannot read '.*nope\.jinja'"):
        PromptFormatter(tok, ChatConfig(enabled=True, chat_template=str(tmp_path / "nope.jinja")))


def test_stop_ids():
    tok = build_tiny_tokenizer()
    assert stop_token_ids(tok) == [tok.eos_token_id]
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=[7, tok.eos_token_id]), [9, 7]) == [tok.eos_token_id, 7, 9]
    assert stop_token_ids(tok, SimpleNamespace(eos_token_id=None)) == [tok.eos_token_id]


# ---------------------------------------------------------------- every consumer sees the same ids


def _first_inputs(model):
    """The input ids of `model`'s next forward (captured at its embedding)."""
    seen: list[torch.Tensor] = []
    h = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    return seen, h


def test_same_messages_same_ids_in_sft_rollout_teachers_and_eval(chat_tiny, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from mopd_core.evaluation import evaluate_model
    from mopd_core.teachers import LocalTeacher
    from mopd_core.teachers.http import HttpTeacher
    from mopd_core.train.sft import sft_dataset_rows

    path, model, tok = chat_tiny
    want = PromptFormatter(tok, CHAT).ids(MSG_EX)
    ime = tok.convert_tokens_to_ids(IM_END)
    P = len(want)

    # SFT: our rows, and what TRL's SFTTrainer keeps of them after its dataset preparation
    rows = sft_dataset_rows([{"prompt": [{"role": "user", "content": "12+3="}], "completion": "15"}], tok, CHAT)
    comp = tok("15", add_special_tokens=False)["input_ids"] + [ime]
    assert rows == [{"input_ids": want + comp, "completion_mask": [0] * P + [1] * len(comp)}]
    args = SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=1, report_to=[], use_cpu=True, max_length=128,
                     completion_only_loss=True, disable_tqdm=True, dataset_num_proc=None)
    trainer = SFTTrainer(model=load_model(path), args=args, train_dataset=Dataset.from_list(rows * 2),
                         processing_class=tok)
    row = trainer.train_dataset[0]
    assert row["input_ids"] == want + comp and row["labels"] == [-100] * P + comp

    # hf rollout
    b = HFRollout(model, tok, "cpu", chat=CHAT).generate([MSG_EX], max_new_tokens=3, greedy=True)
    assert b.prompt_ids[0][b.prompt_mask[0].bool()].tolist() == want
    assert encode_prompts(tok, [MSG_EX], "cpu", formatter=PromptFormatter(tok, CHAT))[0][0].tolist() == want
    assert prompt_ids(tok, [MSG_EX], chat=CHAT) == [want]  # the pre-flight's length rule

    # local teacher: the ids its model is run on
    teacher = LocalTeacher("math", path, torch.device("cpu"))
    seen, h = _first_inputs(teacher.model)
    try:
        teacher.score(b)
    finally:
        h.remove()
    full = seen[0][0][b.attention_mask()[0].bool()].tolist()
    assert full[:P] == want and full[P:] == b.completion_ids[0][b.completion_mask[0].bool()].tolist()

    # http teacher: the token ids in the request body
    stub = _Stub(max_model_len=512)  # the http teachers' stub server (tests/integration/test_http_teachers)
    try:
        t = HttpTeacher("math", stub.url, retries=0)
        t.score(b)
        t.close()
    finally:
        stub.close()
    assert stub.prompts == [full]

    # eval renders the same ids
    dom = SimpleNamespace(eval_examples=lambda: [MSG_EX], uses_truncation=False,  # a Domain's interface
                          rewards=lambda exs, texts: [0.0] * len(exs))
    seen, h = _first_inputs(model)
    try:
        evaluate_model(model, tok, {"math": dom}, EvalConfig(), "cpu", 2, chat=CHAT)
    finally:
        h.remove()
    assert seen[0][0].tolist() == want  # one prompt: the prefill is the prompt, unpadded


def test_vllm_rollout_sends_the_formatter_ids_and_every_stop_id(chat_tiny, monkeypatch):
    from mopd_core.rollout import engines as E

    path, model, tok = chat_tiny
    ime = tok.convert_tokens_to_ids(IM_END)

    class LLM:
        def __init__(self, **kw):
            LLM.last = self

        def generate(self, prompts, params, use_tqdm=False):
            self.prompts, self.params = prompts, params
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5, ime], logprobs=[
                {5: SimpleNamespace(logprob=-0.1)}, {ime: SimpleNamespace(logprob=-0.2)}])]) for _ in prompts]

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = LLM, lambda **kw: SimpleNamespace(**kw)
    mod.envs = SimpleNamespace(disable_envs_cache=lambda: None)
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    eng = E.VllmRollout(model, tok, "cpu", 64, max_model_len=80, allow_cpu=True, chat=CHAT)
    b = eng.generate([MSG_EX, STR_EX], max_new_tokens=4)
    fmt = PromptFormatter(tok, CHAT)
    assert [p["prompt_token_ids"] for p in LLM.last.prompts] == fmt.batch_ids([MSG_EX, STR_EX])
    assert {tuple(p.stop_token_ids) for p in LLM.last.params} == {(tok.eos_token_id, ime)}
    assert b.completion_mask.tolist() == [[1, 1], [1, 1]] and b.texts == [tok.decode([5])] * 2
    kw = E.sampling_kwargs(max_new_tokens=3, temperature=0.7, top_p=1.0, greedy=True, seed=1, stop_ids=[1, 9])
    assert kw["stop_token_ids"] == [1, 9] and kw["temperature"] == 0.0


# ---------------------------------------------------------------- stopping on the end-of-turn token


def _forced(model, plan):
    """Make the model's greedy choice at generation step k be `plan[k]` (its lm_head's output overridden)."""
    step = [0]

    def hook(mod, args, out):
        k = min(step[0], len(plan) - 1)
        step[0] += 1
        out = out.clone()
        out[:, -1, :] = -1e4
        out[:, -1, plan[k]] = 1e4
        return out

    return model.lm_head.register_forward_hook(hook)


def test_generation_stops_on_the_end_of_turn_id_not_only_eos(chat_tiny):
    _, model, tok = chat_tiny
    ime = tok.convert_tokens_to_ids(IM_END)
    seven = tok.convert_tokens_to_ids("7")
    assert ime != tok.eos_token_id
    plan = [seven, seven, ime, seven, seven, seven]
    h = _forced(model, plan)
    try:
        b = HFRollout(model, tok, "cpu", chat=CHAT).generate([MSG_EX], max_new_tokens=6, greedy=True)
    finally:
        h.remove()
    assert b.completion_ids[0].tolist() == [seven, seven, ime]  # stopped after the end-of-turn token
    assert b.completion_mask[0].tolist() == [1, 1, 1] and b.texts == ["77"]  # inside the mask, not in the text
    # without chat the same model runs past it (only EOS stops): the stop came from the chat template
    h = _forced(model, plan)
    try:
        raw = HFRollout(model, tok, "cpu").generate([STR_EX], max_new_tokens=6, greedy=True)
    finally:
        h.remove()
    assert raw.completion_ids[0].tolist() == plan
    # sample() stops each row on any of several ids
    ids, mask = encode_prompts(tok, ["a", "b"], "cpu")
    h = _forced(model, [seven, ime, seven, seven])
    try:
        c, m, _ = sample(model, ids, mask, max_new_tokens=4, eos_id=[tok.eos_token_id, ime], pad_id=0, greedy=True)
    finally:
        h.remove()
    assert c.tolist() == [[seven, ime]] * 2 and m.tolist() == [[1, 1]] * 2


def test_an_override_template_travels_in_every_checkpoint_the_stages_save(tmp_path):
    """`data.chat.chat_template` becomes the saved tokenizer's own template (SFT's final model, and the policy
    loop's checkpoints and final model), so the model renders chat elsewhere as it was trained here."""
    from mopd_core.models import load_tokenizer
    from tests.conftest import tiny_overrides

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")
    cfg = load_config("tiny", tiny_overrides(tmp_path / "runs") + [
        "model.tiny.chat=true", "data.chat.enabled=true", f"data.chat.chat_template={f}", "sft.steps=1",
        "expert.steps=1", "expert.save_every=1", "data.max_prompt_tokens=40"])
    sft = R.sft_stage(cfg, R.base_model(cfg), progress=False)
    assert load_tokenizer(sft.model_dir).chat_template == f.read_text()
    assert not load_tokenizer(cfg.run_dir() / "base").chat_template == f.read_text()  # the base's own is kept
    exp = R.expert_stage(cfg, "math", sft.model_dir, progress=False)
    ckpts = sorted((exp.model_dir.parent / "checkpoints").glob("step-*"))
    for d in [exp.model_dir, *(c / "model" for c in ckpts)]:
        assert load_tokenizer(d).chat_template == f.read_text(), d
    assert ckpts
