r"""A persisted privacy odometer for one dataset: the budget ledger.

Every release that reads the dataset is charged *before* any work starts. A release is a run of
InvisibleInk over disjoint, data-independently formed batches of B references, each batch producing
``texts_per_batch`` texts of at most T tokens.

Composition (paper Theorem 1 and Corollary 1):

* within one release, disjoint batches compose in **parallel**: n texts from n disjoint batches cost one
  sequence of T tokens (each reference influences one text); ``num_batches`` is recorded, not charged;
* a batch used for ``texts_per_batch`` texts composes sequentially: T·texts_per_batch token steps;
* separate releases on the same dataset compose **sequentially**, and their parameters may be chosen
  after seeing earlier outputs (fully adaptive composition), so the ledger is a *privacy filter*.

Every token step is ε0-bounded-range with its release's ε0 = 2Δ/τ and ρ = ε0²/8-zCDP. The spend is:

* **one release**: its T·texts_per_batch steps form a sequence fixed before it runs, so the ledger's
  accountant applies as for a plan (``br-adaptive`` included);
* **several releases**: ρ_total = Σ ρ over all steps, converted to ε at the ledger's δ with the ledger's
  zCDP conversion (CKS for ``br-adaptive``). Summing ρ is a valid filter when each release's
  parameters are chosen adaptively (Feldman & Zrnic 2021, "Individual Privacy Accounting via a Rényi
  Filter", arXiv:2008.11193, Thm. 3.1; Whitehouse, Ramdas, Rogers & Wu 2023, "Fully-Adaptive
  Composition in Differential Privacy", arXiv:2203.05481). The optimal bounded-range composition of a
  *fixed* sequence is not: an analyst who picks the next release's ε0 from the previous output can
  exceed it (``tests/test_accounting_review.py`` builds such an interaction).

Durability: the ledger is a JSON file rewritten atomically (temporary file, fsync, ``os.replace``,
directory fsync), so a crash leaves either the old or the new file, never a torn one. Concurrency: every
read-check-write holds an exclusive lock on ``<path>.lock`` (``filelock``), so two processes never both
spend the last of the budget. Idempotence: a release carries a ``release_id``; charging the same id
again with the same parameters returns the recorded entry without spending twice (a resumed run), and
with different parameters is an error. A crash after the charge keeps the spend: outputs may already
have been released, so the budget is never given back.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import tempfile
import uuid
from pathlib import Path

from filelock import FileLock, Timeout

from accounting._validation import check_count, check_delta, check_positive
from accounting.accountants import (
    DEFAULT_ACCOUNTANT,
    Accountant,
    as_accountant,
    bounded_range_epsilon,
    composed_epsilon,
)
from accounting.conversions import ConversionMethod, zcdp_to_epsilon
from accounting.sensitivity import Adjacency, Clipping, _coerce, linf_sensitivity

__all__ = ["BudgetLedger", "BudgetExceededError", "LedgerError", "Release", "LedgerStatus"]

_FORMAT_VERSION = 1
_LOCK_TIMEOUT_SECONDS = 60.0


class LedgerError(ValueError):
    """The ledger file is missing, corrupt, or a request contradicts what it records."""


class BudgetExceededError(LedgerError):
    """A release would take the dataset past its total budget; nothing was recorded."""


@dataclasses.dataclass(frozen=True)
class Release:
    """The public parameters of one release (never anything derived from the private data)."""

    clip_norm: float
    batch_size: int
    temperature: float
    max_new_tokens: int
    texts_per_batch: int = 1
    num_batches: int = 1
    label: str = ""
    release_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    clipping: Clipping = Clipping.DIFFERENCE
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL

    def __post_init__(self) -> None:
        check_positive("clip_norm", self.clip_norm)
        check_count("batch_size", self.batch_size)
        check_positive("temperature", self.temperature)
        check_count("max_new_tokens", self.max_new_tokens)
        check_count("texts_per_batch", self.texts_per_batch)
        check_count("num_batches", self.num_batches)
        if not isinstance(self.release_id, str) or not self.release_id.strip():
            raise ValueError(f"release_id must be a non-empty string; got {self.release_id!r}")
        if not isinstance(self.label, str):
            raise ValueError(f"label must be a string; got {self.label!r}")
        object.__setattr__(self, "clipping", _coerce(self.clipping, Clipping))
        object.__setattr__(self, "adjacency", _coerce(self.adjacency, Adjacency))

    @property
    def epsilon0(self) -> float:
        """Per-token bounded range 2Δ/τ, Δ from :func:`accounting.linf_sensitivity`."""
        sens = linf_sensitivity(self.clip_norm, self.batch_size, self.clipping, self.adjacency)
        return bounded_range_epsilon(sens, self.temperature)

    @property
    def num_steps(self) -> int:
        """Token steps charged: T per text, times the texts drawn from each batch (batches parallel)."""
        return self.max_new_tokens * self.texts_per_batch

    def _parameters(self) -> dict:
        return {
            "clip_norm": self.clip_norm,
            "batch_size": self.batch_size,
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
            "texts_per_batch": self.texts_per_batch,
            "num_batches": self.num_batches,
            "clipping": self.clipping.value,
            "adjacency": self.adjacency.value,
        }

    def to_json(self) -> dict:
        return {"release_id": self.release_id, "label": self.label, **self._parameters()}

    @classmethod
    def from_json(cls, data: dict) -> Release:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class LedgerStatus:
    """What the ledger has spent and what remains, at its δ."""

    epsilon_budget: float
    delta: float
    accountant: str
    epsilon_spent: float
    releases: tuple[dict, ...]

    @property
    def epsilon_remaining(self) -> float:
        return max(0.0, self.epsilon_budget - self.epsilon_spent)


def _spent_epsilon(releases: list[Release], delta: float, accountant: Accountant) -> float:
    """Spend of the recorded releases (module docstring: one release vs a privacy filter over several)."""
    if not releases:
        return 0.0
    if len(releases) == 1:
        r = releases[0]
        return composed_epsilon(delta, r.epsilon0, r.num_steps, accountant=accountant)
    rho = math.fsum(r.num_steps * r.epsilon0**2 / 8.0 for r in releases)
    conversion = ConversionMethod.CKS if accountant is Accountant.BR_ADAPTIVE else accountant.conversion
    return zcdp_to_epsilon(rho, delta, conversion)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class BudgetLedger:
    """A privacy odometer stored at ``path`` (see the module docstring)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise LedgerError(f"no ledger at {str(self.path)!r}; create one with BudgetLedger.create")
        self._lock = FileLock(str(self.path) + ".lock", timeout=_LOCK_TIMEOUT_SECONDS)
        self._read()  # validate now, not at the first charge

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        epsilon: float,
        delta: float,
        accountant: Accountant | str = DEFAULT_ACCOUNTANT,
        dataset: str = "",
    ) -> BudgetLedger:
        """Create a new ledger with a total budget (ε, δ); refuses to overwrite an existing one."""
        epsilon = check_positive("epsilon", epsilon)
        delta = check_delta("delta", delta)
        acc = as_accountant(accountant)
        path = Path(path)
        lock = FileLock(str(path) + ".lock", timeout=_LOCK_TIMEOUT_SECONDS)
        with lock:
            if path.exists():
                raise LedgerError(f"a ledger already exists at {str(path)!r}; refusing to overwrite it")
            _atomic_write_json(
                path,
                {
                    "format_version": _FORMAT_VERSION,
                    "dataset": dataset,
                    "created_at": _now(),
                    "budget": {"epsilon": epsilon, "delta": delta},
                    "accountant": acc.value,
                    "releases": [],
                },
            )
        return cls(path)

    # -- reading ------------------------------------------------------------------------------------

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError as err:
            raise LedgerError(f"no ledger at {str(self.path)!r}") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LedgerError(f"ledger {str(self.path)!r} is not valid JSON: {err}") from err
        if not isinstance(data, dict) or data.get("format_version") != _FORMAT_VERSION:
            raise LedgerError(f"ledger {str(self.path)!r} has an unknown format")
        try:
            check_positive("budget.epsilon", data["budget"]["epsilon"])
            check_delta("budget.delta", data["budget"]["delta"])
            as_accountant(data["accountant"])
            for entry in data["releases"]:
                Release.from_json(entry["release"])
        except (KeyError, TypeError, ValueError) as err:
            raise LedgerError(f"ledger {str(self.path)!r} is corrupt: {err}") from err
        return data

    def status(self) -> LedgerStatus:
        """The spend so far (recomputed from the recorded releases, never from a cached total)."""
        with self._lock:
            data = self._read()
        return self._status(data)

    def _status(self, data: dict) -> LedgerStatus:
        releases = [Release.from_json(e["release"]) for e in data["releases"]]
        acc = as_accountant(data["accountant"])
        spent = _spent_epsilon(releases, data["budget"]["delta"], acc)
        return LedgerStatus(
            epsilon_budget=data["budget"]["epsilon"],
            delta=data["budget"]["delta"],
            accountant=acc.value,
            epsilon_spent=spent,
            releases=tuple(data["releases"]),
        )

    # -- charging -----------------------------------------------------------------------------------

    def preview(self, release: Release) -> float:
        """The total ε that would be spent after ``release`` (nothing is recorded)."""
        with self._lock:
            data = self._read()
        return self._projected(data, release)

    def _projected(self, data: dict, release: Release) -> float:
        releases = [Release.from_json(e["release"]) for e in data["releases"]]
        acc = as_accountant(data["accountant"])
        return _spent_epsilon([*releases, release], data["budget"]["delta"], acc)

    def charge(self, release: Release) -> dict:
        """Record ``release`` if the total budget allows it; otherwise raise :class:`BudgetExceededError`.

        Returns the recorded entry. Charging an already recorded ``release_id`` with the same parameters
        returns the existing entry and spends nothing more.
        """
        if not isinstance(release, Release):
            raise ValueError(f"release must be a Release; got {type(release).__name__}")
        try:
            self._lock.acquire()
        except Timeout as err:
            raise LedgerError(f"ledger {str(self.path)!r} is locked by another process; try again") from err
        try:
            return self._charge_locked(release)
        finally:
            self._lock.release()

    def _charge_locked(self, release: Release) -> dict:
        data = self._read()
        for entry in data["releases"]:
            if entry["release"]["release_id"] == release.release_id:
                recorded = Release.from_json(entry["release"])
                if recorded._parameters() != release._parameters():
                    raise LedgerError(
                        f"release_id {release.release_id!r} is already recorded with different "
                        f"parameters ({recorded._parameters()}); use a new release_id"
                    )
                return entry
        budget = data["budget"]["epsilon"]
        spent_after = self._projected(data, release)
        if not spent_after <= budget:
            raise BudgetExceededError(
                f"release {release.label or release.release_id!r} would bring the spend to "
                f"epsilon={spent_after:.6g} at delta={data['budget']['delta']:g}, over the budget "
                f"epsilon={budget:g} ({data['accountant']}); nothing was recorded"
            )
        entry = {
            "recorded_at": _now(),
            "release": release.to_json(),
            "epsilon0": release.epsilon0,
            "num_steps": release.num_steps,
            "epsilon_spent_after": spent_after,
        }
        data["releases"].append(entry)
        _atomic_write_json(self.path, data)
        return entry


def _atomic_write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, sort_keys=True, allow_nan=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


