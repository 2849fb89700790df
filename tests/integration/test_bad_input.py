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
