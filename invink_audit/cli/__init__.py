"""The ``invink-audit`` command line.

Each subcommand lives in its own module exposing ``register(subparsers)``; its handler is set with
``parser.set_defaults(handler=fn)`` and returns an exit status. Modules are imported only to build the
parser; anything heavy (torch, transformers) is imported inside the handlers.

Errors: a ``ValueError`` or ``CliError`` raised by a handler becomes one readable line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from invink_audit import __version__

# subcommand modules, in the order they appear in --help
_SUBCOMMANDS = (
    "invink_audit.cli._plan",
    "invink_audit.cli._ledger",
    "invink_audit.cli._generate",
    "invink_audit.cli._bench",
    "invink_audit.cli._audit",
)


class CliError(Exception):
    """An error the CLI reports as one line, with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), not a usage dump."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_float(flag: str, text: str) -> float:
    """A float given on the command line; NaN and inf are rejected by the validators downstream."""
    try:
        return float(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{flag} must be a number; got {text!r}") from err


def parse_int(flag: str, text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{flag} must be an integer; got {text!r}") from err


def parse_list(flag: str, text: str, convert) -> list:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{flag} must be a comma-separated list; got {text!r}")
    return [convert(flag, t.strip()) for t in items]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="invink-audit",
        description="Plan, run and audit differentially private LLM text generation (InvisibleInk).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )
    for name in _SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (ValueError, CliError, OSError) as err:
        print(f"invink-audit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"invink-audit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
