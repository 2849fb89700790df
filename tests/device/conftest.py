"""tests/device: checks that need a CUDA GPU or an Ascend NPU. Every test here carries the `device` marker and
is skipped on machines without an accelerator (CI, the CPU dev boxes); a test that needs one kind in
particular skips itself when only the other is present."""

from __future__ import annotations

import pytest


from device_common import accelerator as _accelerator  # noqa: E402 — one definition for conftest and checks


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/device/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.device)


@pytest.fixture(autouse=True)
def _needs_accelerator():
    if _accelerator() is None:
        pytest.skip("needs a CUDA/NPU accelerator")


@pytest.fixture
def accelerator() -> str:
    return _accelerator() or "cpu"
