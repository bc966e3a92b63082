"""CPU threads chosen for the machine as it is when a command starts, so that a shared CPU is not a trap.

On a CPU shared with another busy process, torch's default (one OpenMP thread per core, spinning while
it waits) makes every parallel region wait for a thread that has no core: measured on the project's
2-core machine, a SmolLM2 decode step took 0.67-0.78 s on 2 threads against 0.10-0.11 s on 1 while one
other CPU-bound process ran, and ``make demo`` did not finish in 15 minutes
(docs/results/cpu_threads.md). Two things are done, both only where the user has not decided:

* :func:`prefer_passive_waiting`: ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep instead of
  spinning; the OpenMP specification's wait policy, read once when the runtime starts, so it is set
  before ``torch`` is imported: the command line and the demo call it first);
* :func:`choose_cpu_threads`: as many threads as there are cores that other processes leave free,
  measured over a short window from ``/proc/stat`` (Linux; elsewhere torch's default is kept), at
  least one.

``INVINK_CPU_THREADS=N`` fixes the count; ``OMP_NUM_THREADS`` (torch's own setting) is respected as it
is, and so is an ``OMP_WAIT_POLICY`` already set. Threads change the order of floating-point
reductions, so a seeded run reproduces bitwise only at the same thread count (a seeded run carries no
privacy; a release is unaffected).
"""

from __future__ import annotations

import dataclasses
import os
import time

__all__ = ["CPU_THREADS_ENV", "CpuThreads", "apply_cpu_threads", "choose_cpu_threads", "prefer_passive_waiting"]

#: fixes the number of torch CPU threads (an integer >= 1)
CPU_THREADS_ENV = "INVINK_CPU_THREADS"


def prefer_passive_waiting() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless it is set already; effective only before ``torch`` is imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@dataclasses.dataclass(frozen=True)
class CpuThreads:
    """The torch CPU thread count chosen, the cores this process may use, the cores other processes kept
    busy while it measured (``None`` where it did not measure) and why, in words."""

    threads: int
    cores: int
    busy_cores: float | None
    reason: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


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
        import torch

        return CpuThreads(torch.get_num_threads(), cores, None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']}")
    if busy is None:
        busy = busy_cores()
    if busy is None:
        import torch

        return CpuThreads(torch.get_num_threads(), cores, None, "torch's default (no /proc/stat to measure the load)")
    free = max(1, min(cores, cores - int(busy + 0.5)))
    if free == cores:
        return CpuThreads(cores, cores, busy, f"one per core: {busy:.1f} of {cores} cores busy with other processes")
    return CpuThreads(free, cores, busy, f"{free} of {cores} cores free: {busy:.1f} busy with other processes")


def apply_cpu_threads() -> CpuThreads:
    """:func:`choose_cpu_threads`, then ``torch.set_num_threads`` with its count."""
    import torch

    choice = choose_cpu_threads()
    if choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    return choice
