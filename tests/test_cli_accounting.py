"""The planning and ledger commands of the CLI."""

import json
import subprocess
import sys

import pytest

from accounting import epsilon_for_clip_norm, plan_clip_norm
from invink_audit.cli import EXIT_OVER_BUDGET, main

PLAN_KEYS = ["clip_norm", "rho_token", "rho_sequence", "epsilon", "delta", "accountant"]
PLAN_ARGS = ["--epsilon", "3", "--delta", "1e-6", "--max-new-tokens", "200", "--batch-size", "8", "--temperature", "1.1"]


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_json_has_exactly_the_documented_keys(capsys):
    rc, out, _ = _run(["plan", *PLAN_ARGS, "--accountant", "cks", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    assert list(data) == PLAN_KEYS
    expected = plan_clip_norm(epsilon=3, delta=1e-6, max_new_tokens=200, batch_size=8, temperature=1.1,
                              accountant="cks")
    assert data["clip_norm"] == expected.clip_norm and data["accountant"] == "cks"


def test_plan_text_mentions_forward_rows(capsys):
    rc, out, _ = _run(["plan", *PLAN_ARGS, "--accountant", "cks"], capsys)
    assert rc == 0 and "B+1 = 9 forward rows" in out and "clip norm" in out


def test_epsilon_command_inverts_plan(capsys):
    plan = plan_clip_norm(epsilon=2, delta=1e-5, max_new_tokens=100, batch_size=4, temperature=1.0,
                          accountant="cks")
    rc, out, _ = _run(["epsilon", "--clip-norm", repr(plan.clip_norm), "--max-new-tokens", "100",
                       "--batch-size", "4", "--temperature", "1.0", "--delta", "1e-5", "--accountant", "cks",
                       "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and list(data) == PLAN_KEYS
    assert data["epsilon"] <= 2.0 and data["epsilon"] == pytest.approx(2.0, rel=1e-6)
    assert data["epsilon"] == epsilon_for_clip_norm(clip_norm=plan.clip_norm, max_new_tokens=100, batch_size=4,
                                                    temperature=1.0, delta=1e-5, accountant="cks").epsilon


def test_max_tokens_min_batch_and_table(capsys):
    rc, out, _ = _run(["max-tokens", "--epsilon", "1", "--delta", "1e-6", "--clip-norm", "0.0829",
                       "--batch-size", "7", "--temperature", "1.2", "--accountant", "cks", "--json"], capsys)
    assert rc == 0 and json.loads(out)["max_new_tokens"] == 500
    rc, out, _ = _run(["min-batch-size", "--epsilon", "1", "--delta", "1e-6", "--max-new-tokens", "500",
                       "--clip-norm", "0.0829", "--temperature", "1.2", "--accountant", "cks", "--json"], capsys)
    assert rc == 0 and json.loads(out)["batch_size"] == 7
    rc, out, _ = _run(["table", "--epsilons", "1,3", "--batch-sizes", "4,8", "--accountant", "cks", "--json"], capsys)
    rows = json.loads(out)
    assert rc == 0 and len(rows) == 4 and rows[1]["forward_rows_per_token"] == 9


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [("--epsilon", "0", "epsilon"), ("--epsilon", "nan", "epsilon"), ("--delta", "1", "delta"),
     ("--delta", "0", "delta"), ("--batch-size", "0", "batch_size"), ("--batch-size", "2.5", "--batch-size"),
     ("--max-new-tokens", "0", "max_new_tokens"), ("--temperature", "-1", "temperature"),
     ("--temperature", "inf", "temperature"), ("--epsilon", "abc", "--epsilon")],
)
def test_bad_input_is_one_line_exit_2(flag, value, needle):
    args = dict(zip(PLAN_ARGS[::2], PLAN_ARGS[1::2]))
    args[flag] = value
    argv = [x for kv in args.items() for x in kv]
    proc = subprocess.run([sys.executable, "-m", "invink_audit.cli", "plan", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and value in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "line"),
    [(["table", "--epsilons", "1,x"], "table: error: --epsilons must be a number; got 'x'"),
     (["table", "--epsilons", ","], "table: error: --epsilons must be a comma-separated list; got ','"),
     (["table", "--batch-sizes", "4,2.5"], "table: error: --batch-sizes must be an integer; got '2.5'"),
     (["ledger", "charge", "L", "--clip-norm", "0.1", "--batch-size", "4", "--max-new-tokens", "5", "--num-batches", "y"],
      "ledger: error: --num-batches must be an integer; got 'y'"),
     (["ledger", "init", "L", "--epsilon", "x", "--delta", "1e-6"], "ledger: error: --epsilon must be a number; got 'x'"),
     (["check-locks", ".", "--hold", "s"], "check-locks: error: --hold must be a number; got 's'"),
     (["audit", "--selftest", "--seed", "q"], "audit: error: --seed must be an integer; got 'q'"),
     (["generate", "--input", "r.csv", "--output", "o.jsonl", "--delta", "1e-6", "--max-new-tokens", "4", "--where", "x"],
      "generate: error: --where must be COLUMN=VALUE; got 'x'"),
     (["sweep", "--input", "r.csv", "--real", "r.csv", "--output", "d", "--epsilons", "1", "--batch-sizes", "2",
       "--public-proxy", "--top-ks", "0"], "sweep: error: --top-ks must be an integer >= 1 or 'full'; got '0'")],
)
def test_a_value_its_converter_refuses_is_one_line_naming_the_flag(argv, line, tmp_path, monkeypatch, capsys):
    # the shared flags' type= converters: the line a handler's error gives (the top command named, no usage
    # hint), main returns 2 (no SystemExit), and nothing is read or written
    monkeypatch.chdir(tmp_path)
    assert _run(argv, capsys) == (2, "", f"invink-audit {line}\n")
    assert list(tmp_path.iterdir()) == []


def test_plan_command_does_not_import_torch():
    code = ("import sys; from invink_audit.cli import main; "
            "rc = main(['plan', '--epsilon', '1', '--delta', '1e-6', '--max-new-tokens', '10', '--batch-size', '2', "
            "'--accountant', 'cks', '--json']); sys.exit(rc or ('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_ledger_commands(tmp_path, capsys):
    path = str(tmp_path / "l.json")
    assert _run(["ledger", "init", path, "--epsilon", "1.0", "--delta", "1e-6", "--accountant", "cks"], capsys)[0] == 0
    charge = ["ledger", "charge", path, "--clip-norm", "0.1", "--batch-size", "8", "--max-new-tokens", "100",
              "--release-id", "r1", "--json"]
    rc, out, _ = _run(charge, capsys)
    spent = json.loads(out)["epsilon_spent_after"]
    assert rc == 0 and 0 < spent < 1
    assert _run(charge, capsys)[0] == 0  # idempotent
    rc, out, _ = _run(["ledger", "charge", path, "--clip-norm", "2", "--batch-size", "8", "--max-new-tokens", "500",
                       "--dry-run"], capsys)
    assert rc == EXIT_OVER_BUDGET and "EXCEED" in out
    rc, _, err = _run(["ledger", "charge", path, "--clip-norm", "2", "--batch-size", "8", "--max-new-tokens", "500"],
                      capsys)
    assert rc == EXIT_OVER_BUDGET and "over the budget" in err
    rc, out, _ = _run(["ledger", "show", path, "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and len(data["releases"]) == 1 and data["epsilon_spent"] == pytest.approx(spent)


def _dry_run_fits(path, clip_norm, shape, capsys) -> bool:
    status = main(["ledger", "charge", str(path), "--clip-norm", repr(clip_norm), *shape, "--dry-run", "--json"])
    capsys.readouterr()
    assert status in (0, EXIT_OVER_BUDGET)
    return status == 0


@pytest.mark.parametrize("charged", [(), ("0.5", "4", "64"), ("0.3", "2", "40")])
def test_ledger_fits_is_the_largest_clip_norm_a_dry_run_accepts(tmp_path, capsys, charged):
    """`ledger fits` against an independent bisection over `ledger charge --dry-run`."""
    path = tmp_path / "l.json"
    assert main(["ledger", "init", str(path), "--epsilon", "8", "--delta", "1e-6"]) == 0
    for i in range(0, len(charged), 3):
        c, b, t = charged[i : i + 3]
        assert main(["ledger", "charge", str(path), "--clip-norm", c, "--batch-size", b, "--max-new-tokens", t]) == 0
    shape = ["--batch-size", "7", "--max-new-tokens", "100", "--temperature", "1.2"]
    capsys.readouterr()
    assert main(["ledger", "fits", str(path), *shape, "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["fits"] and answer["epsilon_spent_after"] <= 8.0
    low, high = 1e-6, 1e6  # the bisection the user would run by hand
    for _ in range(60):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if _dry_run_fits(path, middle, shape, capsys) else (low, middle)
    assert answer["clip_norm"] == pytest.approx(low, rel=1e-6)
    assert _dry_run_fits(path, answer["clip_norm"], shape, capsys)
    assert not _dry_run_fits(path, answer["clip_norm"] * (1 + 1e-6), shape, capsys)
    if charged:  # the release alone may spend more than the "remaining" epsilon: composition is not additive
        assert main(["ledger", "show", str(path), "--json"]) == 0
        remaining = json.loads(capsys.readouterr().out)["epsilon_remaining"]
        assert answer["epsilon_release"] > remaining


def test_ledger_fits_says_when_nothing_fits(tmp_path, capsys):
    path = tmp_path / "l.json"
    assert main(["ledger", "init", str(path), "--epsilon", "1", "--delta", "1e-6"]) == 0
    shape = ["--batch-size", "1", "--max-new-tokens", "64"]
    capsys.readouterr()
    assert main(["ledger", "fits", str(path), *shape, "--json"]) == 0
    largest = json.loads(capsys.readouterr().out)["clip_norm"]
    assert main(["ledger", "charge", str(path), "--clip-norm", repr(largest), *shape]) == 0  # the whole budget
    capsys.readouterr()
    status = main(["ledger", "fits", str(path), "--batch-size", "1", "--max-new-tokens", "1000000000"])
    assert status == EXIT_OVER_BUDGET
    assert "nothing fits" in capsys.readouterr().out
    assert main(["ledger", "show", str(path)]) == 0
    assert "not what a next release can spend" in capsys.readouterr().out
