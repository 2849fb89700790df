"""The `ifeval` verifier: IFEval's instruction checks, as lm-eval implements them (`lm_eval.tasks.ifeval`: its
instruction registry and its strict/loose `test_instruction_following_*`), used as they are — not a copy.

Row fields: `instruction_id_list` (list of IFEval instruction ids) and `kwargs` (one dict per instruction; None
values are dropped, as lm-eval does); the prompt (`example.prompt`, or the last user message when it is a list of
chat messages) is passed for the instructions that read it.

verifier_args:
  mode:  `strict` (default) or `loose` (lm-eval's loose variants: first/last line dropped, `*` removed).
  score: `all` (default; prompt-level: 1 iff every instruction is followed) or `fraction` (instruction-level:
         the share followed).
  strip_think / zero_if_truncated / think_format_weight: see `verifiers.RealVerifier`.

No network, ever: importing lm-eval's IFEval module calls `nltk.download("punkt_tab")` when NLTK's data is
missing; we import it with `nltk.download` replaced by a no-op. Two instructions need that data (NLTK's Punkt
sentence splitter): `length_constraints:number_sentences` and `change_case:capital_word_frequency`. Without
`tokenizers/punkt_tab/english` on NLTK's path, `validate` refuses rows that use them (one line naming the ids and
the fix); rows without them score as usual. langdetect (used by three instructions) is seeded, so a score never
depends on the run.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Sequence
from typing import Any

from .base import DomainError, Example, thaw
from .schemas import ifeval_kwargs
from .verifiers import RealVerifier, VerdictRow, _arg_choice

# The instructions whose lm-eval check calls NLTK's Punkt (count_sentences, nltk.word_tokenize).
NEEDS_PUNKT = ("change_case:capital_word_frequency", "length_constraints:number_sentences")
PUNKT_RESOURCE = "tokenizers/punkt_tab/english/"
PUNKT_FIX = ("install NLTK's punkt_tab data offline: on a machine with network run `python -m nltk.downloader -d "
             "DIR punkt_tab`, copy DIR to this host and set NLTK_DATA=DIR (or put it in ~/nltk_data)")
_INSTALL = "pip install 'mopd[domains]' (lm-eval[ifeval])"

_LOCK = threading.Lock()
_MODULES: tuple[Any, Any] | None = None


def lm_eval_ifeval() -> tuple[Any, Any]:
    """(instructions_registry, utils) of lm-eval's IFEval task, imported once without any download."""
    global _MODULES
    with _LOCK:
        if _MODULES is not None:
            return _MODULES
        try:
            import nltk
        except ImportError:
            raise DomainError(f"verifier ifeval needs lm-eval's IFEval checks: {_INSTALL}") from None
        real_download = nltk.download
        nltk.download = lambda *a, **k: False  # lm-eval's import-time download: never from here
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                from lm_eval.tasks.ifeval import instructions_registry, utils
        except ImportError as e:
            raise DomainError(f"verifier ifeval needs lm-eval's IFEval checks ({e}): {_INSTALL}") from None
        finally:
            nltk.download = real_download
        try:
            from langdetect import DetectorFactory

            DetectorFactory.seed = 0  # langdetect samples: unseeded, a response's language could flip
        except ImportError:
            pass
        _MODULES = (instructions_registry, utils)
        return _MODULES


def punkt_available() -> bool:
    """Whether NLTK finds the Punkt tables lm-eval's sentence checks need (looks at the disk only)."""
    import nltk

    try:
        nltk.data.find(PUNKT_RESOURCE)
    except LookupError:
        return False
    return True


def last_user_text(example: Example) -> str:
    """The prompt as IFEval knows it: a string prompt as is; for chat messages, the last user message's content."""
    users = [m["content"] for m in example.prompt_messages() if m["role"] == "user"]
    if not users:
        raise DomainError("ifeval: the prompt has no user message; fix the row")
    return users[-1]


class IFEval(RealVerifier):
    """IFEval instruction following through lm-eval's checks (see the module docstring). Extracted: the response
    text that was checked; info: the per-instruction verdicts."""

    name = "ifeval"

    def __init__(self, *, mode: str = "strict", score: str = "all", **common: Any):
        super().__init__(**common)
        _arg_choice(self.name, "mode", mode, ("strict", "loose"))
        _arg_choice(self.name, "score", score, ("all", "fraction"))
        self.mode = mode
        self.score_mode = score
        self._punkt_ok = False

    def check_ready(self) -> None:
        lm_eval_ifeval()

    def _fields(self, example: Example) -> tuple[list[str], list[dict]]:
        ids, kwargs = example.fields.get("instruction_id_list"), example.fields.get("kwargs")
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, str) for i in ids):
            raise DomainError("ifeval needs 'instruction_id_list' (a non-empty list of IFEval instruction ids); "
                              "add it or choose another verifier")
        if kwargs is None:
            kwargs = [{} for _ in ids]
        try:  # the loader's rule (a list of one object per instruction, nulls dropped as lm-eval does)
            out = ifeval_kwargs(thaw(kwargs), len(ids))
        except DomainError as e:
            raise DomainError(f"ifeval: {e}; fix the row") from None
        return list(ids), [thaw(kw) for kw in out]

    def _need_punkt(self, ids: Sequence[str]) -> None:
        affected = sorted(set(ids) & set(NEEDS_PUNKT))
        if not affected or self._punkt_ok:
            return
        if not punkt_available():
            raise DomainError(f"ifeval: instruction(s) {', '.join(affected)} need NLTK's punkt_tab, which is not "
                              f"installed (nothing is downloaded at run time); {PUNKT_FIX}")
        self._punkt_ok = True

    def validate(self, example: Example) -> None:
        registry, _ = lm_eval_ifeval()
        ids, kwargs = self._fields(example)
        last_user_text(example)
        for j, (iid, kw) in enumerate(zip(ids, kwargs)):
            cls = registry.INSTRUCTION_DICT.get(iid)
            if cls is None:
                raise DomainError(f"ifeval: unknown instruction id {iid!r} (instruction_id_list[{j}]); use one of "
                                  "lm-eval's IFEval ids, e.g. punctuation:no_comma")
            inst = cls(iid)
            given = {k: v for k, v in kw.items() if v}  # what lm-eval passes on
            try:
                keys = set(inst.get_instruction_args_keys()) - {"prompt"}
                inst.build_description(**given)
            except (TypeError, ValueError) as e:
                raise DomainError(f"ifeval: kwargs[{j}] for {iid} are invalid ({str(e).splitlines()[0][:160]}); "
                                  "fix the row") from None
            missing = sorted(keys - set(given))
            if missing:  # lm-eval would draw them at random: the reward would change between runs
                raise DomainError(f"ifeval: kwargs[{j}] for {iid} lacks {missing}; add them to the row")
        self._need_punkt(ids)

    def _score(self, example: Example, answer: str, completion: str) -> VerdictRow:
        _, utils = lm_eval_ifeval()
        ids, kwargs = self._fields(example)
        self._need_punkt(ids)
        inp = utils.InputExample(key=0, instruction_id_list=ids, prompt=last_user_text(example), kwargs=kwargs)
        check = utils.test_instruction_following_strict if self.mode == "strict" else \
            utils.test_instruction_following_loose
        out = check(inp, answer)
        followed = [bool(x) for x in out.follow_instruction_list]
        reward = float(all(followed)) if self.score_mode == "all" else sum(followed) / len(followed)
        return VerdictRow(reward, answer, {"followed": [[i, f] for i, f in zip(ids, followed)], "mode": self.mode})

    def __repr__(self) -> str:
        return f"IFEval(mode={self.mode!r}, score={self.score_mode!r})"
