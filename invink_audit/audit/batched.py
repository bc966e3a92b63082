"""Batched canary audit: one generation run, as many independent trials as it has batches.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.batched"); docs/guide/auditing.md (§"Batched black-box
audits: one trial per batch").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from accounting.limits import check_count
from invink_audit.audit import stats
from invink_audit.audit.blackbox import DEFAULT_SCORES, SCORES, score_matrix, select_score, verdict_of
from invink_audit.audit.records import BlackBoxReport
from invink_audit.audit.targets import BlackBoxTarget, EngineTarget, as_target
from invink_audit.audit.tradeoff import PrivacyProfile, SequentialTest, fit_gdp, perfect_attack_ceiling

__all__ = ["LLR_SCORE", "SURROGATE_SCORE", "SurrogateScorer", "batched_canary_audit", "echo_canary"]

#: the name of the exact log-likelihood-ratio score in reports
LLR_SCORE = "log-likelihood-ratio"
#: the same ratio computed with a surrogate model (:class:`SurrogateScorer`: black box)
SURROGATE_SCORE = "surrogate-log-likelihood-ratio"


def echo_canary(tokenizer, prefix: str, *, num_suffix_tokens: int = 8, seed: int = 0) -> str:
    """A natural-text canary that the model can echo: an in-distribution ``prefix`` (e.g. the opening of a
    real review of the kind audited) followed by a high-perplexity suffix of ``num_suffix_tokens`` tokens
    drawn uniformly from the tokenizer's ordinary vocabulary (Meeus et al. 2025, "The Canary's Echo": a
    canary the model would not write on its own, so a release that repeats its suffix reveals it). The
    suffix is drawn from ``seed`` alone, never from data; decoded tokens that do not survive a round trip
    are redrawn, so the canary tokenizes as drawn."""
    check_count("num_suffix_tokens", num_suffix_tokens)
    if not isinstance(prefix, str) or not prefix.strip():
        raise ValueError("prefix must be a non-empty string")
    special = set(tokenizer.all_special_ids)
    rng = np.random.default_rng(seed)
    words: list[str] = []
    while len(words) < num_suffix_tokens:
        token = int(rng.integers(0, len(tokenizer)))
        text = tokenizer.decode([token])
        # ordinary word pieces only: not special, printable, alphanumeric, tokenizing back to itself
        if token in special or not text.strip().isalnum() or tokenizer.encode(text, add_special_tokens=False) != [token]:
            continue
        words.append(text.strip())
    return f"{prefix.rstrip()} {' '.join(words)}"


class SurrogateScorer:
    """The log-likelihood-ratio score of released *texts* computed with a model the auditor has, standing in
    for the target's unknown one (black box): each text is tokenized by the surrogate, cut at T tokens or
    ended by its end-of-sequence token, and teacher-forced under the batch with the canary and read under
    its neighbour, through the surrogate's InvisibleInk engine at ``clip_norm`` over the full vocabulary (a
    token the target drew is never impossible under the surrogate). A valid test whatever the surrogate
    (its threshold is chosen on the selection batches); the further the surrogate from the target, the
    weaker."""

    def __init__(self, *, model=None, clip_norm: float, temperature: float = 1.0, batch_size: int, max_new_tokens: int,
                 prompt="generic", prompt_fields: dict | None = None) -> None:
        from invink_audit.mechanism import MechanismConfig

        mechanism = MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=None, batch_size=batch_size)
        self.engine = EngineTarget(mechanism, model=model, max_new_tokens=max_new_tokens, prompt=prompt,
                                   prompt_fields=prompt_fields, seed=0, stop_strings=False)

    def __call__(self, batches_with_canary: Sequence[Sequence[str]], slot: int, texts: Sequence[str]) -> np.ndarray:
        from invink_audit.prompts import forced_text_ids

        loaded = self.engine.loaded
        ids = [forced_text_ids(loaded.tokenizer, text, eos_token_ids=loaded.eos_token_ids,
                               max_new_tokens=self.engine.max_new_tokens)[0] for text in texts]
        return self.engine.log_likelihood_ratios(batches_with_canary, slot, ids)


@dataclasses.dataclass
class _Run:
    """The batches of one audit and what was generated and scored so far (by batch index)."""

    target: BlackBoxTarget
    batches: list[list[str]]
    with_canary: list[list[str]]
    coins: np.ndarray
    canary: str
    slot: int
    scores: tuple
    surrogate: SurrogateScorer | None = None
    texts: dict = dataclasses.field(default_factory=dict)
    surrogate_llr: dict = dataclasses.field(default_factory=dict)
    llr: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0

    def generate(self, indices: Sequence[int]) -> None:
        start = time.perf_counter()
        texts = self.target.texts([self.batches[i] for i in indices])
        self.texts.update(zip(indices, texts))
        with_canary = [self.with_canary[i] for i in indices]
        if LLR_SCORE in self.scores:
            ratios = self.target.log_likelihood_ratios(with_canary, self.slot)
            self.llr.update(zip(indices, _checked(ratios, indices, "the target's log_likelihood_ratios")))
        if self.surrogate is not None:
            ratios = self.surrogate(with_canary, self.slot, texts)
            self.surrogate_llr.update(zip(indices, _checked(ratios, indices, "the surrogate")))
        self.seconds += time.perf_counter() - start

    def matrix(self, indices: Sequence[int], selection: Sequence[int]):
        """(names, values (S, len(indices)), values on ``selection``) for every score."""
        texts, labels = [self.texts[i] for i in indices], self.coins[list(indices)]
        text_scores = tuple(s for s in self.scores if s not in (LLR_SCORE, SURROGATE_SCORE))
        position = {i: k for k, i in enumerate(indices)}
        sel = np.array([position[i] for i in selection], dtype=int)
        names, values, chosen = score_matrix(text_scores, self.canary, texts, labels, sel) if text_scores else (
            [], np.zeros((0, len(indices))), np.zeros((0, sel.size)))
        for name, table in ((SURROGATE_SCORE, self.surrogate_llr), (LLR_SCORE, self.llr)):
            if name in self.scores:
                row = np.array([table[i] for i in indices])[None, :]
                names, values, chosen = [name, *names], np.vstack([row, values]), np.vstack([row[:, sel], chosen])
        return list(names), values, chosen


def _checked(ratios, indices, what: str) -> list[float]:
    """The ratios as a list, after checking there is one per text."""
    if np.asarray(ratios).shape != (len(indices),):
        raise ValueError(f"{what} must return one ratio per text ({len(indices)}); got shape {np.asarray(ratios).shape}")
    return ratios.tolist()


def _coins(seed: int | None, num_batches: int, n_sel: int) -> np.ndarray:
    """A fair coin per batch, redrawn (data-independently) until both splits hold both sides."""
    rng = np.random.default_rng(seed)
    for _ in range(100):
        coins = rng.random(num_batches) < 0.5
        if all(0 < part.sum() < part.size for part in (coins[:n_sel], coins[n_sel:])):
            return coins
    raise ValueError(f"{num_batches} batches cannot give both sides in the selection and evaluation splits; give more")


def _batches(pool: Sequence[str], canary: str, width: int, num_batches: int, slot: int, coins: np.ndarray):
    """Batch i: the canary (or, by its coin, an empty slot) in ``slot``, the ``width − 1`` others cycled through ``pool``."""
    others = width - 1
    filled, actual = [], []
    for i in range(num_batches):
        rest = [pool[(i * others + j) % len(pool)] for j in range(others)]
        full = rest[:slot] + [canary] + rest[slot:]
        filled.append(full)
        actual.append(full if coins[i] else rest[:slot] + [""] + rest[slot:])
    return actual, filled


def batched_canary_audit(
    target,
    pool: Sequence[str],
    canary: str,
    *,
    batch_size: int,
    num_batches: int,
    claimed_epsilon: float,
    claimed_delta: float,
    canary_slot: int = 0,
    scores: Sequence[str | Callable[[str], float]] | None = None,
    significance: float = 0.05,
    selection_fraction: float = 0.25,
    num_looks: int = 4,
    seed: int | None = None,
    mechanism: str | None = None,
    spare_references: int = 0,
    surrogate: SurrogateScorer | None = None,
    claimed_profile: Callable[[float], float] | None = None,
) -> BlackBoxReport:
    """Audit ``target`` (a :class:`~invink_audit.audit.targets.BlackBoxTarget`, or a callable ``references -> text``;
    the :data:`LLR_SCORE` needs a target that knows its likelihoods) with ``num_batches`` batches of ``batch_size``
    references (docs/guide/auditing.md). ``pool``: the other references, cycled; ``scores``: default the exact
    log-likelihood ratio when the target offers it, and the text scores. ``seed``: the coins (recorded either way).
    ``spare_references``: more references in every batch (a generator that drops empty slots, as the reference package
    does, pulls the next one in). ``surrogate``: adds the :data:`SURROGATE_SCORE` (:class:`SurrogateScorer`: the ratio
    under a model the auditor has). ``claimed_profile``: the claim's ε at every δ' (e.g. ``lambda d: event.epsilon(d)``:
    the release's accountant), equal to ``claimed_epsilon`` at ``claimed_delta``; the score, the threshold and the
    verdict then test the claim's whole curve (:class:`~invink_audit.audit.tradeoff.PrivacyProfile`), not its one quoted
    point."""
    target = as_target(target)
    batch_size, num_batches = check_count("batch_size", batch_size), check_count("num_batches", num_batches)
    if num_batches < 16:
        raise ValueError(f"num_batches must be at least 16 (selection and evaluation trials); got {num_batches}")
    _check_inputs(target, pool, canary, batch_size, canary_slot, selection_fraction, num_batches)
    beta = stats.check_significance(significance)
    scores = _scores(target, scores, surrogate)
    profile = _profile(claimed_profile, claimed_epsilon, claimed_delta)
    n_sel = max(4, int(round(num_batches * selection_fraction)))
    coins = _coins(seed, num_batches, n_sel)
    test = SequentialTest(coins[n_sel:], claimed_epsilon=claimed_epsilon, delta=claimed_delta,
                          significance=beta, num_looks=num_looks, profile=profile)  # checks num_looks before anything runs
    actual, filled = _batches(list(pool), canary, batch_size + spare_references, num_batches, canary_slot, coins)
    run = _Run(target, actual, filled, coins, canary, canary_slot, scores, surrogate)
    selection = list(range(n_sel))
    run.generate(selection)
    names, _, chosen = run.matrix(selection, selection)
    k, threshold = select_score(chosen, coins[selection], delta=claimed_delta, significance=beta, profile=profile)
    evaluation = list(range(n_sel, num_batches))
    done = 0
    while True:
        m = test.schedule[len(test.looks)][0]
        run.generate(evaluation[done:m])
        done = m
        # every score as trained on the selection batches (exact-match included), read on the evaluation ones
        values = run.matrix(selection + evaluation[:m], selection)[1][k, n_sel:]
        if test.look(values >= threshold) is not None:
            break
    return _report(run, test, names[k], threshold, values, evaluation[:done], claimed_epsilon, claimed_delta, beta,
                   mechanism or target.label)


def _profile(claimed_profile, claimed_epsilon: float, claimed_delta: float) -> PrivacyProfile:
    """The claim's curve (:class:`PrivacyProfile`), quoted at exactly (``claimed_epsilon``, ``claimed_delta``)."""
    if claimed_profile is None:
        return PrivacyProfile.point(claimed_epsilon, claimed_delta)
    if not callable(claimed_profile):
        raise ValueError(f"claimed_profile must be a callable delta -> epsilon; got {claimed_profile!r}")
    curve = PrivacyProfile.of(claimed_profile, claimed_delta)
    if not math.isclose(curve.epsilon, claimed_epsilon, rel_tol=1e-9, abs_tol=1e-12):
        raise ValueError(f"claimed_profile gives ε = {curve.epsilon!r} at δ = {claimed_delta!r}, not claimed_epsilon = {claimed_epsilon!r}")
    return PrivacyProfile(curve.deltas, (float(claimed_epsilon), *curve.epsilons[1:]))


def _check_inputs(target, pool, canary, batch_size, canary_slot, selection_fraction, num_batches) -> None:
    if not isinstance(canary, str) or not canary.strip():
        raise ValueError("the canary must be a non-empty string")
    if not 0 <= canary_slot < batch_size:
        raise ValueError(f"canary_slot must be in [0, {batch_size}); got {canary_slot!r}")
    if not pool or not all(isinstance(r, str) and r.strip() for r in pool) or canary in pool:
        raise ValueError("pool must hold non-empty reference strings, the canary not among them")
    if not 0 < selection_fraction < 1 or num_batches - max(4, int(round(num_batches * selection_fraction))) < 2:
        raise ValueError(f"selection_fraction must be in (0, 1) and leave at least 2 evaluation batches; got {selection_fraction!r}")
    if target.slot not in (None, canary_slot):
        raise ValueError(f"the target's canary slot is {target.slot}, not canary_slot={canary_slot}")


def _scores(target, scores, surrogate) -> tuple:
    """The scores to choose from (default: the exact ratio when the target offers it, the surrogate's when
    given, and the text scores), every name checked before anything runs."""
    gray = target.knows_likelihood
    scores = tuple(scores) if scores is not None else (
        ((LLR_SCORE,) if gray else ()) + ((SURROGATE_SCORE,) if surrogate is not None else ()) + tuple(DEFAULT_SCORES))
    if not scores:
        raise ValueError("scores must name at least one score")
    for s in scores:
        if not callable(s) and s not in (*SCORES, LLR_SCORE, SURROGATE_SCORE):
            raise ValueError(f"scores must be callables or names in {sorted((*SCORES, LLR_SCORE, SURROGATE_SCORE))}; got {s!r}")
    if SURROGATE_SCORE in scores and surrogate is None:
        raise ValueError(f"the {SURROGATE_SCORE!r} score needs a surrogate (SurrogateScorer)")
    if LLR_SCORE in scores and not gray:
        raise ValueError(f"the {LLR_SCORE!r} score needs a target that teacher-forces its texts (knows_likelihood)")
    return scores


def _report(run: _Run, test: SequentialTest, score: str, threshold: float, values: np.ndarray, used: list[int],
            claimed_epsilon: float, claimed_delta: float, beta: float, mechanism: str) -> BlackBoxReport:
    result = test.result()
    positive = run.coins[used]
    detected = values >= threshold
    level = test.looks[-1][1]
    ceiling = perfect_attack_ceiling(int(positive.sum()), int((~positive).sum()), delta=claimed_delta, significance=level)
    gdp = None
    if positive.sum() >= 2 and (~positive).sum() >= 2:
        gdp = fit_gdp(values[positive], values[~positive], delta=claimed_delta).to_json()
    verdict, reason = verdict_of(result.epsilon_lower_bound, claimed_epsilon, beta, result.profile)
    n_trials = len(run.texts)
    return BlackBoxReport(
        kind="black-box", mechanism=mechanism, verdict=verdict, reason=reason, significance=beta,
        claimed_epsilon=float(claimed_epsilon), claimed_delta=float(claimed_delta),
        epsilon_lower_bound=float(result.epsilon_lower_bound), threshold=float(threshold), score=score,
        num_trials={"selection": n_trials - len(used), "evaluation": len(used), "batches_planned": len(run.coins)},
        true_positives=int((detected & positive).sum()), false_positives=int((detected & ~positive).sum()),
        positives=int(positive.sum()), negatives=int((~positive).sum()),
        timings={"generation_seconds": run.seconds, "seconds_per_trial": run.seconds / max(n_trials, 1)},
        scores_with=tuple(float(x) for x in values[positive]), scores_without=tuple(float(x) for x in values[~positive]),
        ceiling=float(ceiling), gdp=gdp, sequential=result.to_json(), coins=tuple(bool(c) for c in run.coins),
        profile=None if test.profile.is_point else {"deltas": list(test.profile.deltas), "epsilons": list(test.profile.epsilons)},
        notes=(f"{len(run.coins)} batches planned, {n_trials} generated; sequential looks stopped: {result.stopped}",),
    )  # fmt: skip

