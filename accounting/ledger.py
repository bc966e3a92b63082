"""A persisted privacy odometer for one dataset and one unit of privacy: the budget ledger.

:class:`BudgetLedger` charges every :class:`Release` before it runs (paper Theorem 2, thm:accounting, and
Corollary 11, coro:parallel-batches: disjoint batches in parallel, releases sequentially). Several releases
compose as a privacy filter by summing ρ (Feldman & Zrnic 2021, arXiv:2008.11193, Thm. 3.1; Whitehouse,
Ramdas, Rogers & Wu 2023, arXiv:2203.05481). The file is rewritten atomically under a lock, charges are
idempotent on ``release_id``, and every load re-checks every figure and a SHA-256 hash chain (no secret key)
whose ``head`` also commits to the number of releases: what that detects and what it cannot, and how format-1
and format-2 files load, is docs/guide/planning.md (§"Budget ledger", "Integrity"). A ledger refuses a release
of another privacy unit than its own (docs/guide/privacy-unit.md). Design: docs/accounting_notes.md §6.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import functools
import hashlib
import json
import math
import os
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from accounting.atomic import atomic_write_json
from accounting.accountants import DEFAULT_ACCOUNTANT, Accountant, as_accountant
from accounting.conversions import epsilon_to_zcdp, zcdp_to_epsilon
from accounting.events import GenerationEvent, ZcdpEvent, event_from_json, forwarded_property
from accounting.limits import CLIP_NORM_RANGE, RANGES
from accounting.planner import plan_clip_norm
from accounting.strict_json import DuplicateKeyError, loads_strict

__all__ = ["BudgetLedger", "BudgetExceededError", "ChargeOutcome", "LedgerError", "Release", "LedgerStatus",
           "check_privacy_unit"]

#: Format written by this version (2: hash chain; 3: ``head`` binds the release count and the chain starts
#: from the format version). Format 1 and 2 files are read and migrated at the next charge.
_FORMAT_VERSION = 3
_READABLE_FORMATS = (1, 2, 3)
_LOCK_TIMEOUT_SECONDS = 60.0
#: Relative tolerance between a stored ``epsilon_spent_after`` and its recomputation. The same code
#: recomputes the same floats, so they agree to the last bit; the tolerance only absorbs a different
#: scipy minimiser in a later install. An edit that matters (a clip norm, a deleted release) moves the
#: spend by far more.
_SPEND_RTOL = 1e-6
_CHAIN_DOMAIN = b"invink-audit ledger chain v2\n"
_HEAD_DOMAIN = b"invink-audit ledger head v3\n"
#: the keys of a flat record: the event's parameters (``unit_contributions`` only when not 1) and the release's own
_RELEASE_KEYS = ("release_id", "label", *(f.name for f in dataclasses.fields(GenerationEvent)
                                          if f.name != "unit_contributions"), "num_batches")
_ZCDP_RELEASE_KEYS = ("release_id", "label", "kind", "mechanism", "rho", "num_batches")
_ENTRY_KEYS = ("recorded_at", "release", "epsilon_spent_after")


def _entry_figures(release: Release) -> dict:
    """The figures an entry stores beside its release, each recomputed from the release on every load: ε0 and
    the token steps of a bounded-range release, ρ of a zCDP one."""
    if isinstance(release.event, ZcdpEvent):
        return {"rho": release.event.rho}
    return {"epsilon0": release.epsilon0, "num_steps": release.num_steps}


def check_privacy_unit(unit) -> str | None:
    """A privacy unit's name: ``None`` (one reference) or a non-empty string (the column whose value makes a unit)."""
    if unit is not None and (not isinstance(unit, str) or not unit.strip()):
        raise ValueError(f"privacy_unit must be None (one reference) or a non-empty column name; got {unit!r}")
    return unit


def unit_phrase(unit: str | None) -> str:
    """How messages name a unit of privacy."""
    return "one reference" if unit is None else f"one privacy unit (the references sharing a {unit!r} value)"


class LedgerError(ValueError):
    """The ledger file is missing, corrupt, or a request contradicts what it records."""


class BudgetExceededError(LedgerError):
    """A release would take the dataset past its total budget; nothing was recorded."""


@dataclasses.dataclass(frozen=True)
class Release:
    """One release as the ledger records it: its privacy ``event`` (C, B, τ, T, texts per batch, the clipping
    and adjacency, the batches one unit may touch), how many disjoint batches it drew, its id and a free-text
    label, and its ``privacy_unit`` (the column whose value makes one unit; ``None``: one reference). Never
    anything derived from the private data. The event is the record: C, B, τ and T exist once, checked against
    their documented ranges (:mod:`accounting.limits`) by the event's constructor.
    """

    event: GenerationEvent | ZcdpEvent
    num_batches: int = 1
    release_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    label: str = ""
    privacy_unit: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.event, (GenerationEvent, ZcdpEvent)):
            raise ValueError(
                f"event must be an accounting.GenerationEvent or ZcdpEvent; got {type(self.event).__name__}"
            )
        RANGES["num_batches"].check("num_batches", self.num_batches)
        if not isinstance(self.release_id, str) or not self.release_id.strip():
            raise ValueError(f"release_id must be a non-empty string; got {self.release_id!r}")
        if not isinstance(self.label, str):
            raise ValueError(f"label must be a string; got {self.label!r}")
        check_privacy_unit(self.privacy_unit)

    @classmethod
    def of(
        cls, *, num_batches: int = 1, release_id: str | None = None, label: str = "", privacy_unit: str | None = None,
        **event,
    ) -> Release:  # fmt: skip
        """A release from the event's parameters by name (``clip_norm``, ``batch_size``, ``temperature``,
        ``max_new_tokens``, optionally ``texts_per_batch``, ``clipping``, ``adjacency``, ``unit_contributions``)."""
        ids = {} if release_id is None else {"release_id": release_id}
        return cls(GenerationEvent(**event), num_batches, label=label, privacy_unit=privacy_unit, **ids)

    clip_norm = forwarded_property("event", "clip_norm", "Clip norm C.")
    batch_size = forwarded_property("event", "batch_size", "B private references per text.")
    temperature = forwarded_property("event", "temperature", "Temperature τ.")
    max_new_tokens = forwarded_property("event", "max_new_tokens", "Token budget T per text.")
    texts_per_batch = forwarded_property("event", "texts_per_batch", "Texts drawn from each batch.")
    clipping = forwarded_property("event", "clipping", "The clipping rule.")
    adjacency = forwarded_property("event", "adjacency", "The neighbouring relation.")
    epsilon0 = forwarded_property("event", "epsilon0", "Per-token bounded range 2Δ/τ.")
    num_steps = forwarded_property("event", "num_steps", "Token steps charged (batches compose in parallel).")
    rho_sequence = forwarded_property("event", "rho_sequence", "zCDP of the release (the ledger's term).")

    def _parameters(self) -> dict:
        """The flat record's parameters; the unit's fields only when not per reference (older records unchanged)."""
        unit = {} if self.privacy_unit is None else {"privacy_unit": self.privacy_unit}
        if isinstance(self.event, ZcdpEvent):
            return {**self.event.to_json(), "num_batches": self.num_batches, **unit}
        contributions = self.event.unit_contributions
        return {
            "clip_norm": self.clip_norm,
            "batch_size": self.batch_size,
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
            "texts_per_batch": self.texts_per_batch,
            "num_batches": self.num_batches,
            "clipping": self.clipping.value,
            "adjacency": self.adjacency.value,
            **({} if contributions == 1 else {"unit_contributions": contributions}),
            **unit,
        }

    def to_json(self) -> dict:
        """The ledger's flat record (the file format of every ledger version)."""
        return {"release_id": self.release_id, "label": self.label, **self._parameters()}

    @classmethod
    def from_json(cls, data: dict) -> Release:
        """A release from its flat record (keys other than the event's, ``num_batches``, ``release_id`` and
        ``label`` are ignored)."""
        rest = {k: data[k] for k in ("num_batches", "release_id", "label", "privacy_unit") if k in data}
        return cls(event_from_json(data), **rest)


@dataclasses.dataclass(frozen=True)
class LedgerStatus:
    """What the ledger has spent and what remains, at its δ.

    ``head`` commits to the hash chain and the number of releases (format 3; in format 2 it is the chain
    value after the last release; ``None`` for a format-1 ledger not yet migrated); write it down somewhere
    the ledger's writers cannot change it, to detect a consistently rewritten ledger later.
    """

    epsilon_budget: float
    delta: float
    accountant: Accountant
    epsilon_spent: float
    releases: tuple[dict, ...]
    format_version: int = _FORMAT_VERSION
    head: str | None = None
    rho_spent: float = 0.0
    #: what the budget protects: ``None``, one reference; a column name, one privacy unit (module docstring)
    privacy_unit: str | None = None

    @property
    def epsilon_remaining(self) -> float:
        """Budget minus spend. Not what a next release may spend: ε does not add up across releases (they
        compose by adding ρ, module docstring); :attr:`rho_remaining` says what still fits."""
        return max(0.0, self.epsilon_budget - self.epsilon_spent)

    @property
    def rho_remaining(self) -> float:
        """The largest zCDP ρ a next release may cost and still fit the budget: ρ of the budget (the ledger's
        conversion inverted at δ, its lower end) minus the ρ the recorded releases add up to. Conservative
        when nothing is recorded yet (a first release alone is charged by the accountant's tighter rule)."""
        return max(0.0, epsilon_to_zcdp(self.epsilon_budget, self.delta, self.accountant.zcdp_conversion) - self.rho_spent)


@dataclasses.dataclass(frozen=True)
class ChargeOutcome:
    """What :meth:`BudgetLedger.charge_once` did.

    ``already_recorded``: the ``release_id`` was recorded before with the same parameters, so nothing
    was spent now and ``entry`` is the earlier record. ``epsilon_spent``: the ledger's total spend after
    the call (for a replay, today's total, which may exceed ``entry["epsilon_spent_after"]``).
    """

    entry: dict
    already_recorded: bool
    epsilon_spent: float


def _spent_epsilon(releases: list[Release], delta: float, accountant: Accountant) -> float:
    """Spend of the recorded releases (docs/accounting_notes.md §6: one release vs a privacy filter over several)."""
    if not releases:
        return 0.0
    if len(releases) == 1:
        return _single_release_spend(releases[0].event, delta, accountant)
    return _filter_spend(math.fsum(r.rho_sequence for r in releases), delta, accountant)


@functools.lru_cache(maxsize=256)
def _single_release_spend(event: GenerationEvent | ZcdpEvent, delta: float, accountant: Accountant) -> float:
    # cached: verifying a ledger recomputes its first release's spend, up to seconds for br-adaptive
    return event.epsilon(delta, accountant)


@functools.lru_cache(maxsize=4096)
def _filter_spend(rho: float, delta: float, accountant: Accountant) -> float:
    return zcdp_to_epsilon(rho, delta, accountant.zcdp_conversion)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# -- hash chain ---------------------------------------------------------------------------------------


def _canonical(obj) -> bytes:
    """The bytes hashed for ``obj``: sorted keys, no whitespace, exact float reprs (JSON round-trips them)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def _header(data: dict) -> dict:
    # the file's own version (2 or 3): a format-3 chain relabelled as format 2 no longer verifies; the privacy
    # unit only where the ledger has one (every ledger before units keeps its chain)
    return {
        "format_version": data["format_version"],
        "dataset": data["dataset"],
        "created_at": data["created_at"],
        "budget": data["budget"],
        "accountant": data["accountant"],
        **({"privacy_unit": data["privacy_unit"]} if "privacy_unit" in data else {}),
    }


def _genesis(data: dict) -> str:
    return hashlib.sha256(_CHAIN_DOMAIN + _canonical(_header(data))).hexdigest()


def _link(previous: str, entry: dict) -> str:
    body = {k: v for k, v in entry.items() if k != "chain"}
    return hashlib.sha256(_CHAIN_DOMAIN + previous.encode() + b"\n" + _canonical(body)).hexdigest()


def _head(data: dict, chain: list[str]) -> str:
    """``head`` of ``data`` from its chain: format 3 hashes the last chain value with the number of releases,
    so a truncated ledger needs a value stored nowhere in the file; format 2 stored the last chain value."""
    if data["format_version"] < 3:
        return chain[-1]
    count = len(data["releases"])
    return hashlib.sha256(_HEAD_DOMAIN + chain[-1].encode() + b"\n" + str(count).encode()).hexdigest()


def _chain_values(data: dict) -> list[str]:
    """The hash chain of ``data``: the genesis value (its header), then the value after each release."""
    chain = [_genesis(data)]
    for entry in data["releases"]:
        chain.append(_link(chain[-1], entry))
    return chain


def _with_chain(data: dict) -> dict:
    """``data`` in the current format with every chain value and ``head`` (re)computed."""
    out = {**data, "format_version": _FORMAT_VERSION}
    chain = _chain_values(out)
    out["releases"] = [
        {**{k: v for k, v in entry.items() if k != "chain"}, "chain": value}
        for entry, value in zip(data["releases"], chain[1:])
    ]
    out["head"] = _head(out, chain)
    return out


# -- verification on load ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Verified:
    """A ledger file that passed every check, with what the checks computed."""

    data: dict
    releases: tuple[Release, ...]
    accountant: Accountant
    epsilon_spent: float


def _corrupt(where: str, message: str) -> LedgerError:
    return LedgerError(f"ledger {where} is corrupt or was edited: {message}; refusing to use it")


@dataclasses.dataclass(frozen=True)
class _Header:
    """A ledger's checked header: its format version, its budget (ε, δ) and its accountant."""

    version: int
    budget_epsilon: float
    delta: float
    accountant: Accountant
    privacy_unit: str | None = None


def _verify_header(data, where: str) -> _Header:
    """The format version, the top-level keys and their types, the budget and the accountant."""
    if not isinstance(data, dict):
        raise LedgerError(f"ledger {where} has an unknown format (not a JSON object)")
    version = data.get("format_version")
    if isinstance(version, bool) or version not in _READABLE_FORMATS:
        raise LedgerError(
            f"ledger {where} has an unknown format (format_version {version!r}; this version reads "
            f"{', '.join(map(str, _READABLE_FORMATS))})"
        )
    for key, kind in (("budget", dict), ("accountant", str), ("releases", list), ("dataset", str), ("created_at", str)):
        if not isinstance(data.get(key), kind):
            json_kind = "object" if kind is dict else "array" if kind is list else "string"
            raise _corrupt(where, f"{key!r} must be a JSON {json_kind}; got {type(data.get(key)).__name__}")
    budget = data["budget"]
    if set(budget) != {"epsilon", "delta"}:
        raise _corrupt(where, f"budget must hold exactly 'epsilon' and 'delta'; got keys {sorted(budget)}")
    try:
        budget_epsilon = RANGES["epsilon"].check("budget epsilon", budget["epsilon"])
        delta = RANGES["delta"].check("budget delta", budget["delta"])
        accountant = as_accountant(data["accountant"])
        unit = data.get("privacy_unit")
        if "privacy_unit" in data and unit is None:
            raise ValueError("privacy_unit is null (a per-reference ledger has no privacy_unit key)")
        check_privacy_unit(unit)
    except ValueError as err:
        raise _corrupt(where, str(err)) from err
    return _Header(version, budget_epsilon, delta, accountant, unit)


def _verify_entry(index: int, entry, seen: set[str], where: str) -> Release:
    """One entry's shape, its release (not seen before) and the ε0 and step count stored with it."""
    at = f"release #{index + 1}"
    if not isinstance(entry, dict) or not isinstance(entry.get("release"), dict):
        raise _corrupt(where, f"{at} is not an entry with a 'release' object")
    zcdp = entry["release"].get("kind") == "zcdp"
    entry_keys = (*_ENTRY_KEYS, *(("rho",) if zcdp else ("epsilon0", "num_steps")))
    release_keys = _ZCDP_RELEASE_KEYS if zcdp else _RELEASE_KEYS
    missing = [k for k in entry_keys if k not in entry] + [k for k in release_keys if k not in entry["release"]]
    if missing:
        raise _corrupt(where, f"{at} lacks {', '.join(repr(k) for k in missing)}")
    try:
        release = Release.from_json(entry["release"])
    except (TypeError, ValueError) as err:
        raise _corrupt(where, f"{at}: {err}") from err
    at = f"release #{index + 1} ({release.release_id!r})"
    if release.release_id in seen:
        raise _corrupt(where, f"{at} is recorded twice")
    for name, value in _entry_figures(release).items():
        stored = entry[name]
        same = (not isinstance(stored, bool) and stored == value) if isinstance(value, int) else _same_float(
            stored, value, 1e-12
        )
        if not same:
            raise _corrupt(where, f"{at} stores {name}={stored!r} but its parameters give {value!r}")
    return release


def _stored_spend(at: str, entry: dict, where: str) -> float:
    """An entry's stored running spend ``epsilon_spent_after``: a finite number >= 0."""
    stored = entry["epsilon_spent_after"]
    if isinstance(stored, bool) or not isinstance(stored, (int, float)) or not stored >= 0 or math.isinf(stored):
        raise _corrupt(where, f"{at} stores epsilon_spent_after={stored!r}, not a finite number >= 0")
    return stored


def _verify_spend(at: str, stored: float, recomputed: float, spent_before: float, header: _Header, where: str) -> None:
    """One entry's stored running spend against the recomputed one, the spend before it and the budget."""
    if not _same_float(stored, recomputed, _SPEND_RTOL):
        raise _corrupt(
            where,
            f"{at} stores epsilon_spent_after={stored!r} but the releases up to it spend {recomputed!r} "
            f"({header.accountant.value}, delta={header.delta:g})",
        )
    if stored < spent_before * (1.0 - _SPEND_RTOL):
        raise _corrupt(where, f"{at} stores a total spend below the release before it")
    if not recomputed <= header.budget_epsilon * (1.0 + _SPEND_RTOL):
        raise _corrupt(
            where, f"{at} brings the spend to {recomputed:.6g}, over the budget epsilon={header.budget_epsilon:g}"
        )


def _verify_releases(data: dict, header: _Header, where: str) -> list[Release]:
    """Every entry in order (:func:`_verify_entry`), its running spend recomputed (:func:`_verify_spend`)."""
    releases: list[Release] = []
    seen: set[str] = set()
    spent_before = 0.0
    for index, entry in enumerate(data["releases"]):
        release = _verify_entry(index, entry, seen, where)
        if release.privacy_unit != header.privacy_unit:
            raise _corrupt(where, f"release #{index + 1} ({release.release_id!r}) protects "
                                  f"{unit_phrase(release.privacy_unit)}, the ledger {unit_phrase(header.privacy_unit)}")
        seen.add(release.release_id)
        releases.append(release)
        at = f"release #{index + 1} ({release.release_id!r})"
        stored = _stored_spend(at, entry, where)
        recomputed = _spent_epsilon(releases, header.delta, header.accountant)
        _verify_spend(at, stored, recomputed, spent_before, header, where)
        spent_before = stored
    return releases


def _verify_chain(data: dict, releases: list[Release], where: str) -> None:
    """Format 2 on: each entry's stored chain value and ``head`` against the recomputed hash chain (format 3:
    and the number of releases)."""
    chain = _chain_values(data)
    for index, entry in enumerate(data["releases"]):
        if entry.get("chain") != chain[index + 1]:
            raise _corrupt(
                where,
                f"the hash chain breaks at release #{index + 1} ({releases[index].release_id!r}): the header "
                "(format version, budget, delta, accountant, dataset) or a release up to this one was changed, "
                "or a release before it was removed",
            )
    if data.get("head") != _head(data, chain):
        raise _corrupt(
            where,
            f"'head' does not match the hash chain and its {len(data['releases'])} release(s): releases were "
            "removed from the end, or the header or format version was changed",
        )


def _verify(data, where: str) -> _Verified:
    """Recompute and cross-check every stored figure (docs/guide/planning.md, "Integrity"); LedgerError if not."""
    header = _verify_header(data, where)
    releases = _verify_releases(data, header, where)
    if header.version >= 2:
        _verify_chain(data, releases, where)
    spent = _spent_epsilon(releases, header.delta, header.accountant)
    return _Verified(data=data, releases=tuple(releases), accountant=header.accountant, epsilon_spent=spent)


def _same_float(stored, recomputed: float, rtol: float) -> bool:
    if isinstance(stored, bool) or not isinstance(stored, (int, float)):
        return False
    return abs(stored - recomputed) <= rtol * max(abs(recomputed), abs(stored)) + 1e-300


# -- the ledger ----------------------------------------------------------------------------------------


def _resolve(path) -> Path:
    """The file a ledger path names: symbolic links resolved, never a directory (pinned by
    ``tests/test_accounting_ledger_integrity.py::test_symlinked_ledger_charges_the_target_and_stays_a_link``)."""
    given = Path(path)
    resolved = given.resolve()
    if resolved.is_dir():
        raise LedgerError(
            f"{str(given)!r} is a directory, not a ledger file; give a file path such as "
            f"{str(given / 'ledger.json')!r}"
        )
    return resolved


class BudgetLedger:
    """A privacy odometer stored at ``path`` (see the module docstring).

    ``path`` may be a symbolic link; :attr:`path` is the file it resolves to, which is what is read,
    locked and replaced.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = _resolve(path)
        if not self.path.exists():
            raise LedgerError(
                f"no ledger at {str(path)!r}; create one first (command line: `invink-audit ledger init`; "
                "Python: BudgetLedger.create)"
            )
        self._lock = FileLock(str(self.path) + ".lock", timeout=_LOCK_TIMEOUT_SECONDS)
        self._cache: tuple[bytes, _Verified] | None = None
        self._load()  # validate now, not at the first charge

    @classmethod
    def of(cls, ledger) -> BudgetLedger | None:
        """``ledger`` as a :class:`BudgetLedger`: one already open, a path to one, or ``None`` (no ledger)."""
        if ledger is None or isinstance(ledger, cls):
            return ledger
        if not isinstance(ledger, (str, os.PathLike)) or not str(os.fspath(ledger)).strip():
            raise ValueError(f"ledger must be a BudgetLedger, a path to one, or None; got {ledger!r}")
        return cls(ledger)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        epsilon: float,
        delta: float,
        accountant: Accountant | str = DEFAULT_ACCOUNTANT,
        dataset: str = "",
        privacy_unit: str | None = None,
    ) -> BudgetLedger:
        """Create a new ledger with a total budget (ε, δ) for ``privacy_unit`` (``None``: one reference; a column
        name: the references sharing its value, module docstring); refuses to overwrite an existing one."""
        check_privacy_unit(privacy_unit)
        epsilon = RANGES["epsilon"].check("epsilon", epsilon)
        delta = RANGES["delta"].check("delta", delta)
        acc = as_accountant(accountant)
        if not isinstance(dataset, str):
            raise ValueError(f"dataset must be a string; got {dataset!r}")
        target = _resolve(path)
        lock = FileLock(str(target) + ".lock", timeout=_LOCK_TIMEOUT_SECONDS)
        with _locked(lock, target):
            if target.exists():
                raise LedgerError(f"a ledger already exists at {str(path)!r}; refusing to overwrite it")
            data = {
                "format_version": _FORMAT_VERSION,
                "dataset": dataset,
                "created_at": _now(),
                "budget": {"epsilon": epsilon, "delta": delta},
                "accountant": acc.value,
                **({} if privacy_unit is None else {"privacy_unit": privacy_unit}),
                "releases": [],
            }
            atomic_write_json(target, _with_chain(data))
        return cls(target)

    # -- reading (no lock: the file is only ever replaced whole) -------------------------------------

    def _load(self) -> _Verified:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError as err:
            raise LedgerError(f"no ledger at {str(self.path)!r}") from err
        except IsADirectoryError as err:
            raise LedgerError(f"{str(self.path)!r} is a directory, not a ledger file") from err
        if self._cache is not None and self._cache[0] == raw:
            return self._cache[1]
        try:
            data = loads_strict(raw.decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LedgerError(f"ledger {str(self.path)!r} is not valid JSON: {err}") from err
        except DuplicateKeyError as err:  # json.loads would read its last value, another reader its first
            raise LedgerError(f"ledger {str(self.path)!r} is corrupt: an object repeats the key "
                              f"{err.key_shown()}") from None
        verified = _verify(data, repr(str(self.path)))
        self._cache = (raw, verified)
        return verified

    def status(self) -> LedgerStatus:
        """The spend so far (recomputed from the recorded releases, never from a stored total)."""
        v = self._load()
        return LedgerStatus(
            epsilon_budget=float(v.data["budget"]["epsilon"]),
            delta=float(v.data["budget"]["delta"]),
            accountant=v.accountant,
            epsilon_spent=v.epsilon_spent,
            releases=tuple(v.data["releases"]),
            format_version=int(v.data["format_version"]),
            head=v.data.get("head") if v.data["format_version"] >= 2 else None,
            rho_spent=math.fsum(r.rho_sequence for r in v.releases),
            privacy_unit=v.data.get("privacy_unit"),
        )

    def recorded(self, release_id: str) -> dict | None:
        """The recorded entry of ``release_id``, or ``None`` when it has not been charged."""
        for entry in self._load().data["releases"]:
            if entry["release"]["release_id"] == release_id:
                return entry
        return None

    # -- charging -----------------------------------------------------------------------------------

    def preview(self, release: Release) -> float:
        """The total ε spent after charging ``release`` (nothing is recorded).

        An already recorded ``release_id`` with the same parameters adds nothing (the total stays as it
        is); with different parameters it raises :class:`LedgerError`, as :meth:`charge` would.
        """
        v = self._load()
        _check_unit(v, _check_release(release), self.path)
        if _replay(v, release) is not None:
            return v.epsilon_spent
        return _spent_epsilon([*v.releases, release], v.data["budget"]["delta"], v.accountant)

    def largest_clip_norm(
        self, *, batch_size: int, max_new_tokens: int, temperature: float = 1.0, texts_per_batch: int = 1,
        num_batches: int = 1, unit_contributions: int = 1,
    ) -> Release | None:
        """The next InvisibleInk release with these (B, T, τ, texts per batch) at the largest clip norm C
        the budget still allows (:meth:`preview` at most the budget), or ``None`` when even the smallest
        supported C does not fit. ``num_batches`` changes nothing (disjoint batches compose in parallel).
        Per the ledger's privacy unit: ``unit_contributions`` = k batches one unit may touch (k·T steps).

        Empty ledger: the planner's inverse (:func:`accounting.plan_clip_norm` at the whole budget, errs
        low). Otherwise the spend is the privacy filter over the summed ρ (module docstring), monotone in
        C: bisection on C to the last representable step, keeping the side that fits. Either answer is
        checked against the spend :meth:`preview` computes (the same function) before it is returned.
        """
        v = self._load()
        budget, delta = float(v.data["budget"]["epsilon"]), float(v.data["budget"]["delta"])

        def release(c: float) -> Release:
            return Release.of(clip_norm=c, batch_size=batch_size, temperature=temperature, max_new_tokens=max_new_tokens,
                              texts_per_batch=texts_per_batch, num_batches=num_batches,
                              unit_contributions=unit_contributions, privacy_unit=v.data.get("privacy_unit"))

        def fits(c: float) -> bool:
            return _spent_epsilon([*v.releases, release(c)], delta, v.accountant) <= budget

        low, high = CLIP_NORM_RANGE.low, CLIP_NORM_RANGE.high
        first = release(low)  # every argument's range is checked here, before any search
        if not v.releases:
            try:
                c = plan_clip_norm(epsilon=budget, delta=delta, max_new_tokens=first.event.num_steps,
                                   batch_size=batch_size, temperature=temperature, accountant=v.accountant).clip_norm
                if fits(c):
                    return release(c)
            except ValueError:  # the planned C is outside the supported range: search it instead
                pass
        if not fits(low):
            return None
        if fits(high):
            return release(high)
        while True:  # invariant: fits(low) and not fits(high)
            middle = math.sqrt(low * high)
            if not low < middle < high:
                middle = math.nextafter(low, high)
                if middle >= high:
                    return release(low)
            low, high = (middle, high) if fits(middle) else (low, middle)

    def charge(self, release: Release) -> dict:
        """Record ``release`` if the total budget allows it; otherwise raise :class:`BudgetExceededError`.

        Returns the recorded entry. Charging an already recorded ``release_id`` with the same parameters
        returns the existing entry and spends nothing more (:meth:`charge_once` says which happened).
        """
        return self.charge_once(release).entry

    def charge_once(self, release: Release) -> ChargeOutcome:
        """:meth:`charge`, saying whether the release was recorded now or had been already."""
        release = _check_release(release)
        with _locked(self._lock, self.path) as held:
            v = self._load()
            _check_unit(v, release, self.path)
            entry = _replay(v, release)
            if entry is not None:
                return ChargeOutcome(entry=entry, already_recorded=True, epsilon_spent=v.epsilon_spent)
            links = os.stat(self.path).st_nlink
            if links > 1:
                held.discard()  # a refused charge leaves no lock file of its own behind
                raise LedgerError(
                    f"ledger {str(self.path)!r} has {links} hard links; an atomic rewrite would leave the other "
                    "names on the old contents and split the ledger. Keep one name (use a symbolic link to share it)"
                )
            budget, delta = float(v.data["budget"]["epsilon"]), float(v.data["budget"]["delta"])
            spent_after = _spent_epsilon([*v.releases, release], delta, v.accountant)
            if not spent_after <= budget:
                raise BudgetExceededError(
                    f"release {release.label or release.release_id!r} would bring the spend to "
                    f"epsilon={spent_after:.6g} at delta={delta:g}, over the budget "
                    f"epsilon={budget:g} ({v.accountant.value}); nothing was recorded"
                )
            entry = {
                "recorded_at": _now(),
                "release": release.to_json(),
                **_entry_figures(release),
                "epsilon_spent_after": spent_after,
            }
            data = _with_chain({**v.data, "releases": [*v.data["releases"], entry]})  # also migrates a format-1 ledger
            atomic_write_json(self.path, data)
            return ChargeOutcome(entry=data["releases"][-1], already_recorded=False, epsilon_spent=spent_after)


def _check_release(release) -> Release:
    if not isinstance(release, Release):
        raise ValueError(f"release must be a Release; got {type(release).__name__}")
    return release


def _check_unit(v: _Verified, release: Release, path: Path) -> None:
    """Refuse a release that protects another unit of privacy than the ledger (module docstring), saying why."""
    ledger_unit = v.data.get("privacy_unit")
    if release.privacy_unit == ledger_unit:
        return
    if ledger_unit is None:
        why = ("its total states a per-reference guarantee; a per-unit release belongs in a ledger of that unit "
               f"(`invink-audit ledger init --privacy-unit {release.privacy_unit}`)")
    elif release.privacy_unit is None:
        why = ("a per-reference release's epsilon says nothing of a unit with several references (group privacy "
               "multiplies it); release with --privacy-unit / ReferencesFile(privacy_unit=...)")
    else:
        why = "a ledger's total states one guarantee for one unit of privacy"
    raise LedgerError(
        f"ledger {str(path)!r} protects {unit_phrase(ledger_unit)}, but release "
        f"{release.label or release.release_id!r} protects {unit_phrase(release.privacy_unit)}: {why}; nothing was recorded"
    )


def _replay(v: _Verified, release: Release) -> dict | None:
    """The recorded entry when ``release`` repeats a recorded id with the same parameters (else None)."""
    for entry, recorded in zip(v.data["releases"], v.releases):
        if recorded.release_id == release.release_id:
            if recorded._parameters() != release._parameters():
                raise LedgerError(
                    f"release_id {release.release_id!r} is already recorded with different "
                    f"parameters ({recorded._parameters()}); use a new release_id"
                )
            return entry
    return None


class _locked:
    """Hold ``lock`` (on ``<ledger>.lock``); a timeout, an unwritable directory or a symbolic link at the
    lock's path is a LedgerError. :meth:`discard` removes the lock file when this hold created it."""

    def __init__(self, lock: FileLock, path: Path) -> None:
        self._lock, self._path = lock, path
        self._created = False

    def __enter__(self):
        lock_file = Path(self._lock.lock_file)
        if lock_file.is_symlink():  # never lock (or truncate) whatever a link points at
            raise LedgerError(_symlinked_lock(lock_file, self._path))
        existed = os.path.lexists(lock_file)
        try:
            self._lock.acquire()
        except Timeout as err:
            raise LedgerError(f"ledger {str(self._path)!r} is locked by another process; try again") from err
        except OSError as err:
            if err.errno == errno.ELOOP or lock_file.is_symlink():  # a link made since the check above
                raise LedgerError(_symlinked_lock(lock_file, self._path)) from err
            raise LedgerError(
                f"cannot lock ledger {str(self._path)!r} ({err.strerror or err}): writing needs a writable "
                f"directory for {self._path.name}.lock"
            ) from err
        self._created = not existed
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def discard(self) -> None:
        """Remove the lock file, still held, if this hold created it, so that a refused write leaves
        nothing behind; a lock file that was already there is kept (other processes may wait on it)."""
        if self._created:
            Path(self._lock.lock_file).unlink(missing_ok=True)


def _symlinked_lock(lock_file: Path, path: Path) -> str:
    return (
        f"the lock file {str(lock_file)!r} of ledger {str(path)!r} is a symbolic link; refusing to follow it "
        "(remove the link: the lock is a plain file beside the ledger)"
    )

