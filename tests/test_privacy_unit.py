"""The privacy unit (docs/guide/privacy-unit.md): references sharing a column's value are one unit, bounded by a
public rule (combine, spread, first) before batching.

Checked against independent computations: rule (b)'s accounting (k texts of T tokens composed) against
dp-accounting's composition of zCDP events; the planner's inverses per unit against the forward accountant; the
partition of each rule, by brute force on random unit columns, against what per-unit DP needs (the slots are a
function of file order and the unit column only; a unit's neighbour, every reference null, changes at most k
batches, one slot each, to null); a release on a generated table where one user wrote five references, its records,
its ledger and its audit with per-unit neighbours; the planted bug (a unit in two slots of one batch at the
per-reference ε) a VIOLATION, white-box and in a release audit.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accounting import (
    BudgetLedger,
    GenerationEvent,
    LedgerError,
    Release,
    ZcdpEvent,
    epsilon_for_clip_norm,
    plan_clip_norm,
    plan_max_new_tokens,
)
from invink_audit.data import (
    UNIT_SEPARATOR,
    PrivacyUnit,
    ReferencesFile,
    UnitReferences,
    unit_partition,
)

DELTA = 1e-6
#: dp-accounting's RDP conversion and ours differ by the order grid and float rounding only
RDP_RTOL = 1e-6
#: dp-accounting evaluates the CKS conversion on a grid of orders; ours optimises over all of them
CKS_GRID_RTOL = 1e-3


# ------------------------------------------------------------------------------------------------
# accounting: rule (b) composes k texts; dp-accounting composes the same events


def _dp_accounting_epsilon(rho_token: float, steps: int, k: int, delta: float) -> float:
    """k texts of ``steps`` tokens, each token a ρ_tok-zCDP event, composed by dp-accounting's RDP accountant."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    text = dp_event.SelfComposedDpEvent(dp_event.ZCDpEvent(rho_token), steps)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.ComposedDpEvent([text] * k))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_rule_spread_charges_k_texts_as_dp_accounting_composes_them(k):
    event = GenerationEvent(clip_norm=0.4, batch_size=8, temperature=1.0, max_new_tokens=50, unit_contributions=k)
    assert event.num_steps == 50 * k and event.rho_sequence == pytest.approx(k * 50 * event.rho_token, rel=1e-15)
    oracle = _dp_accounting_epsilon(event.rho_token, 50, k, DELTA)
    ours = event.epsilon(DELTA, "rdp")
    assert ours == pytest.approx(oracle, rel=RDP_RTOL) and ours >= oracle * (1 - 1e-12)  # rounded up, never down
    # CKS's conversion, optimised over every order, is at most dp-accounting's (its grid of orders), and close
    assert oracle * (1 - CKS_GRID_RTOL) <= event.epsilon(DELTA, "cks") <= oracle * (1 + 1e-12)


def test_rule_spread_under_bounded_range_is_k_times_T_steps_and_tighter_than_zcdp():
    per_unit = GenerationEvent(0.4, 8, 1.0, 50, unit_contributions=3)
    one_long_text = GenerationEvent(0.4, 8, 1.0, 150)  # the same k*T adaptively composed eps0-BR steps
    assert per_unit.epsilon(DELTA) == one_long_text.epsilon(DELTA)
    assert per_unit.epsilon(DELTA) <= per_unit.epsilon(DELTA, "cks")
    assert per_unit.epsilon(DELTA) > GenerationEvent(0.4, 8, 1.0, 50).epsilon(DELTA)  # more than one text's


def test_a_zcdp_release_per_unit_is_k_rho_as_dp_accounting_composes_it():
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    event = ZcdpEvent(0.05, "amin", unit_contributions=4)
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.SelfComposedDpEvent(dp_event.ZCDpEvent(0.05), 4))
    assert event.rho_sequence == pytest.approx(0.2, rel=1e-15)
    assert event.epsilon(DELTA, "rdp") == pytest.approx(accountant.get_epsilon(DELTA), rel=RDP_RTOL)
    assert "unit_contributions" not in ZcdpEvent(0.05, "amin").to_json()  # older records unchanged


@given(epsilon=st.floats(0.5, 20.0), k=st.integers(1, 8), tokens=st.integers(1, 300),
       accountant=st.sampled_from(["cks", "rdp", "bun-steinke"]))
def test_the_planner_per_unit_never_overspends(epsilon, k, tokens, accountant):
    _plan_round_trip(epsilon, k, tokens, accountant)


def test_the_planner_per_unit_never_overspends_with_bounded_range():
    for epsilon, k, tokens in ((1.0, 2, 40), (3.0, 5, 100), (10.0, 3, 7)):
        _plan_round_trip(epsilon, k, tokens, "br-adaptive")


def _plan_round_trip(epsilon, k, tokens, accountant):
    """The planned C per unit spends at most ε over k texts, and exactly what one text of k·T tokens spends."""
    common = dict(delta=DELTA, batch_size=8, temperature=1.0, accountant=accountant)
    plan = plan_clip_norm(epsilon=epsilon, max_new_tokens=tokens, unit_contributions=k, **common)
    assert plan.unit_contributions == k and plan.event.num_steps == k * tokens
    spent = epsilon_for_clip_norm(clip_norm=plan.clip_norm, max_new_tokens=tokens, unit_contributions=k, **common).epsilon
    assert spent <= epsilon
    assert spent == epsilon_for_clip_norm(clip_norm=plan.clip_norm, max_new_tokens=tokens * k, **common).epsilon


@pytest.mark.parametrize("k", [1, 3])
def test_max_tokens_per_unit_is_the_largest_T_whose_k_texts_fit(k):
    plan = plan_max_new_tokens(epsilon=3.0, delta=DELTA, clip_norm=0.3, batch_size=8, temperature=1.0,
                               accountant="cks", unit_contributions=k)

    def spent(t):
        return GenerationEvent(0.3, 8, 1.0, t, unit_contributions=k).epsilon(DELTA, "cks")

    assert spent(plan.max_new_tokens) <= 3.0 < spent(plan.max_new_tokens + 1)


# ------------------------------------------------------------------------------------------------
# the ledger names its unit


def _unit_release(unit="user", k=1, release_id=None):
    return Release.of(clip_norm=0.3, batch_size=4, temperature=1.0, max_new_tokens=20, num_batches=3,
                      privacy_unit=unit, unit_contributions=k, **({} if release_id is None else {"release_id": release_id}))


def test_a_ledger_refuses_a_release_of_another_unit_with_the_reason(tmp_path):
    per_user = BudgetLedger.create(tmp_path / "u.json", epsilon=20.0, delta=DELTA, privacy_unit="user")
    per_reference = BudgetLedger.create(tmp_path / "r.json", epsilon=20.0, delta=DELTA)
    with pytest.raises(LedgerError, match="group privacy"):
        per_user.charge(_unit_release(unit=None))
    with pytest.raises(LedgerError, match="per-reference guarantee"):
        per_reference.charge(_unit_release())
    with pytest.raises(LedgerError, match="one guarantee for one unit"):
        per_user.charge(_unit_release(unit="patient"))
    assert per_user.status().releases == () and per_reference.status().releases == ()
    entry = per_user.charge(_unit_release(k=3))
    assert entry["release"]["privacy_unit"] == "user" and entry["release"]["unit_contributions"] == 3
    reopened = BudgetLedger(tmp_path / "u.json").status()  # every figure recomputed, the unit in the chain
    assert reopened.privacy_unit == "user"
    assert reopened.epsilon_spent == GenerationEvent(0.3, 4, 1.0, 20, unit_contributions=3).epsilon(DELTA)


def test_a_ledger_written_before_units_loads_per_reference_and_keeps_its_chain(tmp_path):
    path = tmp_path / "old.json"
    ledger = BudgetLedger.create(path, epsilon=20.0, delta=DELTA)
    ledger.charge(Release.of(clip_norm=0.3, batch_size=4, temperature=1.0, max_new_tokens=20))
    data = json.loads(path.read_text())
    assert "privacy_unit" not in data and "privacy_unit" not in data["releases"][0]["release"]
    assert "unit_contributions" not in data["releases"][0]["release"]  # byte-for-byte the earlier format
    assert BudgetLedger(path).status().privacy_unit is None


def test_editing_a_ledgers_unit_is_caught(tmp_path):
    path = tmp_path / "u.json"
    BudgetLedger.create(path, epsilon=20.0, delta=DELTA, privacy_unit="user").charge(_unit_release())
    for edit in (lambda d: d.pop("privacy_unit"), lambda d: d.update(privacy_unit="patient"),
                 lambda d: d["releases"][0]["release"].pop("privacy_unit")):
        data = json.loads(path.read_text())
        edit(data)
        (tmp_path / "edited.json").write_text(json.dumps(data))
        with pytest.raises(LedgerError, match="corrupt"):
            BudgetLedger(tmp_path / "edited.json")


# ------------------------------------------------------------------------------------------------
# the rules, by brute force on random unit columns


def _neighbour(refs: UnitReferences, unit: int) -> UnitReferences:
    texts = tuple("" if u == unit else t for t, u in zip(refs.texts, refs.units))
    return UnitReferences(texts, refs.units, refs.privacy_unit)


def _ordinals(values) -> tuple[int, ...]:
    seen: dict = {}
    return tuple(seen.setdefault(v, len(seen)) for v in values)


RULES = [PrivacyUnit("u", "combine"), PrivacyUnit("u", "combine", max_chars=7), PrivacyUnit("u", "first"),
         PrivacyUnit("u", "spread", 1), PrivacyUnit("u", "spread", 2), PrivacyUnit("u", "spread", 3)]


@given(values=st.lists(st.integers(0, 6), min_size=6, max_size=40), rule=st.sampled_from(RULES),
       batch_size=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_each_rule_is_public_and_a_units_neighbour_changes_at_most_k_slots_to_null(values, rule, batch_size, seed):
    rng = random.Random(seed)
    units = _ordinals(values)
    refs = UnitReferences(tuple(rng.choice(["", "ab", "cdefgh", "ijk lmn opq"]) for _ in units), units, rule)
    try:
        partition, _, positions = unit_partition(refs, batch_size)
    except ValueError:  # too few references, or too few batches for spread's k: refused before anything runs
        return
    # public: other texts (same unit column, same order) give the same slots
    other = UnitReferences(tuple(f"x{i}" for i in range(len(units))), units, rule)
    other_partition, _, other_positions = unit_partition(other, batch_size)
    assert other_positions == positions and other_partition.units == partition.units
    for batch in partition.units:  # one slot per unit per batch: per-slot neighbours are the unit's
        assert len(set(batch)) == len(batch)
    for unit in set(units):
        changed = 0
        neighbour, _, _ = unit_partition(_neighbour(refs, unit), batch_size)
        for batch, theirs, members in zip(partition.batches, neighbour.batches, partition.units):
            differ = [s for s in range(batch_size) if batch[s] != theirs[s]]
            assert all(members[s] == unit and theirs[s] == "" for s in differ)  # only the unit's slot, to null
            changed += unit in members
        assert changed <= rule.unit_contributions
    if rule.rule.value == "spread":  # each unit's first k references, each kept at most once
        kept = [p for batch in positions for p in batch]
        assert len(kept) == len(set(kept))
        for unit in set(units):
            first_k = [p for p, u in enumerate(units) if u == unit][: rule.unit_contributions]
            assert set(p for p in kept if units[p] == unit) <= set(first_k)


def test_combine_joins_a_units_references_in_file_order_and_cuts_at_the_public_bound():
    refs = UnitReferences(("one", "", "two", "three", ""), (0, 0, 1, 0, 2), PrivacyUnit("u", "combine", max_chars=10))
    partition, _, positions = unit_partition(refs, 3)
    assert partition.batches == (("one" + UNIT_SEPARATOR + "three"[:5], "two", ""),)
    assert positions == ((0, 2, 4),)  # each slot stands at its unit's first record


def test_bad_units_are_refused_without_echoing_a_value(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("user,text\nsecret-alice,a\n,b\n")
    with pytest.raises(ValueError, match="record 2 has no privacy unit value") as err:
        ReferencesFile(path, privacy_unit="user").read()
    assert "secret-alice" not in str(err.value)
    with pytest.raises(ValueError, match="cannot also be the text"):
        ReferencesFile(path, privacy_unit="text").read()
    with pytest.raises(ValueError, match="needs rule 'spread'"):
        PrivacyUnit("user", "combine", 2)
    with pytest.raises(ValueError, match="'combine' only"):
        PrivacyUnit("user", "first", max_chars=5)
    with pytest.raises(ValueError, match="only 1 full batches"):
        unit_partition(UnitReferences(("a", "b", "c"), (0, 0, 1), PrivacyUnit("u", "spread", 2)), 2)


# ------------------------------------------------------------------------------------------------
# a release on a table where one user wrote five references, its records, its ledger and its audit

USERS = ["alice-7731"] * 5 + [f"user-{i:04d}" for i in range(7)]  # alice wrote five of the twelve reviews


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A generated review table with a user column (Yelp's processed files have none): alice's five reviews
    interleaved with seven other users' one each."""
    root = tmp_path_factory.mktemp("units")
    order = [0, 5, 1, 6, 7, 2, 8, 3, 9, 10, 4, 11]
    rows = [(USERS[i], f"Review {i}: the {'soup' if i % 2 else 'bread'} was {'great' if i % 3 else 'cold'}.") for i in order]
    (root / "reviews.jsonl").write_text("".join(json.dumps({"user": u, "text": t}) + "\n" for u, t in rows))
    return root


def _generate(table, tiny_dir, name, *flags):
    from invink_audit.cli import main

    return main(["generate", "--input", str(table / "reviews.jsonl"), "--output", str(table / f"{name}.jsonl"),
                 "--model", str(tiny_dir), "--batch-size", "2", "--max-new-tokens", "4", "--delta", "1e-6",
                 "--clip-norm", "0.5", "--top-k", "8", "--no-progress", "--json", *flags])


@pytest.mark.parametrize("rule", [["--unit-rule", "combine", "--unit-max-chars", "120"],
                                  ["--unit-rule", "spread", "--unit-max-references", "3"]])
def test_a_per_user_release_states_its_unit_in_records_and_ledger_and_passes_its_audit(table, tiny_dir, rule, capsys):
    from invink_audit.audit.quick import audit_release_file
    from invink_audit.audit.stats import Verdict
    from invink_audit.cli import main

    name = rule[1]
    ledger = table / f"{name}-ledger.json"
    assert main(["ledger", "init", str(ledger), "--epsilon", "50", "--delta", "1e-6", "--privacy-unit", "user"]) == 0
    capsys.readouterr()
    assert _generate(table, tiny_dir, name, "--privacy-unit", "user", "--ledger", str(ledger), *rule) == 0
    summary = json.loads(capsys.readouterr().out)
    k = 3 if name == "spread" else 1
    event = GenerationEvent(0.5, 2, 1.0, 4, unit_contributions=k)
    assert summary["privacy_unit"]["column"] == "user" and summary["privacy_unit"]["rule"] == name
    assert summary["guarantee"]["epsilon"] == pytest.approx(event.epsilon(DELTA), rel=1e-12)
    records = [json.loads(line) for line in (table / f"{name}.jsonl").read_text().splitlines()]
    for record in records:
        assert record["guarantee_protects"] == "one privacy unit (the references sharing a 'user' value)"
        assert record["run"]["privacy_unit"]["unit_contributions"] == k and record["guarantee"] == summary["guarantee"]
    # who wrote what is not written anywhere beside the texts
    for path in table.glob(f"{name}.jsonl*"):
        assert not any(user in path.read_text() for user in USERS), path.name
    entry = BudgetLedger(ledger).status().releases[0]
    assert entry["release"]["privacy_unit"] == "user" and entry["epsilon_spent_after"] == summary["guarantee"]["epsilon"]
    report = audit_release_file(table / f"{name}.jsonl", table / "reviews.jsonl", model=str(tiny_dir), sampled_batch=None,
                                privacy_unit="user")
    assert report.verdict is Verdict.PASS and report.findings == ()
    with pytest.raises(ValueError, match="not one unit of 'patient'"):
        audit_release_file(table / f"{name}.jsonl", table / "reviews.jsonl", model=str(tiny_dir), sampled_batch=None,
                           privacy_unit="patient")
    capsys.readouterr()
    cli = ["audit", "--release", str(table / f"{name}.jsonl"), "--input", str(table / "reviews.jsonl"), "--model",
           str(tiny_dir), "--sampled-batch", "none", "--json", "--privacy-unit"]
    assert main([*cli, "user"]) == 0 and json.loads(capsys.readouterr().out)["verdict"] == "PASS"
    assert main([*cli, "patient"]) == 2 and "not one unit of 'patient'" in capsys.readouterr().err


def test_epsilon_under_spread_is_the_units_and_the_clip_norm_is_planned_for_its_k_texts(table, tiny_dir, capsys):
    """``generate --epsilon 4 --unit-rule spread --unit-max-references 3`` states and charges (at most) 4 per user, the
    clip norm planned for 3·T composed steps (the `plan --unit-max-references 3` C); a baseline refuses the pair."""
    from accounting import plan_clip_norm
    from invink_audit.cli import main

    common = ["generate", "--input", str(table / "reviews.jsonl"), "--model", str(tiny_dir), "--batch-size", "2",
              "--max-new-tokens", "4", "--delta", "1e-6", "--epsilon", "4", "--top-k", "8", "--no-progress", "--json",
              "--privacy-unit", "user", "--unit-rule", "spread", "--unit-max-references", "3"]
    assert main([*common, "--output", str(table / "eps.jsonl")]) == 0
    summary = json.loads(capsys.readouterr().out)
    plan = plan_clip_norm(epsilon=4.0, delta=DELTA, max_new_tokens=4, batch_size=2, temperature=1.0, unit_contributions=3)
    assert summary["guarantee"]["clip_norm"] == pytest.approx(plan.clip_norm, rel=1e-12)
    assert 3.99 < summary["guarantee"]["epsilon"] <= 4.0  # per user: three texts composed, not three times 4
    assert main([*common, "--output", str(table / "amin.jsonl"), "--mechanism", "amin"]) == 2
    assert "planned per unit for InvisibleInk only" in capsys.readouterr().err


def test_a_per_reference_ledger_refuses_a_per_user_release_and_nothing_is_generated(table, tiny_dir, capsys):
    from invink_audit.cli import main

    ledger = table / "per-reference.json"
    assert main(["ledger", "init", str(ledger), "--epsilon", "50", "--delta", "1e-6"]) == 0
    assert _generate(table, tiny_dir, "refused", "--privacy-unit", "user", "--ledger", str(ledger)) == 2
    assert "per-reference guarantee" in capsys.readouterr().err
    output = table / "refused.jsonl"
    assert BudgetLedger(ledger).status().releases == () and (not output.exists() or not output.read_text().strip())


def test_the_planted_bug_a_unit_in_two_slots_at_the_per_reference_epsilon_is_a_violation():
    """White-box on the self-test's sources (exact per-step checks: the unit moves each step by twice the claimed
    range), and as a release-audit finding for a partition that gives a unit two slots of one batch."""
    import torch

    from invink_audit.audit import selftest
    from invink_audit.audit.release_checks import FINDING_KINDS, unit_findings
    from invink_audit.audit.stats import Verdict
    from invink_audit.audit.units import UnitPlacement
    from invink_audit.audit.whitebox import WhiteBoxConfig
    from invink_audit.data import Partition

    s = selftest.SelfTestSettings(num_samples=150, num_is_samples=40, baselines=False)
    config = WhiteBoxConfig(alphas=s.alphas, num_samples=s.num_samples, num_is_samples=s.num_is_samples)
    bug = selftest.unit_two_slots(s)
    honest = selftest.synthetic.AuditedMechanism("one-slot", "", UnitPlacement(bug.mechanism.config, range(4)),
                                                 s.max_new_tokens, "PASS")  # fmt: skip
    for source in selftest.selftest_sources(s):
        for audited, verdict, ratio in ((bug, Verdict.VIOLATION, 2.0), (honest, Verdict.PASS, 1.0)):
            report, record = selftest._audit_on_source(audited, source, config, s, torch.Generator().manual_seed(7))
            row = selftest._source_row(report, record, source)
            assert report.verdict is verdict and row["max_loss_range_over_epsilon0"] == pytest.approx(ratio, abs=1e-9)
    doubled = Partition((("a", "b"), ("c", "d")), 2, 4, 0, 0, units=((0, 1), (2, 2)))
    (finding,) = unit_findings(doubled)
    assert finding.kind == "unit-in-two-slots" and finding.batches == (1,)
    assert FINDING_KINDS["unit-in-two-slots"] is Verdict.VIOLATION
    assert unit_findings(dataclasses.replace(doubled, units=((0, 1), (2, 3)))) == []


def test_a_black_box_canary_unit_fills_and_empties_all_its_slots():
    """A generator that leaks only what a unit wrote twice: invisible to a one-slot canary, a VIOLATION of its
    per-unit claim with the canary unit in two slots (docs/guide/privacy-unit.md)."""
    from invink_audit.audit.blackbox import blackbox_audit
    from invink_audit.audit.stats import Verdict

    canary = "zebra quartz lantern"
    seen = []

    def leaky(references):
        seen.append(tuple(references))
        return canary if sum(r == canary for r in references) >= 2 else "a public text"

    refs = ["one", "two", "three", "four"]
    common = dict(claimed_epsilon=1.0, claimed_delta=1e-6, num_trials=200, scores=["canary-overlap"])
    assert blackbox_audit(leaky, refs, canary, canary_slot=0, **common).verdict is Verdict.INCONCLUSIVE
    seen.clear()
    assert blackbox_audit(leaky, refs, canary, canary_slot=(0, 2), **common).verdict is Verdict.VIOLATION
    assert {(b[0], b[2]) for b in seen} == {(canary, canary), (None, None)} and {b[1] for b in seen} == {"two"}
    with pytest.raises(ValueError, match="distinct slots"):
        blackbox_audit(leaky, refs, canary, canary_slot=(1, 1), **common)


def test_profile_plans_each_point_per_unit():
    from invink_audit.evaluation.profile import ProfileConfig

    unit = PrivacyUnit("user", "spread", 3)
    point = ProfileConfig(epsilons=(3.0,), batch_sizes=(4,), max_new_tokens=32, privacy_unit=unit).points()[0]
    per_unit = plan_clip_norm(epsilon=3.0, delta=1e-6, max_new_tokens=32, batch_size=4, temperature=1.0,
                              unit_contributions=3)
    assert point.clip_norm == per_unit.clip_norm
    assert point.clip_norm < ProfileConfig(epsilons=(3.0,), batch_sizes=(4,), max_new_tokens=32).points()[0].clip_norm
    with pytest.raises(ValueError, match="where with a privacy unit"):
        ProfileConfig(epsilons=(3.0,), batch_sizes=(4,), privacy_unit="user", where={"label1": "x"})


def test_quick_audit_of_a_per_user_result_uses_its_partition_and_checks_the_references_given(table, tiny):
    from invink_audit.audit.quick import quick_audit
    from invink_audit.audit.stats import Verdict
    from invink_audit.generation import GenerationConfig, generate

    unit = PrivacyUnit("user", "spread", 2)
    references = ReferencesFile(table / "reviews.jsonl", privacy_unit=unit)
    config = GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, clip_norm=0.5, top_k=8)
    result = generate(references, config, model=tiny)
    assert result.privacy_unit == unit and result.guarantee.epsilon == GenerationEvent(
        0.5, 2, 1.0, 4, unit_contributions=2).epsilon(DELTA)
    assert all(len(set(units)) == 2 for units in result.partition.units)
    report = quick_audit(result, references, model=tiny, sampled_batch=None)
    assert report.verdict is Verdict.PASS and report.findings == ()
    with pytest.raises(ValueError, match="another privacy unit or rule"):
        quick_audit(result, ReferencesFile(table / "reviews.jsonl", privacy_unit="user"), model=tiny, sampled_batch=None)
    with pytest.raises(ValueError, match="disagree"):
        quick_audit(result, ReferencesFile(table / "reviews.jsonl"), model=tiny, sampled_batch=None)


def test_the_unit_flags_are_refused_where_they_cannot_apply(table, capsys):
    from invink_audit.cli import main

    base = ["generate", "--input", str(table / "reviews.jsonl"), "--output", str(table / "x.jsonl"), "--batch-size", "2",
            "--max-new-tokens", "4", "--delta", "1e-6", "--clip-norm", "0.5"]
    for flags, message in ((["--unit-rule", "spread"], "--unit-rule is only used with --privacy-unit"),
                           (["--privacy-unit", "user", "--where", "user=x"], "--where with --privacy-unit"),
                           (["--privacy-unit", "user", "--unit-max-references", "2"], "needs rule 'spread'"),
                           (["--privacy-unit", "user", "--mechanism", "augpe"], "not supported by --mechanism augpe")):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    ledger = table / "shown.json"
    assert main(["ledger", "init", str(ledger), "--epsilon", "9", "--delta", "1e-6", "--privacy-unit", "user"]) == 0
    assert main(["ledger", "charge", str(ledger), "--batch-size", "2", "--max-new-tokens", "4", "--clip-norm", "0.5",
                 "--privacy-unit", "user", "--unit-max-references", "3"]) == 0
    capsys.readouterr()
    assert main(["ledger", "show", str(ledger)]) == 0
    shown = capsys.readouterr().out
    assert "protecting one privacy unit (all references sharing a 'user' value)" in shown and "x3 batches per unit" in shown
