r"""A short audit of texts that were just generated (used by ``make demo``).

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.quick"); docs/guide/auditing.md (§"Auditing texts you
just generated").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from accounting.ledger import unit_phrase
from invink_audit.audit.records import REPORT_PRIVACY_NOTICE, WhiteBoxReport, headline_lines, to_jsonable
from invink_audit.audit.release_checks import (Finding, check_published_records, label_findings, model_findings,
                                               record_findings, seeded_findings, unit_findings)
from invink_audit.audit.stats import Verdict
from invink_audit.audit.whitebox import Claim, SamplingPlan, WhiteBoxConfig, WhiteBoxRecorder
from invink_audit.not_private import mark_not_private

if TYPE_CHECKING:
    from invink_audit.data import Partition
    from invink_audit.mechanisms import Mechanism, MechanismGuarantee
    from invink_audit.models import DtypeChoice
    from invink_audit.prompts import PromptTemplate

__all__ = [
    "PHASE_EXACT",
    "PHASE_SAMPLED",
    "AuditedRelease",
    "QuickAuditReport",
    "ReleaseFile",
    "audit_release_file",
    "quick_audit",
    "teacher_forced_losses",
    "write_quick_report",
]


@dataclasses.dataclass(frozen=True)
class QuickAuditReport:
    """Verdict and headline numbers of :func:`quick_audit` (``sampled`` is the full sampled report)."""

    verdict: Verdict
    reason: str
    texts_audited: int
    step_checks: int
    step_failures: dict
    max_loss_range_over_epsilon0: float
    realised_loss_max: float  # max over texts and neighbours of L_j(x), nats
    realised_loss_mean: float
    a_priori_loss_bound: float  # T * epsilon0
    accountant_epsilon: float
    sampled: WhiteBoxReport | None
    seconds: float
    # texts the sampled audit drew from the references outside the ledger (not charged, not covered)
    uncharged_samples: int = 0
    privacy_notice: str = REPORT_PRIVACY_NOTICE
    mechanism: str = "invisibleink"
    guarantee: str = "a-priori"  # or "data-dependent" (never a PASS)
    # the dtype the model was teacher-forced in, and why (DtypeChoice.to_json(); the release's own)
    model_dtype: dict | None = None
    # a release file's: the ε its records claim (None: no claim, or not read from a file), and each way the
    # published file is not the release its state and journal record (release_checks.Finding; none: a PASS stands)
    claimed_epsilon: float | None = None
    findings: tuple = ()

    def to_dict(self) -> dict:
        """JSON-ready, marked first (``not_private``, ``privacy_notice``: the report is not private)."""
        return mark_not_private(to_jsonable(self), self.privacy_notice)

    def summary(self) -> str:
        lines = [
            f"audit verdict: {self.verdict.value} ({self.reason})",
            f"  {self.privacy_notice}",
            f"  mechanism {self.mechanism}, guarantee {self.guarantee.upper() if self.guarantee != 'a-priori' else self.guarantee}"
            + (f", model dtype {self.model_dtype['dtype']}" if self.model_dtype else ""),
            f"  teacher-forced {self.texts_audited} generated texts: {self.step_checks} exact per-step checks, "
            f"failures {sum(self.step_failures.values())}; max loss range / eps0 = {self.max_loss_range_over_epsilon0:.4f}",
            f"  realised privacy loss of the released texts: max {self.realised_loss_max:.4f}, mean "
            f"{self.realised_loss_mean:.4f} nats ("
            + (f"a-priori bound T*eps0 = {self.a_priori_loss_bound:.3f}; " if math.isfinite(self.a_priori_loss_bound)
               else "no a-priori bound on one text's loss; ")
            + f"the settings certify eps = {self.accountant_epsilon:.3f})",
        ]
        if self.claimed_epsilon is not None:
            lines.append(f"  the release claims eps = {self.claimed_epsilon:g} (its published records)")
        lines += [f"  finding {f.line()}" for f in self.findings]
        if self.sampled is not None:
            h = self.sampled.headroom_summary()
            lines.append(
                f"  sampled audit of batch 0 ({self.uncharged_samples} extra texts drawn outside the ledger: UNCHARGED, "
                "not covered by the release's guarantee, never to be published): "
                f"{self.sampled.verdict.value}; sequence Renyi headroom (claim/estimate) min {h['sequence_renyi_min']:.3g}"
            )
            # eps against the release's claimed eps (the accountant's), and whether sampling confirmed anything; for a
            # release file the claim is its records' (printed above), and this figure is what its settings certify
            headline = headline_lines(h, self.sampled.verdict)
            if self.claimed_epsilon is not None:
                headline = [line.replace("ε: the release claims ", "ε: its settings certify ", 1) for line in headline]
            lines += [f"    {line}" for line in headline]
        lines.append(f"  ({self.seconds:.1f} s)")
        return "\n".join(lines)


def teacher_forced_losses(
    loaded, mechanism, requests, token_ids, *, claim: Claim, config: WhiteBoxConfig,
    progress: Callable[[int, int], None] | None = None,
):
    """Run the engine forcing ``token_ids[i]`` for ``requests[i]``; return the recorder's measurements.

    Every prefix of every text is checked exactly (all B neighbours) and the exact log-probabilities
    of each text under R and every R'_j are accumulated. ``mechanism``: a
    :class:`~invink_audit.mechanisms.Mechanism`, in its exact state; ``token_ids[i]`` are the text's *outcomes*
    (``mode·V + token``, and the stop outcome last when the mechanism's stop rule ended it: InvisibleInk's are its
    tokens), and each step's per-step claim is checked on the distributions the mechanism names for it.
    ``progress(done, total)``: forced tokens so far, of all the texts' tokens.
    """
    from invink_audit.audit.model_audit import Slots, engine_step
    from invink_audit.engine import Engine

    engine = Engine(loaded, mechanism)
    n = len(requests)
    plan = SamplingPlan(np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64))
    max_len = max(1, max(len(t) for t in token_ids))
    recorder = WhiteBoxRecorder(plan, claim, config, max_steps=max_len, device=loaded.device)

    def observer(step):
        recorder.weigh(step.request_indices, engine_step(step))
        recorder.record(step.request_indices, step.outcomes if step.generic else step.tokens)

    stop_id = mechanism.stop_outcome(loaded.vocab_size)
    slots = Slots(progress, sum(1 for t in token_ids for o in t if o != stop_id))
    engine.force(requests, token_ids, max_new_tokens=claim.max_new_tokens, observer=observer,
                 progress=slots.add if progress is not None else None)
    slots.finish()
    return recorder.finish()


# ---------------------------------------------------------------------------------------------
# what the audited generation was


@dataclasses.dataclass(frozen=True)
class AuditedRelease:
    """What an audited ``generate`` call was, as the audit uses it: the mechanism, its guarantee for the release's
    T and δ, the release's ε (its accountant's), the partition, and the prompt template (with each batch's labels
    in a label-conditioned release)."""

    mechanism: Mechanism
    guarantee: MechanismGuarantee
    epsilon: float
    partition: Partition
    template: PromptTemplate
    labels: tuple | None = None
    label_fields: Mapping[str, str] | None = None  # label column -> prompt field, as generate placed them

    @classmethod
    def of(cls, result, references=None, *, prompt=None, prompt_fields=None) -> AuditedRelease:
        """The release a :class:`~invink_audit.generation.GenerationResult` records (its ``mechanism``,
        ``guarantee``, ``template``, ``partition``, ``labels`` and ``label_fields``). ``references``, ``prompt`` and
        ``prompt_fields`` are optional; when given they must agree with what the generation used (a ``ValueError``
        otherwise). A result that records no mechanism (built by hand or by an older version) is rebuilt from
        InvisibleInk's guarantee, ``references`` (needed then) and the prompt."""
        if any(getattr(result, name, None) is None for name in ("mechanism", "template", "partition")):
            return cls._rebuilt(result, references, prompt=prompt, prompt_fields=prompt_fields)
        _check_recorded(result)
        if references is not None:
            _check_references(result, references)
        if prompt is not None or prompt_fields is not None:
            _check_prompt(result, prompt, prompt_fields)
        g, mechanism = result.guarantee, result.mechanism
        return cls(mechanism, mechanism.guarantee(g.max_new_tokens, g.delta), g.epsilon, result.partition, result.template,
                   result.labels, getattr(result, "label_fields", None))  # fmt: skip

    @classmethod
    def _rebuilt(cls, result, references, *, prompt, prompt_fields) -> AuditedRelease:
        from invink_audit.data import partition_references

        g = result.guarantee
        if not {"clip_norm", "batch_size", "temperature", "top_k"} <= set(g.details):
            raise ValueError("this result records no mechanism, partition or template: audit the result generate returned")
        if references is None:
            raise ValueError("this result records no mechanism, partition or template: give the references given to generate")
        if getattr(result, "labels", None) is not None:
            raise ValueError(
                "this label-conditioned result records no mechanism, partition or template: its batches' prompts "
                "cannot be rebuilt from the references; audit the result generate returned"
            )
        d, references = g.details, _reference_texts(references)
        mechanism = _invisibleink(d)
        return cls(mechanism, mechanism.guarantee(g.max_new_tokens, g.delta), g.epsilon,
                   partition_references(references, d["batch_size"]), _template(prompt or result.prompt, prompt_fields))

    def batch_template(self, index: int):
        """The prompt of batch ``index`` (the template, with the batch's labels in a label-conditioned release)."""
        from invink_audit.prompts import template_for_batch

        return template_for_batch(self.template, self.labels, self.label_fields, index)

    def claim(self) -> Claim:
        """The claim the release's mechanism makes for texts of at most T tokens (its guarantee for B references)."""
        return Claim(self.guarantee, self.mechanism.batch_size)

    def audit_settings(self):
        """The sampled audit's mechanism parameters: the release's mechanism, T and δ."""
        from invink_audit.audit.model_audit import ModelAuditSettings

        g = self.guarantee
        return ModelAuditSettings(max_new_tokens=g.max_new_tokens, delta=g.delta, mechanism=self.mechanism)


def _invisibleink(settings: Mapping):
    """InvisibleInk with the settings its guarantee's details (or a release's state) name: C, τ, top-k, B and the
    accountant."""
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import InvisibleInk

    config = MechanismConfig(clip_norm=settings["clip_norm"], temperature=settings["temperature"], top_k=settings["top_k"],
                             batch_size=settings["batch_size"])  # fmt: skip
    return InvisibleInk(config, accountant=settings.get("accountant", "br-adaptive"))


def _disagree(what: str, given, recorded) -> ValueError:
    return ValueError(f"the result's {what} do not match: {given!r} vs {recorded!r} (the result is inconsistent)")


def _check_recorded(result) -> None:
    """The result's guarantee is its mechanism's (for its T and δ; per privacy unit, its texts composed), and its
    partition has the mechanism's B."""
    from invink_audit.generation import ReleaseConfig

    g, mech = result.guarantee, result.mechanism
    own = ReleaseConfig(mech, g.max_new_tokens, g.delta).unit_guarantee(getattr(result, "privacy_unit", None))
    for name in ("kind", "epsilon", "rho_sequence", "composition", "step_epsilon0", "step_rho"):
        if getattr(g, name) != getattr(own, name):
            raise _disagree(f"guarantee and mechanism ({name})", getattr(g, name), getattr(own, name))
    if result.partition.batch_size != mech.batch_size:
        raise _disagree("partition and mechanism (batch_size)", result.partition.batch_size, mech.batch_size)


def _reference_texts(references) -> list:
    """References in any form :func:`~invink_audit.generation.generate` takes (a list, a path, a
    :class:`~invink_audit.data.ReferencesFile`, :class:`~invink_audit.data.LabelledReferences`) as their texts."""
    from invink_audit.data import LabelledReferences, as_references

    references = as_references(references)
    return list(references.texts) if isinstance(references, LabelledReferences) else references


def _template(prompt, prompt_fields):
    """The template of a prompt in any form ``generate`` takes (a preset name, a template, a
    :class:`~invink_audit.generation.PromptSpec`), with ``prompt_fields``."""
    from invink_audit.generation import PromptSpec
    from invink_audit.prompts import get_preset

    if isinstance(prompt, PromptSpec):
        if prompt_fields:
            raise ValueError("give the prompt's fields in its PromptSpec, not also as prompt_fields")
        return prompt.resolved()
    return get_preset(prompt, **(prompt_fields or {}))


def _check_references(result, references) -> None:
    """``references`` (a list or a file path; a :class:`~invink_audit.data.ReferencesFile` with the release's
    privacy unit) are those the generation partitioned."""
    from invink_audit.data import UnitReferences, as_references, partition_references, unit_partition, unit_slots

    references, recorded = as_references(references), result.partition.batches
    given = None
    if isinstance(references, UnitReferences):  # the unit's rule makes the slots (and, for spread, the batches)
        if references.privacy_unit != getattr(result, "privacy_unit", None):
            raise ValueError("the references given name another privacy unit or rule than the release's")
        if result.labels is None:
            given = unit_partition(references, result.partition.batch_size)[0].batches[: len(recorded)]
        references = unit_slots(references)[0]
    references = _reference_texts(references)
    if result.labels is None:
        given = given or partition_references(references, result.partition.batch_size).batches[: len(recorded)]
        differs = next((i for i, (a, b) in enumerate(zip(given, recorded)) if a != b), None)
        if differs is None and len(given) < len(recorded):
            differs = len(given)
        if differs is not None:
            raise ValueError(
                f"the references given disagree with those the generation used (batch {differs} differs): pass the "
                "references given to generate, or none (the result records its partition)"
            )
        return
    # a label-conditioned partition groups the references by label: every one used must be among those given
    missing = Counter(r for batch in recorded for r in batch) - Counter(r if r else "" for r in references)
    if missing:
        raise ValueError(
            f"the references given disagree with those the generation used ({sum(missing.values())} of its references "
            "are not among them): pass the references given to generate, or none (the result records its partition)"
        )


def _check_prompt(result, prompt, prompt_fields) -> None:
    """``prompt``/``prompt_fields`` give the template the generation used."""
    given = _template(prompt if prompt is not None else result.template, prompt_fields)
    if given != result.template:
        raise ValueError(
            f"the prompt given ({given.name!r}, fields {dict(given.fields)}) disagrees with the template the generation "
            f"used ({result.template.name!r}, fields {dict(result.template.fields)}): pass the same prompt and "
            "prompt_fields, or none (the result records its template)"
        )


# ---------------------------------------------------------------------------------------------
# phases shared by both kinds of result


def _verdict(failures: dict, sampled: WhiteBoxReport | None, claim: Claim) -> tuple[Verdict, str]:
    """VIOLATION if either part finds one, PASS if both pass, INCONCLUSIVE otherwise; a data-dependent
    guarantee is never a PASS."""
    total = sum(failures.values())
    if total:
        verdict, reason = Verdict.VIOLATION, f"{total} exact per-step checks failed on the generated texts"
    elif sampled is not None and sampled.verdict is Verdict.VIOLATION:
        verdict, reason = Verdict.VIOLATION, f"sampled audit: {sampled.reason}"
    elif sampled is not None and sampled.verdict is Verdict.INCONCLUSIVE:
        verdict, reason = Verdict.INCONCLUSIVE, f"sampled audit: {sampled.reason}"
    else:
        verdict, reason = Verdict.PASS, "exact checks held on every prefix of the generated texts" + (
            " (no sampled audit)" if sampled is None else "; sampled audit passed"
        )
        if sampled is not None and not sampled.sampled_confirmations:
            reason += (
                f", but its {sampled.num_texts} texts are too few to confirm anything (no upper confidence end falls "
                "below its claim): this PASS rests on the exact checks"
            )
    if not claim.a_priori and verdict is Verdict.PASS:
        verdict, reason = Verdict.INCONCLUSIVE, f"DATA-DEPENDENT guarantee, never a PASS ({reason})"
    elif not claim.a_priori and verdict is Verdict.VIOLATION:
        reason = f"the reported DATA-DEPENDENT guarantee is exceeded by the measurement: {reason}"
    return verdict, reason


def _with_findings(verdict: Verdict, reason: str, findings) -> tuple[Verdict, str]:
    """The verdict once the release file's findings are counted: each makes a PASS its own verdict (VIOLATION or
    INCONCLUSIVE), the worst one wins, and every finding is named in the reason."""
    if not findings:
        return verdict, reason
    kinds = ", ".join(dict.fromkeys(f.kind for f in findings if f.kind != "seeded-release"))
    combined = Verdict.worst([verdict, *(f.verdict for f in findings)])
    said = [f"the release file is not the release it records ({kinds})"] if kinds else []
    if any(f.kind == "seeded-release" for f in findings):  # not a disagreement: what the release itself records
        said.insert(0, "the release was drawn with a fixed seed and carries no guarantee (seeded-release)")
    return combined, f"{'; '.join(said)}; {reason}"


def _quick_report(rec, claim: Claim, sampled, *, texts: int, accountant_epsilon: float, start: float,
                  findings: tuple = (), **labels) -> QuickAuditReport:
    """The :class:`QuickAuditReport` of the teacher-forced record and the sampled audit."""
    with np.errstate(invalid="ignore"):
        losses = rec.log_prob_actual[:, None] - rec.log_prob_neighbours  # realised losses L_j(x), (texts, B)
    failures = dict(rec.failures)
    max_range = float(rec.max_loss_range_per_step.max()) if rec.max_loss_range_per_step.size else 0.0
    verdict, reason = _with_findings(*_verdict(failures, sampled, claim), findings)
    finite = losses[np.isfinite(losses)]
    return QuickAuditReport(
        verdict=verdict,
        reason=reason,
        texts_audited=texts,
        step_checks=rec.num_step_checks,
        step_failures=failures,
        max_loss_range_over_epsilon0=max_range / claim.epsilon0 if claim.step_checks else math.nan,
        realised_loss_max=float(losses.max()) if losses.size else 0.0,
        realised_loss_mean=float(finite.mean()) if finite.size else 0.0,
        a_priori_loss_bound=claim.loss_upper(),
        accountant_epsilon=float(accountant_epsilon),
        sampled=sampled,
        seconds=time.perf_counter() - start,
        uncharged_samples=0 if sampled is None else int(sampled.num_texts),
        findings=tuple(findings),
        **labels,
    )


def _sampled_config(*, alphas, num_samples, num_is_samples, significance, directions) -> WhiteBoxConfig:
    return WhiteBoxConfig(
        alphas=alphas, num_samples=num_samples, num_is_samples=num_is_samples, significance=significance,
        directions=tuple(directions), min_samples=16,
    )


# ---------------------------------------------------------------------------------------------
# the entry point

#: :func:`quick_audit`'s phases, as its ``progress`` callback names them
PHASE_EXACT = "exact checks (teacher forcing)"
PHASE_SAMPLED = "sampled audit"


def _phase(progress, phase: str) -> Callable[[int, int], None] | None:
    """``progress(phase, done, total)`` as a ``(done, total)`` callback of one phase (``None`` stays ``None``)."""
    if progress is None:
        return None
    if not callable(progress):
        raise ValueError(f"progress must be callable or None; got {type(progress).__name__}")
    return lambda done, total: progress(phase, done, total)


def quick_audit(
    result,
    references=None,
    *,
    model=None,
    prompt=None,
    prompt_fields: dict | None = None,
    sampled_batch: int | None = 0,
    num_samples: int = 16,
    num_is_samples: int = 0,
    directions: tuple[str, ...] = ("forward",),
    alphas: tuple[float, ...] = (2.0, 8.0),
    significance: float = 0.05,
    generator: torch.Generator | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> QuickAuditReport:
    """Audit the texts of a :class:`invink_audit.generation.GenerationResult`: the release it records
    (:class:`AuditedRelease`). ``references``, ``prompt``, ``prompt_fields``: optional, in any form ``generate``
    takes; when given they must be those given to ``generate`` (a ``ValueError`` says they disagree). ``model``: the
    same model (a loaded one is reused; default: the one the result names). ``sampled_batch``: the batch of the
    sampled audit (``None``: none): ``num_samples`` texts from R (with ``"reverse"`` in ``directions`` as many from
    each R'_j) plus ``num_is_samples`` per α, neighbour and direction; below 16 its verdict is INCONCLUSIVE. Its
    texts are drawn outside the ledger, not charged and not covered (``uncharged_samples``); the report is not
    private. ``progress(phase, done, total)``: :data:`PHASE_EXACT` counts the tokens teacher-forced,
    :data:`PHASE_SAMPLED` the sampled texts' token slots (texts × T), each from 0 to ``total``.
    """
    start = time.perf_counter()
    _phase(progress, "")  # a progress that is not callable is refused before anything is loaded
    release = AuditedRelease.of(result, references, prompt=prompt, prompt_fields=prompt_fields)
    return _quick_audit_release(
        result, release, model=model, sampled_batch=sampled_batch, findings=tuple(unit_findings(release.partition)),
        sampled_config=_sampled_config(alphas=alphas, num_samples=num_samples, num_is_samples=num_is_samples,
                                       significance=significance, directions=directions),
        alphas=alphas, significance=significance, generator=generator, start=start, progress=progress,
    )


def _quick_audit_release(result, release: AuditedRelease, *, model, sampled_batch, sampled_config, alphas, significance,
                         generator, start, progress, **found) -> QuickAuditReport:
    """:func:`quick_audit` of a release: teacher forcing of its texts (the mechanism's outcomes), then the
    sampled audit of one batch. ``found``: a release file's ``findings`` and ``claimed_epsilon``, for the report."""
    from invink_audit.audit.model_audit import audit_model
    from invink_audit.engine import text_outcomes
    from invink_audit.models import load_model, loadable_name
    from invink_audit.prompts import encode_request

    if model is None and getattr(result, "model", None):  # the model the release ran on, by its recorded name
        model = loadable_name(result.model)
    # teacher-forced in the dtype the release ran in (its recorded choice), so the exact log-probabilities
    # are those of the distributions the texts were drawn from
    loaded = load_model(model, dtype=getattr(result, "dtype_choice", None))
    claim = release.claim()
    config = WhiteBoxConfig(alphas=alphas, num_samples=max(1, len(result.texts)), num_is_samples=0, significance=significance)
    config, _ = config.for_claim(claim)
    stop = release.mechanism.stop_outcome(loaded.vocab_size)
    forced = [text_outcomes(t, loaded.vocab_size, stop) for t in result.texts]
    requests = [
        encode_request(loaded.tokenizer, release.batch_template(t.batch_index),
                       [r if r else None for r in release.partition.batches[t.batch_index]], key=t.batch_index)
        for t in result.texts
    ]
    rec = teacher_forced_losses(
        loaded, release.mechanism, requests, forced, claim=claim, config=config, progress=_phase(progress, PHASE_EXACT)
    )
    sampled = None
    if sampled_batch is not None:
        sampled = audit_model(
            [r if r else None for r in release.partition.batches[sampled_batch]], release.audit_settings(),
            sampled_config, model=loaded, prompt=release.batch_template(sampled_batch), generator=generator,
            progress=_phase(progress, PHASE_SAMPLED),
        )
    return _quick_report(rec, claim, sampled, texts=len(result.texts), accountant_epsilon=release.epsilon, start=start,
                         model_dtype=loaded.dtype_choice.to_json(), mechanism=release.mechanism.name, guarantee=claim.kind,
                         **found)


# ---------------------------------------------------------------------------------------------
# a release read back from its output file


@dataclasses.dataclass(frozen=True)
class _ReleasedText:
    batch_index: int
    token_ids: tuple[int, ...]
    modes: tuple[int, ...] = ()  # a generic mechanism's (Amin et al.: public or private)
    finish_reason: str = ""
    text: str | None = None  # the published text (a release file's), checked against its tokens' decoding


@dataclasses.dataclass(frozen=True)
class ReleaseFile:
    """A release read back from what ``generate`` wrote: its published records (``<output>``), checked against its
    state file (``<output>.state.json``: the settings and the input's fingerprint) and its journal
    (``<output>.sampled``: the texts drawn), and the references it was made from, rebuilt into the
    :class:`AuditedRelease` the quick audit needs. The partition is rebuilt from ``references`` as ``generate``
    built it and accepted only when its fingerprint equals the recorded one: the audit is of the released batches,
    or nothing. ``texts``: one per published batch whose text was drawn (those to teacher-force); ``findings``:
    each way the published file is not the release its state and journal record
    (:mod:`invink_audit.audit.release_checks`); ``claimed_epsilon``: the ε the published records claim."""

    release: AuditedRelease
    texts: tuple[_ReleasedText, ...]
    dtype_choice: DtypeChoice | None
    model_name: str
    release_id: str
    run: Mapping = dataclasses.field(default_factory=dict)  # the state's settings
    findings: tuple = ()
    claimed_epsilon: float | None = None

    @classmethod
    def read(cls, output, references, *, column: str | None = None, where: Mapping[str, str] | None = None) -> ReleaseFile:
        """``output``: the ``.jsonl`` file a release wrote; ``references``: its input file, with the ``column``
        and ``where`` selection ``generate`` was given (``ValueError`` when they do not give the recorded input,
        and, naming the file and line, for a line that is not a text record of this release)."""
        from invink_audit.outputs import read_journal_claims, read_numbered_records, read_state, state_path

        output = Path(output)
        if not output.is_file() or not state_path(output).is_file():
            raise ValueError(f"{output}: no release output with its state file ({state_path(output).name}) here")
        state = read_state(output)
        run, release_id = state["run"], state["release_id"]
        num_batches = _recorded_num_batches(output, run)
        records = check_published_records(output, read_numbered_records(output), num_batches, release_id)
        claims = read_journal_claims(output, release_id, num_batches)
        findings, not_drawn = record_findings(records, run, claims, num_batches)
        findings = (*seeded_findings(run), *findings)  # a seeded release is never a PASS, whatever else holds
        release = _release_of_run(run, references, column, where, state["input_sha256"])
        # the labels and prompt fields each batch gets from the input the state's fingerprint fixes
        findings = (*findings, *label_findings(records, release.template, release.labels, release.label_fields))
        findings = (*findings, *unit_findings(release.partition))  # a per-unit release: one slot per unit per batch
        first: dict = {}
        for published in records:
            first.setdefault(published.batch_index, published)
        forced = [p for i, p in sorted(first.items()) if i not in not_drawn]
        texts = tuple(_ReleasedText(p.batch_index, tuple(p.record["token_ids"]), tuple(p.record.get("modes", ())),
                                    p.record["finish_reason"], p.record.get("text")) for p in forced)  # fmt: skip
        dtype = _dtype_choice(forced[0] if forced else records[0])
        return cls(release, texts, dtype, run.get("model", ""), release_id, run, findings, _claimed_epsilon(records))


def _recorded_num_batches(output, run: Mapping) -> int:
    n = run.get("num_batches")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"resume state of {output} is corrupt: num_batches must be a positive integer; got {n!r}")
    return n


def _claimed_epsilon(records) -> float | None:
    """The ε the first published record claims (``None``: it claims none, e.g. a seeded release's)."""
    g = records[0].record.get("guarantee")
    epsilon = g.get("epsilon") if isinstance(g, dict) else None
    return float(epsilon) if isinstance(epsilon, (int, float)) and not isinstance(epsilon, bool) else None


def _dtype_choice(published):
    """The dtype choice a published record names (``None``: it names none); a ``ValueError`` naming its line."""
    from invink_audit.models import DtypeChoice

    recorded = published.record.get("model_dtype")
    if not recorded:
        return None
    try:
        return DtypeChoice(recorded["requested"], recorded["dtype"], recorded["device_type"], recorded["reason"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{published.source}:{published.line}: model_dtype is not a dtype record ({err})") from None


def _release_of_run(run: Mapping, references, column, where, fingerprint: str) -> AuditedRelease:
    """The :class:`AuditedRelease` of a recorded run: its template, event and mechanism, δ and ε (the
    accountant's, recomputed from the settings, never the ε a record claims), and the partition whose
    fingerprint is the recorded one (settings that cannot be read are a ``ValueError``)."""
    from invink_audit.mechanisms import mechanism_from_json
    from invink_audit.prompts import PromptTemplate

    try:
        template = PromptTemplate.from_json(run["prompt"])
        # the mechanism its records name, or InvisibleInk's settings
        mechanism = mechanism_from_json(run["mechanism"]) if "mechanism" in run else _invisibleink(run)
        g = mechanism.guarantee(run["max_new_tokens"], run["delta"])
        partition, labels = _recorded_partition(run, references, column, where, fingerprint)
        return AuditedRelease(mechanism, g, g.epsilon, partition, template, labels, run.get("label_fields"))
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"the release's state cannot be read ({type(err).__name__}: {err})") from None


def _recorded_partition(run: Mapping, references, column, where, fingerprint: str):
    """The partition (and labels) of ``references`` that ``generate`` released: every batch count it may
    have been limited to is tried, and only the one with the recorded fingerprint is accepted."""
    from invink_audit.data import (
        labelled_partition,
        partition_references,
        read_labelled_references,
        read_references,
        select_references,
    )

    columns = tuple(run.get("label_columns") or ())
    if "privacy_unit" in run:
        return _recorded_unit_partition(run, references, column, columns, fingerprint)
    if where:
        selected = select_references(references, where, column=column, label_columns=columns)
    elif columns:
        selected = read_labelled_references(references, column=column, label_columns=columns)
    else:
        selected = read_references(references, column=column)
    b = run["batch_size"]
    if columns:
        limits = [None, *range(1, len(selected.texts) // b + 1)]
        candidates = (labelled_partition(selected, b, num_texts_per_group=n)[:2] for n in limits)
    else:
        candidates = ((partition_references(selected, b, num_texts=run["num_batches"]), None),)
    return _fingerprinted(candidates, fingerprint, "give the same input file, --column and --where as generate was given")


def _fingerprinted(candidates, fingerprint: str, advice: str):
    """The first (partition, labels) of ``candidates`` whose input fingerprint is the recorded one."""
    from invink_audit.generation import input_fingerprint

    for partition, labels in candidates:
        if input_fingerprint(partition, labels) == fingerprint:
            return partition, labels
    raise ValueError(f"the references do not give the release's input (its recorded fingerprint): {advice}")


def _recorded_unit_partition(run: Mapping, references, column, columns: tuple, fingerprint: str):
    """:func:`_recorded_partition` of a per-unit release: the unit and rule its settings name, applied again to the
    input (:func:`~invink_audit.data.unit_partition`); the partition keeps each slot's unit for the neighbours."""
    from invink_audit.data import PrivacyUnit, read_unit_references, unit_partition

    refs = read_unit_references(references, PrivacyUnit.from_json(run["privacy_unit"]), column=column,
                                label_columns=columns or None)  # fmt: skip
    b = run["batch_size"]
    if columns:
        candidates = (unit_partition(refs, b, num_texts_per_group=n)[:2] for n in [None, *range(1, len(refs.texts) // b + 1)])
    else:
        candidates = (unit_partition(refs, b, num_texts=run["num_batches"])[:2],)
    return _fingerprinted(candidates, fingerprint, "give the same input file and --column as generate was given (the "
                          "privacy unit and its rule are the recorded ones)")


def audit_release_file(
    output,
    references,
    *,
    column: str | None = None,
    where: Mapping[str, str] | None = None,
    model=None,
    sampled_batch: int | None = 0,
    num_samples: int = 16,
    alphas: tuple[float, ...] = (2.0, 8.0),
    significance: float = 0.05,
    seed: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    privacy_unit: str | None = None,
) -> QuickAuditReport:
    """:func:`quick_audit` of a release from its output file (:class:`ReleaseFile`), in the dtype it ran in, with
    the model it names (``model``: the same model; another name and another fingerprint is a ``ValueError``).
    What was published is checked first (:mod:`invink_audit.audit.release_checks`; the findings, and the texts
    then teacher-forced: docs/guide/auditing.md, "Auditing texts you just generated"): a finding makes the verdict
    VIOLATION or INCONCLUSIVE, and a release drawn with a fixed seed (``seeded-release``) is never a PASS. ``seed``:
    a fixed seed for the sampled audit (reproducible; default OS entropy). ``privacy_unit``: the unit column the
    release must protect (another, or none, is a ``ValueError``; a per-unit release is rebuilt with its unit's
    neighbours)."""
    from invink_audit.engine import ForcedTextMismatch
    from invink_audit.mechanism import make_generator
    from invink_audit.models import load_model, loadable_name, model_fingerprint

    start = time.perf_counter()
    found = ReleaseFile.read(output, references, column=column, where=where)
    recorded_unit = (found.run.get("privacy_unit") or {}).get("column")
    if privacy_unit is not None and privacy_unit != recorded_unit:
        raise ValueError(f"{output}: the release protects {unit_phrase(recorded_unit)}, not one unit of {privacy_unit!r}")
    # no model named: the one the release recorded (an empty or unknown name loads the default, and its
    # fingerprint then decides)
    recorded = loadable_name(found.model_name) if found.model_name else None
    loaded = load_model(model if model is not None else recorded, dtype=found.dtype_choice)
    findings = (*found.findings, *model_findings(found.run, loaded.name, model_fingerprint(loaded)))
    findings = (*findings, *_undecoded_texts(found, loaded.tokenizer))
    if sampled_batch is not None and not 0 <= sampled_batch < len(found.release.partition.batches):
        raise ValueError(f"sampled_batch must be a batch of the release (0 .. {len(found.release.partition.batches) - 1})")
    if any(f.kind == "model-mismatch" for f in findings):
        return _unaudited(found, loaded, findings, start, "nothing was teacher-forced: the model is not the release's")
    generator = None if seed is None else make_generator(seed, device=loaded.device)
    audit = functools.partial(
        _quick_audit_release, release=found.release, model=loaded, sampled_batch=sampled_batch,
        sampled_config=_sampled_config(alphas=alphas, num_samples=num_samples, num_is_samples=0,
                                       significance=significance, directions=("forward",)),
        alphas=alphas, significance=significance, generator=generator, start=start, progress=progress,
        claimed_epsilon=found.claimed_epsilon,
    )  # fmt: skip
    texts = found.texts
    if texts:
        try:
            return audit(_ReleaseTexts(texts, loaded.dtype_choice), findings=findings)
        except ForcedTextMismatch:  # some published text cannot come from this mechanism: find which, audit the rest
            texts, undrawable = _drawable(found, loaded)
            findings = (*findings, *undrawable)
    if not texts:
        return _unaudited(found, loaded, findings, start, "no published text could be teacher-forced")
    return audit(_ReleaseTexts(texts, loaded.dtype_choice), findings=findings)


def _undecoded_texts(found: ReleaseFile, tokenizer) -> tuple:
    """A finding naming the published texts that are not the released text of their own token ids
    (:func:`~invink_audit.prompts.release_text` with the batch's stop strings): a text edited in the output (and
    the journal) while its tokens were kept would publish words the mechanism never drew."""
    from invink_audit.prompts import release_text

    edited = [t.batch_index for t in found.texts if t.text is not None
              and t.text != release_text(tokenizer, t.token_ids, found.release.batch_template(t.batch_index).stop)]
    if not edited:
        return ()
    return (Finding("text-not-drawn", f"the published text of batch(es) {', '.join(map(str, edited[:10]))} is not the "
                    "decoding of its own token ids: words the mechanism did not draw", tuple(edited)),)


def _drawable(found: ReleaseFile, loaded) -> tuple[tuple[_ReleasedText, ...], tuple]:
    """The texts that teacher forcing accepts one by one, and a finding naming those it refuses (a token of
    probability zero under the recorded mechanism and model, or a text that ends elsewhere)."""
    from invink_audit.engine import ForcedTextMismatch

    kept, refused = [], []
    for text in found.texts:
        try:
            _quick_audit_release(_ReleaseTexts((text,), loaded.dtype_choice), found.release, model=loaded,
                                 sampled_batch=None, sampled_config=None, alphas=(2.0,), significance=0.05,
                                 generator=None, start=0.0, progress=None)  # fmt: skip
            kept.append(text)
        except ForcedTextMismatch:
            refused.append(text.batch_index)
    message = (f"the published tokens of batch(es) {', '.join(map(str, refused))} cannot have been drawn by the "
               "recorded mechanism and model (teacher forcing refuses them)")  # fmt: skip
    return tuple(kept), ((Finding("text-not-drawn", message, tuple(refused)),) if refused else ())


def _unaudited(found: ReleaseFile, loaded, findings, start: float, why: str) -> QuickAuditReport:
    """The report of a release file none of whose texts was teacher-forced: its findings, no measurement."""
    claim = found.release.claim()
    verdict, reason = _with_findings(Verdict.INCONCLUSIVE, why, findings)
    return QuickAuditReport(
        verdict=verdict, reason=reason, texts_audited=0, step_checks=0, step_failures={},
        max_loss_range_over_epsilon0=math.nan, realised_loss_max=math.nan, realised_loss_mean=math.nan,
        a_priori_loss_bound=claim.loss_upper(), accountant_epsilon=float(found.release.epsilon), sampled=None,
        seconds=time.perf_counter() - start, model_dtype=loaded.dtype_choice.to_json(),
        claimed_epsilon=found.claimed_epsilon, findings=tuple(findings), mechanism=found.release.mechanism.name,
        guarantee=claim.kind,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _ReleaseTexts:
    """What :func:`_quick_audit_release` reads of a result: its texts and the dtype they were drawn in."""

    texts: tuple[_ReleasedText, ...]
    dtype_choice: object


def write_quick_report(report: QuickAuditReport, output_dir, *, plots: bool = True) -> list:
    """``report.json`` (every figure), ``report.md`` (the summary) and, with a sampled audit, its own report
    and plots under ``sampled/``; all owner-only and marked NOT PRIVATE (the report is computed from the
    references in the clear)."""
    from invink_audit.audit.report import write_report
    from invink_audit.not_private import write_not_private_json, write_not_private_text

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_not_private_json(out / "report.json", report.to_dict(), notice=report.privacy_notice)
    write_not_private_text(out / "report.md", f"# Quick audit\n\n```text\n{report.summary()}\n```\n", markdown=True)
    written = [out / "report.json", out / "report.md"]
    if report.sampled is not None:
        written += write_report(report.sampled, out / "sampled", plots=plots)
    return written
