"""Amin et al. 2024 (invink_audit.mechanisms.amin) against independent computations.

* one step's distribution: numpy (recentred clipping, softmaxes, L1 distance) and scipy quadrature of
  the SVT threshold's posterior (continuous Laplace prior, product of Laplace CDFs);
* the whole output distribution: the real mechanism (sampled Laplace threshold and query noise) run
  many times against the exact enumeration of its exact state (a G-test);
* the accountant: sensitivities by brute force and attained, the SVT privacy loss by quadrature
  against 2Δq/σ, the zCDP formula against the paper's re-implementation, the planner never overspends.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import integrate, stats

from accounting import epsilon_to_zcdp, zcdp_to_epsilon
from invink_audit.audit import synthetic
from invink_audit.mechanisms import AminAccounting, AminConfig, AminInfeasibleError, AminMechanism, AminSensitivity, plan_amin
from invink_audit.mechanisms.amin import amin_clipped_contributions, amin_svt_distance

# quadrature of the threshold posterior on a 2048-point quantile grid: the integrand behaves like
# sqrt(1 - u) in the prior's upper tail (the Laplace survival function of a Laplace quantile), so the
# midpoint rule's error is O(n^-1.5): ~1e-4 relative at 2048 points, shrinking with the grid (tested)
GRID_RTOL = 2e-4
FLOAT_ATOL = 1e-12


def _softmax(x):
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _np_terms(private, public, cfg: AminConfig):
    """Numpy oracle of one step's pieces: query q, EM log-probs, public log-probs (paper Eq. (8) (eq:amin-avg))."""
    b = private.shape[0]
    clip = np.clip(private - private.max(axis=-1, keepdims=True) + cfg.clip_norm, -cfg.clip_norm, cfg.clip_norm)
    em = _log_softmax(clip.sum(axis=0) / (b * cfg.temperature))
    q = np.abs(_softmax(private).mean(axis=0) - _softmax(public)).sum()
    pub = _log_softmax(public / cfg.public_temperature)
    return q, em, pub


def _posterior_private_probability(history_q, q_next, cfg: AminConfig):
    """P(private at the next step | the queries in ``history_q`` stayed below) by quadrature over the
    continuous Laplace(θ, σ) threshold, query noise Laplace(0, 2σ)."""
    prior = stats.laplace(loc=cfg.svt_threshold, scale=cfg.svt_noise)
    noise = stats.laplace(scale=2 * cfg.svt_noise)

    def weight(t):
        return prior.pdf(t) * np.prod([noise.cdf(t - q) for q in history_q])

    points = sorted({cfg.svt_threshold, q_next, *history_q})
    lo, hi = cfg.svt_threshold - 60 * cfg.svt_noise, cfg.svt_threshold + 60 * cfg.svt_noise
    kw = dict(points=points, limit=400, epsabs=1e-14, epsrel=1e-11)
    num = integrate.quad(lambda t: weight(t) * noise.sf(t - q_next), lo, hi, **kw)[0]
    den = integrate.quad(weight, lo, hi, **kw)[0]
    return num / den


def _config(**kw):
    base = dict(clip_norm=1.5, batch_size=3, temperature=0.8, public_temperature=1.1, svt_threshold=0.6, svt_noise=0.25,
                max_private_tokens=5, posterior_grid=2048)
    base.update(kw)
    return AminConfig(**base)


def test_exact_step_matches_numpy_and_quadrature_over_a_history_of_public_steps():
    cfg = _config()
    mech = AminMechanism(cfg)
    gen = torch.Generator().manual_seed(3)
    b, v = cfg.batch_size, 6
    state = mech.initial_state(torch.zeros(1, 0), exact=True)
    history = {d: [] for d in range(1 + b)}  # each dataset's own past queries (all stayed below)
    for step in range(4):
        private = 2.0 * torch.randn(1, b, v, dtype=torch.float64, generator=gen)
        public = 2.0 * torch.randn(1, v, dtype=torch.float64, generator=gen)
        out = mech.step(private, public, state, torch.zeros(1, 0), exact=True, neighbours=True)
        pv, pb = private[0].numpy(), public[0].numpy()
        for d in range(1 + b):
            rows = pv.copy()
            if d > 0:
                rows[d - 1] = pb  # R'_j: reference j replaced by the empty string, whose logits are the public row
            q, em, pub = _np_terms(rows, pb, cfg)
            a = _posterior_private_probability(history[d], q, cfg)
            lp = (out.log_probs[0] if d == 0 else out.neighbours[0, d - 1]).numpy()
            assert np.exp(lp[v:]).sum() == pytest.approx(a, rel=GRID_RTOL)
            assert np.allclose(lp[v:] - np.log(np.exp(lp[v:]).sum()), em, atol=1e-10)  # EM given private
            assert np.allclose(lp[:v] - np.log(np.exp(lp[:v]).sum()), pub, atol=1e-10)  # public token given public
            if d == 0:
                assert np.allclose(out.check_actual[0].numpy(), em, atol=1e-10)
            else:
                assert np.allclose(out.check_neighbours[0, d - 1].numpy(), em, atol=1e-10)
            history[d].append(q)
        # release a public token (mode 0): every dataset's threshold is conditioned on its query staying below
        state, stop = mech.advance(out, state, torch.tensor([2]), torch.zeros(1, 0), exact=True)
        assert not bool(stop)
    # a private token resets the threshold: the next step is the prior's probability again
    out = mech.step(private, public, state, torch.zeros(1, 0), exact=True, neighbours=True)
    state, _ = mech.advance(out, state, torch.tensor([v + 1]), torch.zeros(1, 0), exact=True)
    out = mech.step(private, public, state, torch.zeros(1, 0), exact=True, neighbours=True)
    q, _, _ = _np_terms(private[0].numpy(), public[0].numpy(), cfg)
    assert np.exp(out.log_probs[0, v:].numpy()).sum() == pytest.approx(_posterior_private_probability([], q, cfg), rel=GRID_RTOL)
    assert float(state[0, 0]) == 1.0  # one private token so far


def test_posterior_quadrature_error_shrinks_with_the_grid():
    private = torch.tensor([[[2.0, -1.0, 0.5], [0.0, 1.0, -2.0]]], dtype=torch.float64)
    public = torch.tensor([[0.3, 0.1, -0.4]], dtype=torch.float64)
    errors = []
    for n in (512, 2048, 8192):
        cfg = _config(batch_size=2, posterior_grid=n)
        mech = AminMechanism(cfg)
        out = mech.step(private, public, mech.initial_state(torch.zeros(1, 0), exact=True), torch.zeros(1, 0), exact=True, neighbours=True)
        q, _, _ = _np_terms(private[0].numpy(), public[0].numpy(), cfg)
        exact = _posterior_private_probability([], q, cfg)
        errors.append(abs(float(torch.exp(out.log_probs[0, 3:]).sum()) - exact) / exact)
    assert errors[0] > errors[1] > errors[2] and errors[2] < 3e-5


def test_sampled_step_is_literal_svt():
    cfg = _config()
    mech = AminMechanism(cfg)
    private = torch.randn(4, 3, 5, dtype=torch.float64)
    public = torch.randn(4, 5, dtype=torch.float64)
    state = mech.initial_state(torch.tensor([[0.5], [0.5], [0.001], [0.999]], dtype=torch.float64), exact=False)
    assert state[0, 1] == pytest.approx(cfg.svt_threshold)  # the median of Laplace(θ, σ)
    assert state[2, 1] == pytest.approx(stats.laplace.ppf(0.001, cfg.svt_threshold, cfg.svt_noise))
    aux = torch.tensor([[0.5, 0.5], [0.999999, 0.2], [0.5, 0.5], [1e-9, 0.5]], dtype=torch.float64)
    out = mech.step(private, public, state, aux, exact=False, neighbours=False)
    q = amin_svt_distance(private, public)
    noise = torch.tensor(stats.laplace.ppf(aux[:, 0].numpy(), scale=2 * cfg.svt_noise))
    private_step = (q + noise) >= state[:, 1]
    for g in range(4):
        block = out.log_probs[g, 5:] if private_step[g] else out.log_probs[g, :5]
        other = out.log_probs[g, :5] if private_step[g] else out.log_probs[g, 5:]
        assert torch.isinf(other).all() and torch.exp(block).sum() == pytest.approx(1.0)
    new, _ = mech.advance(out, state, torch.where(private_step, 6, 1), aux, exact=False)
    fresh = torch.tensor(stats.laplace.ppf(aux[:, 1].numpy(), cfg.svt_threshold, cfg.svt_noise))
    assert torch.allclose(new[:, 1], torch.where(private_step, fresh, state[:, 1]))
    assert torch.equal(new[:, 0], private_step.double())


def test_the_real_mechanism_has_the_exact_states_output_distribution():
    """Sampled Laplace threshold and query noise, run 40,000 times, against the exact enumeration (G-test)."""
    cfg = AminConfig(clip_norm=1.0, batch_size=2, svt_threshold=0.5, svt_noise=0.4, max_private_tokens=2, posterior_grid=2048)
    mech = AminMechanism(cfg)
    source = synthetic.RandomSource(vocab_size=3, batch_size=2, scale=1.5, private_scale=1.5, period=2, eos_shift=1.0, seed=5)
    horizon = 3
    exact = synthetic.enumerate_outputs(source, synthetic.AuditedMechanism("a", "", mech, horizon, "PASS"))
    probs = np.exp(exact.log_prob_actual)
    assert probs.sum() == pytest.approx(1.0, abs=1e-9)
    for j in range(2):
        assert np.exp(exact.log_prob_neighbours[:, j]).sum() == pytest.approx(1.0, abs=1e-9)
    # the same outputs, keyed by their outcome sequence, from the sampled mechanism
    gen = torch.Generator().manual_seed(12)
    n = 40_000
    state = mech.initial_state(torch.rand(n, 1, dtype=torch.float64, generator=gen), exact=False)
    prefixes = torch.zeros(n, horizon, dtype=torch.int64)
    outcomes = torch.full((n, horizon), -1, dtype=torch.int64)
    alive = torch.ones(n, dtype=torch.bool)
    v = source.vocab_size
    for step in range(horizon):
        ids = alive.nonzero().reshape(-1)
        private, public = source.logits(prefixes[ids, :step], step)
        aux = torch.rand(ids.numel(), 2, dtype=torch.float64, generator=gen).clamp(1e-15, 1 - 1e-15)
        out = mech.step(private, public, state[ids], aux, exact=False, neighbours=False)
        drawn = torch.multinomial(torch.exp(out.log_probs), 1, generator=gen).reshape(-1)
        state[ids], stop = mech.advance(out, state[ids], drawn, aux, exact=False)
        outcomes[ids, step] = drawn
        prefixes[ids, step] = drawn % v
        alive[ids] = ~(((drawn % v) == source.eos_token) | stop)
    # enumerate again keeping the outcome sequences, to match the samples
    keys = _enumerated_keys(source, mech, horizon)
    index = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys))
    for row in outcomes.tolist():
        counts[index[tuple(o for o in row if o >= 0)]] += 1
    expected = probs * n
    keep = expected >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expect = np.append(expected[keep], expected[~keep].sum())
    g = 2 * np.sum(np.where(observed > 0, observed * np.log(observed / expect), 0.0))
    assert stats.chi2.sf(g, observed.size - 1) > 1e-3


def _rows_of(step, rows):
    """The step restricted to some of its rows (what the mechanism's advance reads)."""
    return types.SimpleNamespace(log_probs=step.log_probs[rows], carry={k: v[rows] for k, v in (step.carry or {}).items()})


def _enumerated_keys(source, mech, horizon):
    """The outcome sequences of :func:`synthetic.enumerate_outputs`, in its order."""
    v = source.vocab_size
    prefixes = torch.zeros(1, 0, dtype=torch.int64)
    seqs = [()]
    state = mech.initial_state(torch.zeros(1, 0), exact=True)
    done = []
    for step in range(horizon):
        if not seqs:
            break
        private, public = source.logits(prefixes, step)
        out = mech.step(private, public, state, torch.zeros(len(seqs), 0), exact=True, neighbours=True)
        possible = torch.isfinite(out.log_probs) | torch.isfinite(out.neighbours).any(1)
        rows, outs = possible.nonzero(as_tuple=True)
        new_state, stop = mech.advance(_rows_of(out, rows), state[rows], outs, torch.zeros(rows.numel(), 0), exact=True)
        tokens = outs % v
        ended = (tokens == source.eos_token) | stop | (step + 1 >= horizon)
        new_seqs = [seqs[r] + (o,) for r, o in zip(rows.tolist(), outs.tolist())]
        done += [s for s, e in zip(new_seqs, ended.tolist()) if e]
        keep = ~ended
        seqs = [s for s, e in zip(new_seqs, ended.tolist()) if not e]
        prefixes = torch.cat([prefixes[rows[keep]], tokens[keep].unsqueeze(-1)], dim=1)
        state = new_state[keep]
    return done


# ------------------------------------------------------------------------------------------------
# sensitivities and the accountant


def test_sensitivities_by_brute_force_and_attained():
    b, c = 4, 0.7
    gen = torch.Generator().manual_seed(0)
    worst_q = worst_agg = 0.0
    for _ in range(200):
        private = 6 * torch.randn(1, b, 7, dtype=torch.float64, generator=gen)
        public = 6 * torch.randn(1, 7, dtype=torch.float64, generator=gen)
        q = amin_svt_distance(private, public)
        agg = amin_clipped_contributions(private, c).sum(1) / b
        for j in range(b):
            p2 = private.clone()
            p2[:, j] = public
            worst_q = max(worst_q, float((q - amin_svt_distance(p2, public)).abs()))
            worst_agg = max(worst_agg, float((agg - amin_clipped_contributions(p2, c).sum(1) / b).abs().max()))
    acc = AminAccounting(c, b, 1.0, 0.3, 10, AminSensitivity.REPLACE_BY_NULL)
    assert worst_q <= acc.query_sensitivity + FLOAT_ATOL and worst_agg <= acc.aggregate_sensitivity + FLOAT_ATOL
    # attained: disjoint supports for the query; opposite clipping ends for the aggregate (paper Prop. amin-sens)
    private = torch.full((1, b, 3), -300.0, dtype=torch.float64)
    private[..., 0] = 300.0
    public = torch.full((1, 3), -300.0, dtype=torch.float64)
    public[..., 1] = 300.0
    p2 = private.clone()
    p2[:, 0] = public
    assert float((amin_svt_distance(private, public) - amin_svt_distance(p2, public)).abs()) == pytest.approx(2.0 / b)
    gap = (amin_clipped_contributions(private, c).sum(1) - amin_clipped_contributions(p2, c).sum(1)).abs().max() / b
    assert float(gap) == pytest.approx(2 * c / b)
    paper = AminAccounting(c, b, 1.0, 0.3, 10, AminSensitivity.PAPER)
    assert paper.aggregate_sensitivity == pytest.approx(c / b) and paper.query_sensitivity == pytest.approx(1.0 / b)
    assert acc.rho_sequence == pytest.approx(4 * paper.rho_sequence)


@pytest.mark.parametrize("pattern", [(0, [0.9]), (2, [0.2, 0.5, 1.4]), (4, [0.1, 0.3, 0.2, 0.6, 1.2])])
def test_one_above_threshold_run_is_two_delta_q_over_sigma_dp(pattern):
    """Pr[m queries below then one above] under R vs R' (|q - q'| <= Δq) by quadrature: the log-ratio is at
    most ε_svt = 2Δq/σ (Dwork & Roth 2014, Thm. 3.23). (The bound is loose on these patterns; it is a
    worst case over all query sequences.)"""
    m, qs = pattern
    theta, sigma, dq = 0.6, 0.3, 0.25
    prior = stats.laplace(loc=theta, scale=sigma)
    noise = stats.laplace(scale=2 * sigma)

    def prob(q):
        f = lambda t: prior.pdf(t) * np.prod([noise.cdf(t - x) for x in q[:m]]) * noise.sf(t - q[m])  # noqa: E731
        return integrate.quad(f, theta - 60 * sigma, theta + 60 * sigma, points=sorted({theta, *q}), limit=400,
                              epsabs=1e-15, epsrel=1e-12)[0]

    eps_svt = AminAccounting(1.0, 1, 1.0, sigma, 1, AminSensitivity.PAPER).epsilon_svt * dq  # 2Δq/σ with Δq = dq
    worst = 0.0
    for shift_below in (-dq, dq):
        for shift_above in (-dq, dq):
            q2 = [x + shift_below for x in qs[:m]] + [qs[m] + shift_above]
            worst = max(worst, abs(math.log(prob(qs) / prob(q2))))
    assert 0.05 * eps_svt < worst <= eps_svt + 1e-9


def test_paper_mode_is_the_accounting_of_the_papers_experiments():
    """The re-implementation's compute_rho: T (0.5 (C/(sτ))^2 + 2/(sσ)^2) with s = B: our PAPER mode."""
    for c, b, tau, sigma, r in [(6.5, 15, 1.0, 0.3, 100), (2.0, 63, 1.2, 0.5, 8)]:
        reimpl = r * (0.5 * (c / (b * tau)) ** 2 + 2 / (b * sigma) ** 2)
        assert AminAccounting(c, b, tau, sigma, r, AminSensitivity.PAPER).rho_sequence == pytest.approx(reimpl, rel=1e-12)
        assert AminAccounting(c, b, tau, sigma, r, "replace-by-null").rho_sequence == pytest.approx(4 * reimpl, rel=1e-12)


@given(
    epsilon=st.floats(0.5, 20.0),
    r=st.integers(1, 200),
    b=st.integers(1, 256),
    tau=st.floats(0.5, 2.0),
    sigma=st.floats(0.05, 3.0),
    mode=st.sampled_from(list(AminSensitivity)),
)
def test_planner_never_overspends(epsilon, r, b, tau, sigma, mode):
    delta = 1e-6
    rho = epsilon_to_zcdp(epsilon, delta, "cks")
    probe = AminAccounting(1.0, b, tau, sigma, r, mode)
    if probe.rho_svt >= rho / r:
        with pytest.raises(AminInfeasibleError, match="infeasible"):
            plan_amin(epsilon=epsilon, delta=delta, max_private_tokens=r, batch_size=b, temperature=tau, svt_noise=sigma, sensitivity=mode)
        return
    acc = plan_amin(epsilon=epsilon, delta=delta, max_private_tokens=r, batch_size=b, temperature=tau, svt_noise=sigma, sensitivity=mode)
    assert acc.rho_sequence <= rho
    assert acc.rho_sequence >= rho * (1 - 1e-9)  # and it spends the budget
    assert zcdp_to_epsilon(acc.rho_sequence, delta, "cks") <= epsilon * (1 + 1e-9)


def test_config_validation_and_guarantee():
    with pytest.raises(ValueError, match="clip_norm"):
        AminConfig(clip_norm=0.0, batch_size=3)
    with pytest.raises(ValueError, match="max_private_tokens"):
        AminConfig(clip_norm=1.0, batch_size=3, max_private_tokens=0)
    with pytest.raises(ValueError):
        AminConfig(clip_norm=1.0, batch_size=3, sensitivity="zero-out")
    with pytest.raises(ValueError, match="posterior_grid"):
        AminConfig(clip_norm=1.0, batch_size=3, posterior_grid=3)
    cfg = AminConfig.planned(epsilon=10.0, delta=1e-6, batch_size=31, max_private_tokens=8, sensitivity="paper")
    g = AminMechanism(cfg).guarantee(64, 1e-6)
    assert g.a_priori and g.composition == "zcdp" and g.epsilon <= 10.0 * (1 + 1e-9)
    assert g.step_epsilon0 == pytest.approx(2 * (cfg.clip_norm / 31) / cfg.temperature)
    assert "understated" in g.description
