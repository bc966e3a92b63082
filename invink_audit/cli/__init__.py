"""The ``invink-audit`` command line.

Each subcommand lives in its own module exposing ``register(subparsers)``; its handler, given as
``add_parser(name, handler=fn, ...)``, returns an exit status. Modules are imported only to build the
parser; anything heavy (torch, transformers) is imported inside the handlers. The flags several commands take
are defined once, in :mod:`invink_audit.cli._options`, with the converters below (``type=``).

Errors become one readable line on stderr, never a traceback, with every character a terminal would interpret
escaped (:func:`invink_audit.terminal.printable`). Exit statuses (the ``EXIT_*`` constants): docs/guide/planning.md,
"Valid ranges and exit codes"; a failed process of a multi-process ``generate`` (``ReleaseIncompleteError``: the
finished texts are kept, a rerun resumes) is ``EXIT_FAILURE``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import re
import sys

from invink_audit import __version__
from invink_audit.terminal import printable

# subcommand modules, in the order they appear in --help
_SUBCOMMANDS = (
    "invink_audit.cli._plan",
    "invink_audit.cli._ledger",
    "invink_audit.cli._generate",
    "invink_audit.cli._bench",
    "invink_audit.cli._audit",
    "invink_audit.cli._evaluate",
    "invink_audit.cli._sweep",
    "invink_audit.cli._profile",
    "invink_audit.cli._preflight",
)


EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3
EXIT_OVER_BUDGET = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by the closed pipe


class CliError(Exception):
    """An error the CLI reports as one line, with exit status 2."""


# argparse takes "-inf" or "-1e-6" for an option (its own pattern only knows "-1" and "-1.5"), so
# `--epsilon -inf` failed with "expected one argument" instead of the range check's message
_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


#: argparse's error for a value a ``type=`` converter refused: "argument --epsilon: must be a number; got 'x'"
_BAD_VALUE = re.compile(r"argument (\S+): (must .*)", re.DOTALL)


class _BadValue(Exception):
    """A value a ``type=`` converter refused (``--epsilon must be a number; got 'x'``), in ``command``."""

    def __init__(self, command: str, message: str) -> None:
        super().__init__(message)
        self.command = command


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit 2), not a usage dump, a value a converter refuses
    is the line a handler's ``ValueError`` gives (:func:`main` returns 2), and negative-looking numbers (``-inf``,
    ``-1e-6``) are values, so that their range check names them. ``handler``: what the (sub)command runs."""

    def __init__(self, *args, handler=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER
        if handler is not None:
            self.set_defaults(handler=handler)

    def error(self, message: str):  # noqa: D401 - argparse API
        value = _BAD_VALUE.fullmatch(message)
        if value is not None:  # a converter's: reported as a handler's ValueError is (main returns 2)
            raise _BadValue(" ".join(self.prog.split()[1:2]), f"{value[1]} {value[2]}")  # "ledger" for "ledger charge"
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {printable(message)} (see --help)\n")


def shown(path) -> str:
    """A path (or any user-supplied name) as the command line prints it in a report or summary: characters a
    terminal would interpret escaped (:func:`invink_audit.terminal.printable`); files keep the name as given."""
    return printable(str(path))


def number(text: str) -> float:
    """A float (argparse ``type=``); NaN, inf and every range are left to the validators downstream
    (:mod:`accounting.limits` and the records' constructors), which name the parameter and its range."""
    try:
        return float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None


def integer(text: str) -> int:
    """An int (argparse ``type=``); its range is checked downstream, as :func:`number`'s."""
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None


def top_k(text: str, word: str = "full"):
    """A k of the Top-k+ set (``--top-k``, each of ``--top-ks``): an integer >= 1, or ``full`` (also ``none``,
    ``all``) for the whole vocabulary (``None``); ``word``: the one the error names."""
    if text.strip().lower() in {"full", "none", "all"}:
        return None
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or {word!r}; got {text!r}")
    return value


def comma_list(convert):
    """A converter of ``a,b,c`` into a tuple of ``convert``'s values (``--epsilons 1,3,10``), none empty."""

    def convert_list(text: str) -> tuple:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list; got {text!r}")
        return tuple(convert(item) for item in items)

    return convert_list


def parse_value(convert, flag: str, text):
    """``convert(text)`` for a value read by hand (not by argparse): its error a ``ValueError`` naming ``flag``."""
    try:
        return convert(text)
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"{flag} {err}") from None


def parse_float(flag: str, text) -> float:
    return parse_value(number, flag, text)


def parse_int(flag: str, text) -> int:
    return parse_value(integer, flag, text)


def parse_top_k(flag: str, text, word: str = "full"):
    return parse_value(functools.partial(top_k, word=word), flag, text)


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """``count`` and the noun that agrees with it: ``plural(1, "text")`` is ``"1 text"``, ``plural(2, "text")``
    ``"2 texts"`` (``plural_form``: for nouns that do not take an ``s``, e.g. ``"batches"``)."""
    return f"{count} {singular if count == 1 else plural_form or singular + 's'}"


#: seconds between redraws when stderr is not a terminal (a log file, CI): one line per bar every so often
#: instead of one per update
LOG_REDRAW_SECONDS = 30.0


def tqdm_bar(**options):
    """A tqdm bar on stderr; when stderr is not a terminal it redraws at most every :data:`LOG_REDRAW_SECONDS`
    (tqdm's ``mininterval``), so a log gets a line now and then, not one per update. Every bar of the
    command line is made here."""
    from tqdm import tqdm

    if not sys.stderr.isatty():
        options.setdefault("mininterval", LOG_REDRAW_SECONDS)
    return tqdm(file=sys.stderr, dynamic_ncols=True, **options)


def phase_progress(enabled: bool = True, *, unit: str = "tok", leave: bool = True):
    """A ``progress(phase, done, total)`` callback that draws one tqdm bar per phase on stderr (with its
    total, so an ETA), e.g. for :func:`invink_audit.audit.quick_audit`; returns ``(progress, close)``
    (``(None, close)`` when not ``enabled``). A bar closes when its phase reaches its total or the next
    phase starts (``unit``, ``leave``: tqdm's)."""
    bars: dict = {}

    def close() -> None:
        for bar in bars.values():
            bar.close()
        bars.clear()

    if not enabled:
        return None, close

    def progress(phase: str, done: int, total: int) -> None:
        if phase not in bars:
            close()
            bars[phase] = tqdm_bar(total=total, desc=phase, unit=unit, leave=leave)
        bar = bars[phase]
        bar.update(done - bar.n)
        if done >= total:
            close()

    return progress, close


def progress_bar(desc: str, enabled: bool = True, **options):
    """One bar of :func:`phase_progress`: ``(update(done, total), close)``; ``(None, close)`` when not ``enabled``."""
    progress, close = phase_progress(enabled, **options)
    return progress and functools.partial(progress, desc), close


def print_report(args, data, text, *, indent: int | None = None, written: str = "report") -> None:
    """A command's report on stdout: ``data()`` as JSON with ``--json``, else ``text()`` and, with ``--output``,
    where the report files are."""
    print(json.dumps(data(), indent=indent) if args.json else text())
    if args.output and not args.json:
        print(f"{written} written to {shown(args.output)}")


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


def console_main() -> int:
    """The ``invink-audit`` command: :func:`main` in CPU threading fit for the machine as it is now
    (:mod:`invink_audit.cpu`: no more torch threads than the cores other processes leave free, and
    OpenMP threads that sleep while they wait when some core is busy; said on stderr when that is fewer
    threads than cores)."""
    from invink_audit.cpu import configure_cpu_threads

    words = sys.argv[1:2]
    if words and words[0] in _MODEL_COMMANDS and not {"-h", "--help"} & set(sys.argv[2:]):
        choice = configure_cpu_threads()  # before torch is imported
        if choice.threads < choice.cores:
            print(f"cpu: {plural(choice.threads, 'torch thread')} ({choice.reason})", file=sys.stderr)
    return main()


#: the commands that run a model (the others, e.g. ``plan`` and ``ledger``, never import torch)
_MODEL_COMMANDS = frozenset({"generate", "evaluate", "sweep", "profile", "audit", "bench"})


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status. A process of a torchrun/accelerate launch (one whose
    process group this command created) ends here instead, through
    :func:`invink_audit.distributed.exit_process`, once its group is destroyed."""
    from invink_audit.distributed import exit_process, shutdown

    try:
        status = _run(argv)
    except SystemExit as stop:
        if not shutdown():
            raise
        exit_process(stop.code if isinstance(stop.code, int) else EXIT_FAILURE)
    except BaseException:  # an unexpected error: a launched rank must still end through exit_process
        if not shutdown():
            raise
        import traceback

        traceback.print_exc()
        exit_process(EXIT_FAILURE)
    if shutdown():  # a process group left to interpreter exit can abort a rank after complete work
        exit_process(status)
    return status


def _run(argv: list[str] | None) -> int:
    from accounting import BudgetExceededError
    from invink_audit.distributed import ReleaseIncompleteError

    try:
        args = build_parser().parse_args(argv)
    except _BadValue as err:
        print(f"invink-audit {err.command}: error: {printable(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        status = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not as "Exception ignored" at interpreter exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except BudgetExceededError as err:
        print(f"invink-audit {args.command}: over budget: {printable(str(err))}", file=sys.stderr)
        return EXIT_OVER_BUDGET
    except (ValueError, CliError, OSError) as err:
        print(f"invink-audit {args.command}: error: {printable(str(err))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ReleaseIncompleteError as err:
        print(f"invink-audit {args.command}: incomplete: {printable(str(err))}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"invink-audit {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again (Python docs,
    "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # pragma: no cover - stdout without a file descriptor (captured)
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
