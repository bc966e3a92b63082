"""The budget ledger's integrity: links, tampering, replays, read-only use and file mode, exit codes and
messages. Each test reproduces the probe that found a defect."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from accounting import BudgetExceededError, BudgetLedger, LedgerError, Release, zcdp_to_epsilon
from accounting.ledger import _with_chain
from invink_audit.cli import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_FAILURE,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    main,
)

DATA = Path(__file__).parent / "data"
#: Format-1 ledgers written by the code before the hash chain (commit 92b9310), two releases each.
FORMAT1_FIXTURES = ["ledger_v1_cks.json", "ledger_v1_br-adaptive.json"]
#: A format-2 ledger written by the code before ``head`` bound the release count (commit 29f9563): three
#: releases, the last a zCDP one.
FORMAT2_FIXTURE = "ledger_v2_cks.json"


def _release(**kw):
    base = dict(clip_norm=0.2, batch_size=8, temperature=1.0, max_new_tokens=50)
    return Release.of(**{**base, **kw})


@pytest.fixture
def ledger(tmp_path):
    led = BudgetLedger.create(tmp_path / "ledger.json", epsilon=5.0, delta=1e-6, accountant="cks")
    led.charge(_release(release_id="a", label="first"))
    led.charge(_release(release_id="b", clip_norm=0.3, max_new_tokens=20))
    led.charge(_release(release_id="c", clip_norm=0.1, texts_per_batch=3))
    return led


def _cli(argv, capsys):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


# --- item 3: links ---------------------------------------------------------------------------------


def test_symlinked_ledger_charges_the_target_and_stays_a_link(tmp_path, capsys):
    # probe: proj/ledger.json -> ../shared/reviews.json; os.replace swapped the link for a regular file,
    # the shared ledger was never charged and the lock was taken on the link's name
    (tmp_path / "proj").mkdir()
    (tmp_path / "shared").mkdir()
    target = tmp_path / "shared" / "reviews.json"
    BudgetLedger.create(target, epsilon=3.0, delta=1e-6, accountant="cks")
    link = tmp_path / "proj" / "ledger.json"
    link.symlink_to(Path("..") / "shared" / "reviews.json")
    rc, out, _ = _cli(["ledger", "charge", link, "--clip-norm", "0.2", "--batch-size", "8", "--max-new-tokens", "50",
                       "--release-id", "r1"], capsys)
    assert rc == EXIT_OK and "charged r1" in out
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "shared", "reviews.json")
    assert [e["release"]["release_id"] for e in BudgetLedger(target).status().releases] == ["r1"]
    assert (tmp_path / "shared" / "reviews.json.lock").exists()
    assert not (tmp_path / "proj" / "ledger.json.lock").exists()
    assert BudgetLedger(link).path == target.resolve()


def test_hard_linked_ledger_is_refused_for_writing(ledger, tmp_path):
    # os.replace gives one name a new file: the other hard link would silently keep the old ledger
    other = tmp_path / "other-name.json"
    os.link(ledger.path, other)
    before = ledger.path.read_bytes()
    with pytest.raises(LedgerError, match="hard links"):
        BudgetLedger(other).charge(_release(release_id="d"))
    assert ledger.path.read_bytes() == before == other.read_bytes()
    assert len(BudgetLedger(other).status().releases) == 3  # reading is fine


# --- item 4: tampered or inconsistent ledgers --------------------------------------------------------


def _raise_budget(d):
    d["budget"]["epsilon"] = 50.0


def _delete_first(d):
    del d["releases"][0]


def _delete_last(d):
    del d["releases"][-1]


def _delete_all(d):
    d["releases"] = []


def _truncate_with_previous_chain_as_head(d):
    # probe (privacy-hygiene issue): the last release deleted and the chain value before it copied into
    # 'head' loaded, because a format-2 head was the last chain value, which the file also stores
    del d["releases"][-1]
    d["head"] = d["releases"][-1]["chain"]


def _truncate_two_with_first_chain_as_head(d):
    del d["releases"][-2:]
    d["head"] = d["releases"][0]["chain"]


def _truncate_and_relabel_as_format2(d):
    # the same truncation relabelled as a format-2 file, whose head was the last chain value
    _truncate_with_previous_chain_as_head(d)
    d["format_version"] = 2


def _drop_head(d):
    del d["head"]


def _releases_wrong_type(d):
    d["releases"] = {}


def _duplicate_id(d):
    d["releases"].append(dict(d["releases"][0]))


def _shrink_clip_norm(d):
    d["releases"][1]["release"]["clip_norm"] = 0.01


def _shrink_clip_norm_consistently(d):
    # the attacker also fixes epsilon0 and every later spend: only the hash chain sees it
    led_releases = [Release.from_json(e["release"]) for e in d["releases"]]
    led_releases[0] = Release.from_json({**d["releases"][0]["release"], "clip_norm": 0.01})
    d["releases"][0]["release"]["clip_norm"] = 0.01
    d["releases"][0]["epsilon0"] = led_releases[0].epsilon0
    for k, entry in enumerate(d["releases"]):
        rho = sum(r.num_steps * r.epsilon0**2 / 8 for r in led_releases[: k + 1])
        entry["epsilon_spent_after"] = zcdp_to_epsilon(rho, 1e-6, "cks")


def _change_accountant(d):
    d["accountant"] = "bun-steinke"


def _change_adjacency(d):
    d["releases"][2]["release"]["adjacency"] = "zero-out"


def _negative_spend(d):
    d["releases"][0]["epsilon_spent_after"] = -1.0


def _understated_spend(d):
    d["releases"][2]["epsilon_spent_after"] *= 0.5


def _wrong_num_steps(d):
    d["releases"][2]["num_steps"] = 1


def _missing_parameter(d):
    del d["releases"][1]["release"]["adjacency"]  # would silently default to replace-by-null


#: each edit and the check that catches it (figures first, then the hash chain)
TAMPERS = [
    (_raise_budget, "hash chain breaks at release #1"),
    (_delete_first, r"release #1 \('b'\) stores epsilon_spent_after"),
    (_delete_last, "'head' does not match"),
    (_delete_all, "'head' does not match"),
    (_truncate_with_previous_chain_as_head, "'head' does not match the hash chain and its 2 release"),
    (_truncate_two_with_first_chain_as_head, "'head' does not match the hash chain and its 1 release"),
    (_truncate_and_relabel_as_format2, "hash chain breaks at release #1"),
    (_drop_head, "'head' does not match"),
    (_releases_wrong_type, "'releases' must be a JSON array"),
    (_duplicate_id, "recorded twice"),
    (_shrink_clip_norm, r"release #2 \('b'\) stores epsilon0"),
    (_shrink_clip_norm_consistently, "hash chain breaks at release #1"),
    (_change_accountant, r"the releases up to it spend .* \(bun-steinke"),
    (_change_adjacency, r"release #3 \('c'\) stores epsilon0"),
    (_negative_spend, "not a finite number >= 0"),
    (_understated_spend, r"release #3 \('c'\) stores epsilon_spent_after"),
    (_wrong_num_steps, "num_steps=1"),
    (_missing_parameter, "lacks 'adjacency'"),
]


@pytest.mark.parametrize(("tamper", "caught_by"), TAMPERS, ids=[t.__name__.strip("_") for t, _ in TAMPERS])
def test_tampered_ledger_is_refused(ledger, tamper, caught_by, capsys):
    _edit(ledger.path, tamper)
    with pytest.raises(LedgerError, match="corrupt or was edited") as info:
        BudgetLedger(ledger.path)
    assert info.match(caught_by)
    for argv in (["ledger", "show", ledger.path],
                 ["ledger", "charge", ledger.path, "--clip-norm", "0.1", "--batch-size", "8", "--max-new-tokens", "5"]):
        rc, out, err = _cli(argv, capsys)
        assert rc == EXIT_BAD_INPUT and out == "" and "refusing to use it" in err and len(err.splitlines()) == 1


def test_consistent_rewrite_loads_but_changes_the_head(ledger):
    # documented limit: without a secret, a whole-chain rewrite is accepted; the head shows it
    head = ledger.status().head
    data = json.loads(ledger.path.read_text())
    del data["releases"][-1]
    ledger.path.write_text(json.dumps(_with_chain(data)))
    rewritten = BudgetLedger(ledger.path).status()
    assert len(rewritten.releases) == 2 and rewritten.head != head


def test_chain_and_head_are_recorded(ledger):
    data = json.loads(ledger.path.read_text())
    assert data["format_version"] == 3
    assert data["head"] == ledger.status().head
    chains = {e["chain"] for e in data["releases"]}
    assert len(chains) == 3
    assert data["head"] not in chains  # a truncated ledger needs a head stored nowhere in the file


def test_head_commits_to_the_release_count(ledger):
    import hashlib

    data = json.loads(ledger.path.read_text())
    last = data["releases"][-1]["chain"]
    expected = hashlib.sha256(b"invink-audit ledger head v3\n" + last.encode() + b"\n3").hexdigest()
    assert data["head"] == expected  # an independent recomputation of the documented construction
    empty = BudgetLedger.create(ledger.path.parent / "empty.json", epsilon=1.0, delta=1e-6)
    stored = json.loads(empty.path.read_text())
    assert stored["releases"] == [] and stored["head"] == empty.status().head


# --- format 1 ledgers (written before the chain) --------------------------------------------------------


@pytest.mark.parametrize("name", FORMAT1_FIXTURES)
def test_format1_ledger_loads_and_migrates_at_the_next_charge(tmp_path, name):
    path = tmp_path / name
    shutil.copy(DATA / name, path)
    original = json.loads(path.read_text())
    status = BudgetLedger(path).status()
    assert status.format_version == 1 and status.head is None
    assert status.epsilon_spent == pytest.approx(original["releases"][-1]["epsilon_spent_after"], rel=1e-12)
    # a replay writes nothing, so it does not migrate either
    before = path.read_bytes()
    outcome = BudgetLedger(path).charge_once(Release.from_json(original["releases"][0]["release"]))
    assert outcome.already_recorded and path.read_bytes() == before
    BudgetLedger(path).charge(_release(release_id="third", clip_norm=0.05, max_new_tokens=10))
    migrated = json.loads(path.read_text())
    assert migrated["format_version"] == 3 and migrated["head"] == BudgetLedger(path).status().head
    for old, new in zip(original["releases"], migrated["releases"]):
        assert {k: v for k, v in new.items() if k != "chain"} == old
    status = BudgetLedger(path).status()
    assert status.format_version == 3 and len(status.releases) == 3
    _edit(path, _delete_last)  # the chain now protects the migrated ledger
    with pytest.raises(LedgerError, match="head"):
        BudgetLedger(path)


def test_format1_strip_of_a_truncated_ledger_loads_as_documented(ledger):
    # documented limit (docs/guide/planning.md, "Integrity"): format 1 has no chain to check, so a ledger
    # stripped back to format 1 loads; its status says so (no head), and the next charge rechains it
    def strip(d):
        del d["releases"][-1], d["head"]
        for entry in d["releases"]:
            del entry["chain"]
        d["format_version"] = 1

    _edit(ledger.path, strip)
    status = BudgetLedger(ledger.path).status()
    assert status.format_version == 1 and status.head is None and len(status.releases) == 2


# --- format 2 ledgers (written before the head bound the release count) ---------------------------------


def test_format2_ledger_loads_and_migrates_at_the_next_charge(tmp_path):
    path = tmp_path / FORMAT2_FIXTURE
    shutil.copy(DATA / FORMAT2_FIXTURE, path)
    original = json.loads(path.read_text())
    status = BudgetLedger(path).status()
    assert status.format_version == 2 and status.head == original["head"] == original["releases"][-1]["chain"]
    assert len(status.releases) == 3 and status.rho_spent > 0
    before = path.read_bytes()
    assert BudgetLedger(path).charge_once(Release.from_json(original["releases"][0]["release"])).already_recorded
    assert path.read_bytes() == before  # a replay writes nothing, so it does not migrate either
    BudgetLedger(path).charge(_release(release_id="fourth", clip_norm=0.05, max_new_tokens=10))
    migrated = json.loads(path.read_text())
    assert migrated["format_version"] == 3 and migrated["head"] == BudgetLedger(path).status().head
    for old, new in zip(original["releases"], migrated["releases"]):
        assert {k: v for k, v in new.items() if k != "chain"} == {k: v for k, v in old.items() if k != "chain"}
    _edit(path, _truncate_with_previous_chain_as_head)  # now detected
    with pytest.raises(LedgerError, match="'head' does not match the hash chain and its 3 release"):
        BudgetLedger(path)


def test_format2_ledger_is_still_checked_by_its_chain(tmp_path):
    path = tmp_path / FORMAT2_FIXTURE
    shutil.copy(DATA / FORMAT2_FIXTURE, path)
    _edit(path, _delete_last)
    with pytest.raises(LedgerError, match="'head' does not match"):
        BudgetLedger(path)
    shutil.copy(DATA / FORMAT2_FIXTURE, path)
    _edit(path, _truncate_with_previous_chain_as_head)
    # documented limit: a format-2 head is the last chain value, so this truncation of a format-2 file
    # (never charged since the upgrade) loads; the next charge writes format 3
    assert len(BudgetLedger(path).status().releases) == 2


def test_format1_ledger_figures_are_cross_checked(tmp_path):
    path = tmp_path / "old.json"
    shutil.copy(DATA / FORMAT1_FIXTURES[0], path)
    _edit(path, lambda d: d["releases"][0]["release"].update(clip_norm=0.01))
    with pytest.raises(LedgerError, match="epsilon0"):
        BudgetLedger(path)


# --- item 14: replays, read-only use, file mode --------------------------------------------------------


def test_dry_run_of_a_recorded_release_reports_no_new_spend(ledger, capsys):
    charge = ["ledger", "charge", ledger.path, "--clip-norm", "0.2", "--batch-size", "8", "--max-new-tokens", "50",
              "--release-id", "a"]
    spent = ledger.status().epsilon_spent
    rc, out, _ = _cli([*charge, "--dry-run"], capsys)
    assert rc == EXIT_OK and "already recorded" in out and "spends nothing" in out and f"{spent:.6g}" in out
    rc, out, _ = _cli([*charge, "--dry-run", "--json"], capsys)
    assert rc == EXIT_OK and json.loads(out) == {"epsilon_spent_after": spent, "fits": True, "already_recorded": True}
    assert ledger.preview(_release(release_id="a", label="first")) == spent
    with pytest.raises(LedgerError, match="different parameters"):
        ledger.preview(_release(release_id="a", clip_norm=0.25))


def test_idempotent_replay_says_already_charged_and_writes_nothing(ledger, capsys):
    before = ledger.path.read_bytes()
    rc, out, _ = _cli(["ledger", "charge", ledger.path, "--clip-norm", "0.2", "--batch-size", "8",
                       "--max-new-tokens", "50", "--release-id", "a"], capsys)
    assert rc == EXIT_OK and out.startswith("already charged: release 'a'") and "charged a:" not in out
    assert ledger.path.read_bytes() == before
    outcome = ledger.charge_once(_release(release_id="a", label="first"))
    assert outcome.already_recorded and outcome.epsilon_spent == ledger.status().epsilon_spent
    fresh = ledger.charge_once(_release(release_id="d", max_new_tokens=5))
    assert not fresh.already_recorded and fresh.entry["release"]["release_id"] == "d"


def test_show_takes_no_lock(ledger, monkeypatch, capsys):
    # probe: `ledger show` failed in a read-only directory because it created <ledger>.lock
    lock = Path(str(ledger.path) + ".lock")
    lock.unlink()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("accounting.ledger.FileLock.acquire", refuse)
    rc, out, _ = _cli(["ledger", "show", ledger.path], capsys)
    assert rc == EXIT_OK and "spent epsilon" in out
    assert BudgetLedger(ledger.path).preview(_release(release_id="e")) > 0
    assert not lock.exists()
    rc, out, err = _cli(["ledger", "charge", ledger.path, "--clip-norm", "0.1", "--batch-size", "8",
                         "--max-new-tokens", "5"], capsys)
    assert rc == EXIT_BAD_INPUT and "cannot lock" in err and "writable directory" in err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores directory permissions")
def test_show_in_a_read_only_directory(ledger, capsys):
    Path(str(ledger.path) + ".lock").unlink()
    ledger.path.parent.chmod(0o555)
    try:
        rc, out, _ = _cli(["ledger", "show", ledger.path], capsys)
    finally:
        ledger.path.parent.chmod(0o755)
    assert rc == EXIT_OK and "spent epsilon" in out


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600])
def test_charge_keeps_the_file_mode(ledger, mode):
    ledger.path.chmod(mode)
    ledger.charge(_release(release_id="d", max_new_tokens=5))
    assert stat.S_IMODE(ledger.path.stat().st_mode) == mode


def test_new_ledger_is_owner_only(tmp_path):
    led = BudgetLedger.create(tmp_path / "new.json", epsilon=1.0, delta=1e-6)
    assert stat.S_IMODE(led.path.stat().st_mode) == 0o600


# --- item 15: exit codes and messages ------------------------------------------------------------------


def test_exit_codes_are_distinct():
    codes = [EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE, EXIT_OVER_BUDGET, EXIT_BROKEN_PIPE]
    assert len(set(codes)) == len(codes) and EXIT_OVER_BUDGET == 4


def test_over_budget_has_its_own_exit_code(ledger, capsys):
    big = ["ledger", "charge", ledger.path, "--clip-norm", "2", "--batch-size", "8", "--max-new-tokens", "500"]
    rc, out, _ = _cli([*big, "--dry-run"], capsys)  # was 1
    assert rc == EXIT_OVER_BUDGET and "EXCEED" in out
    rc, out, err = _cli(big, capsys)  # was 2, like bad input
    assert rc == EXIT_OVER_BUDGET and out == "" and "over the budget" in err and len(err.splitlines()) == 1
    with pytest.raises(BudgetExceededError):
        ledger.charge(_release(clip_norm=2.0, max_new_tokens=500))


def test_init_on_a_directory_says_so(tmp_path, capsys):
    rc, _, err = _cli(["ledger", "init", tmp_path, "--epsilon", "1", "--delta", "1e-6"], capsys)
    assert rc == EXIT_BAD_INPUT and "is a directory" in err and "already exists" not in err
    rc, _, err = _cli(["ledger", "show", tmp_path], capsys)
    assert rc == EXIT_BAD_INPUT and "is a directory" in err
    with pytest.raises(LedgerError, match="is a directory"):
        BudgetLedger.create(tmp_path, epsilon=1.0, delta=1e-6)


def test_missing_ledger_message_uses_cli_terms(tmp_path, capsys):
    rc, _, err = _cli(["ledger", "show", tmp_path / "none.json"], capsys)
    assert rc == EXIT_BAD_INPUT and "invink-audit ledger init" in err and "BudgetLedger" not in err


@pytest.mark.parametrize("value", ["-inf", "-1", "-1e-6", "-0.5", "-nan"])
def test_negative_numbers_reach_the_range_check(tmp_path, value, capsys):
    # probe: `--epsilon -inf` gave argparse's "expected one argument"
    rc, _, err = _cli(["ledger", "init", tmp_path / "l.json", "--epsilon", value, "--delta", "1e-6"], capsys)
    assert rc == EXIT_BAD_INPUT and "expected one argument" not in err
    assert "epsilon must be in [1e-06, 10000]" in err and f"got {float(value)!r}" in err


def test_show_into_a_closed_pipe_exits_quietly(ledger):
    # probe: `ledger show | head -1` printed "Broken pipe"
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "invink_audit.cli", "ledger", "show", str(ledger.path)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == EXIT_BROKEN_PIPE and proc.stderr == ""


def test_bench_rejects_b0_before_printing(capsys):
    rc, out, err = _cli(["bench", "--batch-size", "0"], capsys)
    assert rc == EXIT_BAD_INPUT and out == ""
    assert err.splitlines() == ["invink-audit bench: error: --batch-size must be an integer >= 1; got 0"]
