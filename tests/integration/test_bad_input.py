"""Bad input: each a one-line error before any compute, and nothing written (or nothing already written lost)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mopd_core import recipe as R
from mopd_core.config import load_config
from mopd_core.domains import DomainError
from mopd_core.models import ModelError, build_tiny
from tests.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mopd_core.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=120)


def _one_line_error(proc, needle):
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_unknown_config_key_is_one_line(tmp_path):
    p = _cli("recipe", "--config", "tiny", "--set", f"output_dir={tmp_path}", "--set", "mopd.stepz=3")
    _one_line_error(p, "unknown config key 'mopd.stepz'")
    assert not any(tmp_path.iterdir())


def _jsonl(path: Path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data_cfg(tmp_path, source: Path, extra=()):
    return load_config("tiny", tiny_overrides(tmp_path / "out") + [
        f"data.domains=[{{name: math, source: '{source}'}}, {{name: code, source: '{source}'}}]",
        "sft.mix=null", "mopd.mix=null", *extra])


def _rows(n=20, tid="math"):
    return [{"prompt": f"{i}+1=", "teacher_id": tid, "answer": str(i + 1)} for i in range(n)]


def test_dataset_with_unknown_teacher_id_names_it_and_the_known_ones(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", _rows(10) + _rows(10, "code") + [
        {"prompt": "x", "teacher_id": "poetry", "answer": "y"}])
    cfg = _data_cfg(tmp_path, src)
    with pytest.raises(DomainError) as e:
        R.run_recipe(cfg, progress=False)
    msg = str(e.value)
    assert "unknown teacher_id 'poetry'" in msg and "row 20" in msg and "code, math" in msg and "\n" not in msg
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rows,needle", [
    ([], "empty"),
    ([{"prompt": "1+1=", "answer": "2"}], "teacher_id"),
])
def test_empty_dataset_or_missing_column(tmp_path, rows, needle):
    src = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _data_cfg(tmp_path, src)
    with pytest.raises(DomainError, match=needle) as e:
        R.run_recipe(cfg, progress=False)
    assert "\n" not in str(e.value) and "d.jsonl" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_cli_missing_dataset_file_is_one_line(tmp_path):
    p = _cli("recipe", "--set", f"output_dir={tmp_path}",
             "--set", f"data.domains=[{{name: math, source: {tmp_path}/nope.parquet}}]", "--set", "sft.mix=null",
             "--set", "mopd.mix=null")
    _one_line_error(p, "nope.parquet")


def test_teacher_with_other_tokenizer_fails_before_training(tmp_path):
    """A teacher whose vocabulary differs (a tokenizer built with fewer characters) is refused up front."""
    cfg = load_config("tiny", tiny_overrides(tmp_path))
    student = build_tiny(cfg.model, tmp_path / "student")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from mopd_core.models import build_tiny_model

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate("0123456789+-=")}}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    other = PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    m = build_tiny_model(cfg.model.tiny, len(other), 0, 1)
    m.save_pretrained(tmp_path / "bad-teacher")
    other.save_pretrained(tmp_path / "bad-teacher")
    teachers = {"math": tmp_path / "bad-teacher", "code": student, "if": student}
    with pytest.raises(ModelError, match="teacher 'math'.*tokenizer fingerprint") as e:
        R.mopd_stage(cfg, student, teachers, progress=False)
    assert "\n" not in str(e.value)
    assert not (Path(cfg.output_dir) / cfg.name / "student").exists()


def test_mopd_without_a_teacher_for_a_domain(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path))
    student = build_tiny(cfg.model, tmp_path / "student")
    with pytest.raises(Exception, match="unknown teacher_id 'if'.*known teachers: math, code"):
        R.mopd_stage(cfg, student, {"math": student, "code": student}, progress=False)
    assert not (Path(cfg.output_dir) / cfg.name / "student").exists()


# ---------------------------------------------------------------- pre-flight (mopd_core/preflight.py)
# Each case: a one-line MopdError naming the field/file and the fix, raised before any compute, and no stage
# folder (nor the output dir) created.

from mopd_core import errors as E  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A saved tiny checkpoint (untrained) and its config: the --init/teacher/eval model of the cases below."""
    root = tmp_path_factory.mktemp("tiny_model")
    cfg = load_config("tiny", tiny_overrides(root / "unused"))
    return build_tiny(cfg.model, root / "model")


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _truncated(tiny_model, tmp_path) -> Path:
    bad = _copy(tiny_model, tmp_path / "truncated")
    w = bad / "model.safetensors"
    with open(w, "r+b") as f:
        f.truncate(w.stat().st_size // 2)
    return bad


def _nothing_written(out: Path):
    assert not out.exists() or not any(out.rglob("*")), sorted(out.rglob("*"))


def _one(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, E.MopdError)
    return msg


@pytest.mark.parametrize("damage,needle", [
    ("truncate", "model.safetensors' is truncated or corrupt"),
    ("no_config", "is not a model checkpoint (no config.json)"),
    ("bad_config", "config.json' is not valid JSON"),
    ("no_tokenizer", "has no tokenizer"),
    ("no_weights", "has no weights (model.safetensors)"),
    ("missing", "does not exist"),
])
def test_init_that_does_not_load_fails_before_any_folder(tiny_model, tmp_path, damage, needle):
    bad = tmp_path / "init"
    if damage == "truncate":
        bad = _truncated(tiny_model, tmp_path)
    elif damage != "missing":
        _copy(tiny_model, bad)
        if damage == "no_config":
            (bad / "config.json").unlink()
        elif damage == "bad_config":
            (bad / "config.json").write_text('{"model_type": "llama",')
        elif damage == "no_tokenizer":
            for f in ("tokenizer.json", "tokenizer_config.json"):
                (bad / f).unlink()
        elif damage == "no_weights":
            (bad / "model.safetensors").unlink()
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    with pytest.raises(E.ModelError) as e:
        R.expert_stage(cfg, "math", bad, progress=False)
    msg = _one(e)
    assert needle in msg and str(bad) in msg and "--init" in msg, msg
    _nothing_written(tmp_path / "out")


def test_weights_of_another_shape_name_the_tensor(tiny_model, tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + ["model.tiny.hidden_size=128"])
    wide = build_tiny(cfg.model, tmp_path / "wide")
    bad = _copy(tiny_model, tmp_path / "mixed")
    (bad / "model.safetensors").write_bytes((wide / "model.safetensors").read_bytes())
    with pytest.raises(E.ModelError) as e:
        R.eval_stage(cfg, {"student": bad})
    msg = _one(e)
    assert "eval model 'student'" in msg and "shape [" in msg and "config.json describes" in msg, msg


def test_cli_truncated_init_is_one_line_exit_2(tiny_model, tmp_path):
    bad = _truncated(tiny_model, tmp_path)
    sets = [a for o in tiny_overrides(tmp_path / "out") for a in ("--set", o)]
    p = _cli("stage", "expert", *sets, "--domain", "math", "--init", str(bad))
    _one_line_error(p, f"--init '{bad}/model.safetensors' is truncated or corrupt")
    _nothing_written(tmp_path / "out")


def test_teacher_that_does_not_load_fails_before_any_folder(tiny_model, tmp_path):
    bad = _truncated(tiny_model, tmp_path)
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    with pytest.raises(E.ModelError) as e:
        R.mopd_stage(cfg, tiny_model, {"math": tiny_model, "code": bad, "if": tiny_model}, progress=False)
    assert "teacher 'code'" in _one(e) and str(bad) in str(e.value)
    _nothing_written(tmp_path / "out")


def _budget(tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    return cfg.data.max_prompt_tokens, cfg.model.tiny.max_position_embeddings


def test_completion_over_the_model_context_fails_before_sft(tmp_path):
    P, ctx = _budget(tmp_path)
    T = ctx - P  # P + T = ctx fits as a sequence, but SFT's EOS (+1) does not
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + [f"rollout.max_new_tokens={T}"])
    with pytest.raises(E.ConfigError) as e:
        R.run_recipe(cfg, progress=False)
    assert _one(e) == (f"prompt + completion + 1 = data.max_prompt_tokens={P} + rollout.max_new_tokens={T} + 1 = "
                       f"{ctx + 1} exceeds the {ctx} positions of the tiny model (model.tiny.max_position_embeddings)"
                       " — lower rollout.max_new_tokens or data.max_prompt_tokens, or use a model with a longer "
                       "context")
    _nothing_written(tmp_path / "out")
    with pytest.raises(E.ConfigError, match=f"= {ctx + 1} exceeds"):  # the one-stage entry point too
        R.sft_stage(cfg, progress=False)
    _nothing_written(tmp_path / "out")
    fits = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_new_tokens": T - 1})})
    R.preflight.check_stage(fits, R.stage_spec(fits, "sft", {}), domains=R.build_domains(fits))  # one token less


def test_eval_budget_over_the_context_names_eval_max_new_tokens(tiny_model, tmp_path):
    P, ctx = _budget(tmp_path)
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + [f"eval.max_new_tokens={ctx - P}"])
    with pytest.raises(E.ConfigError, match=rf"data.max_prompt_tokens={P} \+ eval.max_new_tokens={ctx - P} \+ 1 = "
                                            rf"{ctx + 1} exceeds the {ctx} positions of eval model 'sft'"):
        R.eval_stage(cfg, {"sft": tiny_model})


def test_local_teacher_with_a_shorter_context(tiny_model, tmp_path):
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    need = cfg.max_seq_len() + 1
    short_cfg = load_config("tiny", tiny_overrides(tmp_path / "x") + [f"model.tiny.max_position_embeddings={need - 1}"])
    short = build_tiny(short_cfg.model, tmp_path / "short")
    with pytest.raises(E.ConfigError) as e:
        R.mopd_stage(cfg, tiny_model, {"math": tiny_model, "code": short, "if": tiny_model}, progress=False)
    msg = _one(e)
    assert f"= {need} exceeds the {need - 1} positions of teacher 'code' '{short}'" in msg, msg
    _nothing_written(tmp_path / "out")


def test_dataset_row_over_max_prompt_tokens_fails_before_sft(tmp_path):
    rows = _rows(10) + _rows(10, "code")
    P, _ = _budget(tmp_path)
    long = "1+" * P + "="  # one token per character: 2P + 1 tokens
    rows[13] = {"prompt": long, "teacher_id": "code", "answer": str(P + 1)}
    src = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _data_cfg(tmp_path, src)
    with pytest.raises(E.DataError) as e:
        R.run_recipe(cfg, progress=False)
    msg = _one(e)
    assert f"{src} row 13: prompt of {2 * P + 1} tokens exceeds data.max_prompt_tokens={P}" in msg, msg
    assert "raise data.max_prompt_tokens" in msg and "drop the row" in msg
    _nothing_written(tmp_path / "out")
    with pytest.raises(E.DataError, match="row 13"):  # every stage checks it, not only the recipe
        R.sft_stage(cfg, progress=False)
    _nothing_written(tmp_path / "out")


def test_output_dir_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("in the way")
    p = _cli("recipe", "--set", f"output_dir={tmp_path}/file/runs")
    _one_line_error(p, f"output_dir={tmp_path}/file/runs: '{tmp_path}/file' is a regular file, not a folder")
    assert (tmp_path / "file").read_text() == "in the way" and sorted(tmp_path.iterdir()) == [tmp_path / "file"]


@pytest.fixture
def tmpfs(tmp_path):
    """A real small filesystem (needs mount rights; skipped without them)."""
    import subprocess as sp

    mnt = tmp_path / "mnt"
    mnt.mkdir()

    def mount(size: str, ro: bool = False) -> Path:
        opts = f"size={size}" + (",ro" if ro else "")
        r = sp.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        return mnt

    yield mount
    sp.run(["umount", str(mnt)], capture_output=True)


def test_read_only_output_dir(tmp_path, tmpfs):
    ro = tmpfs("1m", ro=True)
    cfg = load_config("tiny", tiny_overrides(ro / "runs"))
    with pytest.raises(E.ConfigError) as e:
        R.run_recipe(cfg, progress=False)
    msg = _one(e)
    assert f"output_dir={ro}/runs is not writable: cannot create files in '{ro}'" in msg and "Read-only" in msg


def test_read_only_output_dir_without_mount_rights(tmp_path, monkeypatch):
    import errno
    import tempfile

    def refuse(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    with pytest.raises(E.ConfigError, match=r"output_dir=.* is not writable: .*Read-only file system\) — choose"):
        R.sft_stage(cfg, progress=False)
    _nothing_written(tmp_path / "out")


def test_output_dir_without_the_space_of_a_checkpoint(tmp_path, tmpfs):
    small = tmpfs("1m")
    cfg = load_config("tiny", tiny_overrides(small / "runs"))
    with pytest.raises(E.DiskFullError) as e:
        R.run_recipe(cfg, progress=False)
    msg = _one(e)
    assert f"output_dir={small}/runs: the disk holding '{small}' has 1.0 MiB free" in msg, msg
    assert "a checkpoint of this stage needs about" in msg and "free disk space" in msg
    assert not any(small.iterdir())


def test_disk_space_estimate_is_weights_plus_adam_state(tiny_model, tmp_path, monkeypatch):
    from collections import namedtuple

    from mopd_core import preflight
    from mopd_core.models import inspect_checkpoint

    n = inspect_checkpoint(tiny_model).num_params
    need = n * 4 * 3 + preflight.MARGIN_BYTES
    assert preflight.checkpoint_bytes(n, "float32") == need
    usage = namedtuple("usage", "total used free")
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out"))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage(10 * need, 9 * need, need - 1))
    with pytest.raises(E.DiskFullError, match=rf"\({n:,} parameters × 3"):
        R.expert_stage(cfg, "math", tiny_model, progress=False)
    _nothing_written(tmp_path / "out")
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage(10 * need, 9 * need, need))
    spec = R.stage_spec(cfg, "expert:math", {"init": R.model_ref_id(tiny_model)})
    R.preflight.check_stage(cfg, spec, student=tiny_model, domains=R.build_domains(cfg))  # exactly enough: passes


# ---------------------------------------------------------------- a full disk while writing a checkpoint


def _hash_tree(d: Path) -> dict[str, str]:
    import hashlib

    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.rglob("*"))
            if f.is_file()}


def _enospc():
    import errno

    return OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tiny_model, tmp_path, monkeypatch):
    from mopd_core.train import checkpoint as ck

    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + ["expert.steps=3", "expert.save_every=1"])
    stage_dir = cfg.run_dir() / "expert-math"
    real_save, seen = ck.torch.save, {}

    def save(obj, path, *a, **k):  # the 2nd checkpoint's loop state: half written, then the disk is full
        if Path(path).parent.name == ".step-000002.tmp":
            seen["before"] = _hash_tree(stage_dir / "checkpoints" / "step-000001")
            Path(path).write_bytes(b"partial")
            raise _enospc()
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ck.torch, "save", save)
    with pytest.raises(E.DiskFullError) as e:
        R.expert_stage(cfg, "math", tiny_model, progress=False)
    msg = _one(e)
    assert "disk full writing checkpoint" in msg and "MiB free" in msg and "previous checkpoint" in msg, msg
    assert _hash_tree(stage_dir / "checkpoints" / "step-000001") == seen["before"]  # byte-identical
    assert [d.name for d in (stage_dir / "checkpoints").iterdir()] == ["step-000001"]  # the temp dir is gone
    assert json.loads((stage_dir / "stage.json").read_text())["status"] == "running"
    monkeypatch.setattr(ck.torch, "save", real_save)  # space again: the rerun resumes from step 1 and finishes
    out = R.expert_stage(cfg, "math", tiny_model, progress=False)
    assert json.loads((stage_dir / "stage.json").read_text())["status"] == "done" and out.model_dir.is_dir()


def test_full_disk_writing_final_keeps_the_previous_final(tiny_model, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + ["expert.steps=2", "expert.save_every=1"])
    first = R.expert_stage(cfg, "math", tiny_model, progress=False)
    before = _hash_tree(first.model_dir)
    real = PreTrainedModel.save_pretrained

    def save(self, out_dir, *a, **k):
        if Path(out_dir).name == "final.tmp":  # final/ of the continued stage: the disk fills mid-write
            (Path(out_dir) / "model.safetensors").write_bytes(b"partial")
            raise _enospc()
        return real(self, out_dir, *a, **k)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)
    more = load_config("tiny", tiny_overrides(tmp_path / "out") + ["expert.steps=3", "expert.save_every=1"])
    with pytest.raises(E.DiskFullError, match=r"disk full writing the model .*final"):
        R.expert_stage(more, "math", tiny_model, progress=False)
    assert _hash_tree(first.model_dir) == before  # the previous final/ is untouched
    assert sorted(p.name for p in first.stage_dir.iterdir() if p.name.startswith("final")) == ["final"]


def test_missing_device_fails_before_the_base_is_built(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + ["runtime.device=cuda"])
    with pytest.raises(E.PlacementError, match="runtime.device=cuda but torch sees no CUDA device"):
        R.run_recipe(cfg, progress=False)
    _nothing_written(tmp_path / "out")


def test_colocated_memory_budget_fails_before_any_folder(tiny_model, tmp_path):
    from mopd_core.models import inspect_checkpoint, model_shape, model_widths
    from mopd_core.runtime.phases import ColocationError

    info = inspect_checkpoint(tiny_model)
    gib = info.num_params * 4 / 2**30
    act = R.preflight.update_activation_bytes(load_config("tiny", tiny_overrides(tmp_path / "out")), "student",
                                              model_shape(info.config), model_widths(info.config)) / 2**30
    # train = weights + grads + 2 AdamW moments = 4w (+ one micro-batch's activations); three teachers resident
    # (offload=false) add 3w
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + [f"runtime.memory_limit_gib={6 * gib + act}",
                                                                  "teachers.offload=false"])
    teachers = {"math": tiny_model, "code": tiny_model, "if": tiny_model}
    with pytest.raises(ColocationError, match=r"phase 'train' needs .* with 3 teacher\(s\) all resident"):
        R.mopd_stage(cfg, tiny_model, teachers, progress=False)
    _nothing_written(tmp_path / "out")
    off = cfg.model_copy(update={"teachers": cfg.teachers.model_copy(update={"offload": True})})
    R.preflight.check_stage(off, R.mopd_spec(off, tiny_model, teachers), student=tiny_model, teachers=teachers,
                            domains=R.build_domains(off))  # offloaded: 4w fits 6w


@pytest.mark.parametrize("extra,needle", [
    (["mopd.w_rl=0", "mopd.w_kd=0"], "student: mopd.w_rl and mopd.w_kd are both 0 — nothing to learn from"),
    (["expert.w_rl=0"], "expert-math: expert.w_rl and expert.w_kd are both 0"),
    (["teachers.endpoints={math: 'http://127.0.0.1:9'}"],
     "teachers.endpoints is set but teachers.backend=local: the endpoints would be ignored"),
    (["teachers.backend=http", "mopd.kd_loss=jsd", "mopd.jsd_top_k=32", "teachers.max_logprobs=20"],
     "mopd.jsd_top_k=32 exceeds teachers.max_logprobs=20"),
    (["teachers.placement=workers"], "teachers.placement=workers puts local teachers on the training workers' "
     "devices, but teachers.backend=local and runtime.strategy=single — set"),
    (["train.fsdp_cpu_offload=true"], "train.fsdp_cpu_offload=true offloads FSDP2 shards, but "
     "runtime.strategy=single — set runtime.strategy=fsdp2"),
])
def test_impossible_combination_fails_before_the_first_stage(tmp_path, extra, needle):
    """Caught when the recipe starts — not after SFT and the experts have trained."""
    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + extra)
    with pytest.raises(E.ConfigError) as e:
        R.run_recipe(cfg, progress=False)
    assert needle in _one(e)
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("fail", [503, "slow"])
def test_user_endpoint_failing_its_preflight_is_a_teacher_error(tmp_path, fail):
    """A user-given endpoint that answers 5xx or times out while the router is built: the user's to fix (one
    line, exit 2), not an outage to retry — that is only a server we supervise failing later."""
    from mopd_core.models import build_tiny_tokenizer
    from mopd_core.teachers.http import build_http_router
    from tests.integration.test_http_teachers import _Stub

    cfg = load_config("tiny", tiny_overrides(tmp_path / "out") + ["teachers.retries=1", "teachers.backend=http",
                                                                  "teachers.request_timeout_s=0.5"])
    stub = _Stub(fail=[503] * 10 if fail == 503 else [])
    if fail == "slow":
        import time

        stub.server.RequestHandlerClass.do_POST = lambda self: time.sleep(2)
    try:
        with pytest.raises(E.TeacherError) as e:
            build_http_router({"math": stub.url}, cfg.teachers, build_tiny_tokenizer())
    finally:
        stub.close()
    msg = _one(e)
    assert msg.startswith(f"teacher 'math' at {stub.url} failed 2 times (") and not isinstance(e.value, E.InfraError)
    assert ("HTTP 503" if fail == 503 else "ReadTimeout") in msg, msg
