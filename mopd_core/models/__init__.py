"""Models and tokenizers: load any HF causal LM from a path or id, build the tiny one locally, fingerprint
tokenizers so that the student and every teacher provably share a vocabulary.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import string
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, TinyModelConfig

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII without the whitespace control characters: every synthetic domain (and plain-English user
# prompts) tokenize to one id per character, so vLLM and transformers agree on ids trivially.
TINY_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "


class ModelError(ValueError):
    """Bad model or tokenizer input; one line naming the path and the fix."""


def quiet_hf() -> None:
    """Silence per-call tqdm bars of transformers/datasets (weight loading, dataset maps): the stages show
    their own progress, and hundreds of "Loading weights" bars would bury it."""
    import warnings

    import datasets
    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


def build_tiny_tokenizer():
    """A character-level WordLevel tokenizer (Split into single characters, Fuse on decode)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in TINY_ALPHABET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    fast.padding_side = "left"
    return fast


def build_tiny_model(tiny: TinyModelConfig, vocab_size: int, pad_id: int, eos_id: int, seed: int = 0):
    """A Llama-style model of ~1–5 M parameters, initialised deterministically from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads or tiny.num_heads,
        intermediate_size=tiny.intermediate_size, max_position_embeddings=tiny.max_position_embeddings,
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, tie_word_embeddings=False,
        head_dim=tiny.hidden_size // tiny.num_heads, rms_norm_eps=1e-6,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    return model


def build_tiny(cfg: ModelConfig, out_dir: str | Path, seed: int = 0) -> Path:
    """Build and save the tiny base model + tokenizer (idempotent for the same config)."""
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tok = build_tiny_tokenizer()
    model = build_tiny_model(cfg.tiny, len(tok), tok.pad_token_id, tok.eos_token_id, seed)
    save_pretrained(model, tok, out)
    return out


def save_pretrained(model, tokenizer, out_dir: str | Path) -> Path:
    """Write weights + tokenizer atomically (tmp dir, then rename) so a crash never leaves half a model."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def load_tokenizer(path_or_id: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load tokenizer from '{path_or_id}': {str(e).splitlines()[0]} — "
                         "give a checkpoint dir with tokenizer files or a model id available locally") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path_or_id: str | Path, device: torch.device | str = "cpu", dtype: str = "float32",
               trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    p = Path(str(path_or_id))
    if p.exists() and p.is_dir() and not (p / "config.json").exists():
        raise ModelError(f"'{p}' is not a model checkpoint (no config.json) — give a save_pretrained dir")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path_or_id), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model from '{path_or_id}': {str(e).splitlines()[0]}") from None
    return model.to(device)


def load_model_and_tokenizer(path_or_id: str | Path, device="cpu", dtype="float32", trust_remote_code=False):
    return (load_model(path_or_id, device, dtype, trust_remote_code),
            load_tokenizer(path_or_id, trust_remote_code))


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary (token → id) and the special tokens: equal fingerprints ⇒ same token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    blob = json.dumps({"vocab": vocab, "special": specials, "eos": tokenizer.eos_token_id,
                       "pad": tokenizer.pad_token_id}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_same_tokenizer(student_fp: str, teacher_fp: str, teacher: str, where: str = "") -> None:
    if student_fp != teacher_fp:
        raise ModelError(f"teacher '{teacher}'{where} has tokenizer fingerprint {teacher_fp}, the student has "
                         f"{student_fp}: teachers must share the student's tokenizer (retrain the expert from "
                         "the same base, or pick a matching teacher)")


@lru_cache(maxsize=None)
def _cache_kwarg(model_cls: type) -> str:
    """transformers ≥ 5.2x calls the KV cache argument `cache`; older versions `past_key_values`."""
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model, input_ids, attention_mask=None, position_ids=None, cache: Any = None,
            use_cache: bool = False, logits_to_keep: int = 0):
    kw = {_cache_kwarg(type(model)): cache} if cache is not None else {}
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=use_cache, logits_to_keep=logits_to_keep, **kw)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)
    return out.logits, new_cache


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
