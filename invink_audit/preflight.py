"""Pre-flight check of a shared output directory's file locks, before a multi-process release.

A release spread over processes relies on ``flock`` locks beside its output (:mod:`invink_audit.outputs`:
the output's lock, the sampled-batch journal's lock, each shard's lock): the journal's first-claim rule
keeps every batch to one released text only if two processes never hold the journal's lock at once.
These checks take the very lock a release takes (:func:`invink_audit.outputs.output_lock`) on a
scratch file in the directory:

* :func:`check_locks`: here, then from a second process (a subprocess), whose non-blocking attempt
  must fail while the lock is held and succeed once it is released. Proves that ``flock`` works on
  that filesystem **from this machine** and excludes other processes of this machine.
* :func:`hold_lock` / :func:`probe_lock`: the two-machine variant. Machine A holds the lock of a
  fixed scratch file (:data:`LOCK_NAME`) for some seconds and writes who holds it and until when
  beside it; machine B's attempt must fail while A holds it.

What no check on one machine can prove: that *different machines* exclude each other. An NFS mount
with ``local_lock=flock`` (or ``nolock``) implements ``flock`` in each client's kernel only, so every
machine passes :func:`check_locks` and still takes the "same" lock as the others at once. Run
:func:`check_locks` on every machine, and :func:`hold_lock` on one with :func:`probe_lock` on each other
one where the release will run (``invink-audit check-locks DIR --hold 30`` / ``--probe``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from accounting.atomic import atomic_write_json
from invink_audit.outputs import OutputInUseError, lock_path, output_lock

__all__ = [
    "ACQUIRED",
    "EXCLUDED",
    "LOCK_NAME",
    "LockCheck",
    "LockStep",
    "check_locks",
    "hold_lock",
    "probe_lock",
    "try_lock",
]

#: Outcomes of :func:`try_lock`.
ACQUIRED, EXCLUDED = "acquired", "excluded"
#: The scratch output whose lock :func:`hold_lock` holds and :func:`probe_lock` tries (in the directory).
LOCK_NAME = ".invink-audit-lockcheck"
_HOLDER_SUFFIX = ".holder.json"
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"

PROVES_LOCAL = "flock works on this filesystem from this machine: a second process of this machine is excluded"
CANNOT_PROVE_LOCAL = (
    "that processes on different machines exclude each other (NFS may implement flock in each client's kernel "
    "only: local_lock=flock or nolock); run check-locks on every machine, and --hold on one with --probe on the others"
)
PROVES_PROBE = "the lock one machine holds excludes this machine, on this filesystem"
_PROVES_NOTHING = "nothing yet: no other machine held the lock while this one tried"
CANNOT_PROVE_PROBE = "anything about machines not probed; run --probe on every other machine of the release"


@dataclasses.dataclass(frozen=True)
class LockStep:
    """One observation: what was tried, whether it went as a working lock requires, and what happened."""

    name: str
    ok: bool
    detail: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not isinstance(self.ok, bool):
            raise ValueError(f"a LockStep needs a name and ok as a bool; got {self.name!r}, {self.ok!r}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LockCheck:
    """The outcome of a lock check on ``directory``: ``status`` ``"pass"``, ``"fail"`` or ``"inconclusive"``
    (``--probe`` with nobody holding the lock), the ``steps`` observed, and what it ``proves`` and
    ``cannot_prove``."""

    directory: str
    mode: str
    host: str
    status: str
    steps: tuple[LockStep, ...]
    message: str
    proves: str
    cannot_prove: str

    def __post_init__(self) -> None:
        if self.mode not in ("local", "hold", "probe"):
            raise ValueError(f"mode must be local, hold or probe; got {self.mode!r}")
        if self.status not in (PASS, FAIL, INCONCLUSIVE):
            raise ValueError(f"status must be pass, fail or inconclusive; got {self.status!r}")
        object.__setattr__(self, "steps", tuple(self.steps))
        if self.status == PASS and not all(step.ok for step in self.steps):
            raise ValueError("a passing check must have every step ok")

    @property
    def passed(self) -> bool:
        return self.status == PASS

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "steps": [step.to_json() for step in self.steps], "passed": self.passed}


def _directory(directory: str | os.PathLike) -> Path:
    if not isinstance(directory, (str, os.PathLike)) or not str(directory).strip():
        raise ValueError(f"directory must be a non-empty path; got {directory!r}")
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a directory (give the directory the release will write its output in)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{str(path)!r} is not writable by this user: a release could not write its output there")
    return path


def try_lock(output: str | os.PathLike) -> str:
    """One non-blocking attempt at the release's lock on ``output`` (:func:`~invink_audit.outputs.output_lock`):
    :data:`ACQUIRED` (released at once) or :data:`EXCLUDED` (another process holds it); an :class:`OSError`
    where ``flock`` does not work."""
    try:
        with output_lock(Path(output)):
            return ACQUIRED
    except OutputInUseError:
        return EXCLUDED


def _other_process(output: Path, timeout: float) -> str:
    """:func:`try_lock` in a fresh Python process: its outcome, or ``"error: ..."``."""
    command = [sys.executable, "-m", "invink_audit.preflight", str(output)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"error: the second process did not answer within {timeout:g} s"
    answer = done.stdout.strip().splitlines()[-1:] or [""]
    if done.returncode == 0 and answer[0] in (ACQUIRED, EXCLUDED):
        return answer[0]
    return f"error: the second process failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}"


def _remove(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _flock_failed(err: OSError) -> LockStep:
    return LockStep(
        "take the release's lock here", False,
        f"flock failed: {err}. This filesystem does not support flock locks (NFS without a lock manager, some FUSE or "
        "object-store mounts): a release refuses to write its output there; use a local or lock-capable directory",
    )


def check_locks(directory: str | os.PathLike, *, timeout: float = 60.0) -> LockCheck:
    """Take the release's lock on a scratch file in ``directory``, check from a second process that it is
    excluded while the lock is held and gets it once released, and remove the scratch files."""
    path = _directory(directory)
    handle, name = tempfile.mkstemp(prefix=LOCK_NAME + "-", suffix=".jsonl", dir=path)
    os.close(handle)
    output = Path(name)
    steps: list[LockStep] = []
    try:
        try:
            with output_lock(output):
                steps.append(LockStep("take the release's lock here", True, f"held {lock_path(output).name}"))
                seen = _other_process(output, timeout)
                steps.append(LockStep("second process tries while it is held", seen == EXCLUDED, seen))
        except OutputInUseError as err:
            steps.append(LockStep("take the release's lock here", False,
                                  f"a fresh scratch file's lock was held: {err}"))
        except OSError as err:
            steps.append(_flock_failed(err))
        if all(step.ok for step in steps):
            seen = _other_process(output, timeout)
            steps.append(LockStep("second process tries after release", seen == ACQUIRED, seen))
    finally:
        _remove(output, lock_path(output))
    ok = all(step.ok for step in steps)
    message = ("flock locks work in this directory: a second process was excluded while the lock was held and "
               "acquired it after" if ok else next(step.detail for step in steps if not step.ok))
    return LockCheck(str(path), "local", socket.gethostname(), PASS if ok else FAIL, tuple(steps), message,
                     PROVES_LOCAL, CANNOT_PROVE_LOCAL)


def _holder_path(path: Path) -> Path:
    return path / (LOCK_NAME + _HOLDER_SUFFIX)


def hold_lock(directory: str | os.PathLike, seconds: float, *, on_held: Callable[[str], None] | None = None,
              timeout: float = 60.0) -> LockCheck:
    """Machine A of the two-machine check: hold the release's lock on ``directory/`` :data:`LOCK_NAME` for
    ``seconds``, with ``LOCK_NAME.holder.json`` (host, pid, until when) beside it; a second process of this
    machine is checked to be excluded first. ``on_held(message)`` is called once the lock is held."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
        raise ValueError(f"seconds must be a number in (0, 86400]; got {seconds!r}")
    path = _directory(directory)
    output, holder = path / LOCK_NAME, _holder_path(path)
    steps: list[LockStep] = []
    try:
        with output_lock(output):
            steps.append(LockStep("take the release's lock here", True, f"held {lock_path(output).name}"))
            seen = _other_process(output, timeout)
            steps.append(LockStep("second process of this machine tries", seen == EXCLUDED, seen))
            if seen == EXCLUDED:
                until = time.time() + seconds
                record = {"host": socket.gethostname(), "pid": os.getpid(), "until": until}
                atomic_write_json(holder, record, mode=0o644)
                try:
                    if on_held is not None:
                        on_held(f"holding the lock on {output} for {seconds:g} s: run `invink-audit check-locks "
                                f"{path} --probe` on the other machine now")
                    time.sleep(max(0.0, until - time.time()))
                finally:
                    _remove(holder)
    except OutputInUseError:
        steps.append(LockStep("take the release's lock here", False,
                              f"another process holds {lock_path(output).name} (another --hold running?)"))
    except OSError as err:
        steps.append(_flock_failed(err))
    ok = all(step.ok for step in steps)
    message = f"held the lock for {seconds:g} s" if ok else next(step.detail for step in steps if not step.ok)
    return LockCheck(str(path), "hold", socket.gethostname(), PASS if ok else FAIL, tuple(steps), message,
                     "flock works here; what --probe on another machine saw meanwhile is its own answer",
                     "anything by itself: it is the other half of --probe")


def _read_holder(path: Path) -> dict | None:
    """The holder record, or ``None`` when there is none or it has expired."""
    try:
        record = json.loads(_holder_path(path).read_text(encoding="utf-8"))
        until = float(record["until"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return record if until > time.time() else None


def probe_lock(directory: str | os.PathLike) -> LockCheck:
    """Machine B of the two-machine check: while :func:`hold_lock` holds the lock on another machine,
    one non-blocking attempt here must fail. ``"inconclusive"`` when nobody holds it (start ``--hold``
    first); ``"fail"`` when this machine acquired the lock another one holds."""
    path = _directory(directory)
    host = socket.gethostname()
    before = _read_holder(path)
    if before is None:
        step = LockStep("find the holder", False, f"no live {LOCK_NAME + _HOLDER_SUFFIX} in {path}")
        return LockCheck(str(path), "probe", host, INCONCLUSIVE, (step,),
                         f"nobody holds the lock: run `invink-audit check-locks {path} --hold 30` on another machine "
                         "first, then this probe within those 30 s", _PROVES_NOTHING, CANNOT_PROVE_PROBE)
    who = f"{before.get('host')} (pid {before.get('pid')})"
    steps = [LockStep("find the holder", True, f"held by {who}")]
    try:
        seen = try_lock(path / LOCK_NAME)
    except OSError as err:
        steps.append(_flock_failed(err))
        return LockCheck(str(path), "probe", host, FAIL, tuple(steps), steps[-1].detail, PROVES_PROBE,
                         CANNOT_PROVE_PROBE)
    if seen == ACQUIRED and _read_holder(path) is None:  # the holder stopped meanwhile
        steps.append(LockStep("try the lock here", False, "acquired, but the holder stopped meanwhile"))
        return LockCheck(str(path), "probe", host, INCONCLUSIVE, tuple(steps), "the holder stopped during the probe: "
                         "run --hold for longer and probe again", _PROVES_NOTHING, CANNOT_PROVE_PROBE)
    steps.append(LockStep("try the lock here", seen == EXCLUDED, seen))
    same = ""
    if before.get("host") == host:
        same = " (the same host name as this machine: run the probe on another machine)"
    if seen == EXCLUDED:
        message = f"excluded: the lock {who} holds excludes this machine{same}"
    else:
        message = (f"this machine ACQUIRED the lock that {who} holds: flock locks on this filesystem do not exclude "
                   "across machines; do not run a multi-machine release with its output here")
    return LockCheck(str(path), "probe", host, PASS if seen == EXCLUDED else FAIL, tuple(steps), message,
                     PROVES_PROBE, CANNOT_PROVE_PROBE)


def _main(argv: list[str]) -> int:
    """``python -m invink_audit.preflight OUTPUT``: print :func:`try_lock`'s outcome (the second process)."""
    if len(argv) != 1:
        print("usage: python -m invink_audit.preflight OUTPUT", file=sys.stderr)
        return 2
    print(try_lock(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
