"""Pre-flight check of a shared output directory's file locks, before a multi-process release: the very lock a
release takes (:func:`invink_audit.outputs.output_lock`) on a scratch file, tried from a second process
(:func:`check_locks`) and from another machine (:func:`hold_lock` / :func:`probe_lock`). What each proves, what no
check can prove, and the holder record and its heartbeat: docs/guide/capacity.md ("check-locks").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from accounting.atomic import atomic_write_json
from invink_audit.outputs import OutputInUseError, lock_path, output_lock
from invink_audit.terminal import printable

__all__ = [
    "ACQUIRED",
    "EXCLUDED",
    "HEARTBEAT_SECONDS",
    "LOCK_NAME",
    "LockCheck",
    "LockStep",
    "check_locks",
    "hold_lock",
    "printable",  # invink_audit.terminal's, where it lives since the CLI escapes every message with it
    "probe_lock",
    "try_lock",
]

#: Outcomes of :func:`try_lock`.
ACQUIRED, EXCLUDED = "acquired", "excluded"
#: The scratch output whose lock :func:`hold_lock` holds and :func:`probe_lock` tries (in the directory).
LOCK_NAME = ".invink-audit-lockcheck"
_HOLDER_SUFFIX = ".holder.json"
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
#: Outcomes of a probe that decide nothing about other machines: it ran on the holder's own kernel, or
#: the holder record was left behind by a holder that stopped without removing it (killed).
SAME_HOST, STALE = "same-host", "stale"
_STATUSES = (PASS, FAIL, INCONCLUSIVE, SAME_HOST, STALE)
#: How often :func:`hold_lock` rewrites its holder record (its ``beat`` counts up) while it holds the lock.
HEARTBEAT_SECONDS = 1.0
#: The longest heartbeat interval a holder record may state (a probe waits three of them and 2 s).
_MAX_INTERVAL = 5.0
#: A holder record is JSON of a few hundred bytes; a larger file is not read (a forged or foreign file).
_MAX_HOLDER_BYTES = 4096
#: At most this many characters of a holder's field are shown (after escaping).
_SHOWN_CHARS = 80

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
    (``--probe`` with nobody holding the lock), or, for a probe, ``"same-host"`` (it ran on the holder's own
    kernel) or ``"stale"`` (the holder record was left by a holder that stopped); the ``steps`` observed,
    and what it ``proves`` and ``cannot_prove``."""

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
        if self.status not in _STATUSES:
            raise ValueError(f"status must be one of {', '.join(_STATUSES)}; got {self.status!r}")
        if self.status in (SAME_HOST, STALE) and self.mode != "probe":
            raise ValueError(f"status {self.status!r} is an outcome of a probe; got mode {self.mode!r}")
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
    """:func:`try_lock` in a fresh Python process (a new interpreter: the caller's ``__main__`` is never
    re-imported): its outcome, or ``"error: ..."``."""
    code = "import sys; from invink_audit.preflight import try_lock; print(try_lock(sys.argv[1]))"
    try:
        done = subprocess.run([sys.executable, "-c", code, str(output)], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"error: the second process did not answer within {timeout:g} s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"error: the second process failed (exit code {done.returncode}): {last}"
    return done.stdout.strip()


def _remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


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


def _read_small(path: Path) -> str:
    """The first few characters of a small file, or ``""``: for /proc and /etc identity files."""
    try:
        return path.read_text(encoding="ascii", errors="replace")[:256].strip()
    except OSError:
        return ""


def _host_identity() -> dict:
    """Who this process is, as a holder record says it: the host name, a hash of the kernel's boot id (the
    same for every container on one kernel, which share its ``flock``; hashed, so the record leaks no id),
    the pid namespace (a pid means something only inside its own) and the pid."""
    boot_id = _read_small(Path("/proc/sys/kernel/random/boot_id"))
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    boot = hashlib.sha256(b"invink-audit boot\n" + boot_id.encode()).hexdigest()[:32] if boot_id else ""
    return {"host": socket.gethostname(), "boot": boot, "pid_namespace": namespace, "pid": os.getpid()}


@dataclasses.dataclass(frozen=True)
class _Holder:
    """A holder record as read, its fields checked (``token`` and ``beat`` are ``None`` in a record written
    before the heartbeat)."""

    host: str
    pid: int
    until: float
    boot: str = ""
    pid_namespace: str = ""
    token: str | None = None
    beat: int | None = None
    interval: float = HEARTBEAT_SECONDS

    @property
    def who(self) -> str:
        return f"{printable(self.host, _SHOWN_CHARS)} (pid {self.pid})"

    def same_kernel(self, here: dict) -> bool:
        """Whether the holder ran on this kernel: the same boot id; without one on either side, the same host name."""
        if self.boot and here["boot"]:
            return self.boot == here["boot"]
        return self.host == here["host"]


def _holder_from(record) -> _Holder | str:
    """The checked record, or why it is not one."""
    if not isinstance(record, dict):
        return "not a JSON object"
    kinds = {"host": str, "pid": int, "until": (int, float), "boot": str, "pid_namespace": str, "token": str,
             "beat": int, "interval": (int, float)}
    fields = {k: record[k] for k in kinds if record.get(k) is not None}
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, kinds[key]):
            return f"its {key!r} is {printable(value, _SHOWN_CHARS)}"
    if not {"host", "pid", "until"} <= set(fields) or not math.isfinite(fields["until"]) or fields["pid"] <= 0:
        return "it lacks a host, a pid > 0 or a finite 'until'"
    if not 0 < fields.get("interval", HEARTBEAT_SECONDS) <= _MAX_INTERVAL:  # bounds a probe's wait
        interval = printable(fields["interval"], _SHOWN_CHARS)
        return f"its heartbeat interval {interval} is not in (0, {_MAX_INTERVAL:g}] s"
    return _Holder(**fields)


def _read_holder(path: Path) -> _Holder | str:
    """The holder record beside the scratch lock, or why there is none (missing, expired, not a small
    regular file, not a record): read without following a link or blocking on a FIFO, at most
    :data:`_MAX_HOLDER_BYTES`."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(_holder_path(path), flags)
    except FileNotFoundError:
        return "there is no holder record"
    except OSError as err:
        return f"the holder record cannot be read ({err.strerror or err}; a link is not followed)"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "the holder record is not a regular file"
        raw = os.read(fd, _MAX_HOLDER_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > _MAX_HOLDER_BYTES:
        return f"the holder record is larger than {_MAX_HOLDER_BYTES} bytes (not written by --hold)"
    try:
        holder = _holder_from(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "the holder record is not JSON (torn, or not written by --hold)"
    if isinstance(holder, str):
        return f"the holder record is malformed: {holder}"
    return holder if holder.until > time.time() else "the holder record has expired"


def _write_beats(holder: Path, until: float, on_held: Callable[[], None]) -> None:
    """Write this process's holder record, call ``on_held``, and rewrite the record every
    :data:`HEARTBEAT_SECONDS` (``beat`` + 1) until ``until``; the record is removed at the end."""
    record = {**_host_identity(), "token": uuid.uuid4().hex, "beat": 0, "interval": HEARTBEAT_SECONDS,
              "until": until}
    try:
        atomic_write_json(holder, record, mode=0o644)
        on_held()
        while (left := until - time.time()) > 0:
            time.sleep(min(HEARTBEAT_SECONDS, left))
            record["beat"] += 1
            atomic_write_json(holder, record, mode=0o644)
    finally:
        _remove(holder)


def hold_lock(directory: str | os.PathLike, seconds: float, *, on_held: Callable[[str], None] | None = None,
              timeout: float = 60.0) -> LockCheck:
    """Machine A of the two-machine check: hold the release's lock on ``directory/`` :data:`LOCK_NAME` for
    ``seconds``, with ``LOCK_NAME.holder.json`` (host, boot id hash, pid, heartbeat, until when) beside it,
    rewritten every :data:`HEARTBEAT_SECONDS`; a second process of this machine is checked to be excluded
    first. ``on_held(message)`` is called once the lock is held."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
        raise ValueError(f"seconds must be a number in (0, 86400]; got {seconds!r}")
    path = _directory(directory)
    output, holder = path / LOCK_NAME, _holder_path(path)
    steps: list[LockStep] = []
    message = (f"holding the lock on {output} for {seconds:g} s: run `invink-audit check-locks {path} --probe` "
               "on the other machine now")
    try:
        with output_lock(output):
            steps.append(LockStep("take the release's lock here", True, f"held {lock_path(output).name}"))
            seen = _other_process(output, timeout)
            steps.append(LockStep("second process of this machine tries", seen == EXCLUDED, seen))
            if seen == EXCLUDED:
                try:
                    _write_beats(holder, time.time() + seconds, lambda: None if on_held is None else on_held(message))
                except OSError as err:
                    steps.append(LockStep("write the holder record", False, f"could not write {holder.name}: {err}"))
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


def _pid_gone(holder: _Holder, here: dict) -> bool:
    """Whether the holder's process is certainly gone: it ran on this kernel in this pid namespace and its pid
    no longer exists, is a zombie, or is this probe's own."""
    if not (holder.same_kernel(here) and holder.pid_namespace and holder.pid_namespace == here["pid_namespace"]):
        return False
    if holder.pid == here["pid"]:
        return True
    try:
        os.kill(holder.pid, 0)
    except (ProcessLookupError, OverflowError):
        return True
    except PermissionError:  # it exists, under another user
        return False
    state = _read_small(Path(f"/proc/{holder.pid}/stat")).rpartition(")")[2].split()[:1]
    return state == ["Z"]


def _heartbeat(path: Path, holder: _Holder, wait: float) -> str:
    """After this probe's attempt: ``"beating"`` (the same holder wrote a newer beat since: it was alive, and
    held the lock, after the attempt), ``"gone"`` (its record was removed, expired or replaced), ``"silent"``
    (no newer beat within ``wait`` s) or ``"none"`` (a record written before the heartbeat)."""
    if holder.token is None or holder.beat is None:
        return "none"
    first = _read_holder(path)
    deadline = time.monotonic() + wait
    while isinstance(first, _Holder) and first.token == holder.token:
        now = _read_holder(path)
        if not isinstance(now, _Holder) or now.token != holder.token:
            break
        if now.beat is not None and first.beat is not None and now.beat > first.beat:
            return "beating"
        if time.monotonic() >= deadline:
            return "silent"
        time.sleep(min(0.1, holder.interval / 4))
    return "gone"


def _probe_result(path: Path, status: str, steps: list[LockStep], message: str) -> LockCheck:
    proves = PROVES_PROBE if status in (PASS, FAIL) else _PROVES_NOTHING
    return LockCheck(str(path), "probe", socket.gethostname(), status, tuple(steps), message, proves,
                     CANNOT_PROVE_PROBE)


def _stale(path: Path, holder: _Holder, steps: list[LockStep], why: str) -> LockCheck:
    """The holder record was left by a holder that stopped (killed): remove it if it is still the same record."""
    removed = _read_holder(path) == holder
    if removed:
        _remove(_holder_path(path))
    steps.append(LockStep("is the holder alive", False, f"no: {why}"))
    return _probe_result(
        path, STALE, steps,
        f"stale holder record: {holder.who} stopped without removing it (killed?) and holds no lock; "
        f"{'removed it' if removed else 'it changed meanwhile, left it'}: run `invink-audit check-locks {path} "
        "--hold 30` on the other machine again, then this probe",
    )


def _compare_machines(holder: _Holder, here: dict) -> LockStep:
    if not holder.same_kernel(here):
        also = " (the same host name)" if holder.host == here["host"] else ""
        return LockStep("compare machines", True, f"the holder ran on another machine's kernel{also}")
    why = "the same boot id" if holder.boot and here["boot"] else "the same host name; no boot id to compare"
    return LockStep("compare machines", False, f"the holder ran on this machine's kernel ({why})")


def probe_lock(directory: str | os.PathLike, *, wait: float | None = None) -> LockCheck:
    """Machine B of the two-machine check: while :func:`hold_lock` holds the lock on another machine, one
    non-blocking attempt here must fail (``"pass"``). ``"inconclusive"`` when nobody holds it (start
    ``--hold`` first); ``"same-host"`` when the holder ran on this machine's kernel (the same boot id: it
    proves nothing about other machines); ``"fail"`` when this machine acquired the lock and the holder's
    heartbeat then shows it still holds it; ``"stale"`` when the holder stopped without removing its record
    (its process is gone, or its heartbeat stopped for ``wait`` s, by default 3 heartbeats and 2 s): the
    record is removed."""
    if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 600):
        raise ValueError(f"wait must be a number of seconds in [0, 600]; got {wait!r}")
    path = _directory(directory)
    here = _host_identity()
    holder = _read_holder(path)
    if isinstance(holder, str):
        step = LockStep("find the holder", False, f"{holder} ({LOCK_NAME + _HOLDER_SUFFIX} in {path})")
        return _probe_result(path, INCONCLUSIVE, [step], f"nobody holds the lock: run `invink-audit check-locks "
                             f"{path} --hold 30` on another machine first, then this probe within those 30 s")
    steps = [LockStep("find the holder", True, f"held by {holder.who}"), _compare_machines(holder, here)]
    same = not steps[-1].ok
    if _pid_gone(holder, here):
        return _stale(path, holder, steps, f"pid {holder.pid} no longer runs on this machine")
    try:
        seen = try_lock(path / LOCK_NAME)
    except OSError as err:
        steps.append(_flock_failed(err))
        return _probe_result(path, FAIL, steps, steps[-1].detail)
    if seen == EXCLUDED:
        steps.append(LockStep("try the lock here", True, seen))
        if same:
            return _probe_result(path, SAME_HOST, steps, (
                f"SAME HOST: this probe ran on the machine of the holder {holder.who} (the same kernel): it was "
                "excluded by a process of its own machine, which proves nothing about other machines; run the probe "
                "on another machine"))
        return _probe_result(path, PASS, steps, f"excluded: the lock {holder.who} holds excludes this machine")
    # by default a probe that acquired the lock waits three beats and 2 s (a slow shared filesystem)
    return _acquired(path, holder, steps, same, 3 * holder.interval + 2.0 if wait is None else wait)


def _acquired(path: Path, holder: _Holder, steps: list[LockStep], same: bool, wait: float) -> LockCheck:
    """This machine acquired the lock: a failure only if the holder's heartbeat shows it was holding it."""
    beat = _heartbeat(path, holder, wait)
    if beat == "gone":
        steps.append(LockStep("try the lock here", False, "acquired, but the holder stopped meanwhile"))
        return _probe_result(path, INCONCLUSIVE, steps, "the holder stopped during the probe: run --hold for longer "
                             "and probe again")
    if beat == "none":
        steps.append(LockStep("try the lock here", False, "acquired; the holder record has no heartbeat"))
        return _probe_result(path, INCONCLUSIVE, steps, (
            f"acquired the lock {holder.who} claims to hold, but its record has no heartbeat (an older --hold): a "
            "killed holder and a lock that does not exclude look alike; run --hold with this version, then probe"))
    if beat == "silent":
        steps.append(LockStep("try the lock here", True, "acquired: nobody holds it"))
        return _stale(path, holder, steps, f"its heartbeat did not advance within {wait:g} s")
    steps.append(LockStep("try the lock here", False, "acquired while the holder's heartbeat shows it holds it"))
    if same:
        return _probe_result(path, FAIL, steps, (
            f"this process ACQUIRED the lock that {holder.who} holds on this same machine: flock does not exclude "
            "even processes of one machine here; do not run a release with its output here"))
    return _probe_result(path, FAIL, steps, (
        f"this machine ACQUIRED the lock that {holder.who} holds: flock locks on this filesystem do not exclude "
        "across machines; do not run a multi-machine release with its output here"))
