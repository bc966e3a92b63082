r"""Synthetic logit sources and audited mechanisms: the white-box auditor without a model.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.synthetic", "Testing the auditor").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from accounting.sensitivity import Clipping
from invink_audit.audit.whitebox import (
    KIND_ACTUAL,
    KIND_NEIGHBOUR,
    Claim,
    RecordedAudit,
    SamplingPlan,
    WhiteBoxConfig,
    WhiteBoxRecorder,
)
from invink_audit.mechanisms import MechanismStep
from invink_audit.mechanisms.invisibleink import HARDEST_PUBLIC_PROBABILITY

if TYPE_CHECKING:
    from invink_audit.mechanisms import Mechanism

__all__ = [
    "HARDEST_PUBLIC_PROBABILITY",
    "LogitSource",
    "RandomSource",
    "HardestCaseSource",
    "AuditedMechanism",
    "correct_mechanism",
    "mutants",
    "run_synthetic_audit",
    "draw_texts",
    "torch_threads",
    "enumerate_outputs",
    "exact_epsilon_stationary",
    "ExactOutputs",
]

_DTYPE = torch.float64


class LogitSource:
    """Base class: ``logits(prefixes, step)`` → (private (G, B, V), public (G, V)), float64, ``prefixes`` (G, step)
    int64. Attributes: ``vocab_size`` (V, EOS included), ``batch_size`` (B), ``eos_token``, ``reference_lengths``
    (in tokens, 0 for a null reference; for the data-dependent-budget mutant), ``canaries`` ({neighbour: label})."""

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
    r"""Random logits as a function of (last token, position mod ``period``): public logits i.i.d.
    :math:`\mathcal N(0, \text{scale}^2)`, reference ``i`` adding :math:`\mathcal N(0, \text{private\_scale}^2)`
    differences (``clip_C`` binds when private_scale ≳ C), EOS lowered by ``eos_shift``. ``seed`` fixes the
    *dataset* (the tables), not the mechanism's randomness."""

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
    r"""The worst case for one ε0-BR step, repeated at every step (docs/accounting_notes.md §8). Reference 0, the
    canary, pushes the "up" group (every non-EOS token but token 0) up and token 0 down by ``push`` ≫ C (clipped
    difference exactly ±C); references 1..B−1 are null. The public logits give the up group probability
    ``up_probability`` and EOS ``eos_probability`` under the canary's neighbour, and lie outside ±``offset`` (naive
    clipping then also binds, in opposite directions for the public and canary rows: paper Property 9's factor 2).
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


@dataclasses.dataclass(frozen=True)
class AuditedMechanism:
    """A :class:`invink_audit.mechanisms.Mechanism` under audit on a synthetic source: run for at most
    ``max_new_tokens`` outcomes (a public, fixed budget), claiming its own guarantee; ``name`` and
    ``description`` label it, ``expected`` is the verdict a correct auditor must give."""

    name: str
    description: str
    mechanism: Mechanism
    max_new_tokens: int
    expected: str

    def claim(self, *, delta: float = 1e-6) -> Claim:
        """The mechanism's claim for ``max_new_tokens`` at ``delta`` (:meth:`Claim.from_mechanism`)."""
        return Claim.from_mechanism(self.mechanism, self.max_new_tokens, delta)


def _config(clip_norm, temperature, top_k, batch_size, **kwargs):
    from invink_audit.mechanism import MechanismConfig

    return MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size, **kwargs)


def correct_mechanism(*, clip_norm: float, temperature: float, top_k: int | None, batch_size: int,
                      max_new_tokens: int) -> AuditedMechanism:
    """InvisibleInk as specified (paper Algorithm 1), with a fixed, data-independent budget T."""
    from invink_audit.mechanisms import InvisibleInk

    return AuditedMechanism("correct", "InvisibleInk: DClip, Top-k+ from public logits, accounted temperature, fixed T",
                            InvisibleInk(_config(clip_norm, temperature, top_k, batch_size)), max_new_tokens, "PASS")


def mutants(*, clip_norm: float, temperature: float, top_k: int, batch_size: int, max_new_tokens: int,
            reference_lengths: Sequence[int]) -> list[AuditedMechanism]:
    """The four planted bugs (docs/auditing_notes.md, "Testing the auditor";
    :mod:`invink_audit.audit.planted`), each claiming what its (wrong) accountant would say; the data-dependent
    budget is computed from ``reference_lengths`` (a source's)."""
    from invink_audit.audit.planted import DataDependentBudget, PlantedBug, PrivateTopK

    correct = _config(clip_norm, temperature, top_k, batch_size)
    naive = _config(clip_norm, temperature, None, batch_size, clipping=Clipping.NAIVE)
    cold = dataclasses.replace(correct, temperature=temperature / 2.0)
    bugs = [
        (PlantedBug("naive-clipping", naive, dataclasses.replace(correct, top_k=None)),
         "naive clipping accounted with sensitivity C/B under replace-by-null (true: 2C/B)"),
        (PlantedBug("low-temperature", cold, correct), f"samples at temperature {temperature / 2:g}, accounted at {temperature:g}"),
        (PrivateTopK(correct), f"top-{top_k} set computed from the aggregated private logits"),
        (DataDependentBudget(correct, reference_lengths),
         "token budget T = mean + 2 std of the non-empty references' lengths"),
    ]  # fmt: skip
    return [AuditedMechanism(m.name, description, m, max_new_tokens, "VIOLATION") for m, description in bugs]


@contextlib.contextmanager
def torch_threads(num_threads: int):
    """Temporarily set torch's intra-op thread count (restored on exit): the synthetic audits' tensors are tiny,
    where intra-op parallelism only costs (OpenMP spin-waiting made one self-test audit ~25x slower on a shared
    2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------
# one walk: a mechanism decoding on a source in its exact state


class _Walker:
    """How a mechanism decodes on a source, for :func:`_sample` and :func:`_enumerate`: in its exact state
    (outcome distributions under R and every R'_j given the released history), its auxiliary uniforms drawn per
    step; a text ends at EOS, at the stop outcome or stop rule, or after ``max_new_tokens`` outcomes (a public,
    fixed budget)."""

    def __init__(self, source: LogitSource, audited: AuditedMechanism):
        self.mechanism, self.source, self.horizon = audited.mechanism, source, audited.max_new_tokens
        self.stop_id = self.mechanism.stop_outcome(source.vocab_size)

    def _aux(self, count: int, generator, *, at_start: bool) -> torch.Tensor:
        n = self.mechanism.aux_size(exact=True, at_start=at_start)
        return torch.rand((count, n), dtype=_DTYPE, generator=generator).clamp_(2.0**-60, 1.0 - 2.0**-53)

    def start(self, count: int, generator) -> torch.Tensor:
        return self.mechanism.initial_state(self._aux(count, generator, at_start=True), exact=True)

    def aux(self, count: int, generator) -> torch.Tensor:
        return self._aux(count, generator, at_start=False)

    def step(self, private, public, state, aux) -> MechanismStep:
        return self.mechanism.step(private, public, state, aux, exact=True, neighbours=True)

    def advance(self, out, state, outcomes, aux, step: int, rows=None):
        """(state, tokens to append, which texts end); ``rows``: the rows of ``out`` the outcomes were drawn on
        (enumeration; ``None``: all of them), as the mechanism's advance reads ``out``."""
        out = out if rows is None else _rows_of(out, rows)
        new_state, stop_after = self.mechanism.advance(out, state, outcomes, aux, exact=True)
        tokens = outcomes % self.source.vocab_size
        ended = (tokens == self.source.eos_token) | stop_after | (step + 1 >= self.horizon)
        if self.stop_id is not None:
            ended |= outcomes == self.stop_id
        return new_state, tokens, ended

    def extra(self) -> dict:
        """The budgets under R and every R'_j (a planted data-dependent budget's own, else the public one)."""
        b = self.source.batch_size
        return {"budget_actual": getattr(self.mechanism, "budget", self.horizon),
                "budget_neighbours": getattr(self.mechanism, "neighbour_budgets", [self.horizon] * b),
                "source": self.source.name}  # fmt: skip


def _rows_of(step: MechanismStep, rows: torch.Tensor) -> MechanismStep:
    """A step's distributions (and a mechanism's carry) restricted to some of its rows (enumeration)."""
    def pick(t):
        return None if t is None else t[rows]

    return MechanismStep(step.log_probs[rows], pick(step.neighbours), pick(step.check_actual), pick(step.check_neighbours),
                         {k: val[rows] for k, val in (step.carry or {}).items()})  # fmt: skip


def run_synthetic_audit(
    source: LogitSource,
    audited: AuditedMechanism,
    config: WhiteBoxConfig,
    *,
    generator: torch.Generator,
    delta: float = 1e-6,
    progress: Callable[[int, int], None] | None = None,
) -> RecordedAudit:
    """Decode every text of the config's sampling plan through ``audited`` on ``source``, all texts together (one
    batched step per position), in the mechanism's exact state, against its claim at ``delta``."""
    walker = _Walker(source, audited)
    plan = SamplingPlan.build(config, source.batch_size)
    with torch_threads(1):
        return _sample(source, walker, WhiteBoxRecorder(plan, audited.claim(delta=delta), config, max_steps=walker.horizon),
                       generator=generator, progress=progress)


def draw_texts(source: LogitSource, audited: AuditedMechanism, canary_in: Sequence[bool], *, slot: int,
               generator: torch.Generator) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """Texts drawn through ``audited`` on ``source`` (a black-box audit's): text ``i`` from R where ``canary_in[i]``,
    else from the neighbour R'_slot; each text's outcomes and its exact log-likelihood ratio
    :math:`\\log P_R(x) - \\log P_{R'_{slot}}(x)` (±∞ for an output one side cannot give, never NaN: each text is
    drawn from its own side)."""
    inside = np.asarray(canary_in, dtype=bool)
    n = inside.size
    plan = SamplingPlan(np.where(inside, KIND_ACTUAL, KIND_NEIGHBOUR).astype(np.int64),
                        np.where(inside, -1, slot).astype(np.int64), np.full(n, -1, dtype=np.int64))  # fmt: skip
    config = WhiteBoxConfig(alphas=(2.0,), num_samples=max(n, 1), num_is_samples=0)
    walker = _Walker(source, audited)
    with torch_threads(1):
        rec = _sample(source, walker, WhiteBoxRecorder(plan, audited.claim(), config, max_steps=walker.horizon),
                      generator=generator, progress=None)
    with np.errstate(invalid="ignore"):
        llr = rec.log_prob_actual - rec.log_prob_neighbours[:, slot]
    return [tuple(int(t) for t in rec.tokens[i, : rec.lengths[i]]) for i in range(n)], llr


def _sample(source: LogitSource, walker: _Walker, recorder: WhiteBoxRecorder, *, generator, progress) -> RecordedAudit:
    """Decode every text of the recorder's plan through ``walker`` on ``source``, all texts together (one batched
    step per position), recording each text's log-probabilities and the per-step checks."""
    from invink_audit.mechanism import sample_tokens

    n = recorder.plan.num_texts
    state = walker.start(n, generator)
    prefixes = torch.zeros(n, walker.horizon, dtype=torch.int64)
    alive = torch.ones(n, dtype=torch.bool)
    for step in range(walker.horizon):
        ids = alive.nonzero().reshape(-1)
        if ids.numel() == 0:
            break
        private, public = source.logits(prefixes[ids, :step], step)
        aux = walker.aux(ids.numel(), generator)
        out = walker.step(private, public, state[ids], aux)
        outcomes = sample_tokens(recorder.weigh(ids, out), generator)
        recorder.record(ids, outcomes)
        state[ids], prefixes[ids, step], ended = walker.advance(out, state[ids], outcomes, aux, step)
        alive[ids] = ~ended
        if progress is not None:
            progress(step + 1, walker.horizon)
    return dataclasses.replace(recorder.finish(), extra=walker.extra())


def _enumerate(source: LogitSource, walker: _Walker, *, max_outputs: int) -> ExactOutputs:
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
        aux = walker.aux(1, generator).expand(prefixes.shape[0], -1)
        out = walker.step(private, public, state, aux)
        # every (prefix, outcome) with positive probability under R or under some R'_j
        possible = torch.isfinite(out.log_probs) | torch.isfinite(out.neighbours).any(1)
        rows, outs = possible.nonzero(as_tuple=True)
        if rows.numel() > max_outputs:
            raise ValueError(f"enumeration would expand {rows.numel()} prefixes (> max_outputs={max_outputs})")
        new_a = lp_a[rows] + out.log_probs[rows, outs]
        new_n = lp_n[rows] + out.neighbours[rows, :, outs]
        new_state, tokens, ended = walker.advance(out, state[rows], outs, aux[rows], step, rows=rows)
        done_a.append(new_a[ended])
        done_n.append(new_n[ended])
        keep = ~ended
        prefixes = torch.cat([prefixes[rows[keep]], tokens[keep].unsqueeze(-1)], dim=1)
        state, lp_a, lp_n = new_state[keep], new_a[keep], new_n[keep]
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

    def _pair(self, neighbour: int, reverse: bool) -> tuple[np.ndarray, np.ndarray]:
        """(log P, log P') of every output: R and R'_j, or reversed."""
        lp, lq = self.log_prob_actual, self.log_prob_neighbours[:, neighbour]
        return (lq, lp) if reverse else (lp, lq)

    def renyi(self, alpha: float, neighbour: int, reverse: bool = False) -> float:
        r""":math:`D_\alpha(P_R\|P_{R'_j})` (or reversed), exactly: a log-sum-exp over all outputs."""
        lp, lq = self._pair(neighbour, reverse)
        keep = np.isfinite(lp)
        if (keep & ~np.isfinite(lq)).any():
            return math.inf
        terms = alpha * lp[keep] + (1 - alpha) * lq[keep]
        m = terms.max()
        return float((m + math.log(np.exp(terms - m).sum())) / (alpha - 1))

    def delta(self, epsilon: float, neighbour: int, reverse: bool = False) -> float:
        """Hockey-stick divergence δ(ε) = Σ_x (P(x) − e^ε P'(x))_+, exactly."""
        lp, lq = self._pair(neighbour, reverse)
        return float(np.clip(np.exp(lp) - math.exp(epsilon) * np.exp(lq), 0, None).sum())

    def epsilon(self, delta: float, neighbour: int, reverse: bool = False) -> float:
        """The smallest ε with :meth:`delta` (ε) ≤ ``delta`` (the tight ε of the pair at δ; a root of the
        monotone hockey-stick divergence), ``inf`` when outputs possible under one dataset only carry more
        than ``delta``."""
        from scipy import optimize

        lp, lq = self._pair(neighbour, reverse)
        if self.delta(0.0, neighbour, reverse) <= delta:
            return 0.0
        mismatch = np.isfinite(lp) & ~np.isfinite(lq)
        if float(np.exp(lp[mismatch]).sum()) > delta:
            return math.inf
        high = 1.0
        while self.delta(high, neighbour, reverse) > delta:
            high *= 2.0
        return float(optimize.brentq(lambda e: self.delta(e, neighbour, reverse) - delta, 0.0, high, xtol=1e-12))


def enumerate_outputs(source: LogitSource, audited: AuditedMechanism, *, max_outputs: int = 200_000) -> ExactOutputs:
    """Every complete output of ``audited`` on ``source`` with its exact log-probability under R and every R'_j (a
    breadth-first walk over released histories, no sampling): the reference the Monte Carlo intervals must cover.
    Tiny V, B and T only: raises beyond ``max_outputs`` prefixes. Auxiliary randomness in a mechanism's exact state
    (AdaPMixED's screening estimate) is one fixed draw per step, shared by all prefixes."""
    return _enumerate(source, _Walker(source, audited), max_outputs=max_outputs)


def exact_epsilon_stationary(source: LogitSource, audited: AuditedMechanism, delta: float, *, neighbour: int = 0) -> float:
    r"""The **true** ε(δ) of a stateless mechanism on a source whose logits do not depend on the prefix (e.g.
    :class:`HardestCaseSource`), between the dataset and its neighbour with reference ``neighbour`` nulled,
    the larger of both directions: no accountant involved.

    With stationary logits a text's probability depends only on how many times each class of tokens
    occurs (tokens with the same pair of log-probabilities under the two datasets form a class) and on
    how it ends (EOS before T, or the budget T), so the hockey-stick divergence
    :math:`\delta(\varepsilon) = \sum_x (P(x) - e^\varepsilon Q(x))_+` (Dwork & Roth 2014, §3.5; the
    tight δ of a pair) is an exact sum over count vectors with multinomial multiplicities; ε(δ) is its
    root (:meth:`ExactOutputs.epsilon`). Checked against :func:`enumerate_outputs` on small vocabularies (tests). A
    mechanism with a state or a stop rule (whose budget differs between the datasets) is refused: use
    :func:`enumerate_outputs`."""
    from scipy.special import gammaln

    mechanism, t_r = audited.mechanism, audited.max_new_tokens
    if mechanism.state_size(exact=True) or mechanism.can_halt:
        raise ValueError(f"{audited.name} has a state or a stop rule (its budget differs between the datasets): "
                         "not stationary")  # fmt: skip
    prefixes = torch.zeros(2, 1, dtype=torch.int64)
    private, public = source.logits(prefixes, 0)
    again, _ = source.logits(prefixes + 1, 1)
    if not torch.equal(private, again):
        raise ValueError("the source's logits depend on the prefix: use enumerate_outputs")
    empty = torch.zeros((2, 0), dtype=_DTYPE)
    out = mechanism.step(private, public, empty, empty, exact=True, neighbours=True)
    a, q = out.log_probs[0].double().numpy(), out.neighbours[0, neighbour].double().numpy()
    eos = source.eos_token
    classes = Counter((float(a[v]), float(q[v])) for v in range(a.size)
                      if v != eos and (np.isfinite(a[v]) or np.isfinite(q[v])))
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
