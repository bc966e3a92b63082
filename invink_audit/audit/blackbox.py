r"""Black-box canary audit of any text generator (:class:`~invink_audit.audit.targets.BlackBoxTarget`, or a callable:
list of references → text).

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.blackbox").
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from accounting.limits import check_count
from invink_audit.audit import stats
from invink_audit.audit.records import BlackBoxReport
from invink_audit.audit.targets import as_target
from invink_audit.audit.tradeoff import PrivacyProfile, ProfileBound

__all__ = [
    "DEFAULT_SCORES", "SCORES", "blackbox_audit", "canary_overlap", "char_count", "exact_match", "score_matrix",
    "select_score", "token_count", "verdict_of", "word_count",
]

_WORD = re.compile(r"[A-Za-z0-9]{3,}")


def canary_overlap(canary: str) -> Callable[[str], float]:
    """Score: fraction of the canary's distinct words (≥ 3 alphanumerics, case-folded) in the text."""
    words = {w.lower() for w in _WORD.findall(canary)}
    if not words:
        raise ValueError(f"the canary must contain a word of at least 3 letters or digits; got {canary!r}")

    def score(text: str) -> float:
        found = {w.lower() for w in _WORD.findall(text)}
        return len(words & found) / len(words)

    return score


def word_count(text: str) -> float:
    """Score: number of whitespace-separated words."""
    return float(len(text.split()))


def char_count(text: str) -> float:
    """Score: number of characters (finer than words for a data-dependent token budget)."""
    return float(len(text))


def exact_match(selection_with: Sequence[str], selection_without: Sequence[str]) -> Callable[[str], float]:
    """Score *trained on the selection split*: how much more often this exact text was produced with
    the canary than without it. Catches deterministic generators (a fixed seed) and verbatim leaks."""
    w, o = Counter(selection_with), Counter(selection_without)
    nw, no = max(len(selection_with), 1), max(len(selection_without), 1)

    def score(text: str) -> float:
        return w[text] / nw - o[text] / no

    return score


def _exact_match_leave_one_out(texts: Sequence[str], labels: np.ndarray) -> np.ndarray:
    """Selection-split scores of :func:`exact_match` with each text left out of its own training
    set: otherwise every unique text would look perfectly separable on the split it was trained on."""
    w = Counter(t for t, lab in zip(texts, labels) if lab)
    o = Counter(t for t, lab in zip(texts, labels) if not lab)
    nw, no = int(labels.sum()), int((~labels).sum())
    out = np.empty(len(texts))
    for i, (t, lab) in enumerate(zip(texts, labels)):
        cw, co = w[t] - (1 if lab else 0), o[t] - (0 if lab else 1)
        out[i] = cw / max(nw - (1 if lab else 0), 1) - co / max(no - (0 if lab else 1), 1)
    return out


def token_count(tokenizer) -> Callable[[str], float]:
    """Score: number of tokens of the output under a (public) tokenizer."""

    def score(text: str) -> float:
        return float(len(tokenizer.encode(text, add_special_tokens=False)))

    score.__name__ = "tokens"
    return score


#: score name -> factory(canary) (``exact-match`` is trained on the selection split instead)
SCORES = {
    "canary-overlap": canary_overlap,
    "length": lambda canary: word_count,
    "characters": lambda canary: char_count,
    "exact-match": None,
}
DEFAULT_SCORES = ("canary-overlap", "length", "characters", "exact-match")


def _best_threshold(with_scores, without_scores, *, profile: PrivacyProfile, significance):
    """The threshold whose Clopper–Pearson pair refutes ``profile`` by most on these trials (selection split
    only): (its :class:`~invink_audit.audit.tradeoff.ProfileBound`, threshold). For a point claim the
    largest ε lower bound (the classic objective), above every score (nothing flagged) unless some threshold
    certifies a positive bound; for a curve the largest power margin. Ties go to the lowest threshold."""
    w = np.sort(np.asarray(with_scores, dtype=float))
    o = np.sort(np.asarray(without_scores, dtype=float))
    candidates = np.unique(np.concatenate([w, o]))
    best = (profile.bounds([0], w.size, [0], o.size, significance=significance)[0],
            float(candidates.max()) + 1.0 if candidates.size else 0.0)
    if not candidates.size:
        return best
    tp = w.size - np.searchsorted(w, candidates, side="left")  # trials with score >= threshold
    fp = o.size - np.searchsorted(o, candidates, side="left")
    points = profile.bounds(tp, w.size, fp, o.size, significance=significance)
    key = _selection_key(profile)
    i = int(np.argmax([key(pt) for pt in points]))
    better = points[i].epsilon_lower_bound > 0 if profile.is_point else key(points[i]) > key(best[0])
    return (points[i], float(candidates[i])) if better else best


def _selection_key(profile: PrivacyProfile):
    """What a selection maximises: the ε lower bound's margin for a point claim, the power margin for a curve."""
    return (lambda pt: pt.margin) if profile.is_point else (lambda pt: pt.power_margin)


def blackbox_audit(
    target,
    references: Sequence[str],
    canary: str,
    *,
    claimed_epsilon: float,
    claimed_delta: float,
    num_trials: int = 200,
    canary_slot: int | Sequence[int] = 0,
    scores: Sequence[str | Callable[[str], float]] = DEFAULT_SCORES,
    significance: float = 0.05,
    selection_fraction: float = 0.5,
    mechanism: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    notes: Sequence[str] = (),
) -> BlackBoxReport:
    """Run ``num_trials`` canary trials (half with the canary, half without) and bound ε from below.

    ``target``: a :class:`~invink_audit.audit.targets.BlackBoxTarget`, or a callable ``references -> text``
    (``None`` in the emptied slot: :class:`~invink_audit.audit.targets.CallableTarget`); a batched target
    generates every trial in one call. ``references``: the batch with any text in ``canary_slot`` (it is
    replaced by the canary, or emptied for the neighbour). ``canary_slot``: a slot, or a canary *unit*'s slots (a
    user's several references: docs/guide/privacy-unit.md), all filled with the canary or all emptied, for a
    per-unit claim. ``mechanism``: the report's name of the target (default: its label). The score and threshold
    are chosen on the selection split, the ε lower bound computed on the evaluation split.
    """
    target = as_target(target)
    refs = list(references)
    beta = _check_audit_arguments(refs, canary_slot, num_trials, selection_fraction, claimed_epsilon, significance, scores)
    batches, labels = _alternating_trials(refs, canary, canary_slot, num_trials)
    start = time.perf_counter()
    texts = target.texts(batches, progress)
    gen_seconds = time.perf_counter() - start
    sel, ev = _selection_split(num_trials, selection_fraction)
    score_names, values, selection_matrix = score_matrix(scores, canary, texts, labels, sel)
    k, thr = select_score(selection_matrix, labels[sel], delta=claimed_delta, significance=beta, claimed_epsilon=claimed_epsilon)
    evaluation = _evaluate(values[k], labels, ev, thr, delta=claimed_delta, significance=beta)
    distinct = _distinct_texts(texts, labels)
    verdict, reason = verdict_of(evaluation["epsilon_lower_bound"], claimed_epsilon, beta)
    return BlackBoxReport(
        kind="black-box",
        mechanism=mechanism or target.label,
        verdict=verdict,
        reason=reason,
        significance=beta,
        claimed_epsilon=float(claimed_epsilon),
        claimed_delta=float(claimed_delta),
        score=score_names[k],
        num_trials={"selection": int(sel.size), "evaluation": int(ev.size), "distinct_texts": distinct},
        **evaluation,
        timings={"generation_seconds": gen_seconds, "seconds_per_trial": gen_seconds / num_trials},
        notes=tuple(list(notes) + _determinism_notes(texts, distinct)),
        scores_with=tuple(float(x) for x in values[k][labels]),
        scores_without=tuple(float(x) for x in values[k][~labels]),
    )


def _check_audit_arguments(refs, canary_slot, num_trials, selection_fraction, claimed_epsilon, significance, scores) -> float:
    """Validate :func:`blackbox_audit`'s arguments; returns the significance."""
    slots = (canary_slot,) if isinstance(canary_slot, int) else tuple(canary_slot)
    if not slots or len(set(slots)) != len(slots) or not all(isinstance(s, int) and 0 <= s < len(refs) for s in slots):
        raise ValueError(f"canary_slot must be a slot, or distinct slots, in [0, {len(refs)}); got {canary_slot!r}")
    check_count("num_trials", num_trials, minimum=8)
    if not 0.0 < selection_fraction < 1.0:
        raise ValueError(f"selection_fraction must be in (0, 1); got {selection_fraction!r}")
    if not (isinstance(claimed_epsilon, (int, float)) and claimed_epsilon >= 0):
        raise ValueError(f"claimed_epsilon must be >= 0; got {claimed_epsilon!r}")
    beta = stats.check_significance(significance)
    for s in scores:
        if not callable(s) and s not in SCORES:
            raise ValueError(f"scores must be callables or names in {sorted(SCORES)}; got {s!r}")
    return beta


def _alternating_trials(refs: list[str], canary: str, canary_slot: int, num_trials: int) -> tuple[list, np.ndarray]:
    """The trials' reference batches and labels (``True``: with the canary): the canary in ``canary_slot``,
    and its replace-by-null neighbour (that slot emptied), alternating (with, without, with, ...) so that
    no drift falls between the two arms."""
    with_canary, without = list(refs), list(refs)
    for slot in (canary_slot,) if isinstance(canary_slot, int) else canary_slot:  # a canary unit: all its slots
        with_canary[slot], without[slot] = canary, ""
    labels = np.arange(num_trials) % 2 == 0
    return [with_canary if label else without for label in labels], labels


def _selection_split(num_trials: int, selection_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The trial indices (selection, evaluation): the first ``selection_fraction`` of the (alternating)
    trials, rounded down to an even count so both arms are equal there, select; the rest evaluate."""
    n_sel = int(round(num_trials * selection_fraction))
    n_sel -= n_sel % 2
    return np.arange(n_sel), np.arange(n_sel, num_trials)


def _evaluate(values: np.ndarray, labels: np.ndarray, ev: np.ndarray, thr: float, *, delta: float,
              significance: float) -> dict:
    r"""The :class:`~invink_audit.audit.records.BlackBoxReport` fields of the chosen score (``values``, one per trial)
    at threshold ``thr`` on the evaluation split ``ev``: true and false positives among its with / without trials,
    and the ε lower bound. The bound is Clopper–Pearson's
    (DP-Sniper / Jagielski et al. 2020 style, :func:`invink_audit.audit.stats.epsilon_lower_bound`):
    :math:`\varepsilon \ge \log\frac{\underline{TPR}-\delta}{\overline{FPR}}` (and the complement)."""
    ev_with = values[ev][labels[ev]]
    ev_without = values[ev][~labels[ev]]
    tp, fp = int((ev_with >= thr).sum()), int((ev_without >= thr).sum())
    eps_lb = stats.epsilon_lower_bound(tp, ev_with.size, fp, ev_without.size, delta=delta, significance=significance)
    return {"epsilon_lower_bound": float(eps_lb), "threshold": float(thr), "true_positives": tp, "false_positives": fp,
            "positives": int(ev_with.size), "negatives": int(ev_without.size)}


def _distinct_texts(texts: list[str], labels: np.ndarray) -> dict:
    """How many distinct texts each arm produced: {"with": ..., "without": ...}."""
    return {"with": len(set(t for t, lab in zip(texts, labels) if lab)), "without": len(set(t for t, lab in zip(texts, labels) if not lab))}


def score_matrix(scores, canary: str, texts: list[str], labels: np.ndarray, sel: np.ndarray):
    """Every score's name, its values on every trial (S, N), and its values on the selection split
    (``exact-match`` trained on the selection split, left out one text at a time there)."""
    score_fns, score_names = [], []
    for s in scores:
        if callable(s):
            score_fns.append(s)
            score_names.append(getattr(s, "__name__", "custom"))
        elif s == "exact-match":  # trained on the selection split only
            score_fns.append(exact_match([texts[i] for i in sel if labels[i]], [texts[i] for i in sel if not labels[i]]))
            score_names.append(s)
        else:
            score_fns.append(SCORES[s](canary))
            score_names.append(s)
    values = np.array([[fn(t) for t in texts] for fn in score_fns], dtype=float)  # (S, N)
    selection_matrix = values[:, sel].copy()
    for k, name in enumerate(score_names):
        if name == "exact-match":  # its selection scores must not see the text they score
            selection_matrix[k] = _exact_match_leave_one_out([texts[i] for i in sel], labels[sel])
    return score_names, values, selection_matrix


def select_score(selection_matrix: np.ndarray, sel_labels: np.ndarray, *, delta: float, significance: float,
                 profile: PrivacyProfile | None = None, claimed_epsilon: float = 0.0) -> tuple[int, float]:
    """The score and threshold that refute the claim by most on the selection split: ``profile`` (the
    claim's curve), else the point (``claimed_epsilon``, ``delta``), whose largest margin is the largest
    ε lower bound at ``delta``."""
    profile = profile if profile is not None else PrivacyProfile.point(claimed_epsilon, delta)
    best, key = (-math.inf, 0, math.inf), _selection_key(profile)
    for k in range(selection_matrix.shape[0]):
        point, thr = _best_threshold(
            selection_matrix[k][sel_labels], selection_matrix[k][~sel_labels], profile=profile, significance=significance
        )
        if key(point) > best[0]:
            best = (key(point), k, thr)
    return best[1], best[2]


def _determinism_notes(texts: list[str], distinct: dict) -> list[str]:
    if distinct["with"] == 1 and distinct["without"] == 1:
        return [
            "every trial of each arm produced the same text: the generator is deterministic (e.g. a fixed seed), "
            "so its output carries no privacy protection at all"
            + (" and the two arms differ" if texts[0] != texts[1] else "")
        ]
    return []


def verdict_of(eps_lb: float, claimed_epsilon: float, beta: float, point: ProfileBound | None = None) -> tuple[stats.Verdict, str]:
    """VIOLATION when the ε lower bound exceeds the claim, or (``point``: the claim's curve tested,
    :class:`~invink_audit.audit.tradeoff.PrivacyProfile`) the bound at some δ' exceeds the ε the claim
    certifies there; otherwise INCONCLUSIVE (never a PASS)."""
    if eps_lb > claimed_epsilon:
        return stats.Verdict.VIOLATION, f"ε lower bound {eps_lb:.3f} > claimed ε {claimed_epsilon:g} (significance {beta:g})"
    if point is not None and point.power_margin > 0:
        return stats.Verdict.VIOLATION, (
            f"the claim's privacy curve is refuted at δ' = {point.delta:.3g}: ε lower bound {point.epsilon_lower_bound:.3f} > "
            f"the ε = {point.claimed_epsilon:.3f} the claim certifies there (significance {beta:g}; at the quoted δ the "
            f"bound is {eps_lb:.3f})"
        )
    closest = "" if point is None or point.epsilon_lower_bound <= 0 else (
        f"; closest on the claim's curve at δ' = {point.delta:.3g}: {point.epsilon_lower_bound:.3f} ≤ {point.claimed_epsilon:.3f}")
    return stats.Verdict.INCONCLUSIVE, (
        f"no violation detected: ε lower bound {eps_lb:.3f} ≤ claimed ε {claimed_epsilon:g}{closest}; "
        "a black-box audit cannot confirm a claim"
    )
