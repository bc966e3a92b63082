"""CPU threads fit for a shared machine (invink_audit.cpu): the count the cores other processes leave
free, passive waiting only when some core is busy, a user's own setting kept, and the command line
applying it before torch starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import invink_audit.cpu as cpu
from invink_audit.cpu import CPU_THREADS_ENV, busy_cores, choose_cpu_threads, configure_cpu_threads


@pytest.mark.parametrize(
    ("cores", "busy", "threads"),
    [(2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.0, 1), (8, 3.2, 5), (8, 0.2, 8), (1, 0.9, 1)],
)
def test_threads_are_the_cores_other_processes_leave_free(cores, busy, threads):
    choice = choose_cpu_threads(cores=cores, busy=busy, environ={})
    assert (choice.threads, choice.cores, choice.busy_cores) == (threads, cores, busy)
    assert ("one per core" in choice.reason) == (threads == cores)
    assert choice.applies and choice.passive == (threads < cores)  # an idle machine keeps OpenMP's default wait


def test_passive_waiting_is_set_only_when_a_core_is_busy(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        for busy, policy in ((1.0, "PASSIVE"), (0.0, None)):
            monkeypatch.setattr(cpu, "busy_cores", lambda window=0.25, busy=busy: busy)
            environ = {}
            choice = configure_cpu_threads(environ=environ)
            assert environ.get("OMP_WAIT_POLICY") == policy and torch.get_num_threads() == choice.threads
        environ = {"OMP_WAIT_POLICY": "ACTIVE"}
        monkeypatch.setattr(cpu, "busy_cores", lambda window=0.25: 5.0)
        configure_cpu_threads(environ=environ)
        assert environ["OMP_WAIT_POLICY"] == "ACTIVE"  # the user's own policy stands
    finally:
        torch.set_num_threads(before)


def test_a_users_own_setting_is_kept():
    assert choose_cpu_threads(cores=2, busy=2.0, environ={CPU_THREADS_ENV: "2"}).threads == 2
    kept = choose_cpu_threads(cores=2, busy=2.0, environ={"OMP_NUM_THREADS": "2"})
    assert kept.reason == "OMP_NUM_THREADS=2" and kept.busy_cores is None and not kept.applies and not kept.passive
    for bad in ("0", "two", "-1", ""):
        with pytest.raises(ValueError, match=CPU_THREADS_ENV):
            choose_cpu_threads(cores=2, busy=0.0, environ={CPU_THREADS_ENV: bad})


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="measures the load from /proc/stat (Linux)")
def test_a_spinning_process_is_seen_as_a_busy_core():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert busy_cores(window=0.5) >= 0.5
    finally:
        spinner.kill()
        spinner.wait()


def test_the_command_line_says_when_it_uses_fewer_threads_than_cores(tmp_path):
    """A model command applies the choice (here fixed to 1 thread) before torch starts and says so; a
    command that runs no model (``plan``) neither measures nor imports torch."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    env = {**os.environ, CPU_THREADS_ENV: "1"}
    env.pop("OMP_WAIT_POLICY", None)

    def run(*argv):
        code = (
            f"import os, sys; from invink_audit.cli import console_main; sys.argv = ['invink-audit', *{list(argv)!r}]; "
            "status = console_main(); print('torch' in sys.modules and __import__('torch').get_num_threads(), "
            "os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr); sys.exit(status)"
        )
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    missing = str(tmp_path / "missing.csv")
    done = run("generate", "--input", missing, "--output", str(tmp_path / "o.jsonl"), "--epsilon", "3", "--delta",
               "1e-6", "--batch-size", "2", "--max-new-tokens", "2")
    assert done.returncode == 2 and "missing.csv" in done.stderr, done.stderr
    assert f"cpu: 1 torch thread ({CPU_THREADS_ENV}=1)" in done.stderr and "\n1 None" in done.stderr
    done = run("plan", "--epsilon", "3", "--delta", "1e-6", "--batch-size", "4", "--max-new-tokens", "8")
    assert done.returncode == 0 and "cpu:" not in done.stderr and "False None" in done.stderr, done.stderr
