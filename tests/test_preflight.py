"""The two-machine lock check (``invink-audit check-locks DIR --hold`` / ``--probe``): each test reproduces a
probe of the privacy-hygiene issue (item 5) or pins the behaviour its fix keeps. Torch-free.

A second machine is played by a holder record that names another kernel (another boot id), written by a
thread that beats like :func:`invink_audit.preflight.hold_lock` does, or by a real ``--hold`` subprocess
while the probe is told it runs elsewhere (``_host_identity`` replaced).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from accounting.atomic import atomic_write_json
from invink_audit import preflight
from invink_audit.cli import EXIT_FAILURE, EXIT_INCONCLUSIVE, EXIT_OK, main

#: How long a test waits for a holder subprocess to write its record (a loaded CI machine).
START_SECONDS = 60.0
#: A probe's wait for a heartbeat in tests whose holder never beats (kept short: the answer is "stale").
SHORT_WAIT = 0.5
OTHER_MACHINE = {"host": "machine-b", "boot": "b" * 32, "pid_namespace": "pid:[1]", "pid": 4242}
CONTROL = ("\x1b", "\x07", "\x9b", "\u202e", "\r")


def _holder_file(directory):
    return directory / (preflight.LOCK_NAME + ".holder.json")


def _cli(argv, capsys):
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _start_hold(directory, seconds):
    """A real ``check-locks --hold`` in a subprocess, returned once its holder record exists."""
    command = [sys.executable, "-m", "invink_audit.cli", "check-locks", str(directory), "--hold", str(seconds),
               "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_SECONDS
    while not _holder_file(directory).exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert _holder_file(directory).exists(), process.communicate()
    return process


def _record(**fields):
    return {"host": "machine-a", "boot": "a" * 32, "pid_namespace": "pid:[1]", "pid": 1, "token": uuid.uuid4().hex,
            "beat": 0, "interval": 0.2, "until": time.time() + 60, **fields}


class _Beating:
    """A holder on another machine that beats (rewrites its record) without holding the lock here: what an
    NFS mount with client-local flock looks like from the probing machine."""

    def __init__(self, directory):
        self.path, self.record = _holder_file(directory), _record()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.wait(self.record["interval"]):
            self.record["beat"] += 1
            atomic_write_json(self.path, self.record, mode=0o644)

    def __enter__(self):
        atomic_write_json(self.path, self.record, mode=0o644)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


# --- a probe on the holder's own machine -----------------------------------------------------------------


def test_probe_on_the_holders_own_machine_is_same_host_not_pass(tmp_path, capsys):
    # probe: --hold and --probe on one host reported PASS (exit 0), proving nothing about other machines
    process = _start_hold(tmp_path, 3)
    try:
        result = preflight.probe_lock(tmp_path)
        rc, out, _ = _cli(["check-locks", tmp_path, "--probe"], capsys)
    finally:
        process.communicate(timeout=START_SECONDS)
    assert result.status == preflight.SAME_HOST and not result.passed, result
    assert "the same boot id" in " ".join(step.detail for step in result.steps)
    assert f"(pid {process.pid})" in result.message and "proves nothing about other machines" in result.message
    assert rc == EXIT_INCONCLUSIVE and "SAME-HOST" in out.splitlines()[0] and "SAME HOST" in out


def test_same_host_is_told_by_the_kernel_not_the_host_name(tmp_path, monkeypatch):
    # a container on the holder's kernel has another host name but shares its flock: still the same host
    here = preflight._host_identity()
    monkeypatch.setattr(preflight, "_host_identity", lambda: {**here, "host": "a-container"})
    process = _start_hold(tmp_path, 3)
    try:
        result = preflight.probe_lock(tmp_path)
    finally:
        process.communicate(timeout=START_SECONDS)
    assert result.status == preflight.SAME_HOST, result


def test_probe_from_another_machine_passes_while_the_lock_is_held(tmp_path, monkeypatch):
    process = _start_hold(tmp_path, 3)
    monkeypatch.setattr(preflight, "_host_identity", lambda: dict(OTHER_MACHINE))
    try:
        result = preflight.probe_lock(tmp_path)
    finally:
        out, err = process.communicate(timeout=START_SECONDS)
    assert result.passed and "excluded" in result.message, result
    assert process.returncode == 0 and json.loads(out)["passed"], err
    assert not _holder_file(tmp_path).exists()


def test_hold_records_its_kernel_and_beats(tmp_path):
    process = _start_hold(tmp_path, 3)
    try:
        first = json.loads(_holder_file(tmp_path).read_text())
        time.sleep(2.5 * preflight.HEARTBEAT_SECONDS)
        later = json.loads(_holder_file(tmp_path).read_text())
    finally:
        process.communicate(timeout=START_SECONDS)
    here = preflight._host_identity()
    assert first["boot"] == here["boot"] and first["pid"] == process.pid and first["token"] == later["token"]
    assert later["beat"] > first["beat"]
    with open("/proc/sys/kernel/random/boot_id") as boot_id:
        assert boot_id.read().strip() not in json.dumps(first)  # hashed, not leaked


# --- a killed holder --------------------------------------------------------------------------------------


def test_probe_after_a_killed_holder_reports_stale_and_recovers(tmp_path, capsys):
    # probe: after `kill -9` of --hold the next probe reported FAIL ("ACQUIRED the lock ... do not exclude"),
    # and so did every probe after it
    process = _start_hold(tmp_path, 60)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=START_SECONDS)
    assert _holder_file(tmp_path).exists()
    rc, out, _ = _cli(["check-locks", tmp_path, "--probe"], capsys)
    assert rc == EXIT_INCONCLUSIVE and "STALE" in out.splitlines()[0] and "ACQUIRED" not in out
    assert f"pid {process.pid} no longer runs on this machine" in out and "removed it" in out
    assert not _holder_file(tmp_path).exists()
    rc, out, _ = _cli(["check-locks", tmp_path, "--probe"], capsys)
    assert rc == EXIT_INCONCLUSIVE and "nobody holds the lock" in out
    process = _start_hold(tmp_path, 3)  # and a new --hold works
    assert preflight.probe_lock(tmp_path).status == preflight.SAME_HOST
    process.communicate(timeout=START_SECONDS)
    assert process.returncode == 0


def test_probe_of_a_killed_holder_on_another_machine_is_stale(tmp_path, capsys):
    # another machine's pid cannot be checked from here: its heartbeat stopped, so the record is stale
    atomic_write_json(_holder_file(tmp_path), _record(), mode=0o644)
    result = preflight.probe_lock(tmp_path, wait=SHORT_WAIT)
    assert result.status == preflight.STALE and not result.passed, result
    assert "heartbeat did not advance" in " ".join(step.detail for step in result.steps)
    assert not _holder_file(tmp_path).exists()


def test_probe_fails_when_a_beating_holder_on_another_machine_does_not_exclude(tmp_path, capsys):
    # the failure the check exists for is still reported: the holder is alive (it beats) and the lock was ours
    with _Beating(tmp_path):
        result = preflight.probe_lock(tmp_path)
        rc, out, _ = _cli(["check-locks", tmp_path, "--probe"], capsys)
    assert result.status == preflight.FAIL and "do not exclude across machines" in result.message, result
    assert rc == EXIT_FAILURE and "ACQUIRED the lock that machine-a (pid 1) holds" in out


def test_record_without_a_heartbeat_is_inconclusive_not_a_failure(tmp_path, capsys):
    # a record written before the heartbeat: a killed holder and a non-excluding lock look alike
    record = {"host": "machine-a", "pid": 1, "until": time.time() + 60}
    _holder_file(tmp_path).write_text(json.dumps(record))
    rc, out, _ = _cli(["check-locks", tmp_path, "--probe"], capsys)
    assert rc == EXIT_INCONCLUSIVE and "no heartbeat" in out and "ACQUIRED" not in out


# --- holder records are untrusted input -----------------------------------------------------------------


@pytest.mark.parametrize("field", ["host", "pid", "interval"])
def test_holder_record_is_printed_safely(tmp_path, capsys, field):
    # probe: a forged holder record's escape sequences (title change, screen clear, RTL override) reached
    # the terminal verbatim
    forged = "evil\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e\r" + "x" * 1000
    _holder_file(tmp_path).write_text(json.dumps(_record(**{field: forged})))
    rc, out, err = _cli(["check-locks", tmp_path, "--probe"], capsys)
    assert rc in (EXIT_FAILURE, EXIT_INCONCLUSIVE)
    assert not any(c in out + err for c in CONTROL) and all(len(line) < 1000 for line in out.splitlines())
    assert "\\x1b]0;pwned\\x07" in out
    rc, out, _ = _cli(["check-locks", tmp_path, "--probe", "--json"], capsys)
    assert not any(c in out for c in CONTROL) and json.loads(out)["mode"] == "probe"


def test_holder_record_that_is_a_fifo_is_not_read(tmp_path):
    # a FIFO planted as the holder record: reading it blocked the probe for ever
    os.mkfifo(_holder_file(tmp_path))
    command = [sys.executable, "-m", "invink_audit.cli", "check-locks", str(tmp_path), "--probe"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=START_SECONDS, check=False)
    assert done.returncode == EXIT_INCONCLUSIVE and "not a regular file" in done.stdout, done


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"x" * 100_000, "larger than"), (b"\xff\xfe", "not JSON"), (b"[1]", "not a JSON object"),
     (json.dumps(_record(pid=True)).encode(), "malformed"), (json.dumps(_record(until=1.0)).encode(), "expired")],
)
def test_unusable_holder_record_means_nobody_holds_the_lock(tmp_path, content, reason):
    _holder_file(tmp_path).write_bytes(content)
    result = preflight.probe_lock(tmp_path)
    assert result.status == preflight.INCONCLUSIVE and reason in result.steps[0].detail, result


def test_printable_escapes_what_a_terminal_would_interpret():
    assert preflight.printable("gpu-node-7 café") == "gpu-node-7 café"
    assert preflight.printable("a\x1b[2Jb\u202ec\n") == "a\\x1b[2Jb\\u202ec\\n"
    assert preflight.printable(12) == "12" and preflight.printable("") == ""
    long = preflight.printable("\x07" * 1000, limit=10)
    assert long.startswith("\\x07\\x07") and long.endswith("(1000 characters)") and "\x07" not in long
    assert preflight.printable("y" * 10, limit=10) == "y" * 10


def test_probe_rejects_a_bad_wait(tmp_path):
    with pytest.raises(ValueError, match="wait must be"):
        preflight.probe_lock(tmp_path, wait=-1)


def test_passing_probe_exit_status(tmp_path, monkeypatch, capsys):
    process = _start_hold(tmp_path, 3)
    monkeypatch.setattr(preflight, "_host_identity", lambda: dict(OTHER_MACHINE))
    try:
        rc, out, _ = _cli(["check-locks", tmp_path, "--probe"], capsys)
    finally:
        process.communicate(timeout=START_SECONDS)
    assert rc == EXIT_OK and "PASS" in out.splitlines()[0]
