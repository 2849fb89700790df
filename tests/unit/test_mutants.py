"""The mutation check's planted bugs still apply to today's code: each mutant's text occurs exactly once in its
file and its replacement differs (a refactor that moves the code fails here, naming the mutant to update)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation.mutants import FAST_SUBSET, MUTANTS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("m", MUTANTS, ids=[m.id for m in MUTANTS])
def test_mutant_applies_once(m):
    text = (ROOT / m.file).read_text()
    assert m.old != m.new
    assert text.count(m.old) == 1, f"{m.id}: text found {text.count(m.old)} times in {m.file}"


def test_mutants_are_many_distinct_and_their_tests_exist():
    assert len(MUTANTS) >= 12
    assert len({m.id for m in MUTANTS}) == len(MUTANTS)
    for t in FAST_SUBSET + [t for m in MUTANTS for t in m.tests]:
        assert (ROOT / t.split("::")[0]).exists(), t
