"""``examples/compare_augpe.py``'s summarising and resuming code on synthetic cell records, without a model:
the intervals over seeds, grouping, the table's labels, resume/skip, the files ``--summarise-only`` writes."""

from __future__ import annotations

import importlib.util
import json
import math
import stat
import sys
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
REL = 1e-12  # float tolerance of the interval arithmetic


@pytest.fixture(scope="module")
def ca():
    spec = importlib.util.spec_from_file_location("compare_augpe", ROOT / "examples" / "compare_augpe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _cell(dataset="yelp", method="invisibleink", epsilon=10.0, setting=4, seed=0, *, mauve=0.5, c5=0.3, seconds=2.0,
          n=4, utility=True, smoke=False) -> dict:  # fmt: skip
    def est(v: float) -> dict:
        return {"estimate": v, "lower": v, "upper": v}

    return {
        "dataset": dataset, "method": method, "epsilon": epsilon, "setting": setting, "seed": seed,
        "max_new_tokens": 16, "num_texts": n, "num_texts_requested": 4, "delta": 1e-6,
        "seconds": seconds * n, "seconds_per_text": seconds, "loadavg_1min": [1.0, 1.5], "smoke": smoke,
        "cpu": "test CPU", "cores": 2, "torch_threads": 1, "commit": "abc1234", "model": "tiny", "embedder": "minilm",
        "guarantee": None, "guarantee_void_reason": "seeded", "mechanism": {},
        "texts": [{"text": f"text {i}"} for i in range(n)],
        "utility": {"mauve": est(mauve), "mauve_c5": est(c5), "delta_ppl": est(10.0), "perplexity_synthetic": est(30.0),
                    "length_synthetic_tokens": est(15.0)} if utility else None,
        "utility_void_reason": None if utility else f"{n} text(s): MAUVE and the other metrics need at least 2",
    }  # fmt: skip


def test_interval_is_mean_plus_minus_t_times_standard_error(ca):
    values = [0.2, 0.5, 0.6]
    iv = ca.t_interval(values)
    mean = sum(values) / 3
    se = math.sqrt(sum((v - mean) ** 2 for v in values) / 2) / math.sqrt(3)
    assert iv["mean"] == pytest.approx(mean, rel=REL)
    assert iv["half_width"] == pytest.approx(stats.t.ppf(0.975, 2) * se, rel=REL)
    assert (iv["lower"], iv["upper"]) == pytest.approx((mean - iv["half_width"], mean + iv["half_width"]), rel=REL)
    assert iv["n"] == 3


def test_interval_edges_clipping_one_seed_and_none(ca):
    clipped = ca.t_interval([0.0, 0.9, 1.0], 0.0, 1.0)
    assert clipped["lower"] == 0.0 and clipped["upper"] == 1.0
    assert clipped["half_width"] > clipped["mean"]  # the half-width is reported unclipped
    assert ca.t_interval([0.4]) == {"mean": 0.4, "half_width": None, "lower": None, "upper": None, "n": 1}
    assert ca.t_interval([None, None])["mean"] is None  # seeds without utility are left out
    assert ca.t_interval([3.0, 3.0, 3.0])["half_width"] == 0.0


def test_groups_pool_seeds_and_keep_settings_apart(ca):
    cells = [_cell(seed=s, mauve=m) for s, m in enumerate((0.4, 0.5, 0.6))]
    cells += [_cell(setting=8, seed=s, seconds=4.0) for s in range(3)]
    cells += [_cell(method="augpe", setting=1, seed=s, seconds=3.0 + s) for s in range(3)]
    summary = ca.summarise_cells(cells)
    rows = {(r["method"], r["setting"]): r for r in summary["groups"]}
    assert set(rows) == {("invisibleink", 4), ("invisibleink", 8), ("augpe", 1)}
    assert rows[("invisibleink", 4)]["mauve"]["mean"] == pytest.approx(0.5, rel=REL)
    assert rows[("invisibleink", 4)]["seeds"] == [0, 1, 2]
    assert rows[("augpe", 1)]["seconds_per_text"]["mean"] == pytest.approx(4.0, rel=REL)
    assert rows[("augpe", 1)]["knob"] == "T_AugPE" and rows[("invisibleink", 8)]["knob"] == "B+1"
    # InvisibleInk before AugPE within an ε; smaller compute first
    assert [(r["method"], r["setting"]) for r in summary["groups"]] == [("invisibleink", 4), ("invisibleink", 8), ("augpe", 1)]


def test_a_seed_run_twice_counts_once(ca):
    cells = [_cell(seed=0, mauve=0.1), _cell(seed=0, mauve=0.7), _cell(seed=1, mauve=0.9)]
    (row,) = ca.summarise_cells(cells)["groups"]
    assert row["seeds"] == [0, 1] and row["mauve"]["mean"] == pytest.approx(0.8, rel=REL)


def test_cells_without_utility_are_counted_and_explained(ca):
    cells = [_cell(dataset="medical", setting=16, n=1, utility=False, seed=s) for s in range(3)]
    (row,) = ca.summarise_cells(cells)["groups"]
    assert row["seeds_evaluated"] == 0 and row["mauve"]["mean"] is None
    assert row["seconds_per_text"]["n"] == 3  # cost is still measured
    table = ca.markdown(ca.summarise_cells(cells))
    assert "No utility for some seeds: 1 text(s)" in table


def test_table_labels_the_papers_convention_reference_points_and_smoke(ca):
    cells = [_cell(method="augpe-paper", setting=1, seed=s) for s in range(2)]
    cells += [_cell(method="floor", epsilon=None, setting=None, seed=s) for s in range(2)]
    table = ca.markdown(ca.summarise_cells(cells))
    assert "AugPE (paper's Δ = 1: NOT a valid guarantee)" in table
    assert "floor (public prompt, no reference)" in table
    assert "SMOKE RUN" not in table
    row = next(r for r in ca.summarise_cells(cells)["groups"] if r["method"] == "augpe-paper")
    assert row["accounting_valid"] is False and row["guarantees_void"] == 2
    assert "SMOKE RUN" in ca.markdown(ca.summarise_cells([_cell(smoke=True)]))


def test_table_cells_are_mean_plus_minus_half_width(ca):
    cells = [_cell(seed=s, mauve=m) for s, m in enumerate((0.4, 0.5, 0.6))]
    iv = ca.t_interval([0.4, 0.5, 0.6])
    table = ca.markdown(ca.summarise_cells(cells))
    assert f"{iv['mean']:.3f} ± {iv['half_width']:.3f}" in table
    assert "(1 seed)" in ca.markdown(ca.summarise_cells(cells[:1]))


def test_planning_signal_is_attached_to_invisibleink_at_its_batch_size(ca):
    gain = {"estimate": 0.1, "lower": 0.05, "upper": 0.15}
    profile = {"points": [{"epsilon": 10.0, "batch_size": 3, "clip_norm": 1.4, "gain_over_floor": gain, "gain_over_null": gain},
                          {"epsilon": 10.0, "batch_size": 7, "clip_norm": 2.0, "gain_over_floor": {}, "gain_over_null": {}}],
               "num_texts": 30, "seconds": 12.0, "max_new_tokens": 16}  # fmt: skip
    cells = [_cell(seed=0), _cell(method="augpe", setting=1, seed=0)]
    rows = {r["method"]: r for r in ca.summarise_cells(cells, {"yelp": profile})["groups"]}
    assert rows["invisibleink"]["planning_signal"]["gain_over_floor"] == gain
    assert "planning_signal" not in rows["augpe"]
    assert "0.100 [0.050, 0.150]" in ca.markdown(ca.summarise_cells(cells, {"yelp": profile}))


def test_grid_is_seed_major_and_pending_skips_finished_cells(ca):
    specs = ca.grid(datasets=["yelp"], methods=["invisibleink", "augpe"], epsilons=[3, 10], rows=[4, 8], iterations=[1],
                    seeds=2, max_new_tokens=16, num_texts=4)  # fmt: skip
    assert len(specs) == 2 * (2 + 2 * (2 + 1))  # per seed: floor, ceiling, and 2 ε × (2 B + 1 T)
    assert [s.seed for s in specs] == sorted(s.seed for s in specs)
    finished = [_cell(epsilon=3.0, setting=4, seed=0), _cell(method="floor", epsilon=None, setting=None, seed=1)]
    left = ca.pending(specs, {ca.cell_key(c) for c in finished})
    assert len(left) == len(specs) - 2
    assert all(s.key != ca.cell_key(c) for s in left for c in finished)
    # a cell with another size is not the same cell: it is run, not skipped
    other = dict(finished[0], num_texts_requested=32)
    assert len(ca.pending(specs, {ca.cell_key(other)})) == len(specs)


def test_cells_are_appended_owner_only_marked_and_read_back(ca, tmp_path):
    path = tmp_path / "cells.jsonl"
    assert ca.read_cells(path) == []
    for s in range(2):
        ca.append_cell(path, _cell(seed=s))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    records = ca.read_cells(path)
    assert [r["seed"] for r in records] == [0, 1]
    assert all(r["not_private"] is True and r["privacy_notice"].startswith("NOT PRIVATE") for r in records)
    assert {ca.cell_key(r) for r in records} == {ca.cell_key(_cell(seed=s)) for s in range(2)}


def test_summarise_only_writes_marked_files_from_cells_alone(ca, tmp_path):
    for s in range(3):
        ca.append_cell(tmp_path / "cells.jsonl", _cell(seed=s, mauve=0.3 + 0.1 * s))
        ca.append_cell(tmp_path / "cells.jsonl", _cell(method="augpe", setting=1, seed=s, seconds=5.0))
        ca.append_cell(tmp_path / "cells.jsonl", _cell(method="floor", epsilon=None, setting=None, seed=s, seconds=0.5))
    summary = ca.summarise(tmp_path)
    assert len(summary["groups"]) == 3
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["not_private"] is True
    assert [g["method"] for g in written["groups"]] == ["floor", "invisibleink", "augpe"]  # reference points first
    md = (tmp_path / "comparison.md").read_text()
    assert md.startswith("NOT PRIVATE") and "## yelp" in md
    assert (tmp_path / "comparison.png").stat().st_size > 0
    for name in ("summary.json", "comparison.md", "comparison.png"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600


def test_papers_convention_runs_only_behind_its_flag(ca):
    assert "augpe-paper" not in ca.parse_args([]).methods_list
    assert ca.parse_args(["--augpe-paper-convention"]).methods_list == ["invisibleink", "augpe", "augpe-paper"]
    with pytest.raises(SystemExit):
        ca.parse_args(["--methods", "augpe-paper"])
    smoke = ca.parse_args(["--smoke"])
    assert (smoke.seeds, smoke.rows_list, smoke.iterations_list) == (1, [4], [1])


def test_texts_per_cell_follow_the_papers_reference_budget(ca):
    assert ca.texts_for("invisibleink", 16, 32, 1327) == (32, 480)  # n disjoint batches of B = 15
    assert ca.texts_for("augpe", 5, 32, 1327) == (32, 224)  # AugPE sees 7n references (paper App. C)
    assert ca.texts_for("invisibleink", 16, 32, 16) == (1, 15)  # the 16 medical references
    assert ca.texts_for("augpe-paper", 1, 4, 16) == (2, 14)
    assert ca.texts_for("floor", None, 4, 16) == (4, 12)


def test_the_committed_run_reproduces_its_summary_and_table(ca):
    """``audits/reports/augpe_comparison``: its summary and table are what its cells and profiles give (what
    ``--summarise-only`` rebuilds), and its grid is complete: 3 seeds of every setting, 16 Yelp texts per cell."""
    from invink_audit.not_private import NOT_PRIVATE_BANNER, unmark

    out = ROOT / "audits" / "reports" / "augpe_comparison"
    cells = [unmark(c) for c in ca.read_cells(out / "cells.jsonl")]
    profiles = {d: unmark(json.loads((out / f"profile_{d}.json").read_text(encoding="utf-8"))) for d in ca.DATASETS}
    summary = ca.summarise_cells(cells, profiles)
    committed = unmark(json.loads((out / "summary.json").read_text(encoding="utf-8")))
    assert json.loads(json.dumps(summary)) == committed
    assert (out / "comparison.md").read_text(encoding="utf-8") == f"{NOT_PRIVATE_BANNER}\n\n{ca.markdown(summary)}"
    expected = ca.grid(datasets=ca.DATASETS, methods=("invisibleink", "augpe"), epsilons=(3, 10), rows=(4, 8, 16),
                       iterations=(1, 3, 5), seeds=3, max_new_tokens=48, num_texts=16)  # fmt: skip
    assert ca.pending(expected, [ca.cell_key(c) for c in cells]) == [] and len(cells) == 84
    assert all(c["guarantee"] is None for c in cells) and not summary["smoke"]
    assert {c["num_texts"] for c in cells if c["dataset"] == "yelp"} == {16}
