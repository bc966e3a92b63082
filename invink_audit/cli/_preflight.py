"""``invink-audit check-locks DIR [--hold SECONDS | --probe] [--json]``: do a directory's file locks exclude other
processes (docs/guide/capacity.md, §"check-locks")? Torch-free. Inconclusive (3) also when the probe ran on the
holder's own machine (``same-host``) or found a holder record left by a killed ``--hold`` (``stale``, removed).
Everything printed has its non-printable characters escaped (whoever can write DIR writes the holder records).
"""

from __future__ import annotations

import json
import sys

from invink_audit.cli import EXIT_FAILURE, EXIT_INCONCLUSIVE, EXIT_OK, number
from invink_audit.cli._options import add

_DESCRIPTION = (
    "Take the lock a release takes beside its output on a scratch file in DIR, and check from a second process "
    "that it is excluded while the lock is held and gets the lock once released. This proves that flock works on "
    "that filesystem from this machine; it cannot prove that two machines exclude each other (NFS may implement "
    "flock in each client's kernel only). Run it on every machine, and the two-machine variant: "
    "`check-locks DIR --hold 30` on machine A, then `check-locks DIR --probe` on machine B within those 30 s "
    "(a probe on machine A itself says SAME-HOST; after a killed --hold it says STALE and removes its record)."
)


def register(subparsers) -> None:
    p = subparsers.add_parser("check-locks", handler=_check_locks, description=_DESCRIPTION,
                              help="check that file locks in a directory exclude other processes")
    p.add_argument("directory", metavar="DIR", help="the directory the release will write its output in")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--hold", metavar="SECONDS", type=number,
                      help="machine A of the two-machine check: hold the lock for SECONDS (0 < SECONDS <= 86400)")
    mode.add_argument("--probe", action="store_true",
                      help="machine B of the two-machine check: the lock machine A holds must exclude this machine")
    add(p, "--json")


def _check_locks(args) -> int:
    from invink_audit.preflight import FAIL, PASS, check_locks, hold_lock, probe_lock

    if args.hold is not None:
        def held(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

        result = hold_lock(args.directory, args.hold, on_held=None if args.json else held)
    elif args.probe:
        result = probe_lock(args.directory)
    else:
        result = check_locks(args.directory)
    print(json.dumps(result.to_json()) if args.json else format_check(result))
    return {PASS: EXIT_OK, FAIL: EXIT_FAILURE}.get(result.status, EXIT_INCONCLUSIVE)


def format_check(result) -> str:
    """A :class:`~invink_audit.preflight.LockCheck` as a few lines of text, every field with its non-printable
    characters escaped (a line per field: no control character or escape sequence reaches the terminal)."""
    from invink_audit.preflight import FAIL
    from invink_audit.terminal import printable

    def show(text) -> str:
        return printable(text, limit=None)

    lines = [f"check-locks ({result.mode}) on {show(result.directory)} from {show(result.host)}: "
             f"{result.status.upper()}"]
    failed = "FAIL" if result.status == FAIL else "--"
    for step in result.steps:
        lines.append(f"  [{'ok' if step.ok else failed}] {show(step.name)}: {show(step.detail)}")
    lines.append(f"  {show(result.message)}")
    lines.append(f"  proves:       {show(result.proves)}")
    lines.append(f"  cannot prove: {show(result.cannot_prove)}")
    return "\n".join(lines)
