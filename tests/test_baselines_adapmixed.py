"""AdaPMixED (invink_audit.mechanisms.adapmixed) against independent computations.

* one step: a numpy re-implementation (softmaxes, mixing weights by scipy's brentq on the symmetric
  Rényi divergence, the mixture, the replace-by-null data-dependent cost of paper App. E.5);
* exact (audit) mode: every neighbour's distribution and cost equal the mechanism recomputed on the
  neighbour dataset (row j replaced by the public row);
* the accountant: the screening's ℓ2 sensitivity by brute force and attained, the RDP → (ε, δ)
  conversion and its inverse, the stop rule never lets the spend exceed the budget.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize

from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, GuaranteeKind
from invink_audit.mechanisms.adapmixed import adapmixed_member_weights, rdp_to_epsilon, renyi_budget, symmetric_renyi

ATOL = 1e-9


def _np_renyi(p, q, a):
    from scipy.special import logsumexp

    return float(logsumexp(a * np.log(p) + (1 - a) * np.log(q))) / (a - 1)


def _np_sym(p, q, a):
    return max(_np_renyi(p, q, a), _np_renyi(q, p, a))


def _softmax(x):
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _np_step(private, public, cfg: AdaPMixEDConfig):
    """Numpy oracle of the mixing step (Flemings et al. Alg. 1 lines 9-15, replace-by-null line 15)."""
    a, radius = cfg.renyi_order, cfg.renyi_order * cfg.beta
    members = _softmax(private / cfg.temperature)
    p0 = _softmax(public / cfg.temperature)
    lams = []
    for p in members:
        f = lambda lam, p=p: _np_sym(p0, lam * p + (1 - lam) * p0, a) - radius  # noqa: E731
        lams.append(1.0 if f(1.0) <= 0 else optimize.brentq(f, 0.0, 1.0, xtol=1e-15, rtol=4 * np.finfo(float).eps))
    mixed = np.array([lam * p + (1 - lam) * p0 for lam, p in zip(lams, members)])
    p = mixed.mean(axis=0)
    n = len(members)
    cost = max(_np_sym((mixed.sum(0) - mixed[i] + p0) / n, p, a) for i in range(n))
    return np.array(lams), p, cost


def _cfg(**kw):
    base = dict(batch_size=3, epsilon=10.0, screen_threshold=1e9, screen_samples=16)  # never screened unless asked
    base.update(kw)
    return AdaPMixEDConfig(**base)


def test_symmetric_renyi_matches_its_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        p, q = rng.dirichlet(np.ones(6)), rng.dirichlet(np.ones(6))
        for a in (1.5, 4.0, 15.0):
            got = float(symmetric_renyi(torch.tensor(p), torch.tensor(q), a))
            assert got == pytest.approx(_np_sym(p, q, a), rel=1e-10)


def test_mixing_step_matches_a_numpy_reimplementation():
    gen = torch.Generator().manual_seed(1)
    for scale in (0.5, 2.0, 6.0):
        cfg = _cfg()
        mech = AdaPMixEDMechanism(cfg)
        private = scale * torch.randn(1, 3, 8, dtype=torch.float64, generator=gen)
        public = scale * torch.randn(1, 8, dtype=torch.float64, generator=gen)
        lams, p, cost = _np_step(private[0].numpy(), public[0].numpy(), cfg)
        members = torch.softmax(private, -1)
        p0 = torch.softmax(public, -1)
        got = adapmixed_member_weights(members, p0, cfg.renyi_order, cfg.radius)[0].numpy()
        assert np.allclose(got, lams, atol=1e-9)
        aux = torch.full((1, mech.aux_size(exact=False, at_start=False)), 0.5, dtype=torch.float64)
        out = mech.step(private, public, torch.zeros(1, 1), aux, exact=False, neighbours=False)
        v = 8
        assert np.allclose(np.exp(out.log_probs[0, v : 2 * v].numpy()), p, atol=ATOL)  # mixed, not screened
        assert torch.isinf(out.log_probs[0, :v]).all() and torch.isinf(out.log_probs[0, 2 * v])
        assert float(out.carry["cost"][0]) == pytest.approx(cfg.screening_cost + cost, rel=1e-9)


def test_member_weight_is_the_largest_inside_the_ball():
    gen = torch.Generator().manual_seed(2)
    members = torch.softmax(4 * torch.randn(5, 4, 10, dtype=torch.float64, generator=gen), -1)
    public = torch.softmax(4 * torch.randn(5, 10, dtype=torch.float64, generator=gen), -1)
    radius, a = 0.5, 15.0
    lam = adapmixed_member_weights(members, public, a, radius)
    mix = lambda l: l.unsqueeze(-1) * members + (1 - l.unsqueeze(-1)) * public.unsqueeze(-2)  # noqa: E731
    inside = symmetric_renyi(public.unsqueeze(-2).expand_as(members), mix(lam), a)
    assert (inside <= radius + 1e-12).all()  # on the boundary, up to the rounding of two formulas
    below_one = lam < 1
    outside = symmetric_renyi(public.unsqueeze(-2).expand_as(members), mix((lam + 1e-9).clamp(max=1.0)), a)
    assert (outside[below_one] > radius).all()
    # steep case (a token of probability ~1e-44 where p_0 has mass): the synthetic hardest case, against brentq
    from invink_audit.audit.synthetic import HardestCaseSource

    private, public_logits = HardestCaseSource(vocab_size=6, batch_size=4).logits(torch.zeros(1, 0, dtype=torch.long), 0)
    lams, _, _ = _np_step(private[0].numpy(), public_logits[0].numpy(), _cfg(batch_size=4))
    got = adapmixed_member_weights(torch.softmax(private, -1), torch.softmax(public_logits, -1), 15.0, 4.5)[0].numpy()
    assert 0.9 < lams[0] < 1 and np.allclose(got, lams, atol=1e-12)
    # a member already inside the ball keeps λ = 1 (the re-implementation would drop it to λ = 0)
    assert float(adapmixed_member_weights(public.unsqueeze(-2), public, a, radius).min()) == 1.0


def test_screening_decision_and_cost():
    cfg = _cfg(screen_threshold=1e-12, screen_top_k=4)  # any noise screens
    mech = AdaPMixEDMechanism(cfg)
    private = torch.randn(2, 3, 6, dtype=torch.float64)
    public = torch.randn(2, 6, dtype=torch.float64)
    aux = torch.rand(2, mech.aux_size(exact=False, at_start=False), dtype=torch.float64)
    out = mech.step(private, public, torch.zeros(2, 1), aux, exact=False, neighbours=False)
    assert torch.allclose(out.log_probs[:, :6], torch.log_softmax(public, -1), atol=ATOL)  # the public distribution
    assert torch.allclose(out.carry["cost"], torch.full((2,), cfg.screening_cost, dtype=torch.float64))
    # ℓ2 sensitivity of λ_s·mean(p_i) under replace-by-null: √2 λ_s/N, attained by disjoint one-hots
    n, lam, sigma, a = 3, 1e-4, 0.01, 15.0
    worst = 0.0
    for _ in range(200):
        ps = np.random.default_rng().dirichlet(np.ones(5) * 0.1, size=n)
        p0 = np.random.default_rng().dirichlet(np.ones(5) * 0.1)
        for j in range(n):
            worst = max(worst, np.linalg.norm(lam * (ps[j] - p0) / n))
    bound = math.sqrt(2) * lam / n
    assert worst <= bound + 1e-15
    assert np.linalg.norm(lam * (np.eye(5)[0] - np.eye(5)[1]) / n) == pytest.approx(bound)
    assert AdaPMixEDConfig(batch_size=n, epsilon=1.0, renyi_order=a, screen_mixing=lam, screen_noise=sigma).screening_cost == pytest.approx(
        a * bound**2 / (2 * sigma**2)
    )


def test_rdp_conversion_and_budget():
    for eps, a, d in [(1.0, 15.0, 1e-6), (10.0, 8.0, 1e-5), (3.0, 2.0, 1e-3)]:
        # Balle et al. 2020 / the re-implementation's rdp_eps
        rdp = 1.7
        assert rdp_to_epsilon(rdp, a, d) == pytest.approx(rdp + math.log1p(-1 / a) - math.log(d * a) / (a - 1))
        assert rdp_to_epsilon(renyi_budget(eps, a, d), a, d) == pytest.approx(eps)
    g = AdaPMixEDMechanism(_cfg(epsilon=4.0)).guarantee(32, 1e-6)
    assert g.kind is GuaranteeKind.DATA_DEPENDENT and not g.a_priori and g.rho_sequence is None
    assert g.renyi_budget == pytest.approx(renyi_budget(4.0, 15.0, 1e-6)) and "DATA-DEPENDENT" in g.label()
    with pytest.raises(ValueError, match="delta"):
        AdaPMixEDMechanism(_cfg()).guarantee(32, 1e-5)


def test_stop_rule_never_lets_the_spend_exceed_the_budget():
    cfg = _cfg(epsilon=2.5)
    mech = AdaPMixEDMechanism(cfg)
    gen = torch.Generator().manual_seed(7)
    state = torch.zeros(6, 1, dtype=torch.float64)
    halted = torch.zeros(6, dtype=torch.bool)
    for _ in range(20):
        private = 3 * torch.randn(6, 3, 7, dtype=torch.float64, generator=gen)
        public = 3 * torch.randn(6, 7, dtype=torch.float64, generator=gen)
        aux = torch.rand(6, mech.aux_size(exact=False, at_start=False), dtype=torch.float64, generator=gen)
        out = mech.step(private, public, state, aux, exact=False, neighbours=False)
        stop = out.log_probs[:, -1] == 0.0
        assert torch.equal(stop, state[:, 0] + out.carry["cost"] > cfg.budget)
        outcomes = torch.where(stop, 14, torch.argmax(out.log_probs, -1))
        state, _ = mech.advance(out, state, outcomes, aux, exact=False)
        halted |= stop
        assert (state[:, 0] <= cfg.budget + 1e-12).all()
    assert halted.any()


def test_exact_mode_neighbours_are_the_mechanism_on_the_neighbour_dataset():
    cfg = _cfg(epsilon=6.0, screen_threshold=4.5, screen_top_k=5, screen_samples=64)
    mech = AdaPMixEDMechanism(cfg)
    gen = torch.Generator().manual_seed(3)
    private = 2 * torch.randn(1, 3, 7, dtype=torch.float64, generator=gen)
    private[0, 1] = 0.0
    public = 2 * torch.randn(1, 7, dtype=torch.float64, generator=gen)
    private[0, 1] = public[0]  # a null reference
    spend = torch.tensor([[0.5, 0.7, 0.5, 0.2]], dtype=torch.float64)  # R, R'_1..R'_3 spent different amounts
    aux = torch.rand(1, mech.aux_size(exact=True, at_start=False), dtype=torch.float64, generator=gen)
    out = mech.step(private, public, spend, aux, exact=True, neighbours=True)
    v = 7
    for d in range(4):
        rows = private.clone()
        if d:
            rows[0, d - 1] = public[0]
        _, p, cost = _np_step(rows[0].numpy(), public[0].numpy(), cfg)
        lp = out.log_probs[0] if d == 0 else out.neighbours[0, d - 1]
        mixed = lp[v : 2 * v]
        halt = spend[0, d] + cfg.screening_cost + cost > cfg.budget
        if halt:
            assert torch.isinf(mixed).all()
        else:
            assert np.allclose(torch.softmax(mixed, -1).numpy(), p, atol=ATOL)
        assert float(out.carry["cost"][0, d]) == pytest.approx(cfg.screening_cost + cost, rel=1e-9)
        assert float(torch.logsumexp(lp, -1)) == pytest.approx(0.0, abs=1e-12)
    # R'_1 (the null slot) is R itself: same distribution whenever the spends agree
    same = mech.step(private, public, torch.full((1, 4), 0.3, dtype=torch.float64), aux, exact=True, neighbours=True)
    assert torch.allclose(same.log_probs[0], same.neighbours[0, 1], atol=ATOL)


def test_config_validation():
    with pytest.raises(ValueError, match="batch_size"):
        AdaPMixEDConfig(batch_size=0, epsilon=1.0)
    with pytest.raises(ValueError, match="renyi_order"):
        AdaPMixEDConfig(batch_size=2, epsilon=1.0, renyi_order=1.0)
    with pytest.raises(ValueError, match="screen_mixing"):
        AdaPMixEDConfig(batch_size=2, epsilon=1.0, screen_mixing=2.0)
    with pytest.raises(ValueError, match="delta"):
        AdaPMixEDConfig(batch_size=2, epsilon=1.0, delta=0.0)
