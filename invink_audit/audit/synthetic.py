r"""Synthetic logit sources and audited mechanisms: the white-box auditor without a model.

Sources (:class:`RandomSource`; :class:`HardestCaseSource`, the worst case of docs/accounting_notes.md §8:
per-token loss pair :math:`(t, t-\varepsilon_0)` with :math:`t\approx 0.53\,\varepsilon_0`, Dong, Durfee &
Rogers 2020), the correct InvisibleInk mechanism and the self-test's four planted bugs (:func:`mutants`),
any :class:`~invink_audit.mechanisms.Mechanism` (:class:`AuditedMechanism`), audits on them
(:func:`run_synthetic_audit`, :func:`run_mechanism_audit`) and exact enumeration (:func:`enumerate_outputs`).

Design: docs/auditing_notes.md ("Testing the auditor").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from accounting.sensitivity import Adjacency, Clipping, linf_sensitivity
from invink_audit.audit.whitebox import Claim, RecordedAudit, SamplingPlan, WhiteBoxConfig, WhiteBoxRecorder

if TYPE_CHECKING:
    from invink_audit.mechanisms import Mechanism

__all__ = [
    "token_budgets",
    "with_stop",
    "HARDEST_PUBLIC_PROBABILITY",
    "LogitSource",
    "RandomSource",
    "HardestCaseSource",
    "SyntheticMechanism",
    "correct_mechanism",
    "mutants",
    "auto_token_budget",
    "run_synthetic_audit",
    "torch_threads",
    "enumerate_outputs",
    "exact_epsilon_stationary",
    "ExactOutputs",
    "AuditedMechanism",
    "run_mechanism_audit",
    "enumerate_mechanism_outputs",
]

#: public probability of the up-weighted outcome in the worst ε0-BR pair (docs/accounting_notes.md §8)
HARDEST_PUBLIC_PROBABILITY = 0.45
_DTYPE = torch.float64


class LogitSource:
    """Base class: ``logits(prefixes, step)`` → (private (G, B, V), public (G, V)), float64.

    ``prefixes`` is (G, step) int64 (tokens generated so far). Attributes: ``vocab_size`` (V, EOS
    included), ``batch_size`` (B), ``eos_token``, ``reference_lengths`` (lengths of the B references
    in tokens; 0 for a null reference; used only by a data-dependent-budget mutant), ``canaries``
    ({neighbour index: label}).
    """

    vocab_size: int
    batch_size: int
    eos_token: int
    reference_lengths: tuple[int, ...]
    canaries: dict
    name: str = "source"

    def logits(self, prefixes: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


def _state(prefixes: torch.Tensor, step: int, bos: int) -> torch.Tensor:
    if step == 0:
        return torch.full((prefixes.shape[0],), bos, dtype=torch.int64)
    return prefixes[:, step - 1].to(torch.int64)


class RandomSource(LogitSource):
    r"""Random logits as a function of (last token, position mod ``period``).

    Public logits :math:`\phi_{pub}` are i.i.d. :math:`\mathcal N(0, \text{scale}^2)`; reference ``i``
    adds :math:`\mathcal N(0, \text{private\_scale}^2)` differences (so ``clip_C`` binds when
    private_scale ≳ C). The EOS logit is lowered by ``eos_shift`` so texts are not too short.
    The tables are drawn once from ``seed`` (a data-generation seed: it fixes the *dataset*, not the
    mechanism's randomness).
    """

    def __init__(
        self,
        *,
        vocab_size: int = 8,
        batch_size: int = 4,
        scale: float = 2.0,
        private_scale: float = 1.5,
        period: int = 3,
        eos_shift: float = 3.0,
        reference_lengths: Sequence[int] | None = None,
        seed: int = 0,
        name: str = "random",
    ):
        if vocab_size < 2 or batch_size < 1 or period < 1:
            raise ValueError(f"need vocab_size >= 2, batch_size >= 1, period >= 1; got {vocab_size}, {batch_size}, {period}")
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.batch_size, self.period = vocab_size, batch_size, period
        self.eos_token = vocab_size - 1
        pub = scale * torch.randn(vocab_size + 1, period, vocab_size, generator=g, dtype=_DTYPE)
        pub[..., self.eos_token] -= eos_shift
        diff = private_scale * torch.randn(batch_size, vocab_size + 1, period, vocab_size, generator=g, dtype=_DTYPE)
        self._public, self._diff = pub, diff
        if reference_lengths is None:
            reference_lengths = [int(x) for x in torch.randint(3, 12, (batch_size,), generator=g)]
        if len(reference_lengths) != batch_size:
            raise ValueError(f"reference_lengths must have batch_size={batch_size} entries; got {reference_lengths!r}")
        self.reference_lengths = tuple(int(x) for x in reference_lengths)
        self.canaries = {}
        self.name = name

    def logits(self, prefixes, step):
        s = _state(prefixes, step, self.vocab_size)
        p = step % self.period
        public = self._public[s, p]  # (G, V)
        private = public.unsqueeze(1) + self._diff[:, s, p].permute(1, 0, 2)  # (G, B, V)
        return private, public


class HardestCaseSource(LogitSource):
    r"""The worst case for one ε0-BR step, repeated at every step (docs/accounting_notes.md §8).

    Reference 0 is the canary: at every prefix it pushes the "up" group (every non-EOS token except
    token 0) up by ``push`` and token 0 down by ``push`` (``push`` ≫ C, so the clipped difference is
    exactly ±C); references 1..B−1 are null (their logits are the public row). The public logits
    give the up group total probability ``up_probability`` (default 0.45) under the canary's
    neighbour (where the aggregate equals the public row), EOS probability ``eos_probability``, and
    are centred so that they lie outside ±``offset`` (naive clipping then also binds, in opposite
    directions for the public and the canary rows, which is the factor-2 case of paper Property 9,
    prop:amin-sens).
    """

    def __init__(
        self,
        *,
        vocab_size: int = 6,
        batch_size: int = 4,
        temperature: float = 1.0,
        up_probability: float = HARDEST_PUBLIC_PROBABILITY,
        eos_probability: float = 0.02,
        offset: float = 0.6,
        push: float = 50.0,
        canary_length: int = 12,
        name: str = "hardest-case",
    ):
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be >= 3 (down token, up group, EOS); got {vocab_size}")
        if not 0 < up_probability < 1 - eos_probability:
            raise ValueError(f"up_probability must be in (0, 1 - eos_probability); got {up_probability}")
        self.vocab_size, self.batch_size = vocab_size, batch_size
        self.eos_token = vocab_size - 1
        n_up = vocab_size - 2
        probs = np.empty(vocab_size)
        probs[0] = 1.0 - up_probability - eos_probability
        probs[1 : 1 + n_up] = up_probability / n_up
        probs[self.eos_token] = eos_probability
        logits = temperature * np.log(probs)
        # centre the gap between the down token and the up group on 0 (softmax is shift-invariant):
        # the down token then sits at +gap/2 and the up group at -gap/2
        gap = logits[0] - logits[1 : 1 + n_up].max()
        logits = logits - (logits[0] + logits[1 : 1 + n_up].max()) / 2.0
        if gap / 2.0 < offset:
            raise ValueError(
                f"public logits cannot straddle ±{offset}: the down token leads the up group by only {gap:.3f}; "
                "lower `offset`, raise `temperature` or lower `up_probability`"
            )
        self._public = torch.tensor(logits, dtype=_DTYPE)
        direction = torch.full((vocab_size,), push, dtype=_DTYPE)
        direction[0] = -push
        direction[self.eos_token] = 0.0
        self._canary = self._public + direction
        self.reference_lengths = (int(canary_length),) + (0,) * (batch_size - 1)
        self.canaries = {0: "hardest-case canary (up group at public probability %.2f)" % up_probability}
        self.up_probability = up_probability
        self.name = name

    def logits(self, prefixes, step):
        g = prefixes.shape[0]
        public = self._public.expand(g, -1).clone()
        private = public.unsqueeze(1).repeat(1, self.batch_size, 1)
        private[:, 0] = self._canary
        return private, public


# ---------------------------------------------------------------------------------------------
# mechanisms under audit


def auto_token_budget(reference_lengths: Sequence[int], *, default: int = 1) -> int:
    """The reference package's ``max_toks="auto"``: mean + 2·std of the non-empty references' lengths.

    A data-dependent hyperparameter (BRIEF.md, "behaviour not to repeat"); here only for the mutant.
    ``default`` when every reference is null.
    """
    lengths = [x for x in reference_lengths if x > 0]
    if not lengths:
        return default
    return max(1, int(np.mean(lengths) + 2 * np.std(lengths)))


@dataclasses.dataclass(frozen=True)
class SyntheticMechanism:
    """A mechanism under audit: one step's log-probabilities, its token budget, and its claim.

    ``step(private, public)`` → (actual (G, V), neighbours (G, B, V)) log-probabilities;
    ``budget(reference_lengths)`` → T for that dataset; ``claimed_epsilon0`` and
    ``claimed_rho_token``: what its accountant was told per token.
    """

    name: str
    description: str
    step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    budget: Callable[[Sequence[int]], int]
    claimed_epsilon0: float
    claimed_rho_token: float
    expected: str  # "PASS" or "VIOLATION": what a correct auditor must say

    def claim(self, source: LogitSource, *, delta: float = 1e-6) -> Claim:
        return Claim(
            self.claimed_epsilon0,
            self.claimed_rho_token,
            self.budget(source.reference_lengths),
            source.batch_size,
            delta,
            self.name,
        )


def _config(clip_norm, temperature, top_k, batch_size, clipping=Clipping.DIFFERENCE):
    from invink_audit.mechanism import MechanismConfig

    return MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size, clipping=clipping)


def _as_step(config):
    def step(private, public):
        out = config.neighbour_log_probs(private, public)
        return out.actual, out.neighbours

    return step


def correct_mechanism(*, clip_norm: float, temperature: float, top_k: int | None, batch_size: int, max_new_tokens: int) -> SyntheticMechanism:
    """InvisibleInk as specified (paper Algorithm 1), with a fixed, data-independent budget T."""
    cfg = _config(clip_norm, temperature, top_k, batch_size)
    return SyntheticMechanism(
        "correct",
        "InvisibleInk: DClip, Top-k+ from public logits, accounted temperature, fixed T",
        _as_step(cfg),
        lambda lengths, T=max_new_tokens: T,
        cfg.epsilon0,
        cfg.rho_token,
        "PASS",
    )


def mutants(*, clip_norm: float, temperature: float, top_k: int, batch_size: int, max_new_tokens: int) -> list[SyntheticMechanism]:
    """The four planted bugs (docs/auditing_notes.md, "Testing the auditor"), each with the claim its
    (wrong) accountant would make."""
    correct = _config(clip_norm, temperature, top_k, batch_size)
    return [
        _naive_clipping_mutant(clip_norm, temperature, batch_size, max_new_tokens),
        _low_temperature_mutant(correct, clip_norm, temperature, top_k, batch_size, max_new_tokens),
        _private_topk_mutant(correct, clip_norm, temperature, top_k, batch_size, max_new_tokens),
        _data_dependent_budget_mutant(correct),
    ]


def _naive_clipping_mutant(clip_norm: float, temperature: float, batch_size: int, max_new_tokens: int) -> SyntheticMechanism:
    """(1) naive clipping (Amin et al. 2024) accounted with sensitivity C/B under replace-by-null, as
    the paper's baselines do (Appendix B.3.1): the true sensitivity is 2C/B (paper Property 9)."""
    naive = _config(clip_norm, temperature, None, batch_size, Clipping.NAIVE)
    wrong_sens = linf_sensitivity(clip_norm, batch_size, Clipping.NAIVE, Adjacency.ZERO_OUT)  # = C/B
    return SyntheticMechanism(
        "naive-clipping",
        "naive clipping accounted with sensitivity C/B under replace-by-null (true: 2C/B)",
        _as_step(naive),
        lambda lengths, T=max_new_tokens: T,
        2.0 * wrong_sens / temperature,
        wrong_sens**2 / (2.0 * temperature**2),
        "VIOLATION",
    )


def _low_temperature_mutant(
    correct, clip_norm: float, temperature: float, top_k: int, batch_size: int, max_new_tokens: int
) -> SyntheticMechanism:
    """(2) sampling at a lower temperature than the one accounted."""
    cold = _config(clip_norm, temperature / 2.0, top_k, batch_size)
    return SyntheticMechanism(
        "low-temperature",
        f"samples at temperature {temperature / 2:g}, accounted at {temperature:g}",
        _as_step(cold),
        lambda lengths, T=max_new_tokens: T,
        correct.epsilon0,
        correct.rho_token,
        "VIOLATION",
    )


def _private_topk_mutant(
    correct, clip_norm: float, temperature: float, top_k: int, batch_size: int, max_new_tokens: int
) -> SyntheticMechanism:
    """(3) top-k of the aggregated private logits (each dataset's own top-k: a token can jump out)."""
    from invink_audit.mechanism import top_k_log_softmax

    full = _config(clip_norm, temperature, None, batch_size)

    def private_topk(private, public, cfg=full, k=top_k):
        o = cfg.neighbour_log_probs(private, public)
        return top_k_log_softmax(o.actual, k), top_k_log_softmax(o.neighbours, k)

    return SyntheticMechanism(
        "private-top-k",
        f"top-{top_k} set computed from the aggregated private logits",
        private_topk,
        lambda lengths, T=max_new_tokens: T,
        correct.epsilon0,
        correct.rho_token,
        "VIOLATION",
    )


def _data_dependent_budget_mutant(correct) -> SyntheticMechanism:
    """(4) data-dependent token budget (the reference package's max_toks="auto")."""
    return SyntheticMechanism(
        "data-dependent-budget",
        "token budget T = mean + 2 std of the non-empty references' lengths",
        _as_step(correct),
        auto_token_budget,
        correct.epsilon0,
        correct.rho_token,
        "VIOLATION",
    )


# ---------------------------------------------------------------------------------------------
# decoding with STOP


def token_budgets(mechanism: SyntheticMechanism, source: LogitSource) -> tuple[int, list[int]]:
    """T of the mechanism on the source's dataset R, and on each neighbour R'_j (reference j nulled)."""
    lengths = list(source.reference_lengths)
    t_r = mechanism.budget(lengths)
    t_j = []
    for j in range(source.batch_size):
        nulled = list(lengths)
        nulled[j] = 0
        t_j.append(mechanism.budget(nulled))
    return t_r, t_j


def with_stop(actual, neighbours, step, t_r, t_j):
    """Append the STOP column: at ``step == T_D`` dataset D stops with probability 1."""
    b = neighbours.shape[1]

    def extend(lp, stop_now: bool):
        col = torch.zeros(lp.shape[:-1] + (1,), dtype=_DTYPE) if stop_now else torch.full(lp.shape[:-1] + (1,), -math.inf, dtype=_DTYPE)
        body = torch.full_like(lp, -math.inf) if stop_now else lp
        return torch.cat([body, col], dim=-1)

    a = extend(actual.to(_DTYPE), step == t_r)
    n = torch.cat([extend(neighbours[:, j : j + 1].to(_DTYPE), step == t_j[j]) for j in range(b)], dim=1)
    return a, n


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """Temporarily set torch's intra-op thread count (restored on exit).

    The synthetic audits work on tensors of a few thousand entries, where intra-op parallelism only
    costs: on a shared 2-core machine, OpenMP spin-waiting made them ~25x slower (measured 46 s vs
    1.7 s for one self-test audit under load). The real-model auditor does not use this.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_synthetic_audit(
    source: LogitSource,
    mechanism: SyntheticMechanism,
    config: WhiteBoxConfig,
    *,
    generator: torch.Generator,
    delta: float = 1e-6,
    progress: Callable[[int, int], None] | None = None,
) -> RecordedAudit:
    """Decode every text of the config's sampling plan through ``mechanism`` on ``source``.

    All texts advance together (one batched step per position); texts end on EOS or STOP.
    """
    with torch_threads(1):
        return _run_synthetic_audit(source, mechanism, config, generator=generator, delta=delta, progress=progress)


def _run_synthetic_audit(source, mechanism, config, *, generator, delta, progress):
    walker = _TokenWalker(source, mechanism)
    return _sample(source, walker, mechanism.claim(source, delta=delta), config, generator=generator, progress=progress)


class _TokenWalker:
    """How a :class:`SyntheticMechanism` decodes on a source, for :func:`_sample` and :func:`_enumerate`: its
    distributions over V tokens and STOP (:func:`with_stop` at each dataset's budget), no state, and a text
    ends at EOS or STOP."""

    def __init__(self, source: LogitSource, mechanism: SyntheticMechanism):
        self.t_r, self.t_j = token_budgets(mechanism, source)
        self.horizon = max([self.t_r, *self.t_j]) + 1
        self.mechanism, self.source = mechanism, source

    def start(self, count: int, generator):
        return None

    def aux(self, count: int, generator):
        return None

    def step(self, private, public, state, aux, step: int) -> _WalkStep:
        actual, neighbours = self.mechanism.step(private, public)
        actual, neighbours = with_stop(actual, neighbours, step, self.t_r, self.t_j)
        return _WalkStep(actual, neighbours)

    def advance(self, out, state, outcomes, aux, step: int, rows=None):
        """(state, tokens to append, which texts end); ``rows``: the rows of ``out`` the outcomes were drawn on
        (enumeration; ``None``: all of them). A text's end does not read ``out``."""
        ended = (outcomes == self.source.eos_token) | (outcomes == self.source.vocab_size)
        return None, outcomes, ended

    def extra(self) -> dict:
        return {"budget_actual": self.t_r, "budget_neighbours": self.t_j, "source": self.source.name}


@dataclasses.dataclass
class _WalkStep:
    """One step's distributions of a walk (the fields of :class:`~invink_audit.mechanisms.MechanismStep` the
    walks read)."""

    log_probs: torch.Tensor
    neighbours: torch.Tensor
    check_actual: torch.Tensor | None = None
    check_neighbours: torch.Tensor | None = None


def _sample(source: LogitSource, walker, claim: Claim, config: WhiteBoxConfig, *, generator, progress) -> RecordedAudit:
    """Decode every text of the config's sampling plan through ``walker`` on ``source``, all texts together
    (one batched step per position), recording each text's log-probabilities and the per-step checks."""
    from invink_audit.mechanism import sample_tokens

    plan = SamplingPlan.build(config, source.batch_size)
    recorder = WhiteBoxRecorder(plan, claim, config, max_steps=walker.horizon)
    n = plan.num_texts
    state = walker.start(n, generator)
    prefixes = torch.zeros(n, walker.horizon, dtype=torch.int64)
    alive = torch.ones(n, dtype=torch.bool)
    for step in range(walker.horizon):
        ids = alive.nonzero().reshape(-1)
        if ids.numel() == 0:
            break
        private, public = source.logits(prefixes[ids, :step], step)
        aux = walker.aux(ids.numel(), generator)
        rows = None if state is None else state[ids]
        out = walker.step(private, public, rows, aux, step)
        weights = recorder.sampling_log_weights(
            ids, out.log_probs, out.neighbours, check_actual=out.check_actual, check_neighbours=out.check_neighbours
        )
        outcomes = sample_tokens(weights, generator)
        recorder.record(ids, outcomes)
        new_state, tokens, ended = walker.advance(out, rows, outcomes, aux, step)
        if state is not None:
            state[ids] = new_state
        prefixes[ids, step] = tokens
        alive[ids] = ~ended
        if progress is not None:
            progress(step + 1, walker.horizon)
    return dataclasses.replace(recorder.finish(), extra=walker.extra())


def _enumerate(source: LogitSource, walker, *, max_outputs: int) -> ExactOutputs:
    """Every complete output of ``walker`` on ``source`` with its exact log-probability under R and every
    R'_j: a breadth-first walk over prefixes (and their state), no sampling."""
    generator = torch.Generator().manual_seed(0)  # a walk's auxiliary draws: one per step, shared by all prefixes
    prefixes = torch.zeros(1, 0, dtype=torch.int64)
    state = walker.start(1, generator)
    lp_a = torch.zeros(1, dtype=_DTYPE)
    lp_n = torch.zeros(1, source.batch_size, dtype=_DTYPE)
    done_a, done_n = [], []
    for step in range(walker.horizon):
        if prefixes.shape[0] == 0:
            break
        private, public = source.logits(prefixes, step)
        aux = walker.aux(1, generator)
        aux = None if aux is None else aux.expand(prefixes.shape[0], -1)
        out = walker.step(private, public, state, aux, step)
        # every (prefix, outcome) with positive probability under R or under some R'_j
        possible = torch.isfinite(out.log_probs) | torch.isfinite(out.neighbours).any(1)
        rows, outs = possible.nonzero(as_tuple=True)
        if rows.numel() > max_outputs:
            raise ValueError(f"enumeration would expand {rows.numel()} prefixes (> max_outputs={max_outputs})")
        new_a = lp_a[rows] + out.log_probs[rows, outs]
        new_n = lp_n[rows] + out.neighbours[rows, :, outs]
        new_state, tokens, ended = walker.advance(
            out, None if state is None else state[rows], outs, None if aux is None else aux[rows], step, rows=rows
        )
        done_a.append(new_a[ended])
        done_n.append(new_n[ended])
        keep = ~ended
        prefixes = torch.cat([prefixes[rows[keep]], tokens[keep].unsqueeze(-1)], dim=1)
        state = None if new_state is None else new_state[keep]
        lp_a, lp_n = new_a[keep], new_n[keep]
    if prefixes.shape[0]:
        raise RuntimeError("enumeration ended with unfinished prefixes (the budget logic is inconsistent)")
    return ExactOutputs(torch.cat(done_a).numpy(), torch.cat(done_n).numpy())


# ---------------------------------------------------------------------------------------------
# exact enumeration


@dataclasses.dataclass(frozen=True)
class ExactOutputs:
    """Every complete output x with :math:`\\log P_R(x)` and :math:`\\log P_{R'_j}(x)` for all j."""

    log_prob_actual: np.ndarray  # (X,)
    log_prob_neighbours: np.ndarray  # (X, B)

    def renyi(self, alpha: float, neighbour: int, reverse: bool = False) -> float:
        r""":math:`D_\alpha(P_R\|P_{R'_j})` (or reversed), exactly: a log-sum-exp over all outputs."""
        lp, lq = self.log_prob_actual, self.log_prob_neighbours[:, neighbour]
        if reverse:
            lp, lq = lq, lp
        keep = np.isfinite(lp)
        if (keep & ~np.isfinite(lq)).any():
            return math.inf
        terms = alpha * lp[keep] + (1 - alpha) * lq[keep]
        m = terms.max()
        return float((m + math.log(np.exp(terms - m).sum())) / (alpha - 1))

    def delta(self, epsilon: float, neighbour: int, reverse: bool = False) -> float:
        """Hockey-stick divergence δ(ε) = Σ_x (P(x) − e^ε P'(x))_+, exactly."""
        lp, lq = self.log_prob_actual, self.log_prob_neighbours[:, neighbour]
        if reverse:
            lp, lq = lq, lp
        return float(np.clip(np.exp(lp) - math.exp(epsilon) * np.exp(lq), 0, None).sum())

    def epsilon(self, delta: float, neighbour: int, reverse: bool = False) -> float:
        """The smallest ε with :meth:`delta` (ε) ≤ ``delta`` (the tight ε of the pair at δ; a root of the
        monotone hockey-stick divergence), ``inf`` when outputs possible under one dataset only carry more
        than ``delta``."""
        from scipy import optimize

        lp, lq = self.log_prob_actual, self.log_prob_neighbours[:, neighbour]
        if reverse:
            lp, lq = lq, lp
        if self.delta(0.0, neighbour, reverse) <= delta:
            return 0.0
        mismatch = np.isfinite(lp) & ~np.isfinite(lq)
        if float(np.exp(lp[mismatch]).sum()) > delta:
            return math.inf
        high = 1.0
        while self.delta(high, neighbour, reverse) > delta:
            high *= 2.0
        return float(optimize.brentq(lambda e: self.delta(e, neighbour, reverse) - delta, 0.0, high, xtol=1e-12))


def enumerate_outputs(source: LogitSource, mechanism: SyntheticMechanism, *, max_outputs: int = 200_000) -> ExactOutputs:
    """Enumerate every output of ``mechanism`` on ``source`` (a breadth-first walk over prefixes).

    Uses the same per-step log-probabilities as the auditor but no sampling: it is the exact
    reference the Monte Carlo intervals must cover. Raises if more than ``max_outputs`` prefixes
    would be expanded (keep V and T small).
    """
    return _enumerate(source, _TokenWalker(source, mechanism), max_outputs=max_outputs)


def exact_epsilon_stationary(source: LogitSource, mechanism: SyntheticMechanism, delta: float, *, neighbour: int = 0) -> float:
    r"""The **true** ε(δ) of ``mechanism`` on a source whose logits do not depend on the prefix (e.g.
    :class:`HardestCaseSource`), between the dataset and its neighbour with reference ``neighbour`` nulled,
    the larger of both directions: no accountant involved.

    With stationary logits a text's probability depends only on how many times each class of tokens
    occurs (tokens with the same pair of log-probabilities under the two datasets form a class) and on
    how it ends (EOS before T, or the budget T), so the hockey-stick divergence
    :math:`\delta(\varepsilon) = \sum_x (P(x) - e^\varepsilon Q(x))_+` (Dwork & Roth 2014, §3.5; the
    tight δ of a pair) is an exact sum over count vectors with multinomial multiplicities; ε(δ) is its
    root (:meth:`ExactOutputs.epsilon`). Checked against :func:`enumerate_outputs` on small vocabularies (tests). A data-dependent budget
    (different T on the two datasets) is refused: use :func:`enumerate_outputs`."""
    from scipy.special import gammaln

    t_r, t_j = token_budgets(mechanism, source)
    if t_j[neighbour] != t_r:
        raise ValueError(f"the budget differs between the datasets ({t_r} vs {t_j[neighbour]}): not stationary")
    prefixes = torch.zeros(2, 1, dtype=torch.int64)
    private, public = source.logits(prefixes, 0)
    again, _ = source.logits(prefixes + 1, 1)
    if not torch.equal(private, again):
        raise ValueError("the source's logits depend on the prefix: use enumerate_outputs")
    actual, neighbours = mechanism.step(private, public)
    a, q = actual[0].double().numpy(), neighbours[0, neighbour].double().numpy()
    eos = source.eos_token
    classes: dict[tuple[float, float], int] = {}
    for v in range(a.size):
        if v != eos and (np.isfinite(a[v]) or np.isfinite(q[v])):
            key = (float(a[v]), float(q[v]))
            classes[key] = classes.get(key, 0) + 1
    keys = list(classes)
    la, lq, size = np.array([k[0] for k in keys]), np.array([k[1] for k in keys]), np.array([classes[k] for k in keys], float)
    outcomes_p, outcomes_q = [], []

    def compositions(n: int, parts: int):
        if parts == 1:
            yield (n,)
            return
        for first in range(n + 1):
            for rest in compositions(n - first, parts - 1):
                yield (first, *rest)

    for n in range(t_r + 1):
        end_p, end_q = (a[eos], q[eos]) if n < t_r else (0.0, 0.0)  # EOS before T, else the budget stops it
        for counts in compositions(n, len(keys)):
            c = np.array(counts, float)
            with np.errstate(invalid="ignore"):  # 0 · (−inf) of an absent class is 0
                lp = float(np.where(c > 0, c * la, 0.0).sum()) + end_p
                lqq = float(np.where(c > 0, c * lq, 0.0).sum()) + end_q
            mult = gammaln(n + 1) - gammaln(c + 1).sum() + float((c * np.log(size)).sum())
            outcomes_p.append(lp + mult)
            outcomes_q.append(lqq + mult)
    exact = ExactOutputs(np.array(outcomes_p), np.array(outcomes_q)[:, None])
    return max(exact.epsilon(delta, 0), exact.epsilon(delta, 0, reverse=True))


# ---------------------------------------------------------------------------------------------
# any mechanism of the interface (invink_audit.mechanisms): decoding in its exact state


@dataclasses.dataclass(frozen=True)
class AuditedMechanism:
    """A :class:`invink_audit.mechanisms.Mechanism` under audit, with the claim its accountant makes.

    ``claim``: from the mechanism's :meth:`~invink_audit.mechanisms.Mechanism.guarantee` unless given
    (a planted bug states a wrong claim); ``expected``: the verdict a correct auditor must give.
    """

    name: str
    description: str
    mechanism: Mechanism
    max_new_tokens: int
    expected: str
    claim_override: Claim | None = None

    def claim(self, source: LogitSource, *, delta: float = 1e-6) -> Claim:
        if self.claim_override is not None:
            return self.claim_override
        return Claim.from_guarantee(self.mechanism.guarantee(self.max_new_tokens, delta), source.batch_size, label=self.name)


def _mechanism_aux(mechanism, count: int, *, at_start: bool, generator: torch.Generator) -> torch.Tensor:
    n = mechanism.aux_size(exact=True, at_start=at_start)
    u = torch.rand((count, n), dtype=_DTYPE, generator=generator)
    return u.clamp_(2.0**-60, 1.0 - 2.0**-53)


def run_mechanism_audit(
    source: LogitSource,
    audited: AuditedMechanism,
    config: WhiteBoxConfig,
    *,
    generator: torch.Generator,
    delta: float = 1e-6,
    progress: Callable[[int, int], None] | None = None,
) -> RecordedAudit:
    """Decode every text of the config's sampling plan through a generic mechanism on ``source``.

    The mechanism runs in its exact state (outcome distributions under R and every R'_j given the
    released history); texts end on EOS, on the mechanism's stop outcome or stop rule, or after
    ``max_new_tokens`` outcomes (a public, fixed budget).
    """
    with torch_threads(1):
        return _run_mechanism_audit(source, audited, config, generator=generator, delta=delta, progress=progress)


def _run_mechanism_audit(source, audited, config, *, generator, delta, progress):
    walker = _MechanismWalker(source, audited)
    return _sample(source, walker, audited.claim(source, delta=delta), config, generator=generator, progress=progress)


class _MechanismWalker:
    """How a generic mechanism decodes on a source, for :func:`_sample` and :func:`_enumerate`: in its exact
    state (outcome distributions under R and every R'_j given the released history), its auxiliary
    uniforms drawn per step; a text ends at EOS, at the stop outcome or stop rule, or after
    ``max_new_tokens`` outcomes (a public, fixed budget)."""

    def __init__(self, source: LogitSource, audited: AuditedMechanism):
        self.mechanism, self.source, self.horizon = audited.mechanism, source, audited.max_new_tokens
        self.stop_id = self.mechanism.stop_outcome(source.vocab_size)

    def start(self, count: int, generator):
        return self.mechanism.initial_state(_mechanism_aux(self.mechanism, count, at_start=True, generator=generator), exact=True)

    def aux(self, count: int, generator):
        return _mechanism_aux(self.mechanism, count, at_start=False, generator=generator)

    def step(self, private, public, state, aux, step: int):
        return self.mechanism.step(private, public, state, aux, exact=True, neighbours=True)

    def advance(self, out, state, outcomes, aux, step: int, rows=None):
        """As :meth:`_TokenWalker.advance`; the mechanism's advance reads ``out``, restricted to ``rows``."""
        out = out if rows is None else _rows_of(out, rows)
        new_state, stop_after = self.mechanism.advance(out, state, outcomes, aux, exact=True)
        tokens = outcomes % self.source.vocab_size
        ended = (tokens == self.source.eos_token) | stop_after | (step + 1 >= self.horizon)
        if self.stop_id is not None:
            ended |= outcomes == self.stop_id
        return new_state, tokens, ended

    def extra(self) -> dict:
        return {"budget_actual": self.horizon, "budget_neighbours": [self.horizon] * self.source.batch_size,
                "source": self.source.name}  # fmt: skip


def enumerate_mechanism_outputs(
    source: LogitSource, audited: AuditedMechanism, *, max_outputs: int = 200_000
) -> ExactOutputs:
    """Every complete output of a generic mechanism on ``source`` with its exact log-probability under R
    and every R'_j (a breadth-first walk over released histories, the exact state carried along).

    Only for tiny V, B and T (each prefix carries the mechanism's exact state). A mechanism with
    auxiliary randomness in its exact state (AdaPMixED's screening estimate) is enumerated for one
    fixed draw of it per step, shared by all prefixes.
    """
    return _enumerate(source, _MechanismWalker(source, audited), max_outputs=max_outputs)


def _rows_of(step, rows: torch.Tensor):
    """A step's distributions (and a mechanism's carry) restricted to some of its rows (enumeration)."""
    view = _WalkStep(step.log_probs[rows], None if step.neighbours is None else step.neighbours[rows],
                     None if step.check_actual is None else step.check_actual[rows],
                     None if step.check_neighbours is None else step.check_neighbours[rows])  # fmt: skip
    view.carry = {k: val[rows] for k, val in (step.carry or {}).items()}
    return view
