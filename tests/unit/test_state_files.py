"""State files damaged between runs: one `StageStateError` naming the file and the way back, never a decoder
traceback; a metrics line torn by a kill mid-write is the one damage that is repaired (dropped) silently."""

from __future__ import annotations

import pytest
import torch

from mopd_core.errors import StageStateError
from mopd_core.stages.folder import model_identity, read_metrics, read_stage
from mopd_core.train.checkpoint import load_loop_state


def test_a_torn_last_metrics_line_is_dropped_and_a_damaged_earlier_one_named(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(p)] == [1, 2]
    p.write_text('{"step": 1, "loss": 0.5}\n[1, 2]\n{"step": 3}\n')
    with pytest.raises(StageStateError, match=r"metrics.jsonl: line 2 .*delete that line"):
        read_metrics(p)
    assert read_metrics(tmp_path / "absent.jsonl") == []


@pytest.mark.parametrize("text", ['{"status": "do', "[]", '{"fingerprint": 7}', "\x00\x01 not json"])
def test_a_damaged_stage_record_names_the_file_and_the_fix(tmp_path, text):
    (tmp_path / "stage.json").write_text(text)
    with pytest.raises(StageStateError) as e:
        read_stage(tmp_path)
    assert str(tmp_path / "stage.json") in str(e.value) and "run the stage again" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_damaged_model_identity_and_loop_state_name_the_file(tmp_path):
    (tmp_path / "mopd_identity.json").write_text("{")
    with pytest.raises(StageStateError, match="mopd_identity.json.*delete it"):
        model_identity(tmp_path)
    torch.save({"step": 2, "optimizer": {}}, tmp_path / "loop_state.pt")
    assert load_loop_state(tmp_path)["step"] == 2
    data = (tmp_path / "loop_state.pt").read_bytes()
    (tmp_path / "loop_state.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(StageStateError, match="loop_state.pt: unreadable.*checkpoint before it"):
        load_loop_state(tmp_path)
    torch.save([1, 2], tmp_path / "loop_state.pt")
    with pytest.raises(StageStateError, match="not a loop state"):
        load_loop_state(tmp_path)
