"""Models and tokenizers: load any HF causal LM from a path or id, build the tiny one locally, fingerprint
tokenizers so that the student and every teacher provably share a vocabulary.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import math
import string
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, TinyModelConfig
from ..errors import ModelError  # noqa: F401 - models.ModelError stays the public name

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# Printable ASCII without the whitespace control characters: every synthetic domain (and plain-English user
# prompts) tokenize to one id per character, so vLLM and transformers agree on ids trivially.
TINY_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "


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


# The tiny model's chat variant (`model.tiny.chat`): ChatML's layout with its two special tokens and a newline
# character, appended after the default vocabulary so that every default id keeps its meaning.
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_tokenizer(chat: bool = False, vocab_size: int | None = None):
    """A character-level WordLevel tokenizer (Split into single characters, Fuse on decode). `chat`: the vocabulary
    also has the newline character, `<|im_start|>` and `<|im_end|>` (special tokens, after every default id) and
    the tokenizer a ChatML-like chat template; the default (`chat=False`) is unchanged. `vocab_size`: padded with
    generated tokens `<|xN|>` up to that many entries (a real vocabulary's width for real-size benchmarks; encoding
    never produces them — the pre-tokenizer splits into characters — decoding writes them out)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in TINY_ALPHABET:
        vocab[ch] = len(vocab)
    if chat:
        for t in ("\n", IM_START, IM_END):
            vocab[t] = len(vocab)
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"model.tiny.vocab_size={vocab_size} is below the {len(vocab)} characters and "
                             "special tokens of the tokenizer; raise it or leave it unset")
        vocab.update({f"<|x{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "." stops at a newline; the chat variant splits every character, the newline included
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]" if chat else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    extra = dict(extra_special_tokens=[IM_START, IM_END], chat_template=TINY_CHAT_TEMPLATE) if chat else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, **extra)
    fast.padding_side = "left"
    return fast


def build_bpe_tokenizer(texts, vocab_size: int = 160):
    """A BPE tokenizer over the tiny alphabet, trained on `texts` (merges may span any characters, spaces
    included): another tokenization of the same strings as `build_tiny_tokenizer`, with the same special tokens
    (`<pad>`, `<eos>`, `<unk>`) — the other side of a cross-tokenizer teacher (docs/cross_tokenizer.md)."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK],
                                  initial_alphabet=list(TINY_ALPHABET), show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    fast.padding_side = "left"
    return fast


def build_tiny_model(tiny: TinyModelConfig, vocab_size: int, pad_id: int, eos_id: int, seed: int = 0,
                     device: torch.device | str | None = None):
    """A model of `tiny`'s shape — Llama-style (`arch: llama`, ~1–5 M parameters for the CPU presets) or
    Qwen3-style (`arch: qwen3`, e.g. Qwen3-1.7B's shape for real-size benchmarks) — initialised deterministically
    from `seed`. `device`: where the weights are created and initialised (an accelerator initialises a
    billion-parameter model in a second; the values differ from a CPU build of the same seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=vocab_size, hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads or tiny.num_heads,
        intermediate_size=tiny.intermediate_size, max_position_embeddings=tiny.max_position_embeddings,
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None, tie_word_embeddings=tiny.tie_word_embeddings,
        head_dim=tiny.hidden_size // tiny.num_heads, rms_norm_eps=1e-6,
    )
    if tiny.arch == "qwen3":
        cfg, cls = Qwen3Config(**shape, rope_theta=1_000_000.0), Qwen3ForCausalLM
    else:
        cfg, cls = LlamaConfig(**shape), LlamaForCausalLM
    import contextlib

    dev = torch.device(device) if device is not None else None
    # the global RNG of the build's device is left as it was (cpu: fork_rng without devices); device None: the
    # caller's default device (the pre-flight counts parameters under torch.device("meta"))
    forked = [] if dev is None or dev.type == "cpu" else [dev.index or 0]
    with (torch.random.fork_rng(devices=forked, device_type=dev.type if forked else "cuda"),
          dev if dev is not None else contextlib.nullcontext()):
        torch.manual_seed(seed)
        model = cls(cfg)
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    return model


def build_tiny(cfg: ModelConfig, out_dir: str | Path, seed: int = 0, device: torch.device | str | None = None,
               tokenizer=None) -> Path:
    """Build and save the locally built base model + tokenizer (idempotent for the same config; `device`: where
    the weights are initialised, `build_tiny_model`; `tokenizer`: one `build_tiny_tokenizer` already built for
    `cfg` — a padded real-size vocabulary takes seconds to build — else built here)."""
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        # a dir built with another tokenizer variant (model.tiny.chat flipped) or shape is rebuilt, not reused
        if (IM_END in (out / "tokenizer.json").read_text()) == cfg.tiny.chat and _same_shape(out, cfg.tiny):
            return out
    tok = tokenizer if tokenizer is not None else build_tiny_tokenizer(chat=cfg.tiny.chat,
                                                                        vocab_size=cfg.tiny.vocab_size)
    model = build_tiny_model(cfg.tiny, len(tok), tok.pad_token_id, tok.eos_token_id, seed, device)
    save_pretrained(model.to(getattr(torch, cfg.tiny.save_dtype)), tok, out)
    return out


def _same_shape(out: Path, tiny: TinyModelConfig) -> bool:
    """Whether the saved config.json has `tiny`'s widths (a dir of the tiny presets' older builds says nothing of
    vocab_size: only compared when the spec pads the vocabulary)."""
    c = json.loads((out / "config.json").read_text())
    want = {"hidden_size": tiny.hidden_size, "num_hidden_layers": tiny.num_layers,
            "intermediate_size": tiny.intermediate_size, "num_attention_heads": tiny.num_heads,
            **({"vocab_size": tiny.vocab_size} if tiny.vocab_size is not None else {})}
    return all(c.get(k) == v for k, v in want.items()) and (c.get("model_type") == tiny.arch
                                                             or tiny.arch == "llama")


def compile_decoder_layers(model, kind: str, backend: str | None = None) -> int:
    """`torch.compile` every decoder layer of `model` (the classes its `_no_split_modules` names) for training, as
    torchtitan compiles per block: one graph, reused by all layers (their weights are graph inputs), fusing RMSNorm,
    rotary, SwiGLU, residual adds and autocast's casts around the matmuls; the layer boundaries keep transformers'
    gradient checkpointing and FSDP2's units working. Only in training mode: in eval mode (the rollout engines,
    evaluation) each layer runs its eager forward, so decode shapes never recompile the graph and a captured
    sampler captures plain kernels. Parameter names, state dicts and hooks are unchanged (the forward is wrapped on
    the instance). `backend` None: the device's (`runtime.device.compile_backend`: inductor on cuda, nothing on cpu
    or npu); tests pass `"eager"` to run the same wrapping on cpu. Returns the layers wrapped."""
    from ..runtime.device import compile_backend

    backend = backend or compile_backend(kind)
    if backend is None:
        return 0
    units = set(getattr(unwrap(model), "_no_split_modules", None) or ())  # lib: transformers (a plain module: none)
    n = 0
    for mod in unwrap(model).modules():
        if type(mod).__name__ not in units:
            continue
        eager = mod.forward
        # shapes change between micro-batches: dynamo marks them dynamic after the first change
        compiled = torch.compile(eager, backend=backend)

        def forward(*args, _eager=eager, _compiled=compiled, _mod=mod, **kwargs):
            return (_compiled if _mod.training else _eager)(*args, **kwargs)

        mod.forward = forward
        n += 1
    return n


def save_pretrained(model, tokenizer, out_dir: str | Path) -> Path:
    """Write weights + tokenizer atomically: into `<out>.tmp`, then renamed over `out`, so a crash or a full disk
    never leaves half a model and never touches the previous `out` (a failed write removes only the temp dir;
    ENOSPC is a `DiskFullError` naming the disk). A model with LoRA adapters is written merged
    (`lora.export_state_dict`)."""
    import shutil

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    old = out.with_name(out.name + ".old")
    with writing(tmp, f"the model {out}"):
        tmp.mkdir(parents=True)
        from .lora import export_state_dict, has_lora

        # a LoRA policy is written merged, under the base names: a plain HF model that loads without peft
        model.save_pretrained(tmp, safe_serialization=True,
                              **({"state_dict": export_state_dict(model)} if has_lora(model) else {}))
        tokenizer.save_pretrained(tmp)
    # swap: the previous `out` moves aside first, so at every instant one complete model lies at out or out.old
    if out.exists():
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


def disk_full_error(path: str | Path, what: str, exc: OSError | None = None):
    """The one-line `DiskFullError` for `path`: which disk, how much is free (and what failed)."""
    import shutil

    from ..errors import DiskFullError

    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = f"{shutil.disk_usage(p).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    why = f" ({exc.strerror})" if exc is not None and exc.strerror else ""
    return DiskFullError(f"disk full writing {what}{why}: the disk holding {p} has {free} — free disk space or "
                         "set output_dir to a larger disk; the previous checkpoint and final/ are intact")


@contextmanager
def writing(tmp: Path, what: str):
    """Around a write into the temp dir `tmp`: on any failure remove `tmp` (only it); a full disk becomes a
    `DiskFullError` naming the disk and its free space."""
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise disk_full_error(tmp, what, e) from e
        raise


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


def run_tokenizer(model: ModelConfig):
    """The tokenizer every stage of a recipe uses (the base model's, which SFT saves with its model; teachers
    must share it): the tiny one as `build_tiny` builds it (in memory, nothing written), else `model.base`'s
    loaded as the stages load it (no download)."""
    if model.base == "tiny":
        return build_tiny_tokenizer(chat=model.tiny.chat, vocab_size=model.tiny.vocab_size)
    return load_tokenizer(model.base)


def load_model(path_or_id: str | Path, device: torch.device | str = "cpu", dtype: str = "float32",
               trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    from safetensors import SafetensorError

    p = Path(str(path_or_id))
    if p.exists() and p.is_dir() and not (p / "config.json").exists():
        raise ModelError(f"'{p}' is not a model checkpoint (no config.json) — give a save_pretrained dir")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path_or_id), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    except SafetensorError as e:  # a truncated or corrupt weights file
        raise ModelError(f"cannot load model from '{path_or_id}': its safetensors weights are truncated or corrupt "
                         f"({_first_line(e)}) — re-save the checkpoint or copy it again") from None
    except RuntimeError as e:
        if "mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
            raise  # not about the checkpoint's contents: a bug keeps its traceback
        raise ModelError(f"cannot load model from '{path_or_id}': its weights do not match its config.json (tensor "
                         "shapes differ) — use the config the weights were saved with, or re-save the "
                         "checkpoint") from None
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model from '{path_or_id}': {_first_line(e)} — give a save_pretrained "
                         "checkpoint dir (config.json, model.safetensors, tokenizer)") from None
    return model.to(device)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


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


def checkpoint_files_identity(path: str | Path) -> dict | None:
    """What a checkpoint dir's weights are, without reading them: the config's and stage identity's hashes and
    each weight file's name, size and modification time (a file rewritten in place gets a new time: a miss,
    never a stale hit; a copied model gets new times too: misses, which are safe). None when `path` is no dir."""
    p = Path(path)
    if not p.is_dir():
        return None
    out = {}
    for f in sorted(p.iterdir()):
        if f.suffix in (".safetensors", ".bin", ".pt"):
            st = f.stat()
            out[f.name] = [st.st_size, st.st_mtime_ns]
        elif f.name in ("config.json", "mopd_identity.json", "tokenizer.json"):
            out[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def weights_digest(model) -> str:
    """blake2b over every parameter and buffer (name, dtype, shape, bytes): the identity of weights held in memory
    (one pass over them; they are what a scorer's numbers come from — the teacher-score cache keys on it)."""
    h = hashlib.blake2b(digest_size=20)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_same_tokenizer(student_fp: str, teacher_fp: str, teacher: str, where: str = "") -> None:
    if student_fp != teacher_fp:
        raise ModelError(f"teacher '{teacher}'{where} has tokenizer fingerprint {teacher_fp}, the student has "
                         f"{student_fp}: teachers must share the student's tokenizer (retrain the expert from "
                         "the same base, pick a matching teacher, or list it in teachers.cross_tokenizer to map "
                         "its log-probs by character offsets)")


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
    new_cache = getattr(out, "cache", None)  # lib: transformers ≥ 5.2x returns `cache`
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)  # lib: transformers < 5.2x: `past_key_values`
    return out.logits, new_cache


def unwrap(model):
    """The transformers model inside a DDP-style wrapper (`.module`), or the model itself."""
    return getattr(model, "module", model)  # lib: torch DDP/DataParallel (and accelerate) wrap it in `.module`


def generation_config(model):
    """The sampled model's generation config (its eos ids stop generation); None for a module without one."""
    return getattr(unwrap(model), "generation_config", None)  # lib: transformers models (a bare nn.Module: none)


def last_hidden_state(model, input_ids, attention_mask=None, position_ids=None):
    """The backbone's final (normed) hidden states `[B,L,H]` — what `lm_head` projects — without projecting them,
    so a chunked scorer projects only the positions it needs (TRL's fused forward calls the backbone the same way).
    A wrapper (DDP) must see the forward to sync gradients, and an FSDP2 root gathers the embeddings, final norm and
    lm_head only in its own forward: both run the whole model with one logit position kept and the last entry of
    `hidden_states`."""
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if unwrap(model) is model and not is_fsdp(model):
        return model.base_model(**kw).last_hidden_state
    return model(**kw, logits_to_keep=1, output_hidden_states=True).hidden_states[-1]


def backbone_with_cache(model, input_ids, attention_mask, position_ids, cache: Any = None):
    """The backbone's final hidden states `[B,L,H]` and its KV cache after `input_ids` (continuing `cache` when
    given): a prefix is run once and its cache extended by what follows (`rollout.shared`). Plain models only (no
    DDP/FSDP wrapper: teachers)."""
    base = model.base_model
    kw = {_cache_kwarg(type(base)): cache} if cache is not None else {}
    out = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kw)
    new_cache = getattr(out, "cache", None)  # lib: transformers ≥ 5.2x returns `cache`
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)  # lib: transformers < 5.2x: `past_key_values`
    return out.last_hidden_state, new_cache


def is_fsdp(model) -> bool:
    """Whether `model` was sharded in place by torch FSDP2 (`fully_shard`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def logit_transform(model) -> tuple[float | None, float]:
    """(final_logit_softcapping, logit_scale) the model applies between `lm_head` and the softmax, read from its
    config as TRL's fused forward reads them: Gemma-2/3 soft-capping; Cohere `logit_scale`, `output_multiplier`,
    Falcon-H1 `lm_head_multiplier`, Granite/MiniCPM3 `1/logits_scaling` (HyperCLOVA X multiplies)."""
    cfg = unwrap(model).config.get_text_config()
    # lib: transformers model configs — each family names its own field, most have none
    scale = getattr(cfg, "logit_scale", None)  # lib: transformers (None on models that do not scale, e.g. MPT)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(cfg, name, None) if scale is None else scale  # lib: transformers (Falcon-H1 …)
    if scale is None and getattr(cfg, "logits_scaling", None) is not None:  # lib: transformers (Granite …)
        scale = cfg.logits_scaling if cfg.model_type == "hyperclovax" else 1 / cfg.logits_scaling
    return getattr(cfg, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)  # lib: transformers


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- cheap checks of a checkpoint dir (pre-flight)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tokenizer_config.json")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass
class CheckpointInfo:
    path: Path
    config: dict
    num_params: int | None  # from the weight headers; None for .bin weights
    context: int | None     # positions the model supports (config.json), None if it does not say


def is_local_path(path_or_id: str | Path) -> bool:
    """A local path rather than a hub id (`org/name`): it exists, is absolute or relative (`./`, `../`), or has
    more than two parts — a missing `runs/tiny/sft/final` is a wrong path, not a model to download."""
    s = str(path_or_id)
    return Path(s).exists() or s.startswith(("/", ".", "~")) or s.count("/") > 1 or "\\" in s


def model_shape(config: dict) -> tuple[int, int, int] | None:
    """(hidden size, decoder layers, vocabulary) of a config dict (the text model's for a multimodal one): what
    the memory estimates need; None when the config does not say."""
    cfg = config.get("text_config") or config
    try:
        return int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    except (KeyError, TypeError, ValueError):
        return None


def model_widths(config: dict) -> tuple[int, int] | None:
    """(MLP intermediate size, key/value width = KV heads × head dim) of a config dict (the text model's for a
    multimodal one): the activation, KV-cache and teacher-forward estimates; None when the config does not say."""
    cfg = config.get("text_config") or config
    try:
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        return int(cfg["intermediate_size"]), int(cfg.get("num_key_value_heads") or heads) * head_dim
    except (KeyError, TypeError, ValueError):
        return None


def model_context(config: dict) -> int | None:
    cfg = config.get("text_config") or config
    for k in _CONTEXT_KEYS:
        if isinstance(cfg.get(k), int) and cfg[k] > 0:
            return int(cfg[k])
    return None


def inspect_checkpoint(path_or_id: str | Path, what: str = "model") -> CheckpointInfo | None:
    """Check a checkpoint dir loads, without loading a tensor: config.json parses, every safetensors header reads
    (safetensors' `safe_open`: a truncated or corrupt file fails here), the header shapes match the model the
    config describes, a tokenizer is there. Raises `ModelError` naming the path (as `what`) and the fix; returns
    None for a hub id (checked when it is downloaded)."""
    if not is_local_path(path_or_id):
        return None
    p = Path(str(path_or_id)).expanduser()
    fix = "give a checkpoint dir written by save_pretrained (config.json, model.safetensors, tokenizer files)"
    if not p.exists():
        raise ModelError(f"{what} '{p}' does not exist — {fix}")
    if not p.is_dir():
        raise ModelError(f"{what} '{p}' is a file, not a checkpoint dir — {fix}")
    cfg_path = p / "config.json"
    if not cfg_path.exists():
        raise ModelError(f"{what} '{p}' is not a model checkpoint (no config.json) — {fix}")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{what} '{cfg_path}' is not valid JSON ({_first_line(e)}) — restore it or re-save the "
                         "checkpoint") from None
    if not isinstance(config, dict):
        raise ModelError(f"{what} '{cfg_path}' is not a JSON object — restore it or re-save the checkpoint")
    shapes = _weight_shapes(p, what)
    if shapes is not None:
        _check_shapes(p, config, shapes, what)
    if not any((p / f).exists() for f in TOKENIZER_FILES):
        raise ModelError(f"{what} '{p}' has no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, …) — save the "
                         "tokenizer into it (tokenizer.save_pretrained) or copy it from the base model")
    n = None if shapes is None else sum(math.prod(s) for s in shapes.values())
    return CheckpointInfo(p, config, n, model_context(config))


def _weight_shapes(p: Path, what: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor name → shape from every safetensors header (no data read); None when the weights are .bin."""
    from safetensors import SafetensorError, safe_open

    index = p / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelError(f"{what} '{index}' is not a valid safetensors index ({_first_line(e)}) — re-save the "
                             "checkpoint") from None
    elif (p / "model.safetensors").exists():
        files = ["model.safetensors"]
    elif any(p.glob("*.bin")):
        return None
    else:
        raise ModelError(f"{what} '{p}' has no weights (model.safetensors) — re-save the checkpoint with "
                         "save_pretrained or copy its weight files")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        f = p / name
        if not f.exists():
            raise ModelError(f"{what} '{f}' is missing (named by model.safetensors.index.json) — copy every "
                             "shard of the checkpoint")
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except (SafetensorError, OSError) as e:
            raise ModelError(f"{what} '{f}' is truncated or corrupt ({_first_line(e)}) — re-save the checkpoint "
                             "or copy it again") from None
    return shapes


def _check_shapes(p: Path, config: dict, shapes: dict[str, tuple[int, ...]], what: str) -> None:
    """The header shapes against the model config.json describes (built on the meta device: no memory, no
    init). Only tensors present on both sides are compared; a config transformers cannot build is left to the
    real load."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        if "model_type" not in config or config.get("auto_map"):  # remote code: not built here
            return
        cfg = AutoConfig.from_pretrained(str(p))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    except Exception:  # noqa: BLE001 - any failure here means "cannot tell"; from_pretrained reports it
        return
    for k, shape in shapes.items():
        if k in want and want[k] != shape:
            raise ModelError(f"{what} '{p}': weight '{k}' has shape {list(shape)} but config.json describes "
                             f"{list(want[k])} — the weights were saved with another config; use its config.json "
                             "or re-save the checkpoint")
