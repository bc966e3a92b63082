"""Seeded releases drawn today equal those pinned in ``tests/data/pinned_releases.json`` (written by
``examples/pin_releases.py --write``): a refactor of the pipeline must leave every token, finish reason,
released text and the quick audit's realised losses unchanged. Compared only on the machine kind they were
pinned on (torch version, thread count, CPU vector flags); elsewhere floating-point reductions may
legitimately differ and the test skips, saying why."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "tests" / "data" / "pinned_releases.json"
sys.path.insert(0, str(ROOT / "examples"))

import pin_releases  # noqa: E402


def test_seeded_releases_are_token_identical_to_the_pinned_ones():
    recorded = json.loads(PINS.read_text())
    here = pin_releases.machine()
    if recorded["machine"] != here:
        pytest.skip(f"pinned on {recorded['machine']}; this machine is {here}")
    assert pin_releases.differences(recorded["cases"], pin_releases.draw()) == []


def test_a_difference_is_named():
    cases = {"a": [1], "b": [2]}
    assert pin_releases.differences(cases, {"a": [1], "b": [3], "c": [4]}) == ["c: not recorded", "b: differs"]
    assert pin_releases.differences(cases, {"a": [1]}) == ["b: missing now"]
