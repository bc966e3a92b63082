"""Batched canary audit: one generation run, as many independent trials as it has batches.

:func:`batched_canary_audit` puts a canary slot in every batch, filled or emptied (replace-by-null) by a
fair coin per batch; each text is one trial (no one-run penalty, unlike Steinke, Nasr & Jagielski 2023).
Scores: the black-box text scores, or for an :class:`EngineTarget` the exact log-likelihood ratio by
teacher forcing (optimal by Neyman–Pearson; :class:`SurrogateScorer` otherwise); sequential looks, the
ceiling and a GDP fit come from :mod:`invink_audit.audit.tradeoff`. :func:`echo_canary` builds canaries.

Design: docs/guide/auditing.md (§"Batched black-box audits: one trial per batch").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from accounting.limits import check_count
from invink_audit.audit import stats
from invink_audit.audit.blackbox import DEFAULT_SCORES, score_matrix, select_score, verdict_of
from invink_audit.audit.records import BlackBoxReport
from invink_audit.audit.tradeoff import PrivacyProfile, SequentialTest, fit_gdp, perfect_attack_ceiling

__all__ = [
    "LLR_SCORE", "SURROGATE_SCORE", "EngineTarget", "SurrogateScorer", "SyntheticTarget", "batched_canary_audit",
    "echo_canary",
]

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


class EngineTarget:
    """Our InvisibleInk engine as an audit target that the auditor can also teacher-force (gray box):
    :meth:`generate_many` releases one text per batch and keeps its token ids; :meth:`log_likelihood_ratios`
    scores released texts exactly. ``generator`` (on the model's device) or ``seed`` fixes the randomness
    (reproducible audits; OS entropy by default)."""

    def __init__(self, *, model=None, clip_norm: float, temperature: float = 1.0, top_k: int | None = 100,
                 batch_size: int, max_new_tokens: int, prompt="generic", prompt_fields: dict | None = None,
                 seed: int | None = None, generator=None) -> None:
        from invink_audit.engine import Engine
        from invink_audit.mechanism import MechanismConfig, make_generator
        from invink_audit.models import load_model
        from invink_audit.prompts import get_preset

        self.loaded = load_model(model)
        self.mechanism = MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size)
        self.engine = Engine(self.loaded, self.mechanism)
        self.template = get_preset(prompt, **(prompt_fields or {}))
        self.max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        self.generator = generator if generator is not None else make_generator(seed, device=self.loaded.device)
        self.token_ids: list[tuple[int, ...]] = []  # of the last generate_many call

    def _requests(self, batches):
        from invink_audit.prompts import encode_request

        # no stop strings: a text ends at its end-of-sequence token or T, so it can be teacher-forced as drawn
        return [dataclasses.replace(encode_request(self.loaded.tokenizer, self.template, list(b), key=i), stop=())
                for i, b in enumerate(batches)]

    def generate_many(self, batches: Sequence[Sequence[str]]) -> list[str]:
        ids: list = [()] * len(batches)
        for f in self.engine.generate(self._requests(batches), max_new_tokens=self.max_new_tokens, generator=self.generator):
            ids[f.request_index] = tuple(f.token_ids)
        self.token_ids = ids
        return [self.loaded.tokenizer.decode(list(t), skip_special_tokens=True) for t in ids]

    def log_likelihood_ratios(self, batches_with_canary: Sequence[Sequence[str]], slot: int,
                              token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        r""":math:`\log p(x_i \mid R_i) - \log p(x_i \mid R_i')` for each text ``token_ids[i]``: ``R_i`` the batch
        with the canary in ``slot``, ``R_i'`` the same batch with it emptied (exact: summed per-step
        log-probabilities of the mechanism, :func:`invink_audit.mechanism.neighbour_log_probs`)."""
        import torch

        llr = torch.zeros(len(token_ids), dtype=torch.float64, device=self.loaded.device)

        def observer(step):
            nlp = step.neighbour_log_probs()
            token = step.tokens[:, None]
            llr.index_add_(0, step.request_indices,
                           nlp.actual.gather(1, token)[:, 0] - nlp.neighbours[:, slot].gather(1, token)[:, 0])

        with torch.no_grad():
            self.engine.force(self._requests(batches_with_canary), token_ids, max_new_tokens=self.max_new_tokens,
                              observer=observer)
        return llr.cpu().numpy()


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
        self.engine = EngineTarget(model=model, clip_norm=clip_norm, temperature=temperature, top_k=None,
                                   batch_size=batch_size, max_new_tokens=max_new_tokens, prompt=prompt,
                                   prompt_fields=prompt_fields, seed=0)

    def __call__(self, batches_with_canary: Sequence[Sequence[str]], slot: int, texts: Sequence[str]) -> np.ndarray:
        from invink_audit.prompts import forced_text_ids

        loaded = self.engine.loaded
        ids = [forced_text_ids(loaded.tokenizer, text, eos_token_ids=loaded.eos_token_ids,
                               max_new_tokens=self.engine.max_new_tokens)[0] for text in texts]
        return self.engine.log_likelihood_ratios(batches_with_canary, slot, ids)


class SyntheticTarget:
    """A self-test mechanism (the correct one or a planted bug, :mod:`invink_audit.audit.synthetic`) on a
    logit source, as an audit target: reference ``slot`` of the source is the canary; a batch whose slot
    holds a text draws from the mechanism on R, one whose slot is empty from its neighbour R'_slot (each
    text its own draw from ``seed``). Texts are token ids written as words; the exact log-likelihood
    ratio of each drawn text is accumulated from the same distributions as it is drawn (gray box),
    the stop at the token budget included (a length only one side's budget allows has a ratio of ±∞)."""

    def __init__(self, source, mechanism, *, slot: int = 0, seed: int | None = None) -> None:
        import torch

        from invink_audit.audit.synthetic import token_budgets

        self.source, self.mechanism, self.slot = source, mechanism, slot
        self.budget_in, budgets = token_budgets(mechanism, source)
        self.budget_out = budgets[slot]
        self.generator = torch.Generator().manual_seed(seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63))
        self.token_ids: list = []
        self._llr = np.zeros(0)

    def generate_many(self, batches: Sequence[Sequence[str]]) -> list[str]:
        import torch

        from invink_audit.audit.synthetic import with_stop
        from invink_audit.mechanism import sample_tokens

        canary_in = torch.tensor([bool(b[self.slot]) for b in batches])
        n, steps = len(batches), max(self.budget_in, self.budget_out) + 1
        prefixes = torch.zeros(n, steps, dtype=torch.int64)
        alive, llr = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.float64)
        stop = self.source.vocab_size
        lengths = torch.zeros(n, dtype=torch.int64)
        for step in range(steps):
            ids = alive.nonzero().reshape(-1)
            if ids.numel() == 0:
                break
            private, public = self.source.logits(prefixes[ids, :step], step)
            actual, neighbours = self.mechanism.step(private, public)
            actual, neighbours = with_stop(actual, neighbours, step, self.budget_in, [self.budget_out] * neighbours.shape[1])
            out = neighbours[:, self.slot]
            tokens = sample_tokens(torch.where(canary_in[ids, None], actual, out), self.generator)
            llr[ids] += actual.gather(1, tokens[:, None])[:, 0] - out.gather(1, tokens[:, None])[:, 0]
            prefixes[ids, step] = tokens
            lengths[ids] += 1
            alive[ids] = (tokens != self.source.eos_token) & (tokens != stop)
        self.token_ids = [tuple(prefixes[i, : lengths[i]].tolist()) for i in range(n)]
        self._llr = llr.numpy()  # ±∞ where a length is possible on one side only; never NaN (each token is drawn
        # from its own side, where its probability is positive)
        return [" ".join(str(t) for t in ids) for ids in self.token_ids]

    def log_likelihood_ratios(self, batches_with_canary, slot: int, token_ids) -> np.ndarray:
        """The ratios of the texts of the last :meth:`generate_many` call (computed as they were drawn)."""
        if slot != self.slot or len(token_ids) != self._llr.size:
            raise ValueError("log_likelihood_ratios scores the texts of the last generate_many call, at the source's slot")
        return self._llr.copy()


@dataclasses.dataclass
class _Run:
    """The batches of one audit and what was generated and scored so far (by batch index)."""

    target: object
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
        generate_many = getattr(self.target, "generate_many", self.target)
        texts = list(generate_many([self.batches[i] for i in indices]))
        if len(texts) != len(indices) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"the generator must return one string per batch ({len(indices)}); got {len(texts)} items")
        self.texts.update(zip(indices, texts))
        if LLR_SCORE in self.scores:
            ratios = self.target.log_likelihood_ratios([self.with_canary[i] for i in indices], self.slot,
                                                       self.target.token_ids)
            _check_count(ratios, indices, "the target's log_likelihood_ratios")
            self.llr.update(zip(indices, ratios.tolist()))
        if self.surrogate is not None:
            ratios = self.surrogate([self.with_canary[i] for i in indices], self.slot, texts)
            _check_count(ratios, indices, "the surrogate")
            self.surrogate_llr.update(zip(indices, ratios.tolist()))
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


def _check_count(ratios, indices, what: str) -> None:
    if np.asarray(ratios).shape != (len(indices),):
        raise ValueError(f"{what} must return one ratio per text ({len(indices)}); got shape {np.asarray(ratios).shape}")


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
    mechanism: str = "black-box generator",
    spare_references: int = 0,
    surrogate: SurrogateScorer | None = None,
    claimed_profile: Callable[[float], float] | None = None,
) -> BlackBoxReport:
    """Audit ``target`` (a ``generate_many(batches) -> texts`` callable, or an object with that method and,
    for the :data:`LLR_SCORE`, ``log_likelihood_ratios`` and ``token_ids`` as :class:`EngineTarget` has) with
    ``num_batches`` batches of ``batch_size`` references (module docstring). ``pool``: the other references,
    cycled; ``scores``: default the exact log-likelihood ratio when the target offers it, and the text
    scores. ``seed``: the coins (recorded either way). ``spare_references``: more references in every batch
    (a generator that drops empty slots, as the reference package does, pulls the next one in). ``surrogate``:
    adds the :data:`SURROGATE_SCORE` (:class:`SurrogateScorer`: the ratio under a model the auditor has).
    ``claimed_profile``: the claim's ε at every δ' (e.g. ``lambda d: event.epsilon(d)``: the release's
    accountant), equal to ``claimed_epsilon`` at ``claimed_delta``; the score, the threshold and the verdict
    then test the claim's whole curve (:class:`~invink_audit.audit.tradeoff.PrivacyProfile`), not its one
    quoted point."""
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
    return _report(run, test, names[k], threshold, values, evaluation[:done], claimed_epsilon, claimed_delta, beta, mechanism)


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
    if getattr(target, "slot", canary_slot) != canary_slot:
        raise ValueError(f"the target's canary slot is {target.slot}, not canary_slot={canary_slot}")


def _scores(target, scores, surrogate) -> tuple:
    """The scores to choose from (default: the exact ratio when the target offers it, the surrogate's when
    given, and the text scores), every name checked before anything runs."""
    from invink_audit.audit.blackbox import SCORES

    gray = hasattr(target, "log_likelihood_ratios")
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
        raise ValueError(f"the {LLR_SCORE!r} score needs a target that teacher-forces its texts (EngineTarget)")
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

