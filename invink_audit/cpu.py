"""CPU threads chosen for the machine as it is when a command starts, so that a shared CPU is not a trap.

:func:`configure_cpu_threads` (call it before importing ``torch``; the command line and the demo do)
measures the cores other processes keep busy (:func:`busy_cores`), uses as many torch threads as they
leave free and, when some core is busy, ``OMP_WAIT_POLICY=PASSIVE`` (:func:`choose_cpu_threads`);
``INVINK_CPU_THREADS``, ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` already set are respected.

Design: docs/guide/generating.md (§"CPU threads"); figures: docs/results/cpu_threads.md.
"""

from __future__ import annotations

import dataclasses
import os
import time

__all__ = ["CPU_THREADS_ENV", "CpuThreads", "busy_cores", "choose_cpu_threads", "configure_cpu_threads"]

#: fixes the number of torch CPU threads (an integer >= 1)
CPU_THREADS_ENV = "INVINK_CPU_THREADS"


@dataclasses.dataclass(frozen=True)
class CpuThreads:
    """The torch CPU thread count chosen, the cores this process may use, the cores other processes kept
    busy while it measured (``None`` where it did not measure) and why, in words."""

    threads: int
    cores: int
    busy_cores: float | None
    reason: str
    #: whether this choice is applied (``torch.set_num_threads``); ``False`` where torch's own default or
    #: the user's ``OMP_NUM_THREADS`` stands
    applies: bool = True
    #: whether OpenMP's threads should sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``): some core busy
    passive: bool = False


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``; ``None`` where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 5:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_cores(window: float = 0.25) -> float | None:
    """Cores kept busy by other processes over ``window`` seconds (this process sleeps meanwhile), as a
    fraction of all the machine's CPUs times the cores this process may use; ``None`` without ``/proc/stat``."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(window)
    second = _cpu_times()
    if second is None or second[1] <= first[1]:
        return None
    share = (second[0] - first[0]) / (second[1] - first[1])
    return max(0.0, min(1.0, share)) * _cores()


def choose_cpu_threads(*, cores: int | None = None, busy: float | None = None, environ=None) -> CpuThreads:
    """The thread count for this machine now (module docstring). ``cores`` and ``busy`` (the cores other
    processes keep busy) are measured when not given; ``environ`` defaults to ``os.environ``."""
    environ = os.environ if environ is None else environ
    cores = _cores() if cores is None else cores
    fixed = environ.get(CPU_THREADS_ENV)
    if fixed is not None:
        try:
            n = int(fixed)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{CPU_THREADS_ENV} must be an integer >= 1; got {fixed!r}")
        return CpuThreads(n, cores, None, f"{CPU_THREADS_ENV}={n}")
    if environ.get("OMP_NUM_THREADS"):
        value = environ["OMP_NUM_THREADS"]
        count = int(value) if value.isdigit() and int(value) > 0 else cores
        return CpuThreads(count, cores, None, f"OMP_NUM_THREADS={value}", applies=False)
    if busy is None:
        busy = busy_cores()
    if busy is None:
        return CpuThreads(cores, cores, None, "torch's default (no /proc/stat to measure the load)", applies=False)
    free = max(1, min(cores, cores - int(busy + 0.5)))
    if free == cores:
        return CpuThreads(cores, cores, busy, f"one per core: {busy:.1f} of {cores} cores busy with other processes")
    return CpuThreads(free, cores, busy, f"{free} of {cores} cores free: {busy:.1f} busy with other processes",
                      passive=True)


def configure_cpu_threads(environ=None) -> CpuThreads:
    """:func:`choose_cpu_threads`, then its passive wait policy (only before ``torch`` is imported, and only
    where ``OMP_WAIT_POLICY`` is not set) and ``torch.set_num_threads`` with its count."""
    environ = os.environ if environ is None else environ
    choice = choose_cpu_threads(environ=environ)
    if choice.passive:
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if choice.applies:
        import torch

        if choice.threads != torch.get_num_threads():
            torch.set_num_threads(choice.threads)
    return choice
