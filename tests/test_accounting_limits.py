"""Issue 12 probes on the accounting commands: hangs (item 9), O(T) memory (10), overflow (11), and
the documented valid range of every argument. Hangs carry a timeout, so a regression fails instead of
hanging the suite."""

import json
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from accounting import (
    ACCOUNTANTS,
    RANGES,
    BudgetLedger,
    br_adaptive_delta,
    check_parameter_ranges,
    composed_delta,
    composed_epsilon,
    epsilon_for_clip_norm,
    max_epsilon0,
    plan_clip_norm,
    plan_max_new_tokens,
)
from accounting.limits import MAX_COUNT
from invink_audit.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_OVER_BUDGET, main

#: A hang probe that takes longer than this is a regression (each ran for ever before the fix).
HANG_SECONDS = 120
#: Peak traced memory allowed for a T = 1e9 query (np.full(T) took 8 GB before the fix).
MEMORY_BYTES = 20 * 2**20

PLAN = ["--delta", "1e-6", "--max-new-tokens", "100", "--batch-size", "8"]


def _cli(argv, capsys):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _one_line_error(rc, out, err, *needles):
    assert rc == EXIT_BAD_INPUT and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- item 9: hangs ----------------------------------------------------------------------------------


@pytest.mark.timeout(HANG_SECONDS)
@pytest.mark.parametrize("accountant", ACCOUNTANTS)
@pytest.mark.parametrize("epsilon", ["1e6", "1e10", "1e308"])
def test_plan_with_huge_epsilon_is_refused_at_once(epsilon, accountant, capsys):
    rc, out, err = _cli(["plan", "--epsilon", epsilon, *PLAN, "--accountant", accountant], capsys)
    _one_line_error(rc, out, err, "epsilon must be in [1e-06, 10000]", repr(float(epsilon)))
    rc, out, err = _cli(["table", "--epsilons", f"1,{epsilon}", "--accountant", accountant], capsys)
    _one_line_error(rc, out, err, "epsilon must be in [1e-06, 10000]")


@pytest.mark.timeout(HANG_SECONDS)
@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_max_epsilon0_ends_on_huge_epsilon(accountant):
    # the API below the range checks: the loops in max_epsilon0 and br_upper_fast never ended
    try:
        e0 = max_epsilon0(1e308, 1e-6, 100, accountant)
    except ValueError as err:
        assert "too large" in str(err)
    else:
        assert math.isfinite(e0) and e0 <= 1e308
    e0 = max_epsilon0(1e10, 1e-6, 100, accountant)
    # oracle: no e0 above eps + 2 s(delta) is feasible (one step at t = e0 - s already has delta > 1e-6;
    # accounting.accountants.max_epsilon0); for br-adaptive, T e0-BR steps are (T e0, 0)-DP, so
    # e0 = eps / T is feasible and the search must find it, up to its tolerance
    assert math.isfinite(e0) and e0 <= 1e10 + 1.0
    if accountant == "br-adaptive":
        assert e0 >= 1e10 / 100 * (1 - 2e-4)  # within the search tolerance rtol = 1e-4


@pytest.mark.timeout(HANG_SECONDS)
def test_plan_at_the_top_of_the_range_is_fast_and_safe(capsys):
    for accountant in ACCOUNTANTS:
        plan = plan_clip_norm(epsilon=1e4, delta=1e-6, max_new_tokens=100, batch_size=8, temperature=1.0,
                              accountant=accountant)
        assert epsilon_for_clip_norm(clip_norm=plan.clip_norm, max_new_tokens=100, batch_size=8, temperature=1.0,
                                     delta=1e-6, accountant=accountant).epsilon <= 1e4


@pytest.mark.timeout(HANG_SECONDS)
def test_min_batch_size_with_huge_clip_norm_is_refused(capsys):
    base = ["min-batch-size", "--epsilon", "1", "--delta", "1e-6", "--max-new-tokens", "100"]
    rc, out, err = _cli([*base, "--clip-norm", "1e300"], capsys)
    _one_line_error(rc, out, err, "clip_norm must be in [1e-06, 1e+06]", "1e+300")
    # in range, but needing more than 1e9 references: one line, not a loop over B
    rc, out, err = _cli([*base, "--clip-norm", "1e6", "--temperature", "1e-4"], capsys)
    _one_line_error(rc, out, err, "more than the largest batch_size")


# --- item 10: memory --------------------------------------------------------------------------------


@pytest.mark.timeout(HANG_SECONDS)
@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_epsilon_for_a_billion_tokens_needs_no_o_t_memory(accountant, capsys):
    tracemalloc.start()
    try:
        rc, out, _ = _cli(["epsilon", "--clip-norm", "0.1", "--max-new-tokens", str(MAX_COUNT), "--batch-size", "8",
                           "--delta", "1e-6", "--accountant", accountant, "--json"], capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == EXIT_OK and peak < MEMORY_BYTES
    data = json.loads(out)
    # oracle: the zCDP closed form (rho = T e0^2 / 8 with e0 = 2C/B); br-adaptive falls back to CKS here
    assert data["rho_sequence"] == pytest.approx(MAX_COUNT * (2 * 0.1 / 8) ** 2 / 8, rel=1e-12)
    assert data["epsilon"] == pytest.approx(
        composed_epsilon(1e-6, 0.025, MAX_COUNT, "cks" if accountant == "br-adaptive" else accountant), rel=1e-9
    )


@pytest.mark.parametrize("tokens", ["10000000000", "1000000000000"])
def test_token_budgets_beyond_the_range_are_one_line(tokens, capsys, tmp_path):
    rc, out, err = _cli(["epsilon", "--clip-norm", "0.1", "--max-new-tokens", tokens, "--batch-size", "8",
                         "--delta", "1e-6"], capsys)
    _one_line_error(rc, out, err, "max_new_tokens must be an integer from 1 to 1000000000", tokens)
    path = tmp_path / "l.json"
    BudgetLedger.create(path, epsilon=1.0, delta=1e-6)
    for flag in ("--max-new-tokens", "--texts-per-batch", "--num-batches"):
        argv = {"--clip-norm": "0.1", "--batch-size": "8", "--max-new-tokens": "10", flag: tokens}
        rc, out, err = _cli(["ledger", "charge", path, *[x for kv in argv.items() for x in kv]], capsys)
        _one_line_error(rc, out, err, f"{flag.lstrip('-').replace('-', '_')} must be an integer from 1 to")


@pytest.mark.timeout(HANG_SECONDS)
def test_ledger_charge_of_a_huge_release_is_refused_as_over_budget(tmp_path, capsys):
    path = tmp_path / "l.json"
    BudgetLedger.create(path, epsilon=1.0, delta=1e-6)
    tracemalloc.start()
    try:
        rc, out, err = _cli(["ledger", "charge", path, "--clip-norm", "0.1", "--batch-size", "8", "--max-new-tokens",
                             str(MAX_COUNT), "--texts-per-batch", str(MAX_COUNT)], capsys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == EXIT_OVER_BUDGET and "over the budget" in err and peak < MEMORY_BYTES


# --- item 11: overflow --------------------------------------------------------------------------------


@pytest.mark.timeout(HANG_SECONDS)
def test_huge_clip_norm_on_a_ledger_with_releases(tmp_path, capsys):
    # probe: an OverflowError traceback (epsilon0 ** 2 of a huge epsilon0)
    path = tmp_path / "l.json"
    BudgetLedger.create(path, epsilon=1.0, delta=1e-6)
    base = ["ledger", "charge", path, "--batch-size", "8", "--max-new-tokens", "10"]
    assert _cli([*base, "--clip-norm", "0.1"], capsys)[0] == EXIT_OK
    rc, out, err = _cli([*base, "--clip-norm", "1e200"], capsys)
    _one_line_error(rc, out, err, "clip_norm must be in")
    # the largest valid per-token range (C = 1e6, B = 1, tau = 1e-4): refused as over budget, no overflow
    rc, out, err = _cli([*base[:3], "--batch-size", "1", "--max-new-tokens", "10", "--clip-norm", "1e6",
                         "--temperature", "1e-4"], capsys)
    assert rc == EXIT_OVER_BUDGET and "Traceback" not in err
    assert len(BudgetLedger(path).status().releases) == 1


@pytest.mark.parametrize(("flag", "value", "needle"), [("--clip-norm", "1e300", "clip_norm must be in"),
                                                       ("--temperature", "1e-300", "temperature must be in"),
                                                       ("--temperature", "1e300", "temperature must be in")])
def test_epsilon_out_of_range_is_one_line_without_warnings(flag, value, needle):
    # probe: RuntimeWarnings and "half_width must be finite"; run as a user does, with warnings shown
    argv = {"--clip-norm": "0.1", "--max-new-tokens": "100", "--batch-size": "8", "--delta": "1e-6", flag: value}
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "invink_audit.cli", "epsilon",
                           *[x for kv in argv.items() for x in kv]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_BAD_INPUT and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"invink-audit epsilon: error: {needle} "
                                                f"{RANGES[flag.lstrip('-').replace('-', '_')].describe()[3:]}; "
                                                f"got {float(value)!r}"]


@pytest.mark.timeout(HANG_SECONDS)
@pytest.mark.parametrize("accountant", ACCOUNTANTS)
def test_largest_per_token_range_is_reported_finite(accountant, capsys):
    # the extremes of the ranges: C = 1e6, B = 1, tau = 1e-4 gives epsilon0 = 2e10 per token
    T, e0 = 3000, 2e10
    rc, out, _ = _cli(["epsilon", "--clip-norm", "1e6", "--batch-size", "1", "--temperature", "1e-4",
                       "--max-new-tokens", str(T), "--delta", "1e-6", "--accountant", accountant, "--json"], capsys)
    assert rc == EXIT_OK
    eps = json.loads(out)["epsilon"]
    assert math.isfinite(eps)
    # oracle (lower bound): each step played at t = e0 - 20 keeps loss t with probability >= 1 - e^-20,
    # so with probability ~1 the total loss is T (e0 - 20), and delta at any smaller epsilon is ~1
    assert eps >= T * (e0 - 20.0) - 1.0


@pytest.mark.parametrize("e0", [1e3, 1.2e4, 1e5, 2e10])
def test_bounded_range_upper_bound_for_huge_epsilon0(e0):
    # regression: e^(t - e0) * expm1(e0 - t) was 0 * inf = NaN, dropped from the supremum: delta = 0 at
    # e0 >= 12,000 (a release at the top of the ranges was reported as 0.0039-DP)
    exact = (1 - math.exp(-1.0)) * -math.expm1(1.0 - (e0 - 1.0))  # one step at t = e0 - 1, at epsilon = 1
    for T in (1, 5):
        assert br_adaptive_delta(1.0, e0, T).upper >= exact
        assert composed_delta(1.0, e0, T) >= exact


def test_max_tokens_is_capped_at_the_largest_valid_t():
    plan = plan_max_new_tokens(epsilon=10.0, delta=1e-6, clip_norm=1e-6, batch_size=1000, temperature=10.0,
                               accountant="cks")
    assert plan.max_new_tokens == MAX_COUNT


# --- the ranges themselves ------------------------------------------------------------------------------


def test_check_parameter_ranges():
    ok = check_parameter_ranges(epsilon=1e4, delta=1e-300, clip_norm=1e-6, temperature=1e4, max_new_tokens=MAX_COUNT,
                                batch_size=1, texts_per_batch=1, num_batches=MAX_COUNT)
    assert ok["epsilon"] == 1e4 and isinstance(ok["max_new_tokens"], int)
    assert check_parameter_ranges(epsilon=None) == {}
    bad = [("epsilon", 1e4 * (1 + 1e-15)), ("epsilon", 0.0), ("delta", 1.0), ("delta", 5e-324),
           ("clip_norm", math.inf), ("temperature", math.nan), ("max_new_tokens", MAX_COUNT + 1),
           ("batch_size", 2.0), ("texts_per_batch", True), ("num_batches", 0), ("epsilon", "1")]
    for name, value in bad:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            check_parameter_ranges(**{name: value})
    with pytest.raises(TypeError, match="unexpected parameter"):
        check_parameter_ranges(epsilon0=1.0)


def test_ranges_keep_every_derived_quantity_finite():
    # the valid ranges' claim (docs/guide/planning.md), at the corners: epsilon0 and rho stay far from overflow and underflow
    lo = RANGES["clip_norm"].low, RANGES["batch_size"].high, RANGES["temperature"].high
    hi = RANGES["clip_norm"].high, RANGES["batch_size"].low, RANGES["temperature"].low
    e0_min, e0_max = 2 * lo[0] / (lo[1] * lo[2]), 2 * 2 * hi[0] / (hi[1] * hi[2])  # factor 2: naive/zero-out
    steps = RANGES["max_new_tokens"].high * RANGES["texts_per_batch"].high
    assert e0_min**2 / 8 > 1e-300 and steps * e0_max**2 / 8 < 1e300
    assert np.isfinite(composed_epsilon(1e-300, e0_max, MAX_COUNT, "cks"))


def test_the_guide_documents_every_range():
    # the planning guide's "Valid ranges and exit codes" section (the README links to it)
    guide = (Path(__file__).parents[1] / "docs" / "guide" / "planning.md").read_text(encoding="utf-8")
    section = guide.split("\n## Valid ranges and exit codes\n", 1)[1].split("\n## ", 1)[0]
    for name, rng in RANGES.items():
        assert f"`{name}`" in section, name
    for text in ("[1e-6, 1e4]", "[1e-300, 1)", "[1e-6, 1e6]", "[1e-4, 1e4]", "1 .. 10^9"):
        assert text in section, text
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 3 |", "| 4 |", "| 141 |"):
        assert code in section, code
