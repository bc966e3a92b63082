r"""White-box audit of a generator's own loop, unmodified: intercept every draw, replay every neighbour.

:func:`audit_generator` runs ``generate(references)`` once, recording the exact distribution of every drawn token at
its final sampling call, then once per neighbour (under the claim's :class:`~accounting.Adjacency`) with the same
tokens forced. Per step: :func:`~invink_audit.audit.whitebox.step_quantities` against the claim's per-step part;
along each text the per-step Rényi sums (adaptive composition, Mironov 2017, Prop. 1; a Rényi filter's spend,
Feldman & Zrnic 2021, Thm. 3.1), held against a per-step claim composed over T or a filter's budget only. A
sequence-level claim is checked from exact realised losses in both directions (:class:`SequenceCheck`). The
reported ε is held against :meth:`~accounting.PrivacyClaim.epsilon_at` and
:meth:`~accounting.PrivacyClaim.epsilon_lower_at`. The patches are process-wide while a run lasts: one audit at a
time, other threads pass through unrecorded, every patch restored in a ``finally``.

What is intercepted and checked: docs/guide/auditing.md ("Auditing your own generator").
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from accounting.claims import RESOLVABLE_SHARE, PrivacyClaim
from accounting.conversions import gdp_to_epsilon
from accounting.limits import check_delta
from accounting.sensitivity import Adjacency
from invink_audit.audit import stats
from invink_audit.audit.stats import Verdict
from invink_audit.audit.whitebox import DEFAULT_ALPHAS, DEFAULT_DELTA_GRID, step_quantities, tolerance_for

__all__ = [
    "NOISE_LAWS", "GeneratorAudit", "InterceptionError", "SamplingCall", "SequenceCheck", "audit_generator",
    "noisy_argmax_log_probs", "unreleased",
]

_LOCK = threading.Lock()
_ACTIVE: _Interceptor | None = None
_WATCHED = (
    "torch.multinomial, Tensor.multinomial (torch.distributions.Categorical.sample, transformers' "
    "generate(do_sample=True)), numpy.random.choice, choice of numpy.random.default_rng generators made during the run, "
    "scores plus normal or gumbel noise of numpy generators made during the run (a noisy argmax)"
)


class InterceptionError(RuntimeError):
    """A generator's draws could not be intercepted, or a neighbour's replay diverged from the actual run."""


@dataclass(frozen=True)
class SamplingCall:
    """One intercepted sampling call: ``sampler`` (its name), ``log_probs`` (G, V) float64 on the CPU (the exact
    distribution of each row's draws, normalised from the weights the sampler was given), ``tokens`` (G, S) int64
    (S draws per row), ``dtype``: the dtype of the weights as given (``"uniform"`` for a choice without ``p``)."""

    sampler: str
    log_probs: torch.Tensor
    tokens: torch.Tensor
    dtype: str

    @property
    def shape(self) -> tuple[int, int, int]:
        """(G, V, S)."""
        return (*self.log_probs.shape, self.tokens.shape[1])

    def describe(self) -> str:
        g, v, s = self.shape
        return f"{self.sampler} of {g} row(s) over {v} outcomes, {s} draw(s) each"


class _Interceptor:
    """Records the calls of one run; with ``forced`` (the actual run's calls), returns their tokens instead."""

    def __init__(self, forced: Sequence[SamplingCall] | None, neighbour: int | None):
        self.forced, self.neighbour = forced, neighbour
        self.owner = threading.get_ident()
        self.calls: list[SamplingCall] = []
        self.argmax_calls = 0
        self.unreleased: set[str] = set()  # samplers whose draws are not released (:func:`unreleased`)

    def draw(self, sampler: str, weights: torch.Tensor, dtype: str, sample: Callable, consume: Callable) -> torch.Tensor:
        """The (G, S) tokens of a call with (G, V) ``weights``: ``sample()``'s, or the forced ones after ``consume()``
        (the same random numbers the draw would have used)."""
        if sampler in self.unreleased:
            return sample().to(device="cpu", dtype=torch.int64)
        w = weights.detach().to(device="cpu", dtype=torch.float64)
        log_probs = torch.log(w) - torch.log(w.sum(-1, keepdim=True))
        step = len(self.calls)
        if self.forced is None:
            tokens = sample().to(device="cpu", dtype=torch.int64)
        else:
            if step >= len(self.forced):
                raise InterceptionError(
                    f"neighbour {self.neighbour}: sampling call {step} ({sampler}) has no counterpart: the actual run "
                    f"made {len(self.forced)} sampling call(s)"
                )
            ref = self.forced[step]
            if ref.sampler != sampler or tuple(ref.log_probs.shape) != tuple(log_probs.shape):
                raise InterceptionError(
                    f"neighbour {self.neighbour}: sampling call {step} differs from the actual run's: "
                    f"{sampler} over {tuple(log_probs.shape)} (rows, outcomes), actual {ref.sampler} over "
                    f"{tuple(ref.log_probs.shape)}"
                )
            consume()
            tokens = ref.tokens
        self.calls.append(SamplingCall(sampler, log_probs, tokens, dtype))
        return tokens


def _active() -> _Interceptor | None:
    active = _ACTIVE
    return active if active is not None and active.owner == threading.get_ident() else None


def _torch_sampler(original: Callable, sampler: str) -> Callable:
    """``torch.multinomial`` (or the ``Tensor`` method) recording its draws while an interceptor is active."""

    def multinomial(input, num_samples, replacement=False, *, generator=None, **kwargs):
        active = _active()
        if active is None:
            return original(input, num_samples, replacement, generator=generator, **kwargs)
        if kwargs or (num_samples > 1 and not replacement):
            raise InterceptionError(
                f"{sampler}: only independent draws can be audited (num_samples=1 or replacement=True, no out=); "
                f"got num_samples={num_samples}, replacement={replacement}, {sorted(kwargs)}"
            )
        rows = input.reshape(1, -1) if input.ndim == 1 else input
        tokens = active.draw(
            sampler, rows, str(input.dtype).removeprefix("torch."),
            sample=lambda: original(rows, num_samples, replacement, generator=generator),
            consume=lambda: original(torch.ones_like(rows), num_samples, replacement, generator=generator),
        )
        return tokens.to(input.device).reshape(-1) if input.ndim == 1 else tokens.to(input.device)

    return multinomial


def _numpy_choice(original: Callable, sampler: str, a, size, replace, p):
    """``choice(a, size, replace, p)`` recorded by the active interceptor; ``original(n, size, replace, p)`` draws
    indices into ``range(n)``."""
    n = int(a) if np.ndim(a) == 0 else len(a)
    draws = 1 if size is None else math.prod(np.atleast_1d(size).tolist())
    if draws > 1 and not replace:
        raise InterceptionError(f"{sampler}: only independent draws can be audited; got size={size}, replace=False")
    probs = np.full(n, 1.0 / n) if p is None else np.asarray(p)
    uniform = np.full(n, 1.0 / n)
    tokens = _active().draw(
        sampler, torch.from_numpy(np.asarray(probs, dtype=np.float64)).reshape(1, n),
        "uniform" if p is None else str(probs.dtype),
        sample=lambda: torch.as_tensor(np.asarray(original(n, draws, replace, probs))).reshape(1, draws),
        consume=lambda: original(n, draws, replace, uniform),
    )
    index = tokens.numpy().reshape(-1)
    index = index[0] if size is None else index.reshape(size)
    return index if np.ndim(a) == 0 else np.asarray(a)[index]


class _RecordingGenerator(np.random.Generator):
    """What ``numpy.random.default_rng`` returns during a run: the same stream, its ``choice`` recorded."""

    def choice(self, a, size=None, replace=True, p=None, axis=0, shuffle=True):
        if _active() is None or axis != 0:
            return super().choice(a, size=size, replace=replace, p=p, axis=axis, shuffle=shuffle)
        parent = super()
        return _numpy_choice(lambda n, s, r, q: parent.choice(n, size=s, replace=r, p=q),
                             "numpy Generator.choice", a, size, replace, p)


#: the noise laws a recorded numpy noise draw declares (its method name); Laplace is not yet audited
NOISE_LAWS = ("normal", "gumbel")
#: quadrature step of :func:`noisy_argmax_log_probs` in units of the noise scale (the integrand's log is concave with
#: curvature ≥ 1: the trapezoid rule's error on it is far below float64's tolerance, tested against closed forms)
_QUADRATURE_STEP = 0.01


def noisy_argmax_log_probs(scores, law: str, scale: float) -> np.ndarray:
    r"""The exact law of :math:`\arg\max_i (s_i + b Z_i)`, :math:`Z_i` i.i.d. of ``law`` (``"gumbel"`` or
    ``"normal"``), ``scale`` = b: log-probabilities of each index (float64).

    Gumbel: :math:`\mathrm{softmax}(s/b)` exactly (the Gumbel-max trick: Gumbel 1954; Yellott 1977, J. Math. Psych.
    15, Thm. 5; the exponential mechanism as report-noisy-max, McSherry & Talwar 2007). Normal (Gaussian
    report-noisy-max): :math:`P(i) = \int \varphi(z) \prod_{j \ne i} \Phi(z + (s_i - s_j)/b)\,dz` (conditioning on
    :math:`Z_i = z`; e.g. Dwork & Roth 2014, §3.3), integrated in log space by the trapezoid rule on
    :math:`z \in [-40, 40 + \max_j (s_j - s_i)/b]` with step :data:`_QUADRATURE_STEP` (the integrand is log-concave
    and smooth: the rule converges geometrically; tested against :math:`\Phi((s_0 - s_1)/(b\sqrt 2))` and Monte Carlo).
    """
    from scipy import special

    s = np.asarray(scores, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or not np.isfinite(s).all():
        raise ValueError(f"scores must be a non-empty finite vector; got shape {s.shape}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number; got {scale!r}")
    if law == "gumbel":
        return s / scale - special.logsumexp(s / scale)
    if law != "normal":
        raise ValueError(f"law must be one of {NOISE_LAWS}; got {law!r}")
    out = np.empty(s.size)
    for i in range(s.size):
        gaps = np.delete(s[i] - s, i) / scale
        top = 40.0 + max(0.0, float(-gaps.min(initial=0.0)))
        z = np.arange(-40.0, top + _QUADRATURE_STEP, _QUADRATURE_STEP)
        log_f = -0.5 * z**2 - 0.5 * math.log(2 * math.pi) + special.log_ndtr(z[:, None] + gaps[None, :]).sum(1)
        log_f[[0, -1]] -= math.log(2.0)  # trapezoid end weights
        out[i] = special.logsumexp(log_f) + math.log(_QUADRATURE_STEP)
    return out


class _NoiseScalar(np.float64):
    """One element of a recorded noise vector: ``score + element`` registers the score (the left operand's type is a
    float, of which this is a subclass, so Python tries this reflected addition first)."""

    def __radd__(self, score):
        return self.draw.add(self.index, score)


class _NoiseDraw(np.ndarray):
    """A noise vector a recording generator returned during a run: adding every score to it is one noisy argmax
    (an array derived from it, a slice say, is plain: ``scores`` is None)."""

    def __array_finalize__(self, obj):
        self.scores = None

    def __iter__(self):
        if self.scores is None:
            yield from self.view(np.ndarray)
            return
        for i, z in enumerate(self.view(np.ndarray)):
            element = _NoiseScalar(z)
            element.draw, element.index = self, i
            yield element

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, _NoiseDraw) else x for x in inputs]
        if ufunc is np.add and method == "__call__" and not kwargs and len(inputs) == 2 and self.scores is not None:
            other = plain[1] if isinstance(inputs[0], _NoiseDraw) else plain[0]
            if np.shape(other) == self.shape:
                return np.asarray([self.add(i, v) for i, v in enumerate(np.asarray(other, dtype=np.float64))])
        return getattr(ufunc, method)(*plain, **kwargs)

    def add(self, index: int, score) -> np.float64:
        """``score + noise[index]``; once every index has its score, the draw is recorded (the forced token of a
        replay gets +inf, every other index its score)."""
        self.scores[index] = float(score)
        forced = self.forced
        value = np.float64(score) + self.view(np.ndarray)[index] if forced is None else (
            np.float64(math.inf) if index == forced else np.float64(score))
        if all(v is not None for v in self.scores) and (active := _active()) is not None:
            scores = np.asarray(self.scores)
            noisy = scores + self.view(np.ndarray)
            finite = np.isfinite(scores).all()  # NaN or inf scores: the law is undefined, a finding (NaN recorded)
            log_probs = noisy_argmax_log_probs(scores, self.law, self.scale) if finite else np.full(scores.size, np.nan)
            active.draw(f"noisy argmax ({self.law} noise)", torch.from_numpy(np.exp(log_probs - log_probs.max()))[None],
                        "float64", sample=lambda: torch.tensor([[int(np.argmax(noisy))]]), consume=lambda: None)
        return value


def _noise(z, law: str, scale) -> np.ndarray:
    """``z`` as a recorded noise draw when a run is active and it is a vector of one positive scale, else as it is."""
    active = _active()
    if active is None or np.ndim(z) != 1 or np.ndim(scale) != 0 or not float(scale) > 0:
        return z
    out = np.asarray(z, dtype=np.float64).view(_NoiseDraw)
    out.law, out.scale, out.scores = law, float(scale), [None] * out.size
    step = len(active.calls)
    out.forced = None if active.forced is None or step >= len(active.forced) else int(active.forced[step].tokens[0, 0])
    return out


def _recording_noise(cls):
    """``cls`` (a numpy generator class) with its :data:`NOISE_LAWS` methods returning recorded noise draws."""

    def method(law):
        def noise(self, loc=0.0, scale=1.0, size=None):
            return _noise(getattr(super(recording, self), law)(loc, scale, size), law, scale)

        return noise

    recording = type(f"Recording{cls.__name__}", (cls,), {law: method(law) for law in NOISE_LAWS})
    return recording


_RecordingRandomState = _recording_noise(np.random.RandomState)
_NoiseRecordingGenerator = _recording_noise(_RecordingGenerator)


@contextlib.contextmanager
def unreleased(*samplers: str):
    """Within the block, draws by ``samplers`` (:attr:`SamplingCall.sampler` names) are not part of the release: they
    pass through unrecorded. For a generator that calls a sampler and discards its token (the reference package
    ``invink`` calls transformers' ``generate(do_sample=True, max_new_tokens=1)`` for its logits, then draws with
    numpy). Declaring a draw that is released unreleased hides it from the audit: the user's responsibility."""
    active = _active()
    saved = None if active is None else active.unreleased
    if active is not None:
        active.unreleased = saved | set(samplers)
    try:
        yield
    finally:
        if active is not None:
            active.unreleased = saved


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) of every patch a run installs."""
    legacy_choice, default_rng = np.random.choice, np.random.default_rng
    torch_argmax, tensor_argmax = torch.argmax, torch.Tensor.argmax

    def choice(a, size=None, replace=True, p=None):
        if _active() is None:
            return legacy_choice(a, size, replace, p)
        return _numpy_choice(lambda n, s, r, q: legacy_choice(n, s, r, q), "numpy.random.choice", a, size, replace, p)

    def legacy_noise(law):
        original = getattr(np.random, law)
        return lambda loc=0.0, scale=1.0, size=None: _noise(original(loc, scale, size), law, scale)

    def counted(original):
        def argmax(*args, **kwargs):
            if (active := _active()) is not None:
                active.argmax_calls += 1
            return original(*args, **kwargs)

        return argmax

    return [
        (torch, "multinomial", _torch_sampler(torch.multinomial, "torch.multinomial")),
        (torch.Tensor, "multinomial", _torch_sampler(torch.Tensor.multinomial, "Tensor.multinomial")),
        (np.random, "choice", choice),
        (np.random, "default_rng", lambda seed=None: _NoiseRecordingGenerator(default_rng(seed).bit_generator)),
        (np.random, "RandomState", _RecordingRandomState),
        *[(np.random, law, legacy_noise(law)) for law in NOISE_LAWS],
        (torch, "argmax", counted(torch_argmax)),
        (torch.Tensor, "argmax", counted(tensor_argmax)),
    ]


@contextlib.contextmanager
def _intercepting(interceptor: _Interceptor):
    """Install the patches for one run (refused while another audit runs); always restored."""
    global _ACTIVE
    if not _LOCK.acquire(blocking=False):
        raise RuntimeError("another audit_generator run is in progress: the interception patches are process-wide")
    saved = []
    try:
        for owner, name, replacement in _patches():
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)
        _ACTIVE = interceptor
        yield interceptor
    finally:
        _ACTIVE = None
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
        _LOCK.release()


def _rng_states():
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), np.random.get_state(), random.getstate(), cuda


def _set_rng_states(states) -> None:
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


def _run(generate: Callable, references: list, forced, neighbour: int | None):
    """One run of ``generate``: its output and its sampling calls."""
    with _intercepting(_Interceptor(forced, neighbour)) as interceptor:
        output = generate(list(references))
    calls = tuple(interceptor.calls)
    if forced is None and not calls:
        raise InterceptionError(
            f"no sampling call was intercepted while generate ran (it returned {type(output).__name__}; "
            f"{interceptor.argmax_calls} argmax call(s) seen). Watched: {_WATCHED}. A draw by an argmax over noisy "
            "scores, by a sampler not listed, or by a numpy generator made before the run cannot be audited yet"
        )
    if forced is not None and len(calls) != len(forced):
        raise InterceptionError(
            f"neighbour {neighbour}: the replay made {len(calls)} sampling call(s), the actual run {len(forced)}; "
            f"it stopped after step {len(calls) - 1}"
        )
    return output, calls


@dataclass(frozen=True)
class SequenceCheck:
    r"""A sampled check of a sequence-level claim against one neighbour, from the run's texts (each text's realised
    privacy loss :math:`L = \sum_t \log p_t(y_t) - \log p'_t(y_t)` is exact, the texts are draws from P; ``direction``
    ``"reverse"``: the neighbour's own texts, draws from P', with :math:`L = \log P'(x) - \log P(x)`, ``+inf`` where P
    gives a drawn token 0; (ε, δ)-DP under a symmetric relation bounds both):
    ``quantity`` ``"delta"`` (:math:`\delta(\varepsilon) = E_P[(1 - e^{\varepsilon - L})_+]` at ``at`` = ε,
    :func:`~invink_audit.audit.stats.hockey_stick_delta`) or ``"renyi"`` (:math:`D_\alpha` at ``at`` = α,
    :func:`~invink_audit.audit.stats.renyi_monte_carlo`); ``lower``/``upper``: its confidence bounds at
    ``significance`` (two-sided; ``upper`` is ``inf`` where no a-priori range bounds the loss); ``claimed``: the claim's
    figure (:meth:`~accounting.PrivacyClaim.delta_at`, :meth:`~accounting.PrivacyClaim.sequence_renyi`)."""

    neighbour: int
    quantity: str
    at: float
    estimate: float
    lower: float
    upper: float
    claimed: float
    significance: float
    num_texts: int
    direction: str = "forward"


@dataclass(frozen=True)
class GeneratorAudit:
    r"""What :func:`audit_generator` found.

    ``claim``: the :class:`~accounting.PrivacyClaim` audited. ``calls``: the actual run's sampling calls;
    ``neighbour_calls[b]``: audited neighbour ``neighbours[b]``'s (reference dropped under add-remove, ``None`` in its
    slot under replace-by-null), with the same tokens forced. Per recorded distribution ``d`` (the rows of every call,
    in order; ``step_call[d]`` its call): ``max_abs_log_ratio`` (D, B), :math:`\max_y |\log p(y) - \log p'(y)|` on the
    union support; ``loss_range`` (D, B), the bounded range; ``renyi_forward``/``renyi_reverse`` (D, B, A),
    :math:`D_\alpha(p\|p')` / :math:`D_\alpha(p'\|p)` at ``alphas``. ``sequence_renyi_forward``/``_reverse``
    (texts, B, A): their sums along each text (a text is a row kept by every call, and a call's S draws of a row are S
    steps of its text, each counted; a generator whose batch changes size is composed as one text); ``text_losses``
    (texts, B): each text's realised privacy loss; ``reverse_text_losses[b]`` (a sequence-level claim only, else
    empty): audited neighbour b's own texts' losses :math:`\log P'(x) - \log P(x)` (``+inf`` where P gives a drawn
    token 0).
    ``excesses``: each exactly checked quantity's largest excess over its claim (nats; > ``tolerance`` is a
    VIOLATION); ``sequence_checks``: the sampled checks of a sequence-level claim (:class:`SequenceCheck`);
    ``certified_epsilon``: the ε at the generator's reported δ that its own claim certifies (our accountant, an upper
    bound); ``claim_lower_epsilon``: where the report is below it, the ε of the worst mechanism the claim admits (a
    lower bound; a report below it is a VIOLATION, between the two INCONCLUSIVE; else ``None``);
    ``nonfinite``: recorded distributions holding NaN (a finding; a sequence-level claim's reverse runs included).
    """

    claim: PrivacyClaim
    output: Any
    calls: tuple[SamplingCall, ...]
    neighbours: tuple[int, ...]
    neighbour_calls: tuple[tuple[SamplingCall, ...], ...]
    alphas: tuple[float, ...]
    tolerance: float
    step_call: np.ndarray
    max_abs_log_ratio: np.ndarray
    loss_range: np.ndarray
    renyi_forward: np.ndarray
    renyi_reverse: np.ndarray
    sequence_renyi_forward: np.ndarray
    sequence_renyi_reverse: np.ndarray
    text_losses: np.ndarray
    reverse_text_losses: tuple[np.ndarray, ...]
    excesses: dict
    sequence_checks: tuple[SequenceCheck, ...]
    certified_epsilon: float | None
    claim_lower_epsilon: float | None
    nonfinite: int
    verdict: Verdict
    reason: str

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes the sampled distributions were given in (for the tolerance)."""
        return tuple(sorted({c.dtype for c in self.calls}))


def _step_arrays(calls, neighbour_calls, alphas) -> dict:
    """Per-step quantities of every recorded distribution, concatenated over the calls (float64 tensors), and each
    row's privacy loss ``log p(y) - log p'(y)`` summed over its S draws, (G, B) per call (``draw_losses``)."""
    parts, draw_losses = [], []
    for k, call in enumerate(calls):
        actual = call.log_probs
        nbs = torch.stack([nc[k].log_probs for nc in neighbour_calls], 1)  # (G, B, V)
        q = step_quantities(actual, nbs, alphas, (0.0,))
        lp = actual.unsqueeze(1)
        both, either = torch.isfinite(lp) & torch.isfinite(nbs), torch.isfinite(lp) | torch.isfinite(nbs)
        ratio = torch.where(both, (lp - nbs).abs(), torch.where(either, math.inf, 0.0))
        parts.append({"step_call": torch.full((actual.shape[0],), k), "max_abs_log_ratio": ratio.amax(-1),
                      "loss_range": q.loss_range, "renyi_forward": q.renyi_forward, "renyi_reverse": q.renyi_reverse})
        drawn = actual.gather(1, call.tokens)  # (G, S)
        nb_drawn = nbs.gather(2, call.tokens.unsqueeze(1).expand(-1, nbs.shape[1], -1))  # (G, B, S)
        draw_losses.append((drawn.unsqueeze(1) - nb_drawn).sum(2))  # a row's S draws: S steps of its text
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}, draw_losses


def _sequence_sums(calls, per_step: torch.Tensor) -> torch.Tensor:
    """(texts, B, A) sums along each text of (D, B, A) per-step values, a row's S draws in one call counting S steps:
    text = a row, when every call draws from the same G rows, else the whole release as one text."""
    weights = torch.cat([torch.full((c.shape[0],), float(c.shape[2]), dtype=per_step.dtype) for c in calls])
    weighted = per_step * weights.reshape(-1, *[1] * (per_step.ndim - 1))
    if len({c.shape[0] for c in calls}) != 1:
        return weighted.sum(0, keepdim=True)
    return weighted.reshape(len(calls), calls[0].shape[0], *per_step.shape[1:]).sum(0)


def _text_losses(calls, draw_losses: list[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """(texts, B): each text's realised privacy loss, the sum of its draws' (texts as :func:`_sequence_sums`); the
    steps per text (every call's S draws of a row) and the draws summed into one text's loss."""
    steps = sum(c.shape[2] for c in calls)
    if len({d.shape[0] for d in draw_losses}) != 1:
        return torch.cat(draw_losses).sum(0, keepdim=True), steps, sum(c.shape[0] * c.shape[2] for c in calls)
    return torch.stack(draw_losses).sum(0), steps, steps


def _checks_path_sums(claim: PrivacyClaim) -> bool:
    """Whether a text's sum of per-step Rényi divergences is bounded by the claim: a per-step claim composed over T,
    or a Rényi filter's budget (a data-dependent sequence-level Rényi claim: its stop rule bounds the path's sum,
    Feldman & Zrnic 2021, Thm. 3.1). A sequence-level claim bounds the divergence of the whole output, which adaptive
    composition bounds by the supremum over paths of the sums (Mironov 2017, Prop. 1): one path's sum above it is no
    violation."""
    return claim.form == "per-step" or (claim.form == "renyi" and claim.data_dependent)


def _excesses(claim: PrivacyClaim, steps: dict, fwd_seq, rev_seq, alphas, columns, steps_per_text: int) -> dict:
    r"""Each exactly checked quantity's largest excess over its claim (NaN read as no excess; counted apart). A pure
    ε-DP text bounds the privacy loss of every output, :math:`|L(x)| \le \varepsilon` (Dwork & Roth 2014, Def. 2.4
    with δ = 0, taken at the single output x): one realised text over it, in either direction, is a violation."""

    def worst(values: torch.Tensor) -> float:
        return float(torch.nan_to_num(values, nan=-math.inf).max())

    excess, step = {}, claim.step
    if math.isfinite(step.epsilon):
        excess["step |log-ratio| over epsilon"] = worst(steps["max_abs_log_ratio"]) - step.epsilon
    if math.isfinite(step.epsilon0):
        excess["step bounded range over epsilon0"] = worst(steps["loss_range"]) - step.epsilon0
    renyi = torch.maximum(steps["renyi_forward"], steps["renyi_reverse"])
    bound = torch.tensor([step.renyi_bound(a) for a in alphas], dtype=torch.float64)
    if bool(torch.isfinite(bound).any()):
        excess["step Renyi over its claim"] = worst(renyi - bound)
    seq_bound = torch.tensor([claim.sequence_renyi(a) for a in alphas], dtype=torch.float64)
    if _checks_path_sums(claim) and bool(torch.isfinite(seq_bound).any()):
        excess["sequence Renyi over the claim"] = worst(torch.maximum(fwd_seq, rev_seq) - seq_bound)
    if claim.form == "epsilon" and claim.delta == 0:
        excess["sequence |realised loss| over pure epsilon"] = max(
            float(np.nan_to_num(np.abs(c[2]), nan=-math.inf).max()) for c in columns) - claim.epsilon
    excess["draws per text over the claim's steps"] = float(steps_per_text - claim.steps)
    return excess


def _sequence_checks(claim: PrivacyClaim, columns, alphas, significance: float):
    """Sampled checks of a sequence-level claim (:class:`SequenceCheck`), one per neighbour, direction and ε grid or
    order, Bonferroni over all of them. ``columns``: (neighbour, direction, losses, slack) of each direction's texts;
    lower bounds from the losses lowered by ``slack`` and upper bounds from them raised by it (the tolerance times the
    draws summed per text: rounding neither makes a violation nor supports a claim). None for a per-step claim (its
    exact checks imply the sequence's) or NaN losses."""
    if claim.form == "per-step" or any(np.isnan(c[2]).any() for c in columns):
        return ()
    if claim.form in ("epsilon", "mu"):
        grid = (claim.epsilon,) if claim.form == "epsilon" else (0.0, *(gdp_to_epsilon(claim.mu, d) for d in DEFAULT_DELTA_GRID))
        plan = [("delta", grid)]
    else:
        plan = [("renyi", (a,)) for a in alphas if math.isfinite(claim.sequence_renyi(a))]
    beta = significance / (len(columns) * max(len(plan), 1))
    checks = []
    for b, direction, column, slack in columns:
        for quantity, at in plan:
            low, mid, high = (_bounds(quantity, at, column + shift, beta) for shift in (-slack, 0.0, slack))
            claimed = [claim.delta_at(e) if quantity == "delta" else claim.sequence_renyi(e) for e in at]
            checks.extend(SequenceCheck(b, quantity, e, mid[i][0], low[i][1], high[i][2], claimed[i], beta, column.size,
                                        direction) for i, e in enumerate(at))  # fmt: skip
    return tuple(checks)


def _bounds(quantity: str, at: tuple, losses: np.ndarray, beta: float) -> list[tuple[float, float, float]]:
    """(estimate, lower, upper) at each of ``at`` from one neighbour's losses: δ(ε) (a single ε's pointwise bounds, or
    the DKW band over a grid) or :math:`D_\alpha` at ``at[0]``."""
    if quantity == "renyi":
        ci = stats.renyi_monte_carlo(losses, at[0], beta).interval
        return [(ci.estimate, ci.lower, ci.upper)]
    curve = stats.hockey_stick_delta(losses, at, beta)
    lower, upper = (curve.pointwise_lower, curve.pointwise_upper) if len(at) == 1 else (curve.band_lower, curve.band_upper)
    return list(zip(curve.estimate, lower, upper))


def _certified_epsilon(claim: PrivacyClaim) -> tuple[float | None, float | None]:
    """The ε at the generator's reported δ that its own claim certifies (our upper bound; ``None`` when it reports none
    or ``inf``), and, only when the report is below it, the lower bound on the ε of the worst mechanism the claim admits
    (:meth:`~accounting.PrivacyClaim.epsilon_lower_at`; else ``None``)."""
    if claim.reported_epsilon is None or math.isinf(claim.reported_epsilon):
        return None, None
    certified = claim.epsilon_at(claim.reported_delta)
    if claim.reported_epsilon >= certified * (1.0 - REPORTED_EPSILON_RTOL):
        return certified, None
    return certified, claim.epsilon_lower_at(claim.reported_delta)


#: relative slack of the reported-ε check: a report below its claim's certified ε (or the lower bound) by more than this
#: is a finding
REPORTED_EPSILON_RTOL = 1e-6


def _verdict(claim: PrivacyClaim, excesses: dict, checks, certified, lower, nonfinite: int, tolerance: float,
             summed: int) -> tuple[Verdict, str]:
    """VIOLATION: an exact excess over the tolerance (per step; times the draws summed for sums), a sampled lower bound
    over the claim, NaN in a released distribution (the law a token was drawn from is undefined), or a reported ε below
    the ε of the worst mechanism the claim admits (``lower``, :meth:`~accounting.PrivacyClaim.epsilon_lower_at`). Never
    PASS for a data-dependent claim, nor for a reported ε below what the claim certifies (``certified``, our upper
    bound), nor when an excess within a tolerance that is not small against the claim (a coarse dtype) could hide a
    leak of its size, nor when a sampled check's upper bound is over its claim (the texts cannot support it)."""
    over = {name: v for name, v in excesses.items() if v > tolerance * (summed if "sequence" in name else 1)}
    over |= {f"sampled {c.quantity} at {c.at:.4g} (neighbour {c.neighbour}, {c.direction}) lower bound over the claim": c.lower - c.claimed
             for c in checks if c.lower > c.claimed}  # fmt: skip
    if over:
        return Verdict.VIOLATION, "; ".join(f"{name}: +{v:.6g}" for name, v in over.items())
    if nonfinite:
        return Verdict.VIOLATION, f"{nonfinite} recorded distribution(s) hold NaN: the law of those draws is undefined"
    if lower is not None:
        reports = f"reports epsilon = {claim.reported_epsilon:.6g} at delta = {claim.reported_delta:g}; its own {claim.form}"
        if claim.reported_epsilon < lower * (1.0 - REPORTED_EPSILON_RTOL):
            return Verdict.VIOLATION, (f"{reports} claim composes to {certified:.6g}, and a mechanism meeting it exactly "
                                       f"has epsilon >= {lower:.6g}")
        return Verdict.INCONCLUSIVE, (f"{reports} claim certifies <= {certified:.6g}, and a mechanism meeting it exactly "
                                      f"has epsilon >= {lower:.6g}: the report rests on more than the claim states")
    if claim.data_dependent:
        return Verdict.INCONCLUSIVE, "no excess found; a data-dependent claim is never certified (no PASS)"
    smallest = claim.step.unresolved_by(tolerance, DEFAULT_ALPHAS)
    if any(v > 0 for v in excesses.values()) and smallest is not None:
        return Verdict.INCONCLUSIVE, (f"an excess within the tolerance ({tolerance:g} nats per step, over "
                                      f"{RESOLVABLE_SHARE:.0%} of the claim's {smallest:.3g}): audit in a wider dtype")
    if loose := [c for c in checks if c.upper > c.claimed]:
        c = loose[0]
        return Verdict.INCONCLUSIVE, (f"no sampled lower bound over the claim, but {len(loose)} upper bound(s) over it "
                                      f"(e.g. {c.quantity} at {c.at:.4g}: {c.upper:.4g} > {c.claimed:.4g} from "
                                      f"{c.num_texts} text(s)): more texts, or a per-step claim, are needed to support it")
    return Verdict.PASS, f"every checked quantity within its claim (tolerance {tolerance:g} nats per step)"


def _default_alphas(claim: PrivacyClaim) -> tuple[float, ...]:
    """The orders the claim states; with the white-box defaults where it bounds every order (ρ, μ, ε0, ε)."""
    stated = set(claim.step.renyi) | set(claim.renyi or {})
    s = claim.step
    every_order = claim.form in ("rho", "mu") or any(map(math.isfinite, (s.rho, s.epsilon0, s.epsilon)))
    return tuple(sorted(stated | set(DEFAULT_ALPHAS))) if every_order or not stated else tuple(sorted(stated))


def _neighbour(references: list, j: int, adjacency: Adjacency) -> list:
    """Neighbour ``j`` of ``references``: ``None`` in slot j (replace-by-null), or the list without it (add-remove)."""
    return references[:j] + ([] if adjacency is Adjacency.ADD_REMOVE else [None]) + references[j + 1:]


def _reverse_runs(generate, references, audited, adjacency, start, after) -> list:
    r"""The reverse direction of a sequence-level claim: every audited neighbour run freely (its own draws: texts from
    P'), then the actual references replayed with those tokens forced, each from the actual run's starting RNG states;
    ``after`` restored. Per neighbour: each text's realised loss :math:`\log P'(x) - \log P(x)` (``+inf`` where P gives
    a drawn token 0: evidence, kept), the steps per text, the draws summed per text, and both runs' calls."""
    try:
        out = []
        for j in audited:
            _set_rng_states(start)
            own = _run(generate, _neighbour(references, j, adjacency), None, j)[1]
            _set_rng_states(start)
            replay = _run(generate, references, own, j)[1]
            draw_losses = [(o.log_probs.gather(1, o.tokens) - r.log_probs.gather(1, o.tokens)).sum(1, keepdim=True)
                           for o, r in zip(own, replay)]  # fmt: skip
            losses, steps, summed = _text_losses(own, draw_losses)
            out.append((losses[:, 0].numpy(), steps, summed, own + replay))
        return out
    finally:
        _set_rng_states(after)


def _run_neighbours(generate, references, calls, audited, adjacency, start, after) -> list:
    """Every audited neighbour's replay, each from the actual run's starting RNG states; ``after`` restored."""
    try:
        neighbour_calls = []
        for j in audited:
            _set_rng_states(start)
            neighbour_calls.append(_run(generate, _neighbour(references, j, adjacency), calls, j)[1])
        return neighbour_calls
    finally:
        _set_rng_states(after)


def audit_generator(
    generate: Callable[[list], Any],
    references: Sequence,
    claim,
    *,
    alphas: Sequence[float] | None = None,
    neighbours: Sequence[int] | None = None,
    tolerance: float | None = None,
    significance: float = 0.05,
) -> GeneratorAudit:
    """White-box audit of ``generate(references)``, the user's own generator loop, unmodified (docs/guide/auditing.md).

    ``claim``: an :class:`accounting.PrivacyClaim` (a :class:`~invink_audit.mechanisms.MechanismGuarantee` or a
    white-box :class:`~invink_audit.audit.whitebox.Claim` is converted, :meth:`~accounting.PrivacyClaim.of`), for a text
    of at most ``claim.steps`` draws; its adjacency says how neighbour ``j`` is made (``None`` in slot j, or the list
    without it). ``alphas``: Rényi orders checked (default: the orders the claim states, with the white-box defaults
    where it bounds every order); ``neighbours``: the indices audited (default: all); ``tolerance``: nats per step an
    exact excess must pass to be a VIOLATION (times the draws per text for sums and for the sampled checks' losses);
    default: :func:`~invink_audit.audit.whitebox.tolerance_for` the coarsest dtype the draws' distributions were given in
    (:attr:`GeneratorAudit.dtypes`), written in the result. ``significance``: the family-wise level of the sampled
    checks of a sequence-level claim (Bonferroni). Raises :class:`InterceptionError` when no draw is seen or a
    neighbour's replay makes other sampling calls.
    """
    claim, references = PrivacyClaim.of(claim), list(references)
    significance = check_delta("significance", significance)
    alphas = _default_alphas(claim) if alphas is None else tuple(alphas)
    audited = tuple(range(len(references)) if neighbours is None else (int(j) for j in neighbours))
    if not audited or any(not 0 <= j < len(references) for j in audited):
        raise ValueError(f"neighbours must index the {len(references)} references; got {neighbours!r}")
    start = _rng_states()
    output, calls = _run(generate, references, None, None)
    after = _rng_states()
    neighbour_calls = _run_neighbours(generate, references, calls, audited, claim.adjacency, start, after)
    reverse = [] if claim.form == "per-step" else _reverse_runs(generate, references, audited, claim.adjacency, start, after)
    steps, draw_losses = _step_arrays(calls, neighbour_calls, alphas)
    fwd, rev = _sequence_sums(calls, steps["renyi_forward"]), _sequence_sums(calls, steps["renyi_reverse"])
    losses, steps_per_text, summed = _text_losses(calls, draw_losses)
    if tolerance is None:
        tolerance = max(tolerance_for(getattr(torch, "float64" if d == "uniform" else d)) for d in {c.dtype for c in calls})
    columns = [(b, "forward", column, tolerance * summed) for b, column in enumerate(losses.T.numpy())]
    columns += [(b, "reverse", r[0], tolerance * r[2]) for b, r in enumerate(reverse)]
    steps_per_text, summed = max([steps_per_text] + [r[1] for r in reverse]), max([summed] + [r[2] for r in reverse])
    excesses = _excesses(claim, steps, fwd, rev, alphas, columns, steps_per_text)
    checks = _sequence_checks(claim, columns, alphas, significance)
    certified, lower = _certified_epsilon(claim)
    recorded = (calls, *neighbour_calls, *(r[3] for r in reverse))
    nonfinite = sum(int(torch.isnan(c.log_probs).any(-1).sum()) for cs in recorded for c in cs)
    verdict, reason = _verdict(claim, excesses, checks, certified, lower, nonfinite, tolerance, summed)
    return GeneratorAudit(
        claim=claim, output=output, calls=calls, neighbours=audited, neighbour_calls=tuple(neighbour_calls),
        alphas=tuple(float(a) for a in alphas), tolerance=tolerance,
        **{name: value.numpy() for name, value in steps.items()},
        sequence_renyi_forward=fwd.numpy(), sequence_renyi_reverse=rev.numpy(), text_losses=losses.numpy(),
        reverse_text_losses=tuple(r[0] for r in reverse), excesses=excesses, sequence_checks=checks,
        certified_epsilon=certified, claim_lower_epsilon=lower, nonfinite=nonfinite, verdict=verdict,
        reason=reason,
    )  # fmt: skip
