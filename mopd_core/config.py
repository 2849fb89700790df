"""Configuration: one pydantic model per stage and a `RecipeConfig` that holds them.

Every field carries a description (the Prefect UI renders them as a form later); unknown keys are errors
(`extra="forbid"`), so a typo in a YAML preset or a `--set` override fails before any compute, naming the key.
Presets live in `configs/*.yaml`; `load_config(preset, overrides)` reads one and applies dotted overrides such
as `mopd.steps=50`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ConfigError  # noqa: F401 - config.ConfigError stays the public name

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class _Model(BaseModel):
    # allow_inf_nan=False: an infinite learning rate or clip passes `gt=0` and would train NaN weights
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


class RuntimeConfig(_Model):
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="Compute device. `auto` picks npu, then cuda, then cpu.")
    placement: Literal["colocated", "disaggregated", "async"] = Field(
        "colocated", description="Colocated: trainer, rollout and teachers share devices and take turns. "
        "Disaggregated: rollout/teachers are servers on their own devices. Async: disaggregated, and the "
        "student's generation and the teachers' scoring run ahead of the trainer (at most async.max_staleness "
        "weight versions behind; needs rollout.backend=served).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Compute dtype. Trained models keep float32 master weights and optimizer state "
        "(autocast; FSDP2: parameters gathered in this dtype, gradients reduced in float32); teachers, rollout "
        "and eval load their weights in it. float16 is for inference only (training needs bfloat16).")
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op CPU threads; None = all cores. Use 1 on a busy machine "
        "(OpenMP threads spin-wait and slow down under contention).")
    deterministic: bool = Field(True, description="Ask torch for deterministic algorithms where available.")
    memory_limit_gib: float | None = Field(
        None, gt=0, description="Memory of one device the colocated phases may use (checked before any compute: "
        "train = float32 weights + grads + optimizer state, ÷ runtime.num_workers under fsdp2, + one micro-batch's "
        "activations; score = student + one teacher, or all teachers without teachers.offload); None = the "
        "device's total (host RAM on cpu).")
    num_workers: int = Field(
        1, ge=1, description="Training processes, one per device, on Ray (with runtime.strategy ddp or fsdp2): "
        "the expert/MOPD updates (the loop samples and scores in the driver from the gathered weights) and SFT "
        "(TRL's trainer in each, joined by accelerate; sft.batch_size is the global batch).")
    strategy: Literal["single", "ddp", "fsdp2"] = Field(
        "single", description="How training runs: `single` in this process; `ddp` on num_workers Ray workers "
        "with a replicated student; `fsdp2` sharding parameters, gradients and optimizer state over them (torch "
        "fully_shard per decoder layer; SFT through accelerate's FSDP2, which exists on GPU/NPU only — DDP on "
        "CPU).")
    ray_address: str | None = Field(
        None, description="An existing Ray cluster to run the workers on (`ray start --head` …; e.g. "
        "`10.0.0.1:6379` or `auto`); None = start a local Ray for the stage.")
    ray_placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Placement-group strategy of the workers' bundles (STRICT_SPREAD: one per node).")
    ray_timeout_s: float = Field(
        300.0, gt=0, description="How long worker start-up, placement and every collective may take.")

    @model_validator(mode="after")
    def _workers(self) -> "RuntimeConfig":
        if self.num_workers > 1 and self.strategy == "single":
            raise ValueError(f"runtime.num_workers={self.num_workers} needs runtime.strategy=ddp or fsdp2 "
                             "(single trains in this process)")
        return self


class TinyModelConfig(_Model):
    hidden_size: int = Field(192, ge=8, description="Hidden width of the locally built model.")
    num_layers: int = Field(3, ge=1, description="Decoder layers.")
    num_heads: int = Field(6, ge=1, description="Attention heads; head_dim = hidden/heads must be 32 or 64 "
                           "so vLLM's CPU backend can serve the model.")
    num_kv_heads: int | None = Field(None, description="KV heads (GQA); None = num_heads.")
    intermediate_size: int = Field(512, ge=8, description="MLP width.")
    max_position_embeddings: int = Field(128, ge=16, description="Longest sequence (prompt + completion).")
    # left out of the dump while false, so the default tiny model keeps the identity it had before the field existed
    chat: bool = Field(False, exclude_if=lambda v: not v, description="Build the character tokenizer with a "
                       "ChatML-like chat template (`<|im_start|>`/`<|im_end|>` special tokens and a newline "
                       "character), so that data.chat.enabled runs on the tiny model (CI's path for instruct models).")
    # the four fields below shape a locally built model at a real size (configs/gpu_scale.yaml: Qwen3-1.7B's
    # shape with random weights); left out of the dump at their defaults, so the tiny presets keep their identity
    arch: Literal["llama", "qwen3"] = Field(
        "llama", exclude_if=lambda v: v == "llama", description="Architecture of the built model: `llama` "
        "(LlamaForCausalLM) or `qwen3` (Qwen3ForCausalLM: q/k RMSNorm, as Qwen3 checkpoints).")
    vocab_size: int | None = Field(
        None, ge=8, exclude_if=lambda v: v is None, description="Pad the character tokenizer with generated "
        "tokens (`<|x…|>`, never produced by encoding a prompt) up to this many entries, so the model's embedding, "
        "lm_head and log-probs have a real vocabulary's width (Qwen3: 151936); None = the characters only.")
    tie_word_embeddings: bool = Field(False, exclude_if=lambda v: not v,
                                      description="lm_head shares the embedding matrix (Qwen3-1.7B does).")
    save_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", exclude_if=lambda v: v == "float32", description="Dtype the built weights are saved in "
        "(bfloat16 halves the disk and load time of a real-size model; trained stages still load float32 master "
        "weights).")

    @model_validator(mode="after")
    def _head_dim(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.tiny.hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        hd = self.hidden_size // self.num_heads
        if hd not in (32, 64, 80, 96, 112, 128, 256):
            raise ValueError(f"model.tiny head_dim={hd} (hidden_size/num_heads) is not one of 32, 64, 80, 96, "
                             "112, 128, 256; vLLM's CPU attention rejects it — change hidden_size or num_heads")
        return self


class ModelConfig(_Model):
    base: str = Field("tiny", description="Base model: `tiny` builds a Llama-style model and a character "
                      "tokenizer locally (no download); otherwise an HF model id or local path.")
    tokenizer: str | None = Field(None, description="Tokenizer id/path; None = the base model's.")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig,
                                  description="Shape of the locally built tiny model (used when base=tiny).")
    trust_remote_code: bool = Field(False, description="Passed to transformers' from_pretrained.")


IFEVAL_METRICS = ("prompt_strict", "prompt_loose", "inst_strict", "inst_loose")


class EvalSource(_Model):
    """One benchmark of a domain (`data.domains[].eval_sources[]`): its own file, verifier and sampling settings,
    as the published protocol evaluates (e.g. AIME24 mean@32 at T 0.6, top_p 0.95, top_k 20)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Benchmark name: table column and "
                      "metric prefix (`<name>/mean@32`).")
    source: str = Field(description="Dataset path (.jsonl / .json / .parquet / datasets dir), read with `params`.")
    params: dict[str, Any] = Field(default_factory=dict, description="Column map of the file, as "
                                   "data.domains[].params (schema, prompt_field, answer_field, fields, "
                                   "teacher_id_field, answer_join, split).")
    verifier: str = Field("exact_match", description="Reward function (as data.domains[].verifier).")
    verifier_args: dict[str, Any] = Field(default_factory=dict, description="Its keyword arguments.")
    n: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature; 0 = greedy (then n must be 1).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus threshold.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    min_p: float = Field(0.0, ge=0, lt=1, description="Drop tokens below min_p × the top probability; 0 = off.")
    max_new_tokens: int | None = Field(None, ge=1, description="Completion budget; None = eval.max_new_tokens, "
                                       "else rollout.max_new_tokens.")
    metrics: list[str] = Field(default_factory=lambda: ["mean@n"], description="Reported metrics, the first is "
                               "the headline (the domain's score = mean of its benchmarks' headlines): mean@n "
                               "(or mean@<n>), pass@<k> (unbiased, k ≤ n), truncation_rate, and for verifier "
                               "ifeval prompt_strict, prompt_loose, inst_strict, inst_loose.")

    @model_validator(mode="after")
    def _metrics(self) -> "EvalSource":
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"eval_sources '{self.name}': n={self.n} greedy samples are all the same; set "
                             "temperature > 0 or n: 1")
        if not self.metrics:
            raise ValueError(f"eval_sources '{self.name}': metrics is empty; list at least one, e.g. [mean@n]")
        for m in self.metrics:
            kind, _, num = m.partition("@")
            if m in IFEVAL_METRICS:
                if self.verifier != "ifeval":
                    raise ValueError(f"eval_sources '{self.name}': metric {m} needs verifier ifeval (got "
                                     f"{self.verifier})")
            elif m == "truncation_rate" or m == "mean@n":
                pass
            elif kind in ("mean", "pass") and num.isdigit() and int(num) >= 1:
                if kind == "mean" and int(num) != self.n:
                    raise ValueError(f"eval_sources '{self.name}': metric {m} but n={self.n}; write mean@n or "
                                     f"mean@{self.n}")
                if kind == "pass" and int(num) > self.n:
                    raise ValueError(f"eval_sources '{self.name}': metric {m} needs n >= {num} samples (n="
                                     f"{self.n}); raise n or lower k")
            else:
                raise ValueError(f"eval_sources '{self.name}': unknown metric {m!r}; use mean@n, pass@<k>, "
                                 f"truncation_rate or {', '.join(IFEVAL_METRICS)}")
        return self

    def headline(self) -> str:
        """The metric key of the benchmark's headline (mean@n spelled with its n)."""
        return self.metric_keys()[0]

    def metric_keys(self) -> list[str]:
        """The metrics as they are reported (mean@n → mean@<n>), in order, without duplicates."""
        out: list[str] = []
        for m in self.metrics:
            k = f"mean@{self.n}" if m == "mean@n" else m
            if k not in out:
                out.append(k)
        return out


class DomainSpec(_Model):
    name: str = Field(description="Domain name; also the teacher_id that routes its samples to a teacher.")
    source: str = Field(description="`synthetic:<kind>` (math, code, if, mathchain, ifshort, caps) or a path to a "
                        "jsonl / parquet / `datasets` dir with columns prompt, teacher_id, and verifier fields.")
    verifier: str = Field("exact_match", description="Reward function for dataset sources: exact_match, "
                          "contains, code_tests (sandboxed), math_verify, ifeval (the last two need the "
                          "`mopd[domains]` extra). Synthetic domains bring their own.")
    # empty: left out of the dump, so it changes no fingerprint of a config written before it existed
    verifier_args: dict[str, Any] = Field(
        default_factory=dict, exclude_if=lambda v: not v,
        description="Keyword arguments of the verifier, e.g. math_verify {mode: boxed | gsm8k "
        "| aime | any, timeout_s}, ifeval {mode: strict | loose, score: all | fraction}, code_tests {scoring: all | "
        "fraction, max_tests, timeout_s, memory_mb, isolation: bwrap | none}; all real verifiers also take "
        "strip_think, zero_if_truncated, think_format_weight. An unknown key is an error naming the accepted ones.")
    weight: float = Field(1.0, ge=0, description="Share of prompts drawn from this domain (normalised).")
    eval_size: int = Field(200, ge=1, description="Held-out eval prompts, disjoint from training prompts.")
    params: dict[str, Any] = Field(default_factory=dict, description="Domain-specific generator options.")
    # empty: left out of the dump, so configs without it keep their stage fingerprints
    eval_sources: list[EvalSource] = Field(
        default_factory=list, exclude_if=lambda v: not v,
        description="Benchmarks this domain is evaluated on, each with its own file, verifier, sampling and "
        "metrics (`evaluation.evaluate`); empty = greedy (and eval.mean_at_k) on the domain's held-out split.")

    @model_validator(mode="after")
    def _unique_benchmarks(self) -> "DomainSpec":
        names = [b.name for b in self.eval_sources]
        if len(set(names)) != len(names):
            raise ValueError(f"domain '{self.name}': eval_sources has duplicate names {names}; name each benchmark "
                             "once")
        return self


class ChatConfig(_Model):
    """How prompts become token ids (`models.chat.PromptFormatter`, the one path of SFT, rollout, teachers and
    eval). One setting for every domain for now; a per-domain override (e.g. a different user_suffix for math and
    code) would go on DomainSpec and be merged here."""

    enabled: bool = Field(False, description="Render every prompt with the tokenizer's chat template (a string "
                          "prompt becomes one user message; chat-message prompts are rendered as given), with the "
                          "generation prompt, and stop generation on the template's end-of-turn token too; "
                          "chat-message datasets need it. false = raw prompt strings tokenised as they are (the "
                          "synthetic domains).")
    system_prompt: str | None = Field(None, description="A system message put before the messages of every prompt "
                                      "that has none of its own; None = no system message.")
    user_suffix: str | None = Field(None, description="Text appended verbatim to the last user message, e.g. "
                                    "\" Please put your final answer in \\boxed{}.\" (include the leading "
                                    "space or newline you want).")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra variables for the chat template, e.g. {enable_thinking: false}.")
    chat_template: str | None = Field(None, description="Path to a Jinja chat-template file used instead of the "
                                      "tokenizer's own (base models without one). The fingerprint names the file "
                                      "by path: give an edited template a new file name.")

    @model_validator(mode="after")
    def _template_path(self) -> "ChatConfig":
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("data.chat.chat_template is empty: give the path of a Jinja template file or leave it "
                             "unset to use the tokenizer's template")
        return self


class DataConfig(_Model):
    domains: list[DomainSpec] = Field(description="The domains of the recipe; one expert/teacher each.")
    max_prompt_tokens: int = Field(32, ge=1, description="Prompts longer than this (as the rollout renders them, "
                                   "chat template included) are a pre-flight error, or dropped with "
                                   "filter_overlong_prompts.")
    # left out of the dump while false: the default changes nothing, so fingerprints stay
    filter_overlong_prompts: bool = Field(False, exclude_if=lambda v: not v, description="Drop the dataset rows "
                                          "whose prompt is over max_prompt_tokens (counted and logged per domain, "
                                          "as verl's data.filter_overlong_prompts) instead of failing the "
                                          "pre-flight on the first; synthetic domains and benchmarks still fail.")
    # left out of the dump (and so of every fingerprint) while disabled: the settings change nothing then, and
    # configs without the section keep the identity they had before it existed
    chat: ChatConfig = Field(default_factory=ChatConfig, exclude_if=lambda c: not c.enabled,
                             description="Chat formatting of the prompts (system prompt, user suffix, template).")

    @model_validator(mode="after")
    def _unique(self) -> "DataConfig":
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise ValueError(f"data.domains has duplicate names {names}")
        if not names:
            raise ValueError("data.domains is empty; add at least one domain")
        return self


_COMMON_SCHEDULERS = {"linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial"}


class SFTConfig(_Model):
    steps: int = Field(700, ge=0, description="Optimizer steps of mixed-domain SFT (TRL SFTTrainer).")
    batch_size: int = Field(64, ge=1, description="Examples per optimizer step.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (AdamW).")
    warmup_ratio: float = Field(0.05, ge=0, le=1, description="Linear warm-up fraction of steps.")
    lr_scheduler: str = Field("constant_with_warmup", description="transformers scheduler name.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    mix: dict[str, float] | None = Field(None, description="Domain mix of the SFT data {domain: weight}; "
                                         "None = the data.domains weights.")
    num_examples: int | None = Field(None, ge=1, description="Distinct SFT examples; None = steps×batch.")
    logging_steps: int = Field(50, ge=1, description="Log every N steps.")
    eval_every: int = Field(0, ge=0, description="Greedy held-out accuracy every N steps (0 = only at the "
                            "end); shows where SFT sits on its learning curve.")
    eval_size: int | None = Field(None, ge=1, description="Eval prompts per domain during SFT; None = all.")

    @model_validator(mode="after")
    def _scheduler_known(self) -> "SFTConfig":
        _check_weights("sft.mix", self.mix)
        if self.lr_scheduler not in _COMMON_SCHEDULERS:
            from transformers import SchedulerType  # only for an unusual name: the import costs ~1 s

            known = [t.value for t in SchedulerType]
            if self.lr_scheduler not in known:
                raise ValueError(f"lr_scheduler={self.lr_scheduler!r} is not a transformers scheduler; use one "
                                 f"of {known}")
        return self

    @model_validator(mode="after")
    def _eval_on_log_steps(self) -> "SFTConfig":
        if self.eval_every and self.eval_every % self.logging_steps:
            raise ValueError(f"sft.eval_every={self.eval_every} must be a multiple of sft.logging_steps="
                             f"{self.logging_steps} (evaluation runs at logging steps)")
        return self


class RolloutConfig(_Model):
    backend: Literal["hf", "hf_graphed", "vllm", "served"] = Field(
        "hf", description="Generation engine: `hf` (transformers forward with KV cache, any device), `hf_graphed` "
        "(the same with a static KV cache and the decode step captured as a CUDA/NPU graph, for GPUs/NPUs "
        "without vLLM: the eager engine's samples for a seed up to the kernels' rounding; sdpa or eager "
        "attention, full-attention models, no FSDP2; uncaptured on cpu), `vllm` "
        "(in-process, GPU/NPU) or `served` (rollout.servers vLLM OpenAI servers started for the stage, the "
        "trainer's weights sent after every update; python, start-up timeout and CPU KV cache as teachers.*).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature; behaviour log-probs use it too.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1 = off). Truncation (top_p < 1, "
                         "top_k > 0 or min_p > 0): the engines report the processed log-probs of the truncated, "
                         "renormalised distribution sampled from (vLLM logprobs_mode=processed_logprobs); the "
                         "expert/MOPD update recomputes the behaviour log-probs with the trainer's model (the "
                         "untruncated log_softmax(logits / temperature), as verl's old_log_prob and TRL) before the "
                         "PPO ratio and the reverse-KL advantage use them; rollout/trunc_logp_gap logs the "
                         "difference per token (≥ 0).")
    # top_k / min_p are left out of the dump while off, so configs without them keep their stage fingerprints
    top_k: int = Field(0, ge=0, exclude_if=lambda v: v == 0, description="Sample among the k most likely tokens "
                       "(0 = off); training rollouts too. Behaviour log-probs as for top_p.")
    min_p: float = Field(0.0, ge=0, lt=1, exclude_if=lambda v: v == 0, description="Drop tokens with p < min_p · "
                         "p_max (0 = off); applied before top_k and top_p (vLLM's order). Behaviour log-probs as "
                         "for top_p.")
    max_new_tokens: int = Field(12, ge=1, description="Completion budget; unfinished samples are truncated.")
    batch_size: int | None = Field(None, ge=1, description="Sequences per generation call; None = all at once.")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="vllm backend: fraction of device memory the engine may take (weights + KV "
        "cache); None = 0.3, leaving the rest to training in colocated placement.")
    sleep_level: Literal[1, 2] = Field(1, description="vllm backend: 1 = offload weights to host while asleep, "
                                       "2 = discard them (re-sent from the trainer on wake).")
    # the served-backend fields are left out of the dump at their defaults: configs without them keep their stage
    # fingerprints
    servers: int = Field(1, ge=1, exclude_if=lambda v: v == 1,
                         description="served backend: student servers sharing the rollout requests.")
    restarts: int = Field(2, ge=0, exclude_if=lambda v: v == 2,
                          description="served backend: restarts of a dead or hung student server (its request is "
                          "sent again); 0 = fail at once naming the server.")
    request_timeout_s: float = Field(300.0, gt=0, exclude_if=lambda v: v == 300.0,
                                     description="served backend: timeout of one sample's request.")
    server_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", exclude_if=lambda v: v == "float32",
        description="served backend: vLLM --dtype of the student servers (float32 on CPU matches the trainer's "
        "log-probs).")
    # left out of the dump while false, so configs without it keep their stage fingerprints
    ignore_eos: bool = Field(
        False, exclude_if=lambda v: not v, description="Sample every completion to rollout.max_new_tokens, "
        "past EOS and the end-of-turn token (vLLM's SamplingParams.ignore_eos): fixed, real lengths for "
        "benchmarks of random-weight models (configs/gpu_scale.yaml); the stop token still counts as the end for "
        "truncation flags. Training rollouts only (eval stops as usual).")
    engine_process: Literal["inprocess", "separate"] = Field(
        "inprocess", description="vllm backend: engine in the trainer's process (weights handed over as the same "
        "tensors, 0 bytes) or its own process (bucketed CUDA IPC handles / NPU host shared memory).")

    @model_validator(mode="after")
    def _ignore_eos(self) -> "RolloutConfig":
        if self.ignore_eos and self.backend in ("vllm", "served"):
            raise ValueError(f"rollout.ignore_eos=true is implemented for the in-process samplers only (got "
                             f"rollout.backend={self.backend}); set rollout.backend=hf or rollout.ignore_eos=false")
        return self

    @property
    def truncates(self) -> bool:
        """Whether sampling drops tokens (top_p < 1, top_k > 0 or min_p > 0): then the engines' behaviour log-probs
        are the processed ones and the policy loop recomputes them with the trainer's model."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


# "skip", not "off": YAML reads a bare off as false
CompatMode = Literal["fail", "warn", "skip"]


class CompatConfig(_Model):
    """The MOPD stage's compatibility pre-flight of every teacher against the student (tokenizer, chat template,
    EOS, determinism, log-prob mode, temperature), after the teachers are open and before any compute; its table
    goes to `<stage>/compat.md` and the stage's MLflow run. Each check: `fail` stops the stage naming teacher,
    value and fix; `warn`
    logs the same line and trains; `skip` does not run it (its row says so). Not part of any fingerprint."""

    tokenizer: CompatMode = Field("fail", description="Same tokenizer fingerprint as the student (a different one "
                                  "is reported as 'needs mapping').")
    chat_template: CompatMode = Field("fail", description="The teacher's chat template renders a probe "
                                      "conversation like the student's (role markers, generation prompt); with "
                                      "data.chat.enabled=false no template is rendered and the row is skipped.")
    eos: CompatMode = Field("fail", description="The teacher's mean log p(stop token) at the student's stop "
                            "position after the probe rows' reference answers ≥ min_eos_logprob.")
    determinism: CompatMode = Field("fail", description="The same probe scored twice (local: two forwards; http: "
                                    "two requests) gives the same log-probs within determinism_tol.")
    logprob_mode: CompatMode = Field("fail", description="The teacher returns normalised log-probs of its own "
                                     "distribution: local, the scoring path (train.logprob_impl, with the model's "
                                     "logit transform) equals log_softmax of its forward within logprob_tol; http, "
                                     "the top-k log-probs are ≤ 0 and sum to ≤ 1 (not vLLM's logits modes).")
    temperature: CompatMode = Field("fail", description="teachers.temperature (1 for http teachers: vLLM's "
                                    "prompt_logprobs ignore it) equals rollout.temperature, so ℓ^old − ℓᵀ compares "
                                    "distributions at the same temperature.")
    min_eos_logprob: float = Field(-10.0, lt=0, description="eos: lowest mean teacher log p(stop token) that "
                                   "passes (nats; -10 ≈ p 4.5e-5).")
    determinism_tol: float = Field(1e-4, ge=0, description="determinism: largest |Δ log p| between the two "
                                   "scorings.")
    logprob_tol: float = Field(1e-3, gt=0, description="logprob_mode: largest |Δ log p| to the forward's "
                            "log_softmax (local), or excess of the top-k's logsumexp over 0 (http).")
    probe_rows: int = Field(4, ge=1, description="Held-out prompts per teacher (of the domains it scores) with "
                            "their reference answers as probe completions.")


class TeachersConfig(_Model):
    backend: Literal["local", "http"] = Field("local", description="`local`: in-process scoring; `http`: "
                                              "vLLM OpenAI servers with prompt_logprobs.")
    routing: Literal["domain", "mixture"] = Field("domain", description="`domain`: each sample scored by "
                                                  "the teacher of its teacher_id; `mixture`: weighted mix.")
    mixture_kind: Literal["arithmetic", "geometric"] = Field("arithmetic", description="Arithmetic: log Σ w·p; "
                                                             "geometric: Σ w·log p (a product of experts).")
    mixture_weights: dict[str, float] | None = Field(None, description="{teacher: weight} for mixture "
                                                     "routing; None = uniform.")
    domain_mixture_weights: dict[str, dict[str, float]] | None = Field(
        None, description="Per-domain {domain: {teacher: weight}}; overrides mixture_weights for that domain.")
    temperature: float = Field(1.0, gt=0, description="Teacher softmax temperature when scoring.")
    offload: bool = Field(True, description="Keep teachers in CPU memory except while they score.")
    placement: Literal["driver", "workers"] = Field(
        "driver", description="Local teachers: `driver` — in the loop's process, on its device; `workers` — "
        "with runtime.strategy ddp/fsdp2, one Ray actor per teacher on the training workers' devices (teacher i "
        "on worker i mod num_workers), asked at the same time. Same scores either way.")
    batch_size: int | None = Field(None, ge=1, description="Sequences per teacher forward; None = all.")
    endpoints: dict[str, str] | None = Field(None, description="http backend: {teacher_id: url}.")
    serve_python: str = Field(".venv-vllm/bin/python", description="http backend, served teachers: python of "
                              "the vLLM environment (runs `-m vllm.entrypoints.openai.api_server`); a relative "
                              "path resolves against the working dir, then the project root. Build it with "
                              "infra/vllm_venv.sh.")
    max_logprobs: int = Field(20, ge=1, description="Server --max-logprobs: the largest top-k a scoring request "
                              "may ask (must be ≥ mopd.jsd_top_k for kd_loss=jsd).")
    max_concurrency: int = Field(4, ge=1, description="http backend: concurrent scoring requests per teacher.")
    request_batch_size: int = Field(8, ge=1, description="http backend: sequences per /v1/completions request "
                                    "(a list prompt; the server batches them).")
    request_timeout_s: float = Field(120.0, gt=0, description="http backend: timeout of one scoring request.")
    retries: int = Field(3, ge=0, description="http backend: retries of a request on transient failures "
                         "(connection refused/reset, timeouts, HTTP 5xx), exponential backoff; 4xx never retried.")
    restarts: int = Field(2, ge=0, description="Served teachers: restarts of a dead server per teacher (the "
                          "batch is scored again after each); 0 = fail at once naming the teacher.")
    startup_timeout_s: float = Field(300.0, gt=0, description="Served teachers: seconds to wait for a server's "
                                     "/health after launch.")
    server_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="Served teachers: vLLM --dtype (float32 on CPU matches the local backend).")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Served teachers on GPU: vLLM "
                                                 "--gpu-memory-utilization; None = vLLM's default.")
    tensor_parallel_size: int = Field(1, ge=1, description="Served teachers: vLLM --tensor-parallel-size.")
    kv_cache_gib: int = Field(1, ge=1, description="Served teachers on CPU: VLLM_CPU_KVCACHE_SPACE (GiB of KV "
                              "cache per server; vLLM's default asks for most of the RAM).")
    score_cache: bool = Field(True, description="Keep every teacher score in `<stage>/teacher_cache/`, keyed by "
                              "the teacher's identity (weights, tokenizer, temperature, dtype), what is asked and "
                              "the row's token ids: a resumed or replayed step and a rerun after a crash score "
                              "nothing twice (teachers whose weights are not known here are not cached; "
                              "docs/teachers.md).")
    score_cache_gb: float = Field(2.0, gt=0, description="teachers.score_cache: size bound of the folder; past it "
                                  "the least recently used segments are removed.")
    # left out of the dump at their defaults: configs without them keep their fingerprints
    share_prefix: bool = Field(False, exclude_if=lambda v: not v, description="Local teachers: prefill each "
                               "distinct prompt of a micro-batch once and score its group's completions from that "
                               "KV cache (the same numbers up to float rounding; keep teachers.batch_size a "
                               "multiple of the group size). vLLM servers cannot: docs/teachers.md.")
    conflict: Literal["none", "mask", "consensus"] = Field(
        "none", exclude_if=lambda v: v == "none", description="routing=mixture: where the teachers' advantages at "
        "the sampled token differ in sign by more than conflict_nats — `mask` zeroes the distillation advantage, "
        "`consensus` takes the target of the teacher with the smallest advantage magnitude (docs/objectives.md).")
    conflict_nats: float = Field(1.0, gt=0, exclude_if=lambda v: v == 1.0, description="teachers.conflict: spread "
                                 "max_k ℓ_k − min_k ℓ_k (nats) above which opposite-sign teachers are in conflict.")
    compat: CompatConfig = Field(default_factory=CompatConfig, exclude_if=lambda v: v == CompatConfig(),
                                 description="What the compatibility pre-flight checks and how strictly.")
    cross_tokenizer: list[str] = Field(
        default_factory=list, exclude_if=lambda v: not v, description="Teachers allowed a tokenizer and chat "
        "template other than the student's: each sample is re-rendered in the teacher's template and tokenized by its "
        "tokenizer, and its log-probs are mapped back onto the student's tokens by character offsets (exact sequence "
        "sums; docs/cross_tokenizer.md). Needs mopd.kd_loss=sampled_rkl. Empty = every teacher must share the "
        "student's tokenizer.")


class TrainConfig(_Model):
    """How the RL/MOPD update computes (not what it optimises): results agree across choices up to float rounding,
    yet they are different numbers, so the section is part of the expert and mopd fingerprints."""

    logprob_impl: Literal["chunked", "full"] = Field(
        "chunked", description="Log-probs, entropy, teacher top-k and the JSD support of the trainer and local "
        "teachers: `chunked` projects final hidden states through lm_head in tiles, recomputed in backward (memory "
        "grows with tokens·hidden, never tokens·vocab); `full` materialises the [B,T,V] log-softmax (comparison).")
    # Like logprob_impl it only changes how the minibatch's token-mean is summed, yet the sum comes out in another
    # float order, so it is fingerprinted too (recipe.train_fingerprint_part leaves it out while it is None, so
    # configs without it keep the identity they had before it existed).
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, description="Token budget of one RL/MOPD forward/backward: a minibatch's rows, longest first, "
        "are grouped so that rows × (longest prompt + longest completion) stays within it, each micro-batch padded "
        "only to its own longest row (a longer row gets one of its own); replaces the section's micro_batch_size. "
        "None = micro_batch_size rows per micro-batch at the batch's full width.")


    packing: bool = Field(
        False, description="Run each RL/MOPD micro-batch's rows back to back without padding (positions restart per "
        "row; a block-diagonal attention mask, or flash-attention's varlen path when the model uses "
        "attn_implementation=flash_attention_2); with train.max_tokens_per_micro_batch the budget then counts real "
        "tokens. The same loss as the padded computation up to float rounding.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward (transformers' gradient "
        "checkpointing, non-reentrant) in SFT, expert and MOPD training: activation memory of about one layer "
        "instead of all of them for ~30 % more compute; the gradients are the same (not fingerprinted).")
    # how the update computes, not what — but fused kernels round differently, so like packing it is part of the
    # identity when on (left out of the dump while off: configs without it keep their fingerprints)
    compile: bool = Field(
        False, exclude_if=lambda v: not v, description="torch.compile each decoder layer of the trained model "
        "for training (`models.compile_decoder_layers`: fused norms, rotary, SwiGLU and casts, one graph reused by "
        "every layer; sampling and eval stay eager); the first update pays the compilation (tens of seconds), later "
        "ones run faster. CUDA (inductor); ignored on cpu and npu (runtime.device.compile_backend).")
    fsdp_cpu_offload: bool = Field(
        False, description="runtime.strategy=fsdp2: each rank's parameter, gradient and AdamW shards live in host "
        "memory (torch FSDP2 CPUOffloadPolicy, pinned on GPU/NPU); each unit is gathered to the device for its "
        "forward/backward and the optimizer steps on the CPU. Device memory drops to the gathered units and the "
        "activations, for host↔device traffic every step; the same numbers (not fingerprinted).")


class LoRAConfig(_Model):
    """LoRA on the policy (PEFT `LoraConfig`): the base weights stay frozen and only the low-rank adapters train
    and are checkpointed; the rollout engine, `final/` and every later stage get the merged weights (a plain HF
    model)."""

    r: int = Field(16, ge=1, description="Adapter rank (PEFT `r`).")
    alpha: float = Field(32.0, gt=0, description="Adapter scale numerator (PEFT `lora_alpha`): the update is "
                         "(alpha / r) · B·A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input in training (PEFT "
                           "`lora_dropout`). Rollout samples without it, so > 0 makes the PPO ratio noisy; 0 for RL.")
    target_modules: list[str] | None = Field(
        None, description="Module names (or name suffixes) that get adapters, e.g. [q_proj, v_proj]; None = every "
        "linear layer but the output head (PEFT's `all-linear`: the attention and MLP projections).")


def _check_weights(name: str, table: dict[str, float] | None) -> None:
    """A weight table (a mix, mixture weights): every weight ≥ 0 and at least one > 0."""
    if not table:
        return
    bad = {k: v for k, v in table.items() if not v >= 0}
    if bad:
        raise ValueError(f"{name} has negative weights {bad}; weights are shares ≥ 0")
    if not any(v > 0 for v in table.values()):
        raise ValueError(f"{name}={table} gives zero weight to everything; set a weight > 0")


class PolicyLoopConfig(_Model):
    """The one on-policy loop: expert RL (w_kd=0, no teachers) and MOPD (teachers ± reward)."""

    steps: int = Field(200, ge=0, description="Policy updates (one rollout batch each).")
    prompts_per_step: int = Field(32, ge=1, description="Distinct prompts per step.")
    group_size: int = Field(8, ge=1, description="Samples per prompt (the GRPO group).")
    lr: float = Field(2e-4, gt=0, description="AdamW peak learning rate (after warm-up; lr_schedule from there).")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in optimizer steps (a stage takes steps × "
                              "minibatches of them).")
    # left out of the dump at their defaults, so configs that do not set them keep their stage fingerprints
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", exclude_if=lambda v: v == "constant", description="The learning rate after warm-up: constant, "
        "or decayed (linear, cosine) to min_lr_ratio · lr at the stage's last optimizer step (steps × minibatches). "
        "A constant rate leaves the final weights wherever the noisy plateau happens to be at the last step.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, exclude_if=lambda v: v == 0.0,
                                description="lr_schedule linear/cosine: the final learning rate as a share of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    minibatches: int = Field(1, ge=1, description="Optimizer steps per rollout batch (PPO minibatches); "
                             "1 = fully on-policy.")
    micro_batch_size: int | None = Field(None, ge=1, description="Sequences per forward/backward "
                                         "(gradient accumulation); None = whole minibatch.")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1 (ε_lo).")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1 (ε_hi).")
    w_rl: float = Field(1.0, ge=0, description="Weight of the verifiable-reward GRPO advantage.")
    w_kd: float = Field(0.0, ge=0, description="Weight of the distillation advantage (teacher − behaviour).")
    kd_loss: Literal["sampled_rkl", "jsd", "topk_rkl", "full_jsd"] = Field(
        "sampled_rkl", description="`sampled_rkl`: reverse KL on the sampled token as a per-token advantage "
        "(MiMo-V2-Flash); `jsd`: direct generalised JSD over teacher top-k (TRL GKD style); `topk_rkl`: Open-MOPD's "
        "dense reverse KL over kd_top_k candidates per position, weighted by the student's renormalised "
        "probabilities, a PPO ratio per candidate; `full_jsd`: exact JSD_β (jsd_beta) over the whole vocabulary, "
        "chunked (local teachers, domain routing).")
    # the fields below are left out of the dump at their defaults: configs without them keep their fingerprints
    kd_top_k: int = Field(16, ge=1, exclude_if=lambda v: v == 16, description="kd_loss=topk_rkl: candidates per "
                          "position (K; Open-MOPD uses 16).")
    kd_candidates: Literal["student", "teacher", "union"] = Field(
        "student", exclude_if=lambda v: v == "student", description="kd_loss=topk_rkl: the candidate set — the "
        "student's top-K (Open-MOPD's only_stu), the teacher's top-K, or their union (up to 2K).")
    gap_following: bool = Field(False, exclude_if=lambda v: not v, description="Scale each domain's distillation "
                                "advantage by clip(m_d / mean(m), gap_clip) with m_d the running teacher–student gap "
                                "of the domain (Open-MOPD); composes with balance=tokens.")
    gap_clip: tuple[float, float] = Field((0.05, 20.0), exclude_if=lambda v: tuple(v) == (0.05, 20.0),
                                          description="gap_following: [low, high] clip of the per-domain scale.")
    gap_momentum: float = Field(0.9, ge=0, lt=1, exclude_if=lambda v: v == 0.9, description="gap_following: EMA "
                                "momentum of the per-domain gap m_d (0 = this batch's gap only).")
    reward_refresh: bool = Field(False, exclude_if=lambda v: not v, description="With minibatches > 1: recompute the "
                                 "distillation advantage against the current student before each inner minibatch "
                                 "update (teacher log-probs reused; Open-MOPD's M4). kd_loss sampled_rkl|topk_rkl.")
    kd_clip: float | None = Field(5.0, gt=0, description="Clip of the per-token distillation advantage (c).")
    jsd_beta: float = Field(1.0, ge=0, le=1, description="β of the JSD loss: 0 forward KL, 1 reverse KL.")
    jsd_top_k: int = Field(8, ge=1, description="Teacher top-k forming the JSD support (+ sampled + tail).")
    scale_by_std: bool = Field(True, description="GRPO: divide by the group's reward std.")
    balance: Literal["none", "tokens"] = Field("none", description="Token-share balancing across teachers: "
                                               "`tokens` makes each teacher's loss share match its prompt share.")
    mix: dict[str, float] | None = Field(None, description="Prompt mix {domain: weight}; None = data weights.")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0 = only at the end).")
    eval_size: int | None = Field(None, ge=1, description="Eval prompts per domain during training; None = all.")
    save_every: int = Field(50, ge=1, description="Checkpoint (weights + optimizer + step) every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (oldest deleted).")
    # left out of the dump while None, so configs without LoRA keep their stage fingerprints
    lora: LoRAConfig | None = Field(None, exclude_if=lambda v: v is None, description="Train low-rank adapters "
                                    "instead of every weight (set it, even to {}, to enable; None = full "
                                    "fine-tuning). runtime.strategy=single only.")


    @model_validator(mode="after")
    def _degenerate(self) -> "PolicyLoopConfig":
        """Numbers the loop would accept and silently waste: checked here, before any stage writes."""
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={list(self.betas)}: each AdamW beta must be in [0, 1), e.g. [0.9, 0.999]")
        if self.w_rl > 0 and self.group_size < 2:
            raise ValueError(f"group_size={self.group_size} with w_rl={self.w_rl}: a group of one sample has no "
                             "baseline, so every reward advantage is 0; set group_size ≥ 2 (or w_rl=0)")
        rows = self.prompts_per_step * self.group_size
        if self.minibatches > rows:
            raise ValueError(f"minibatches={self.minibatches} exceeds the {rows} samples of a step (prompts_per_step"
                             " × group_size); set minibatches ≤ that")
        if self.steps and self.warmup_steps > self.steps * self.minibatches:
            raise ValueError(f"warmup_steps={self.warmup_steps} > the stage's {self.steps * self.minibatches} "
                             "optimizer steps (steps × minibatches): the learning rate would never reach lr; lower "
                             "warmup_steps")
        if self.lr_schedule == "constant" and self.min_lr_ratio:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} has no effect with lr_schedule=constant; set "
                             "lr_schedule=cosine (or linear), or min_lr_ratio=0 (a preset's "
                             "value too: --set <stage>.min_lr_ratio=0)")
        for name, table in (("mix", self.mix),):
            _check_weights(name, table)
        return self

    def recovery_targets(self, domains: list[str] | None) -> dict[str, float]:
        """{domain: recovery at which its sampling stops} (`MOPDConfig.stop_at_recovery`; none here)."""
        return {}


class ExpertRLConfig(PolicyLoopConfig):
    domains: list[str] | None = Field(None, description="Domains to train an expert for; None = all.")


class MOPDConfig(PolicyLoopConfig):
    w_rl: float = Field(0.0, ge=0, description="Weight of the GRPO reward advantage (0 = pure distillation).")
    w_kd: float = Field(1.0, ge=0, description="Weight of the teacher distillation advantage.")
    # dense top-K by default: the per-position expectation of the sampled-token advantage, less noise per sample
    # (docs/objectives.md, "Why the default is dense"); `sampled_rkl` stays for Ray workers and the async pipeline
    kd_loss: Literal["sampled_rkl", "jsd", "topk_rkl", "full_jsd"] = Field(
        "topk_rkl", description=PolicyLoopConfig.model_fields["kd_loss"].description + " Default: `topk_rkl` "
        "where it runs (one process, local teachers of the student's tokenizer, not async), else `sampled_rkl`.")
    # changes which prompts later steps sample, so it is part of the fingerprint — left out of the dump while
    # None, so configs without it keep their stage fingerprints
    stop_at_recovery: float | dict[str, float] | None = Field(
        None, exclude_if=lambda v: v is None, description="End a domain's sampling once its recovery (student − "
        "SFT) / (expert − SFT) on a mid-training eval (mopd.eval_every) reaches this value (one number for every "
        "domain, or {domain: value} for those named), each in (0, 1.5]; the stage ends when every gated domain "
        "has stopped. SFT and expert accuracies come from their stages' records. None = train all steps.")

    @model_validator(mode="after")
    def _recovery_targets(self) -> "MOPDConfig":
        if self.stop_at_recovery is not None and not self.eval_every:
            raise ValueError("stop_at_recovery acts on the mid-training evals, but eval_every=0 (only a final "
                             "eval); set mopd.eval_every > 0 (e.g. 10)")
        for d, v in self.recovery_targets(None).items():
            if not 0 < v <= 1.5:
                where = "stop_at_recovery" + (f".{d}" if isinstance(self.stop_at_recovery, dict) else "")
                raise ValueError(f"{where}={v} is outside (0, 1.5]: recovery is (student − SFT) / (expert − SFT), "
                                 "1 = the expert's accuracy; give e.g. 0.9")
        return self

    def recovery_targets(self, domains: list[str] | None) -> dict[str, float]:
        """{domain: recovery at which its sampling stops}: `stop_at_recovery` as a table over `domains` (one
        number: every domain; None: none)."""
        v = self.stop_at_recovery
        if v is None:
            return {}
        if isinstance(v, dict):
            return dict(v)
        return {d: float(v) for d in (domains if domains is not None else ["*"])}


class EvalConfig(_Model):
    """Held-out evaluation of the domains without `eval_sources`; a domain with them is scored on its benchmarks
    (their own sampling), with `max_new_tokens`, `eval_size` (a cap on each benchmark's rows) and `batch_size`
    from here."""

    greedy: bool = Field(True, description="Greedy accuracy on the held-out prompts.")
    mean_at_k: int = Field(0, ge=0, description="Also sample k completions per prompt and report mean@k.")
    temperature: float = Field(1.0, gt=0, description="Temperature of the mean@k samples.")
    max_new_tokens: int | None = Field(None, ge=1, description="None = rollout.max_new_tokens.")
    eval_size: int | None = Field(None, ge=1, description="Prompts per domain; None = the domain's eval set.")
    batch_size: int = Field(256, ge=1, description="Prompts per generation call.")


class AsyncConfig(_Model):
    """`runtime.placement: async` — generation and teacher scoring run ahead of the trainer, at most
    `max_staleness` weight versions behind (decoupled PPO corrects for the stale samples)."""

    max_staleness: int = Field(1, ge=0, description="k: a step's samples may come from weights up to k versions "
                               "(updates) behind the trainer's; step s is generated by version s − k (AReaL's "
                               "max_head_offpolicyness gate), so nothing older reaches the trainer (the queue would "
                               "drop and count it). 0 = the synchronous loop's steps exactly.")
    queue_size: int | None = Field(None, ge=1, description="Scored steps buffered ahead of the trainer (generation "
                                   "blocks while full); None = max(1, max_staleness).")
    timeout_s: float = Field(1800.0, gt=0, description="Longest the trainer waits for a step's samples before it "
                             "fails naming the stalled producer.")
    is_cap: float = Field(2.0, gt=0, description="Decoupled PPO: cap of the importance weight π_prox/π_behav "
                          "(stale samples only).")
    is_mode: Literal["truncate", "mask"] = Field("truncate", description="Decoupled PPO: `truncate` clips the "
                                                 "importance weight at is_cap; `mask` drops tokens above it.")


class RecipeConfig(_Model):
    # `async` is a Python keyword: the section is the field `async_`, read and written as `async`
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    name: str = Field("tiny", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                      description="Recipe name: output folder, MLflow experiment, registered-model prefix.")
    seed: int = Field(0, description="Seeds every stage (data order, init, sampling).")
    output_dir: str = Field("runs", description="Root folder; the recipe writes <output_dir>/<name>/<stage>.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig, description="Device and placement.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Base model and tokenizer.")
    data: DataConfig = Field(description="Domains: prompt sources and verifiers.")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="Mixed-domain SFT.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Sampling of the policy.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="How RL/MOPD updates and local teachers "
                               "compute (log-prob implementation).")
    expert: ExpertRLConfig = Field(default_factory=ExpertRLConfig, description="Per-domain expert GRPO.")
    teachers: TeachersConfig = Field(default_factory=TeachersConfig, description="Teacher scoring/routing.")
    mopd: MOPDConfig = Field(default_factory=MOPDConfig, description="Multi-teacher on-policy distillation.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async", exclude_if=lambda v: v == AsyncConfig(),
                                description="Asynchronous pipeline (runtime.placement=async).")
    # Multi-round MOPD (Nemotron 3 Ultra): left out of dumps at their defaults, so a one-round config reads, logs
    # and hashes as before these fields existed
    rounds: int = Field(1, exclude_if=lambda v: v == 1,
                        description="MOPD rounds. Round 1 is sft → experts → student; each round r ≥ 2 re-trains "
                        "every expert by expert RL from round r−1's student and distils a new student from them "
                        "(written under <output_dir>/<name>/r<r>/, registered as <name>-r<r>-expert-<domain> and "
                        "<name>-r<r>-student). 1 = the single-round recipe.")
    round_student_init: Literal["sft", "previous"] | None = Field(
        None, exclude_if=lambda v: v is None,
        description="Where the student of round r ≥ 2 starts: `previous` = round r−1's student (continued), "
                    "`sft` = the SFT model (a fresh student distilled from the new experts). Empty = previous; "
                    "only meaningful with rounds ≥ 2.")

    @model_validator(mode="after")
    def _default_objective(self) -> "RecipeConfig":
        """mopd.kd_loss left unset: the dense `topk_rkl` where it runs (one process, in-process teachers of the
        student's tokenizer, a synchronous loop), else the sampled-token `sampled_rkl` — so a config that only
        changes the serving, the placement or the strategy gets the objective that runs there, not a refusal. A
        value the user sets is kept (and refused with its fix where it cannot run)."""
        if "kd_loss" in self.mopd.model_fields_set:
            return self
        t, rt = self.teachers, self.runtime
        if t.backend == "http" or t.cross_tokenizer or rt.strategy != "single" or rt.placement == "async":
            self.mopd.kd_loss = "sampled_rkl"
            self.mopd.model_fields_set.discard("kd_loss")  # still the default: a later override resolves again
        return self

    @model_validator(mode="after")
    def _cross(self) -> "RecipeConfig":
        names = {d.name for d in self.data.domains}
        for field_name, mix in (("sft.mix", self.sft.mix), ("expert.mix", self.expert.mix),
                                ("mopd.mix", self.mopd.mix)):
            for k in mix or {}:
                if k not in names:
                    raise ValueError(f"{field_name} names unknown domain '{k}'; known: {sorted(names)}")
        if isinstance(self.mopd.stop_at_recovery, dict):
            for k in self.mopd.stop_at_recovery:
                if k not in names:
                    raise ValueError(f"mopd.stop_at_recovery names unknown domain '{k}'; known: {sorted(names)} — "
                                     "name a domain of data.domains or give one number for all")
        for k in self.expert.domains or []:
            if k not in names:
                raise ValueError(f"expert.domains names unknown domain '{k}'; known: {sorted(names)}")
        for k in self.teachers.mixture_weights or {}:
            if k not in names:
                raise ValueError(f"teachers.mixture_weights names unknown teacher '{k}'; known: {sorted(names)}")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds}: the recipe needs at least one round; set rounds=1 (one MOPD "
                             "round) or more")
        _check_weights("teachers.mixture_weights", self.teachers.mixture_weights)
        for d, table in (self.teachers.domain_mixture_weights or {}).items():
            if d not in names:
                raise ValueError(f"teachers.domain_mixture_weights names unknown domain '{d}'; known: "
                                 f"{sorted(names)}")
            _check_weights(f"teachers.domain_mixture_weights.{d}", table)
            for k in table:
                if k not in names:
                    raise ValueError(f"teachers.domain_mixture_weights.{d} names unknown teacher '{k}'; known: "
                                     f"{sorted(names)}")
        for k in self.teachers.cross_tokenizer:
            if k not in names:
                raise ValueError(f"teachers.cross_tokenizer names unknown teacher '{k}'; known: {sorted(names)}")
        if self.teachers.cross_tokenizer and self.mopd.kd_loss != "sampled_rkl":
            raise ValueError(f"teacher '{self.teachers.cross_tokenizer[0]}' is in teachers.cross_tokenizer (its own "
                             f"tokenizer) but mopd.kd_loss={self.mopd.kd_loss} compares distributions over one shared "
                             "vocabulary — use mopd.kd_loss=sampled_rkl, or a teacher with the student's tokenizer")
        if self.teachers.cross_tokenizer and self.teachers.conflict != "none":
            raise ValueError(f"teachers.conflict={self.teachers.conflict} compares the teachers' log-probs token by "
                             f"token, but teacher '{self.teachers.cross_tokenizer[0]}' (teachers.cross_tokenizer) "
                             "has exact log-probs only over spans of tokens — set teachers.conflict=none")
        unread = unread_settings(self)
        if unread:
            raise ValueError(unread[0])
        if self.rounds == 1 and self.round_student_init is not None:
            raise ValueError(f"round_student_init={self.round_student_init} has no effect with rounds=1 (round 1's "
                             "student always starts from SFT); set rounds ≥ 2 or remove round_student_init")
        return self

    def check_teacher_ids(self, teacher_ids) -> None:
        """A teacher named after no domain would never score a sample (routing and mixture weights go by domain
        name): refused, naming it, before anything loads."""
        names = self.domain_names()
        extra = sorted(set(teacher_ids) - set(names))
        if extra:
            raise ConfigError(f"teacher(s) {extra} belong to no domain of data.domains {names}: each teacher is "
                              "named after the domain it scores — rename it or drop it")

    def student_init_of_round(self) -> str:
        """`round_student_init` with its default: where a round r ≥ 2 student starts (`sft` | `previous`)."""
        return self.round_student_init or "previous"

    def domain_names(self) -> list[str]:
        return [d.name for d in self.data.domains]

    def dataset_readers(self) -> dict[str, list[str]]:
        """{dataset source: the domains that read it} (a file several domains share must name each row's
        teacher_id: `domains.dataset.domain_examples`)."""
        out: dict[str, list[str]] = {}
        for d in self.data.domains:
            if not d.source.startswith("synthetic:"):
                out.setdefault(d.source, []).append(d.name)
        return out

    def expert_domains(self) -> list[str]:
        """The domains that get an expert (each then a teacher): `expert.domains`, else every data domain."""
        return list(self.expert.domains or self.domain_names())

    def prompt_mix(self, stage_cfg: SFTConfig | PolicyLoopConfig) -> dict[str, float]:
        """The domain mix {domain: weight} a stage samples from: that stage's own `mix` (`stage_cfg` is
        `self.sft`, `self.expert`, `self.mopd` or a copy of one), else the data weights."""
        return dict(stage_cfg.mix) if stage_cfg.mix else {d.name: d.weight for d in self.data.domains}

    def mix_weights(self, stage_cfg: SFTConfig | PolicyLoopConfig, section: str, names: list[str]) -> list[float]:
        """`prompt_mix` as sampling weights in the order of `names`; a ConfigError naming `<section>.mix` (or
        the data weights) when every one is 0 (random.choices would fail with a bare ValueError)."""
        table = self.prompt_mix(stage_cfg)
        w = [float(table.get(n, 0.0)) for n in names]
        if sum(w) <= 0:
            where = f"{section}.mix" if stage_cfg.mix else "data.domains[].weight"
            raise ConfigError(f"{where} gives zero weight to every domain of {names}; set a weight > 0")
        return w

    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def max_seq_len(self, eval: bool = False) -> int:
        """Prompt + completion — the one place it is computed: the longest sequence the student samples and a
        teacher scores (`data.max_prompt_tokens + rollout.max_new_tokens`); `eval=True`: the longest it generates
        at evaluation too (`eval.max_new_tokens` may be larger). A model needs one position more (SFT appends
        EOS, a teacher server generates one token)."""
        new = self.rollout.max_new_tokens
        if eval:
            new = max(new, self.eval.max_new_tokens or new)
        return self.data.max_prompt_tokens + new


def _changed(section: BaseModel, fields: tuple[str, ...]) -> list[str]:
    """The `fields` of `section` that differ from their defaults (a dump round trip keeps defaults defaults, so
    this — not `model_fields_set` — says what the user changed)."""
    values = dict(section)  # a pydantic model iterates as (field, value) pairs
    return [f for f in fields if values[f] != type(section).model_fields[f].get_default(call_default_factory=True)]


# (section, fields, is it read?, what reads it) — a setting outside its mode changes nothing, so it is refused:
# the user meant something else (and a typo'd mode must not train for an hour with the setting ignored).
_DISTILL_ONLY = ("w_kd", "kd_loss", "kd_top_k", "kd_candidates", "gap_following", "gap_clip", "gap_momentum",
                 "reward_refresh", "kd_clip", "jsd_beta", "jsd_top_k", "balance", "mix")
_SECTION_RULES: list[tuple[str, tuple[str, ...], Any, str]] = [
    ("expert", _DISTILL_ONLY, lambda c: False,
     "experts train one domain on its rewards only (no teachers, no mix); set it under mopd instead"),
    ("mopd", ("kd_top_k", "kd_candidates"), lambda c: c.mopd.kd_loss == "topk_rkl", "mopd.kd_loss=topk_rkl"),
    ("mopd", ("jsd_top_k",), lambda c: c.mopd.kd_loss == "jsd", "mopd.kd_loss=jsd"),
    ("mopd", ("jsd_beta",), lambda c: c.mopd.kd_loss in ("jsd", "full_jsd"), "mopd.kd_loss=jsd or full_jsd"),
    ("mopd", ("gap_clip", "gap_momentum"), lambda c: c.mopd.gap_following, "mopd.gap_following=true"),
    ("teachers", ("mixture_kind", "mixture_weights", "domain_mixture_weights", "conflict", "conflict_nats"),
     lambda c: c.teachers.routing == "mixture", "teachers.routing=mixture"),
    ("rollout", ("servers", "restarts", "request_timeout_s", "server_dtype"),
     lambda c: c.rollout.backend == "served", "rollout.backend=served"),
    ("rollout", ("gpu_memory_utilization", "sleep_level", "engine_process"),
     lambda c: c.rollout.backend == "vllm", "rollout.backend=vllm"),
    ("eval", ("temperature",), lambda c: c.eval.mean_at_k > 0, "eval.mean_at_k > 0"),
    ("runtime", ("ray_address", "ray_placement", "ray_timeout_s"), lambda c: c.runtime.strategy != "single",
     "runtime.strategy=ddp or fsdp2"),
]


def unread_settings(cfg: "RecipeConfig") -> list[str]:
    """One line per setting changed from its default in a mode that never reads it (empty = none)."""
    out = []
    sections = {"expert": cfg.expert, "mopd": cfg.mopd, "teachers": cfg.teachers, "rollout": cfg.rollout,
                "eval": cfg.eval, "runtime": cfg.runtime}
    for sec, fields, read, reader in _SECTION_RULES:
        if not read(cfg):
            for f in _changed(sections[sec], fields):
                out.append(f"{sec}.{f} has no effect here: it is read only with {reader}" if sec != "expert" else
                           f"expert.{f} has no effect: {reader}")
    if cfg.runtime.placement != "async" and cfg.async_ != AsyncConfig():
        out.append("the async section has no effect: it is read only with runtime.placement=async; set that or "
                   "remove the section")
    return [m + ("" if "; " in m else " — remove it or switch the mode") for m in out]


# ---------------------------------------------------------------- loading, overrides, hashing


def _error_line(e: ValidationError, source: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown config key '{loc}' — remove it or fix the spelling"
    if err["type"] == "missing":
        return f"{source}: missing required config key '{loc}'"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}"


def resolve_preset(preset: str | Path) -> Path:
    """A preset name (`tiny`) or a path to a YAML file."""
    p = Path(preset)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = CONFIG_DIR / f"{preset}.yaml"
    if cand.exists():
        return cand
    known = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config preset '{preset}' not found: give a YAML path or one of {known}")


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like key.path=value (e.g. mopd.steps=50)")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    data = json.loads(json.dumps(data))  # deep copy, plain types
    for item in overrides or []:
        path, value = parse_override(item)
        node = data
        for i, part in enumerate(path[:-1]):
            if isinstance(node, list):
                node = _list_item(node, part, path[: i + 1])
                continue
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            node = nxt
        last = path[-1]
        if isinstance(node, list):
            idx = _list_index(node, last, path)
            node[idx] = value
        else:
            node[last] = value
    return data


def _list_index(node: list, part: str, path: list[str]) -> int:
    if part.isdigit() and int(part) < len(node):
        return int(part)
    names = [x.get("name") for x in node if isinstance(x, dict)]
    if part in names:
        return names.index(part)
    raise ConfigError(f"override key '{'.'.join(path)}': no list item '{part}' (have {names or len(node)})")


def _list_item(node: list, part: str, path: list[str]) -> Any:
    return node[_list_index(node, part, path)]


def config_from_dict(data: dict, source: str = "config") -> RecipeConfig:
    try:
        return RecipeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_error_line(e, source)) from None


def load_config(preset: str | Path = "tiny", overrides: list[str] | None = None) -> RecipeConfig:
    """Read a preset (name or path), apply dotted `key=value` overrides, validate."""
    path = resolve_preset(preset)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())}) — fix the file") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder named *.yaml, no permission, not UTF-8
        raise ConfigError(f"{path}: cannot read the config ({type(e).__name__}: {e}) — give a readable UTF-8 "
                          "YAML file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of config sections")
    return config_from_dict(apply_overrides(data, overrides), source=str(path))


# Bumped on purpose — and only then — when a code change alters what a stage produces from the same config and
# inputs (a loss fix, a new sampling order). It is part of every stage fingerprint and recorded in stage.json, so
# editing a comment or refactoring reuses every finished stage while a results-changing release retrains them.
# A synthetic kind that draws other data carries its own version instead (`domains.build.kind_results_version`).
RESULTS_VERSION = 1


def stage_fingerprint(*parts: Any) -> str:
    """Stable hash of config sections/inputs (+ RESULTS_VERSION): the one identity of a stage's result — the
    engine reuses, continues or sets aside stage folders by it, and the Prefect cache key is derived from it."""
    def plain(x: Any) -> Any:
        if isinstance(x, BaseModel):
            return x.model_dump(mode="json")
        return x
    blob = json.dumps([RESULTS_VERSION, *[plain(p) for p in parts]], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} → {'a.b': 1}; used for logging params. A list of mappings with distinct `name`s (the
    domains, their eval_sources) is keyed by name as the overrides address it — `data.domains.math.verifier_args.
    mode` — so every verifier argument and benchmark setting is a param of its own (not one long string)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif _named_list(v):
            for item in v:
                out.update(flatten({kk: vv for kk, vv in item.items() if kk != "name"}, f"{key}.{item['name']}."))
        else:
            out[key] = v
    return out


def _named_list(v: Any) -> bool:
    if not isinstance(v, list) or not v or not all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                                   for x in v):
        return False
    return len({x["name"] for x in v}) == len(v)
