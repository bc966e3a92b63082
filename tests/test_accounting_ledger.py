"""Budget ledger: refusal before work, composition rules, idempotence, crash and concurrency safety."""

import json
import multiprocessing as mp
import os

import numpy as np
import pytest

from accounting import (
    BudgetExceededError,
    BudgetLedger,
    LedgerError,
    Release,
    composed_epsilon,
    zcdp_to_epsilon,
)


def _release(**kw):
    base = dict(clip_norm=0.2, batch_size=8, temperature=1.0, max_new_tokens=50)
    return Release.of(**{**base, **kw})


@pytest.fixture
def ledger(tmp_path):
    return BudgetLedger.create(tmp_path / "ledger.json", epsilon=3.0, delta=1e-6, accountant="cks")


def test_charge_records_and_composes_sequentially(ledger):
    r1, r2 = _release(label="first"), _release(label="second", max_new_tokens=30)
    e1 = ledger.charge(r1)
    e2 = ledger.charge(r2)
    rho = (50 + 30) * r1.epsilon0**2 / 8  # zCDP adds across releases (sequential composition)
    assert e2["epsilon_spent_after"] == pytest.approx(zcdp_to_epsilon(rho, 1e-6, "cks"))
    assert e1["epsilon_spent_after"] < e2["epsilon_spent_after"]
    status = ledger.status()
    assert status.epsilon_spent == pytest.approx(e2["epsilon_spent_after"])
    assert len(status.releases) == 2 and status.epsilon_remaining == pytest.approx(3.0 - status.epsilon_spent)


def test_parallel_batches_cost_once_reuse_costs_again(ledger):
    many = ledger.preview(_release(num_batches=1000))
    one = ledger.preview(_release(num_batches=1))
    twice = ledger.preview(_release(texts_per_batch=2))
    assert many == one  # disjoint batches compose in parallel (paper Corollary 11, coro:parallel-batches)
    assert twice == pytest.approx(composed_epsilon(1e-6, _release().epsilon0, 100, "cks"))
    assert twice > one


def test_refuses_before_recording(ledger):
    ledger.charge(_release())
    before = ledger.path.read_bytes()
    with pytest.raises(BudgetExceededError, match="over the budget"):
        ledger.charge(_release(clip_norm=5.0, max_new_tokens=500))
    assert ledger.path.read_bytes() == before  # nothing recorded


def test_idempotent_release_id(ledger):
    r = _release(release_id="run-42")
    first = ledger.charge(r)
    again = ledger.charge(_release(release_id="run-42"))
    assert again == first
    assert len(ledger.status().releases) == 1
    with pytest.raises(LedgerError, match="different parameters"):
        ledger.charge(_release(release_id="run-42", clip_norm=0.3))


def test_br_adaptive_ledger_one_release_then_filter(tmp_path):
    led = BudgetLedger.create(tmp_path / "l.json", epsilon=5.0, delta=1e-6)  # default br-adaptive
    a, b = _release(clip_norm=0.2), _release(clip_norm=0.3, max_new_tokens=20)
    first = led.charge(a)
    # a single release is a fixed sequence: the optimal bounded-range composition applies
    assert first["epsilon_spent_after"] == pytest.approx(composed_epsilon(1e-6, a.epsilon0, 50), rel=1e-9)
    assert first["epsilon_spent_after"] < zcdp_to_epsilon(50 * a.epsilon0**2 / 8, 1e-6, "cks")
    entry = led.charge(b)
    # several releases (parameters possibly chosen adaptively): the zCDP filter, sum of rho then CKS
    steps = np.r_[np.full(50, a.epsilon0), np.full(20, b.epsilon0)]
    cks = zcdp_to_epsilon(float(np.sum(steps**2)) / 8, 1e-6, "cks")
    assert entry["epsilon_spent_after"] == pytest.approx(cks, rel=1e-12)
    assert entry["epsilon_spent_after"] > first["epsilon_spent_after"]


def test_crash_during_write_leaves_previous_file(ledger, monkeypatch):
    ledger.charge(_release(label="kept"))
    before = ledger.path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="simulated crash"):
        ledger.charge(_release(label="lost"))
    monkeypatch.undo()
    assert ledger.path.read_bytes() == before
    assert [p.name for p in ledger.path.parent.iterdir() if p.name.endswith(".tmp")] == []
    assert [e["release"]["label"] for e in BudgetLedger(ledger.path).status().releases] == ["kept"]


def test_corrupt_or_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(LedgerError, match="no ledger"):
        BudgetLedger(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LedgerError, match="not valid JSON"):
        BudgetLedger(bad)
    bad.write_text(json.dumps({"format_version": 1, "budget": {"epsilon": -1, "delta": 1e-6},
                               "accountant": "cks", "releases": []}))
    with pytest.raises(LedgerError, match="corrupt"):
        BudgetLedger(bad)
    with pytest.raises(LedgerError, match="already exists"):
        BudgetLedger.create(bad, epsilon=1.0, delta=1e-6)


def _charge_worker(args):
    path, idx = args
    try:
        BudgetLedger(path).charge(_release(label=f"p{idx}", release_id=f"id-{idx}"))
        return True
    except BudgetExceededError:
        return False


def test_concurrent_writers_never_overspend(tmp_path):
    path = tmp_path / "shared.json"
    one = composed_epsilon(1e-6, _release().epsilon0, 50, "cks")
    four = composed_epsilon(1e-6, _release().epsilon0, 200, "cks")
    five = composed_epsilon(1e-6, _release().epsilon0, 250, "cks")
    budget = (four + five) / 2  # exactly four releases fit
    assert one < budget
    BudgetLedger.create(path, epsilon=budget, delta=1e-6, accountant="cks")
    with mp.get_context("spawn").Pool(4) as pool:
        results = pool.map(_charge_worker, [(str(path), i) for i in range(10)])
    assert sum(results) == 4
    status = BudgetLedger(path).status()
    assert len(status.releases) == 4 and status.epsilon_spent <= budget
    assert len({e["release"]["release_id"] for e in status.releases}) == 4


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"clip_norm": 0.0}, "clip_norm"), ({"batch_size": 0}, "batch_size"), ({"temperature": -1.0}, "temperature"),
     ({"max_new_tokens": 0}, "max_new_tokens"), ({"texts_per_batch": 0}, "texts_per_batch"),
     ({"release_id": " "}, "release_id")],
)
def test_bad_release(kw, match):
    with pytest.raises(ValueError, match=match):
        _release(**kw)


def _zcdp(rho=0.3, release_id="amin-1", mechanism="amin"):
    from accounting import ZcdpEvent

    return Release(ZcdpEvent(rho, mechanism), 12, release_id, "amin run")


def _rdp_oracle(*rhos, delta=1e-6):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    for rho in rhos:
        accountant.compose(dp_event.ZCDpEvent(rho))
    return accountant.get_epsilon(delta)


def test_a_zcdp_release_is_charged_by_its_rho_and_composes_with_bounded_range_releases(tmp_path):
    """Amin et al.'s kind of release: its ρ alone, then added to an InvisibleInk release's T·ε0²/8, checked
    against dp-accounting's RDP accountant composing the two as zCDP events."""
    ledger = BudgetLedger.create(tmp_path / "l.json", epsilon=20.0, delta=1e-6, accountant="rdp")
    first = ledger.charge(_zcdp(0.3))
    assert first["rho"] == 0.3 and first["release"]["kind"] == "zcdp"
    assert first["epsilon_spent_after"] == pytest.approx(_rdp_oracle(0.3), rel=1e-9)
    assert first["epsilon_spent_after"] >= zcdp_to_epsilon(0.3, 1e-6, "rdp")  # rounded up, never down
    ours = _release()
    second = ledger.charge(ours)
    assert second["epsilon_spent_after"] == pytest.approx(_rdp_oracle(0.3, ours.num_steps * ours.epsilon0**2 / 8), rel=1e-9)
    reopened = BudgetLedger(tmp_path / "l.json").status()  # every figure recomputed on load
    assert reopened.epsilon_spent == pytest.approx(second["epsilon_spent_after"], rel=1e-12)


def test_a_zcdp_release_replays_by_id_and_its_stored_rho_is_checked(tmp_path):
    path = tmp_path / "l.json"
    ledger = BudgetLedger.create(path, epsilon=5.0, delta=1e-6, accountant="cks")
    entry = ledger.charge(_zcdp(0.2))
    outcome = ledger.charge_once(_zcdp(0.2))
    assert outcome.already_recorded and outcome.entry == entry
    with pytest.raises(LedgerError, match="already recorded with different parameters"):
        ledger.charge(_zcdp(0.25))
    with pytest.raises(BudgetExceededError):
        ledger.charge(_zcdp(50.0, release_id="amin-2"))
    data = json.loads(path.read_text())
    data["releases"][0]["rho"] = 0.01  # the stored figure no longer follows from the release
    path.write_text(json.dumps(data))
    with pytest.raises(LedgerError, match="stores rho=0.01"):
        BudgetLedger(path).status()
    data["releases"][0]["rho"] = 0.2
    data["releases"][0]["release"]["rho"] = 0.01  # a shrunk rho, figures made consistent: the chain sees it
    data["releases"][0]["rho"] = 0.01
    path.write_text(json.dumps(data))
    with pytest.raises(LedgerError):
        BudgetLedger(path).status()


@pytest.mark.parametrize("rho, mechanism", [(0.0, "amin"), (-1.0, "amin"), (float("nan"), "amin"), (1e41, "amin"),
                                            (0.1, ""), (0.1, None)])
def test_a_bad_zcdp_event_is_refused_when_built(rho, mechanism):
    from accounting import ZcdpEvent

    with pytest.raises(ValueError):
        ZcdpEvent(rho, mechanism)


def test_an_unknown_release_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown release kind 'gaussian'"):
        Release.from_json({"kind": "gaussian", "release_id": "x", "label": "", "num_batches": 1})


def test_rho_remaining_says_what_a_next_release_can_spend(tmp_path):
    """After an ε = 8 release of a budget of 10, "10 − 8 = 2" is not spendable (releases add ρ); rho_remaining
    is: a zCDP release of just under it fits, one just over it is refused."""
    from accounting import ZcdpEvent, epsilon_to_zcdp, plan_clip_norm

    path = tmp_path / "l.json"
    ledger = BudgetLedger.create(path, epsilon=10.0, delta=1e-6)
    plan = plan_clip_norm(epsilon=8.0, delta=1e-6, max_new_tokens=48, batch_size=7, temperature=1.0)
    ledger.charge(Release(plan.event, 3, "first"))
    status = ledger.status()
    assert status.rho_spent == pytest.approx(plan.rho_sequence, rel=1e-12)
    assert status.rho_remaining == pytest.approx(epsilon_to_zcdp(10.0, 1e-6, "cks") - plan.rho_sequence, rel=1e-12)
    with pytest.raises(BudgetExceededError):
        ledger.charge(Release(ZcdpEvent(status.rho_remaining * 1.001, "next"), 1, "too-much"))
    entry = ledger.charge(Release(ZcdpEvent(status.rho_remaining * 0.999, "next"), 1, "fits"))
    assert entry["epsilon_spent_after"] <= 10.0
    assert ledger.status().rho_remaining == pytest.approx(0.001 * status.rho_remaining, rel=1e-6)
