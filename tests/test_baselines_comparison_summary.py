"""``examples/compare_baselines.py``'s summarising code, without the model: intervals, anchors, batch overlap,
Amin et al.'s feasibility table, and the committed table against the committed summary."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "audits" / "reports" / "baselines_comparison"


@pytest.fixture(scope="module")
def cb():
    spec = importlib.util.spec_from_file_location("compare_baselines", ROOT / "examples" / "compare_baselines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_token_interval_is_clipped_to_zero_and_t(cb):
    mean, lo, hi = cb._t_interval([1.0, 2.0, 32.0], 0.0, 32.0)
    assert mean == pytest.approx(35 / 3)
    assert lo == 0.0 and hi == 32.0
    assert cb._t_interval([5.0]) == (5.0, None, None)


def test_perplexity_interval_is_geometric_and_positive(cb):
    values = [20.0, 400.0, 3000.0]
    geo, lo, hi = cb._geometric_interval(values)
    assert geo == pytest.approx(math.exp(sum(map(math.log, values)) / 3))
    assert 0 < lo < geo < hi
    # symmetric on the log scale
    assert math.log(geo) - math.log(lo) == pytest.approx(math.log(hi) - math.log(geo))


def test_anchor_match_and_batch_overlap(cb):
    anchor = {"text": "Chef Iron makes great pasta"}
    assert cb._matches_anchor({"text": "Chef Iron", "finish_reason": "budget"}, anchor)
    assert not cb._matches_anchor({"text": "Chef Iron", "finish_reason": "length"}, anchor)
    assert not cb._matches_anchor({"text": "Chef Iron", "finish_reason": "budget"}, None)
    assert cb._overlap(0, 16, 64)  # seed 0: refs[0:15] inside refs[0:63]
    assert not cb._overlap(1, 16, 64)  # refs[15:30] and refs[63:126]
    assert cb._overlap(2, 32, 64) is False  # refs[62:93] and refs[126:189]


def test_anchor_keys_share_only_b_independent_anchors(cb):
    assert cb._anchor_key("invisibleink-full", 3.0, 4, 1) == cb._anchor_key("invisibleink-full", 10.0, 64, 1)
    assert cb._anchor_key("adapmixed", 3.0, 4, 2) == cb._anchor_key("adapmixed", 10.0, 16, 2)
    assert cb._anchor_key("invisibleink-top100", 3.0, 4, 0) == cb._anchor_key("invisibleink-top100", 3.0, 64, 0)
    assert cb._anchor_key("invisibleink-top100", 3.0, 4, 0) != cb._anchor_key("invisibleink-top100", 10.0, 4, 0)
    assert cb._anchor_key("amin-paper", 10.0, 16, 0) != cb._anchor_key("amin-paper", 10.0, 64, 0)


def test_top_k_band_depends_on_epsilon_only(cb):
    """The InvisibleInk k=100 anchor is shared across B: its Top-k+ band 2C/B is a function of ε alone."""
    for eps in (3.0, 10.0):
        bands = []
        for rows in (4, 8, 16, 32, 64):
            mech = cb.build_mechanism("invisibleink-top100", eps, rows - 1, 32)
            bands.append(2 * mech.config.clip_norm / (rows - 1))
        assert max(bands) - min(bands) < 1e-12 * max(bands)


def test_amin_feasibility_with_the_papers_r_matches_its_table_2(cb):
    """r = 100, the paper's C/B: feasible exactly where the paper's Table 2 reports Amin et al. (B ∈ {31, 63, 127})."""
    table = {(f["epsilon"], f["r"], f["sensitivity"]): f["clip_norm_by_batch"] for f in cb.amin_feasibility()}
    paper_feasible = {1.0: set(), 3.0: {127}, 5.0: {127}, 10.0: {63, 127}}
    for eps, expected in paper_feasible.items():
        row = table[(eps, 100, "paper")]
        assert {b for b in (31, 63, 127) if row[b] is not None} == expected
    # this comparison's r = 8 is feasible at smaller B
    assert table[(10.0, 8, "paper")][15] is not None and table[(10.0, 8, "replace-by-null")][15] is None


def test_committed_table_is_the_committed_summary(cb):
    summary = json.loads((REPORT / "summary.json").read_text())
    assert cb.markdown(summary) == (REPORT / "comparison.md").read_text()
    dep = summary["reference_dependence"]
    assert dep["groups_with_identical_texts"] == 13
    assert dep["groups_with_identical_texts_on_disjoint_batches"] == 10
    cells = [json.loads(line) for line in (REPORT / "cells.jsonl").read_text().splitlines()]
    anchors = [json.loads(line) for line in (REPORT / "anchors.jsonl").read_text().splitlines()]
    keys = {a["anchor_key"] for a in anchors}
    assert all(cb._anchor_key(c["method"], c["epsilon"], c["rows"], c["seed"]) in keys for c in cells if c["feasible"])
