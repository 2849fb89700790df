"""Prompt formatting: the one path from an `Example`'s prompt to the token ids every consumer sees.

SFT rows, the hf and vLLM rollouts, local and http teachers (they score the batch's ids) and eval all take the ids
of `PromptFormatter.ids`, so the model is trained, sampled and scored on the same prompt, token for token.

- `data.chat.enabled: false` (the default): a prompt is a raw string, tokenised exactly as before the formatter
  existed (`tokenizer(prompts, add_special_tokens=True)`); a prompt given as chat messages is an error naming the
  setting.
- `enabled: true`: a string prompt becomes one user message, a message prompt is taken as given; the system
  prompt goes first when the messages have none, the user suffix is appended to the last user message, and the
  tokenizer's chat template (or `data.chat.chat_template`, a Jinja file) renders them with the generation prompt
  (`apply_chat_template(..., add_generation_prompt=True, tokenize=True)`, `chat_template_kwargs` passed through).
  The template's end-of-turn token (what it writes after an assistant message, e.g. `<|im_end|>`) becomes a stop
  id and ends every SFT completion.

An `Example.prompt` is a `str` or a sequence of `{"role", "content"}` mappings (`domains.base.Example`), read by
duck typing; frozen messages become plain dicts through `domains.base.thaw`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..config import ChatConfig
from ..domains.base import freeze_messages, thaw
from ..errors import ConfigError, DataError

# Stands for the assistant's content when the template is rendered once to find what it writes after an
# assistant message (no template treats it specially: plain letters and digits).
_CONTENT_MARK = "MOPDxCONTENTx7361"


def stop_token_ids(tokenizer, generation_config=None, extra: Sequence[int] = ()) -> list[int]:
    """Every id generation stops on, in a stable order without repeats: the tokenizer's EOS, the generation
    config's `eos_token_id` (an int or a list: instruct checkpoints list their end-of-turn token there), then
    `extra` (the chat template's end-of-turn token)."""
    out: list[int] = []
    gen = getattr(generation_config, "eos_token_id", None)  # lib: transformers GenerationConfig, or None
    for v in [tokenizer.eos_token_id, *(gen if isinstance(gen, (list, tuple)) else [gen]), *extra]:
        if v is not None and int(v) not in out:
            out.append(int(v))
    return out


@runtime_checkable
class HasPrompt(Protocol):
    """What the formatter reads of a row: its `prompt` (an `Example`, or any row object that carries one)."""
    prompt: Any


@runtime_checkable
class HasTeacherId(Protocol):
    """A row that names its domain (`Example.teacher_id`): error messages say which."""
    teacher_id: str


def prompt_of(item: Any) -> Any:
    """An Example's prompt, or the item itself when it already is a prompt (a string or messages)."""
    return item.prompt if isinstance(item, HasPrompt) and not isinstance(item, str) else item


def preview(prompt: Any, n: int = 40) -> str:
    """The start of a prompt for error messages: the string, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt[:n]
    try:
        users = [m["content"] for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        return str(users[-1] if users else prompt)[:n]
    except TypeError:
        return str(prompt)[:n]


class PromptFormatter:
    """Token ids of prompts for one tokenizer and one `data.chat` setting, computed once per prompt (an LRU of
    `cache_size` prompts: synthetic domains draw new prompts every step, so the cache must not grow without end).

    `ids(x)` / `batch_ids(xs)`: the prompt ids of Examples or prompts; `messages(x)`: the messages that are
    rendered (None with chat off); `text(x)`: the rendered prompt as text (logs, `mopd data check`);
    `stop_ids(generation_config)`: every stop id; `completion_ids(text)`: an SFT completion's ids, ending with
    the end-of-turn token (chat) — without chat the caller appends EOS as before."""

    def __init__(self, tokenizer, chat: ChatConfig | None = None, *, cache_size: int = 1 << 16):
        self.tokenizer = tokenizer
        self.chat = chat if chat is not None else ChatConfig()
        self.enabled = bool(self.chat.enabled)
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[Any, list[int]] = OrderedDict()
        self.template: str | None = None  # the override's text; None = the tokenizer's own template
        self.turn_end_ids: list[int] = []  # what the template writes after an assistant message, up to its stop
        self.end_of_turn_id: int | None = None
        if self.enabled:
            if self.chat.chat_template:
                self.template = _read_template(self.chat.chat_template)
            elif not tokenizer.chat_template:
                name = tokenizer.name_or_path or type(tokenizer).__name__
                raise ConfigError(f"data.chat.enabled=true but the tokenizer of '{name}' has no chat template — "
                                  "set data.chat.chat_template to a Jinja template file (base models), or "
                                  "model.tiny.chat=true for the tiny model")
            self.turn_end_ids, self.end_of_turn_id = self._turn_end()

    # -- rendering -------------------------------------------------------------------------------------------
    def messages(self, item: Any) -> list[dict] | None:
        """The chat messages `item` renders to (system prompt and user suffix applied); None with chat off."""
        prompt = prompt_of(item)
        if not self.enabled:
            if not isinstance(prompt, str):
                self._not_a_string(item, prompt)
            return None
        if isinstance(prompt, str):
            msgs = [{"role": "user", "content": prompt}]
        else:
            msgs = self._checked(item, prompt)
        if self.chat.system_prompt is not None and not any(m["role"] == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.chat.system_prompt})
        if self.chat.user_suffix:
            last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
            if last is None:
                raise DataError(f"{_where(item)}prompt has no user message to append data.chat.user_suffix to "
                                f"({preview(prompt)!r}) — add a user message or unset data.chat.user_suffix")
            msgs[last] = {**msgs[last], "content": str(msgs[last]["content"]) + self.chat.user_suffix}
        return msgs

    def text(self, item: Any) -> str:
        """The prompt as the model reads it, as text (the raw string with chat off)."""
        msgs = self.messages(item)  # chat off: checks that the prompt is a string
        return prompt_of(item) if msgs is None else self._apply(msgs, tokenize=False)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """`messages` (a whole conversation, or a prompt) rendered as text by the template the run uses (the
        compatibility pre-flight compares it with each teacher's)."""
        kw = self._template_kw()
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **kw)

    def ids(self, item: Any) -> list[int]:
        """The prompt's token ids (a fresh list: callers may keep or change it)."""
        return self.batch_ids([item])[0]

    def batch_ids(self, items: Sequence[Any]) -> list[list[int]]:
        """Token ids of each prompt (Examples or prompts), from the cache where it has them."""
        prompts = [prompt_of(x) for x in items]
        keys = [_key(p) for p in prompts]
        out: list[list[int] | None] = [None] * len(prompts)
        todo: list[int] = []
        for i, k in enumerate(keys):
            hit = self._cache.get(k) if k is not None else None
            if hit is not None:
                self._cache.move_to_end(k)
                out[i] = list(hit)
            else:
                todo.append(i)
        if todo:
            if self.enabled:
                fresh = [self._apply(self.messages(items[i]), tokenize=True) for i in todo]
            else:
                for i in todo:
                    if not isinstance(prompts[i], str):
                        self._not_a_string(items[i], prompts[i])
                # today's rule, one batched call (bit for bit what the engines fed before the formatter existed)
                fresh = list(self.tokenizer([prompts[i] for i in todo], add_special_tokens=True)["input_ids"])
            for i, ids in zip(todo, fresh):
                ids = [int(t) for t in ids]
                out[i] = ids
                if keys[i] is not None and self.cache_size > 0:
                    self._cache[keys[i]] = tuple(ids)
                    if len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        return out  # type: ignore[return-value]

    # -- stops and SFT targets -------------------------------------------------------------------------------
    def stop_ids(self, generation_config=None, tokenizer=None) -> list[int]:
        """Every stop id: tokenizer EOS, the generation config's eos ids, and (chat) the end-of-turn token.
        `tokenizer`: the engine's current one when it differs from the formatter's (an engine's EOS is read
        at every call, as before chat formatting existed)."""
        extra = [self.end_of_turn_id] if self.end_of_turn_id is not None else []
        return stop_token_ids(tokenizer if tokenizer is not None else self.tokenizer, generation_config, extra)

    def completion_ids(self, completion: str) -> list[int]:
        """An SFT completion's ids: the text (no special tokens added) followed, with chat on, by what the
        template writes after an assistant message up to and including its end-of-turn token — the token
        generation stops on, so SFT teaches the model to stop where rollout stops. With chat off this is the text
        alone (TRL appends EOS to prompt/completion rows, as before)."""
        ids = [int(t) for t in self.tokenizer(completion, add_special_tokens=False)["input_ids"]]
        return ids + list(self.turn_end_ids) if self.enabled else ids

    # -- internals -------------------------------------------------------------------------------------------
    def _template_kw(self) -> dict:
        """`chat_template_kwargs`, plus the override template when one is configured."""
        kw = dict(self.chat.chat_template_kwargs)
        if self.template is not None:
            kw["chat_template"] = self.template
        return kw

    def _apply(self, msgs: list[dict], *, tokenize: bool):
        kw = self._template_kw()
        try:
            out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=tokenize,
                                                     return_dict=False, **kw)
        except Exception as e:  # jinja's TemplateError, a template's raise_exception(), a bad kwarg
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"data.chat: the chat template cannot render the prompt {preview(msgs)!r} "
                              f"({type(e).__name__}: {first}) — fix data.chat (chat_template, "
                              "chat_template_kwargs, system_prompt) or the data's messages") from None
        return [int(t) for t in out] if tokenize else out

    def _turn_end(self) -> tuple[list[int], int | None]:
        """What the template writes after an assistant message, as ids up to and including the first stop token
        in it (`<|im_end|>` of `<|im_end|>\\n`), and that end-of-turn id. A template that ends a turn with plain
        text has no end-of-turn token: EOS is appended after that text instead."""
        kw = self._template_kw()
        conv = [{"role": "user", "content": "1"}, {"role": "assistant", "content": _CONTENT_MARK}]
        try:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=False, tokenize=False, **kw)
        except Exception as e:  # noqa: BLE001 - any failure: the template cannot render a turn at all
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"data.chat: the chat template cannot render a user/assistant turn "
                              f"({type(e).__name__}: {first}) — fix data.chat.chat_template or its "
                              "chat_template_kwargs") from None
        at = text.rfind(_CONTENT_MARK)
        tail = text[at + len(_CONTENT_MARK):] if at >= 0 else ""
        ids = [int(t) for t in self.tokenizer(tail, add_special_tokens=False)["input_ids"]] if tail else []
        eos = self.tokenizer.eos_token_id
        special = set(self.tokenizer.all_special_ids or [])
        special |= set(self.tokenizer.added_tokens_decoder or {})
        for j, t in enumerate(ids):
            if t == eos or t in special:
                return ids[:j + 1], (None if t == eos else t)
        return ids + ([eos] if eos is not None else []), None

    def _checked(self, item: Any, prompt: Any) -> list[dict]:
        """Messages as plain dicts, checked by the loader's rule (`domains.base.freeze_messages`; an Example's are
        already frozen by it)."""
        try:
            return thaw(freeze_messages(prompt))
        except DataError as e:
            raise DataError(f"{_where(item)}{e}") from None

    def _not_a_string(self, item: Any, prompt: Any):
        _messages_need_chat(item, prompt)


def check_prompt_kind(item: Any, chat: ChatConfig | None) -> None:
    """A chat-message prompt with `data.chat` disabled is an error (one line naming the setting) — checkable
    before any tokenizer is loaded."""
    prompt = prompt_of(item)
    if not isinstance(prompt, str) and not (chat is not None and chat.enabled):
        _messages_need_chat(item, prompt)


def _messages_need_chat(item: Any, prompt: Any):
    raise ConfigError(f"{_where(item)}prompt is a list of chat messages ({preview(prompt)!r}) but "
                      "data.chat.enabled is false — set data.chat.enabled=true so the chat template renders it")


def _where(item: Any) -> str:
    tid = item.teacher_id if isinstance(item, HasTeacherId) else None
    return f"domain '{tid}': " if tid else ""


def _key(prompt: Any) -> Any:
    """The cache key of a prompt: itself when hashable (strings, an Example's frozen messages), else None."""
    try:
        hash(prompt)
    except TypeError:
        return None
    return prompt


def carry_chat_template(tokenizer, chat: ChatConfig | None) -> None:
    """With a `data.chat.chat_template` override, make it the tokenizer's own template, so every checkpoint a
    stage saves renders chat the way it was trained (vLLM, transformers and the next stage load it from the
    tokenizer files). Rendering here is unchanged: the formatter passes the override explicitly."""
    if chat is not None and chat.enabled and chat.chat_template:
        tokenizer.chat_template = _read_template(chat.chat_template)


def _read_template(path: str) -> str:
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = (e.strerror if isinstance(e, OSError) else None) or e
        raise ConfigError(f"data.chat.chat_template: cannot read '{p}' ({type(e).__name__}: "
                          f"{why}) — give the path of a UTF-8 Jinja template file"
                          ) from None
    if not text.strip():
        raise ConfigError(f"data.chat.chat_template: '{p}' is empty — give a Jinja chat template")
    return text


def formatter_for(tokenizer, chat: ChatConfig | PromptFormatter | None = None) -> PromptFormatter:
    """`chat` when it already is a formatter (to share its cache), else a new one for `tokenizer`."""
    if isinstance(chat, PromptFormatter):
        return chat
    return PromptFormatter(tokenizer, chat)


__all__ = ["PromptFormatter", "check_prompt_kind", "formatter_for", "preview", "stop_token_ids"]
