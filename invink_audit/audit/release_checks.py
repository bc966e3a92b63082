r"""What ``invink-audit audit --release`` checks of a release file before it teacher-forces a token: that what
was published (the JSON Lines output) is the release its operator's bookkeeping (``<output>.state.json``, the
``<output>.sampled`` journal of the texts drawn) records, and that each claim is the one its settings certify.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.release_checks"); docs/guide/auditing.md (§"Auditing
texts you just generated", a finished output file).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence

from invink_audit.audit.stats import Verdict

__all__ = [
    "CLAIM_RTOL",
    "FINDING_KINDS",
    "Finding",
    "PublishedRecord",
    "certified_guarantee",
    "check_published_records",
    "label_findings",
    "model_findings",
    "unit_findings",
    "record_findings",
    "seeded_findings",
]

#: A recorded ε may exceed the ε its settings certify by this much (relative): the planner returns the largest
#: clip norm whose certified ε is at most the target, so the target recorded is a little above (measured: < 2e-4).
#: A claim *below* what its settings certify is never accepted (beyond float rounding, :data:`_FLOAT_RTOL`).
CLAIM_RTOL = 1e-3
_FLOAT_RTOL = 1e-9

#: The kinds of finding, each with what it makes of a verdict that would otherwise be a PASS.
FINDING_KINDS: Mapping[str, Verdict] = {
    "text-not-drawn": Verdict.VIOLATION,  # a published text (or token ids) not the one drawn for its batch
    "edited-claim": Verdict.VIOLATION,  # a record's guarantee is not the one drawn, or not what its settings certify
    "edited-settings": Verdict.VIOLATION,  # a record's settings (``run``) are not those of the release
    "edited-record": Verdict.VIOLATION,  # another field of a record differs from the journal's copy
    "edited-labels": Verdict.VIOLATION,  # a record states labels or prompt fields the input does not give its batch
    "seeded-release": Verdict.INCONCLUSIVE,  # drawn with a fixed seed: reproducible, it carries no guarantee
    "weaker-claim": Verdict.INCONCLUSIVE,  # a record claims no guarantee, or a larger ε than its settings certify
    "state-inconsistent": Verdict.INCONCLUSIVE,  # the state's settings are not the release's: the audit is not of it
    "missing-record": Verdict.INCONCLUSIVE,  # a batch drawn (journal) but not published
    "duplicated-record": Verdict.INCONCLUSIVE,  # a batch published on more than one line
    "partial-release": Verdict.INCONCLUSIVE,  # fewer batches published than the release has
    "unverified-text": Verdict.INCONCLUSIVE,  # no journal (or a bare claim): a text cannot be checked
    "model-mismatch": Verdict.INCONCLUSIVE,  # the model loaded is not the one that drew the texts
    "model-unidentified": Verdict.INCONCLUSIVE,  # the release records no fingerprint of its model
    # a per-unit release with a unit in two slots of one batch: that unit moves the batch's aggregate twice
    "unit-in-two-slots": Verdict.VIOLATION,
}

_TEXT_FIELDS = ("text", "token_ids", "modes", "num_tokens", "finish_reason")
_CLAIM_FIELDS = ("guarantee", "guarantee_void_reason")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One way the release file is not the release its state and journal record: ``kind`` (a key of
    :data:`FINDING_KINDS`), its ``verdict`` (what it makes of a PASS), a one-line ``message``, the batches."""

    kind: str
    message: str
    batches: tuple[int, ...] = ()
    verdict: Verdict = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.kind not in FINDING_KINDS:
            raise ValueError(f"kind must be one of {sorted(FINDING_KINDS)}; got {self.kind!r}")
        if not self.message or "\n" in self.message:
            raise ValueError(f"message must be one non-empty line; got {self.message!r}")
        object.__setattr__(self, "verdict", FINDING_KINDS[self.kind])

    def line(self) -> str:
        return f"{self.kind} ({self.verdict.value}): {self.message}"


@dataclasses.dataclass(frozen=True)
class PublishedRecord:
    """A record of the published file with the line it is on (checked: :func:`check_published_records`)."""

    line: int
    record: Mapping
    source: str = "<output>"  # the file it is in

    @property
    def batch_index(self) -> int:
        return self.record["batch_index"]


def _short(indices: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", … ({len(indices)} in all)" if len(indices) > limit else "")


# ---------------------------------------------------------------------------------------------
# the records' form: bad input, one line each


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _record_problem(record: Mapping, num_batches: int, release_id: str) -> str | None:
    """What makes ``record`` not a text record of this release (``None``: nothing)."""
    index = record.get("batch_index")
    if not _is_count(index) or index >= num_batches:
        return f"batch_index must be an integer in 0 .. {num_batches - 1} (the release's batches); got {index!r}"
    if record.get("release_id") != release_id:
        return (f"a record of another release (release_id {record.get('release_id')!r}, the state's is "
                f"{release_id!r}): audit one release's file")  # fmt: skip
    for name in ("token_ids", "modes"):
        ids = record.get(name, [])
        if not isinstance(ids, list) or not all(_is_count(t) for t in ids):
            return f"{name} must be a list of non-negative integers; got {str(ids)[:60]}"
    if record.get("modes") and len(record["modes"]) != len(record["token_ids"]):
        return "modes must give one mode per token id"
    for name, kind in (("text", str), ("finish_reason", str), ("run", dict)):
        if not isinstance(record.get(name), kind):
            return f"{name} must be a JSON {'object' if kind is dict else 'string'}; got {str(record.get(name))[:60]}"
    if not isinstance(record.get("guarantee", 0), (dict, type(None))):
        return f"guarantee must be a JSON object or null; got {str(record.get('guarantee'))[:60]}"
    if not isinstance(record.get("model_dtype"), (dict, type(None))):
        return "model_dtype must be a JSON object or null"
    return None


def check_published_records(path, numbered: Sequence[tuple[int, Mapping]], num_batches: int,
                            release_id: str) -> tuple[PublishedRecord, ...]:
    """The records of the published file ``path`` (``(line, record)`` pairs), each checked to be a text record
    of this release: a ``ValueError`` ``"<path>:<line>: ..."`` (one line) names the first that is not."""
    if not numbered:
        raise ValueError(f"{path}: the release has no text yet")
    checked = []
    for line, record in numbered:
        problem = _record_problem(record, num_batches, release_id)
        if problem is not None:
            raise ValueError(f"{path}:{line}: {problem}")
        checked.append(PublishedRecord(line, record, str(path)))
    return tuple(checked)


# ---------------------------------------------------------------------------------------------
# the records against the journal: the texts drawn


def _journal_kind(fields: Sequence[str]) -> str:
    """The finding a record that differs from the journal's copy in ``fields`` is."""
    if any(f in _TEXT_FIELDS for f in fields):
        return "text-not-drawn"
    if any(f in _CLAIM_FIELDS for f in fields):
        return "edited-claim"
    return "edited-settings" if "run" in fields else "edited-record"


def _against_journal(records: Sequence[PublishedRecord], claims: Mapping) -> tuple[dict, dict, list]:
    """Batches by finding kind, fields by kind, and the batches whose journal line is a bare claim."""
    batches: dict[str, list[int]] = {}
    fields: dict[str, set] = {}
    bare = []
    for published in records:
        index = published.batch_index
        if index not in claims:
            batches.setdefault("never-journaled", []).append(index)
        elif claims[index] is None:
            bare.append(index)
        else:
            record, drawn = published.record, claims[index]
            differing = sorted(k for k in set(record) | set(drawn) if record.get(k) != drawn.get(k))
            if differing:
                kind = _journal_kind(differing)
                batches.setdefault(kind, []).append(index)
                fields.setdefault(kind, set()).update(differing)
    return batches, fields, bare


_JOURNAL_MESSAGES = {
    "text-not-drawn": "the published record of batch(es) {b} is not the text drawn for it (the journal's copy differs "
                      "in {f})",
    "edited-claim": "the published record of batch(es) {b} claims another guarantee than the one drawn with it (the "
                    "journal's copy differs in {f})",
    "edited-settings": "the published record of batch(es) {b} names other settings than those of the release (the "
                       "journal's copy differs in {f})",
    "edited-record": "the published record of batch(es) {b} differs from the journal's copy in {f}",
}


def _journal_findings(records: Sequence[PublishedRecord], claims: Mapping | None) -> tuple[list[Finding], set]:
    """Findings of the records against the journal, and the batches whose published text was not drawn."""
    if claims is None:
        return [Finding("unverified-text", "the release has no journal (<output>.sampled): no published text can be "
                        "checked against the texts drawn")], set()  # fmt: skip
    batches, fields, bare = _against_journal(records, claims)
    findings = []
    never = sorted(set(batches.pop("never-journaled", [])))
    if never:
        findings.append(Finding("text-not-drawn", f"batch(es) {_short(never)} are published but the journal records "
                                "no text drawn for them", tuple(never)))  # fmt: skip
    for kind, indices in batches.items():
        indices = sorted(set(indices))
        message = _JOURNAL_MESSAGES[kind].format(b=_short(indices), f=", ".join(sorted(fields[kind])))
        findings.append(Finding(kind, message, tuple(indices)))
    if bare:
        bare = sorted(bare)
        findings.append(Finding("unverified-text", f"the journal holds bare claims (an older journal) for batch(es) "
                                f"{_short(bare)}: their texts cannot be checked", tuple(bare)))  # fmt: skip
    not_drawn = set(never) | set(batches.get("text-not-drawn", ()))
    return findings, not_drawn


def _count_findings(records: Sequence[PublishedRecord], claims: Mapping | None, num_batches: int) -> list[Finding]:
    """Duplicated batches, batches drawn but not published, and a release of fewer batches than it has."""
    lines: dict[int, list[int]] = {}
    for published in records:
        lines.setdefault(published.batch_index, []).append(published.line)
    findings = []
    repeated = sorted(i for i, at in lines.items() if len(at) > 1)
    if repeated:
        where = "; ".join(f"batch {i} on lines {', '.join(map(str, lines[i]))}" for i in repeated[:4])
        findings.append(Finding("duplicated-record", f"{len(repeated)} batch(es) published more than once ({where})",
                                tuple(repeated)))  # fmt: skip
    dropped = sorted(set(claims or {}) - set(lines))
    if dropped:
        findings.append(Finding("missing-record", f"batch(es) {_short(dropped)} were drawn (journal) but are not "
                                "published", tuple(dropped)))  # fmt: skip
    if len(lines) < num_batches:
        unpublished = sorted(set(range(num_batches)) - set(lines))
        never = len(set(unpublished) - set(claims or {})) if claims is not None else None
        drawn = "" if never is None else f"; {never} of them never drawn"
        findings.append(Finding("partial-release", f"{len(lines)} of the release's {num_batches} batches are published "
                                f"(missing: {_short(unpublished)}{drawn})", tuple(unpublished)))  # fmt: skip
    return findings


# ---------------------------------------------------------------------------------------------
# claims against the settings that certify them


def certified_guarantee(run: Mapping) -> dict:
    """The guarantee the settings ``run`` certify, in the records' form: InvisibleInk's recomputed by the
    accountant from C, B, τ, T and δ (never the recorded target), a mechanism's from the mechanism; per privacy
    unit when the settings name one (:meth:`~invink_audit.generation.ReleaseConfig.unit_guarantee`: k texts
    composed under rule spread). A ``ValueError`` when the settings cannot be read."""
    from invink_audit.data import PrivacyUnit
    from invink_audit.generation import GenerationConfig, ReleaseConfig

    try:
        unit = PrivacyUnit.from_json(run["privacy_unit"]) if "privacy_unit" in run else None
        if "mechanism" in run:
            from invink_audit.mechanisms import mechanism_from_json

            mechanism = mechanism_from_json(run["mechanism"])
            return ReleaseConfig(mechanism, run["max_new_tokens"], run["delta"]).unit_guarantee(unit).to_json()
        config = GenerationConfig(clip_norm=run["clip_norm"], max_new_tokens=run["max_new_tokens"], top_k=run["top_k"],
                                  batch_size=run["batch_size"], temperature=run["temperature"], delta=run["delta"],
                                  accountant=run["accountant"])  # fmt: skip
        return config.unit_guarantee(unit).to_json()
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"the release's settings cannot be read ({type(err).__name__}: {err})") from None


def _same(a, b) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return a == b or (numbers and math.isclose(a, b, rel_tol=_FLOAT_RTOL))


def _claim_problem(claimed, run: Mapping) -> tuple[str, str] | None:
    """``(kind, message)`` when the guarantee ``claimed`` is not the one the settings ``run`` certify."""
    if run.get("seeded"):
        if claimed is None:
            return None
        return "edited-claim", "a seeded release (no guarantee: its noise is reproducible) claims one"
    if claimed is None:
        return "weaker-claim", "claims no guarantee, but the release is not seeded"
    if not isinstance(claimed, Mapping):
        return "edited-claim", f"its guarantee is not a JSON object ({str(claimed)[:40]})"
    expected = certified_guarantee(run)
    others = sorted(k for k in (set(expected) | set(claimed)) - {"epsilon", "void_reason"}
                    if not _same(claimed.get(k), expected.get(k)))  # fmt: skip
    if others:
        shown = ", ".join(f"{k} {claimed.get(k)!r} vs {expected.get(k)!r}" for k in others[:4])
        return "edited-claim", f"its guarantee disagrees with its settings ({shown})"
    epsilon, certified = claimed.get("epsilon"), expected["epsilon"]
    if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool) or math.isnan(epsilon):
        return "edited-claim", f"its guarantee's epsilon is not a number ({epsilon!r})"
    if epsilon < certified and not math.isclose(epsilon, certified, rel_tol=_FLOAT_RTOL):
        return "edited-claim", f"claims ε = {epsilon:g}, but its settings certify only ε = {certified:.6g}"
    if epsilon > certified * (1 + CLAIM_RTOL):
        return "weaker-claim", f"claims ε = {epsilon:g}, but its settings certify ε = {certified:.6g}"
    return None


def _claim_findings(records: Sequence[PublishedRecord]) -> list[Finding]:
    """Each distinct published (guarantee, settings) pair against what the settings certify."""
    groups: dict[str, list] = {}
    for published in records:
        key = json.dumps([published.record.get("guarantee"), published.record["run"]], sort_keys=True, default=str)
        groups.setdefault(key, []).append(published)
    findings = []
    for group in groups.values():
        first = group[0].record
        try:
            problem = _claim_problem(first.get("guarantee"), first["run"])
        except ValueError as err:
            raise ValueError(f"{group[0].source}:{group[0].line}: {err}") from None
        if problem is not None:
            batches = sorted({p.batch_index for p in group})
            findings.append(Finding(problem[0], f"the record(s) of batch(es) {_short(batches)}: {problem[1]}",
                                    tuple(batches)))  # fmt: skip
    return findings


def _state_findings(state_run: Mapping, claims: Mapping | None, records: Sequence[PublishedRecord]) -> list[Finding]:
    """The state's settings against the release's (the journal's copies, else the published records), and the
    guarantee recorded with the texts against what the state's settings certify."""
    drawn = [r for r in (claims or {}).values() if isinstance(r, dict)]
    source = "journal's records" if drawn else "published records"
    drawn = drawn or [p.record for p in records]
    findings, seen = [], set()
    for record in drawn:
        run = record.get("run") if isinstance(record.get("run"), dict) else {}
        differing = tuple(k for k in sorted(set(run) | set(state_run)) if run.get(k) != state_run.get(k))
        if differing and differing not in seen:
            seen.add(differing)
            findings.append(Finding("state-inconsistent", f"the state's settings differ from the {source}' in "
                                    f"{', '.join(differing)}: the audit rebuilds the release from the state, so it is "
                                    "not of this release"))  # fmt: skip
    problem = _claim_problem(drawn[0].get("guarantee"), state_run) if drawn else None
    if problem is not None:
        findings.append(Finding("state-inconsistent", f"the guarantee in the {source} is not what the state's settings "
                                f"certify: {problem[1]}"))  # fmt: skip
    return findings


def record_findings(records: Sequence[PublishedRecord], state_run: Mapping, claims: Mapping | None,
                    num_batches: int) -> tuple[tuple[Finding, ...], frozenset]:
    """Every finding of the published ``records`` against the state's settings ``state_run`` and the journal's
    first ``claims`` (batch → record, ``None`` without a journal), and the batches whose published text was
    not drawn (not to be teacher-forced)."""
    journal, not_drawn = _journal_findings(records, claims)
    findings = [*journal, *_count_findings(records, claims, num_batches), *_claim_findings(records),
                *_state_findings(state_run, claims, records)]  # fmt: skip
    return tuple(findings), frozenset(not_drawn)


def seeded_findings(state_run: Mapping) -> tuple[Finding, ...]:
    """A ``seeded-release`` finding when the state's settings record that the release was drawn with a fixed seed
    (``run.seeded``): its texts are reproducible from the seed, so it carries no privacy guarantee whatever its
    teacher forcing shows, and its audit is never a PASS."""
    if not state_run.get("seeded"):
        return ()
    return (Finding("seeded-release", "the release was drawn with a fixed seed: reproducible, it carries no privacy "
                    "guarantee; the checks measure its settings' claim, not a guarantee it has"),)


# ---------------------------------------------------------------------------------------------
# the labels and prompt fields each batch gets from the input


def label_findings(records: Sequence[PublishedRecord], template, labels: Sequence[Mapping[str, str]] | None,
                   label_fields: Mapping[str, str] | None) -> list[Finding]:
    """Each published record's ``labels`` and ``prompt_fields`` against those its batch gets from the input:
    ``labels`` (one mapping per batch, ``None`` for an unlabelled release) rebuilt from ``--input`` and accepted by
    the state's fingerprint, placed in the release's ``template`` by ``label_fields``
    (:func:`~invink_audit.prompts.template_for_batch`). A record without ``prompt_fields`` (written before records
    carried them) is compared by its labels only. An ``edited-labels`` finding names the batches and fields."""
    from invink_audit.prompts import template_for_batch

    batches, fields = set(), set()
    for published in records:
        index, record = published.batch_index, published.record
        # what generate writes in the record of the batch
        expected_labels = None if labels is None else dict(labels[index])
        differing = ["labels"] if record.get("labels") != expected_labels else []
        expected_fields = dict(template_for_batch(template, labels, label_fields, index).fields)
        if "prompt_fields" in record and record["prompt_fields"] != expected_fields:
            differing.append("prompt_fields")
        if differing:
            batches.add(index)
            fields.update(differing)
    if not batches:
        return []
    shown = sorted(batches)
    return [Finding("edited-labels", f"the published record(s) of batch(es) {_short(shown)} state "
                    f"{' and '.join(sorted(fields))} that the input does not give their batch (rebuilt from --input, "
                    "whose fingerprint the state records)", tuple(shown))]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the model


def unit_findings(partition) -> list[Finding]:
    """A per-unit release's batches that hold two slots of one privacy unit (``partition.units``): replacing that
    unit by null moves the batch's aggregate twice, so the per-slot neighbours the audit replays are not the unit's
    and a per-reference ε does not hold per unit (the planted bug of the self-test's ``unit-two-slots`` row)."""
    units = getattr(partition, "units", None) or ()
    doubled = [i for i, batch in enumerate(units) if len(set(batch)) < len(batch)]
    if not doubled:
        return []
    return [Finding("unit-in-two-slots", f"batch(es) {_short(doubled)} hold two references of one privacy unit: that "
                    "unit moves their aggregate twice, beyond the per-reference sensitivity C/B", tuple(doubled))]


def model_findings(run: Mapping, loaded_name: str, fingerprint: str) -> list[Finding]:
    """The model loaded for the audit (``loaded_name``, its ``fingerprint``) against the one the release records.
    Another name and another (or no) fingerprint is a ``ValueError`` (the wrong ``--model``); the same name or
    none, with another fingerprint, is another model at the same path (a finding); no fingerprint recorded is
    a finding too (the model cannot be checked)."""
    name, recorded = run.get("model"), run.get("model_fingerprint")
    named = isinstance(name, str) and bool(name)
    if named and name != loaded_name and recorded != fingerprint:
        raise ValueError(f"the release was generated with {name!r}, not {loaded_name!r}: give --model")
    if not isinstance(recorded, str) or not recorded:
        what = "no model fingerprint" + ("" if named else " and no model name")
        return [Finding("model-unidentified", f"the release records {what} (written before fingerprints were "
                        f"recorded, or its state was edited): the model loaded ({loaded_name!r}) cannot be checked to "
                        "be the one that drew the texts")]  # fmt: skip
    if recorded != fingerprint:
        return [Finding("model-mismatch", f"the model loaded ({loaded_name!r}, {fingerprint[:19]}…) is not the one "
                        f"that drew the texts ({recorded[:19]}…): another model at the same path, or another --model")]
    return []
