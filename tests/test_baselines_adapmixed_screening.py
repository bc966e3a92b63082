"""AdaPMixED's noisy screening, checked independently (numpy) and sampled against exact state (G-test).

* ``_screen_statistic`` against a direct numpy computation of the statistic (paper App. B.3.2; Flemings
  et al. Alg. 1): the public top-k of p_0, the screened mixture λ_s·mean + (1 − λ_s)·p_0 on it plus
  N(0, σ²) noise, both renormalised (noisy entries in absolute value, floored), and the symmetric Rényi
  divergence max(D_α(P‖Q), D_α(Q‖P)); with a threshold at the statistic's median, so that the sampled
  mechanism screens some texts and mixes others, its screening decision is the numpy statistic's;
* the sampled mechanism's first outcome (mode and token) over many texts against the exact (audit)
  state's distribution, whose screening probability is a shared-draw estimate (``screen_samples``,
  here large), by a G-test.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import special, stats

from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism

B, V, K = 3, 12, 8


def _logits(seed: int = 0):
    rng = np.random.default_rng(seed)
    public = rng.normal(0.0, 1.5, size=(1, V))
    private = public[:, None, :] + rng.normal(0.0, 1.0, size=(1, B, V))
    return torch.tensor(private), torch.tensor(public)


def _numpy_statistic(members_mean, p0, normals, cfg: AdaPMixEDConfig) -> np.ndarray:
    """The screening statistic from its definition (no code shared with the mechanism); (n,) for n normal rows."""
    order = cfg.renyi_order
    top = np.argsort(-p0, kind="stable")[: cfg.screen_top_k]
    mix = cfg.screen_mixing * members_mean + (1.0 - cfg.screen_mixing) * p0
    pub = p0[top] / p0[top].sum()
    noisy = mix[top][None, :] + cfg.screen_noise * normals
    prv = np.maximum(np.abs(noisy / noisy.sum(axis=1, keepdims=True)), 1e-300)
    prv = prv / prv.sum(axis=1, keepdims=True)

    def renyi(p, q):  # D_α(P‖Q) = log Σ p^α q^(1−α) / (α − 1), in logs
        return np.maximum(special.logsumexp(order * np.log(p) + (1.0 - order) * np.log(q), axis=-1) / (order - 1.0), 0.0)

    return np.maximum(renyi(pub[None, :], prv), renyi(prv, pub[None, :]))


def _softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def _median_threshold(private, public, cfg_kwargs, n=4000, seed=1) -> float:
    cfg = AdaPMixEDConfig(**cfg_kwargs)
    members = _softmax(private[0].numpy() / cfg.temperature)
    p0 = _softmax(public[0].numpy() / cfg.temperature)
    normals = special.ndtri(np.random.default_rng(seed).uniform(1e-12, 1 - 1e-12, size=(n, cfg.screen_top_k)))
    return float(np.median(_numpy_statistic(members.mean(axis=0), p0, normals, cfg)))


BASE = dict(batch_size=B, epsilon=1000.0, screen_top_k=K, screen_noise=0.01)


def test_screen_statistic_matches_numpy_and_decides_the_mode():
    private, public = _logits()
    threshold = _median_threshold(private, public, BASE)
    cfg = AdaPMixEDConfig(**BASE, screen_threshold=threshold)
    mech = AdaPMixEDMechanism(cfg)
    g = 256
    rng = np.random.default_rng(7)
    uniforms = rng.uniform(1e-12, 1 - 1e-12, size=(g, K))
    members = torch.softmax(private / cfg.temperature, dim=-1)
    p0 = torch.softmax(public / cfg.temperature, dim=-1)
    index = torch.topk(p0, K, dim=-1).indices
    normals = torch.special.ndtri(torch.tensor(uniforms))
    got = mech._screen_statistic(members.mean(dim=-2).expand(g, V), p0.expand(g, V), index.expand(g, K), normals)
    want = _numpy_statistic(members[0].mean(dim=0).numpy(), p0[0].numpy(), special.ndtri(uniforms), cfg)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9, atol=1e-12)
    # the sampled step screens exactly where the numpy statistic exceeds the threshold
    state = torch.zeros((g, 1), dtype=torch.float64)
    step = mech.step(private.expand(g, B, V), public.expand(g, V), state, torch.tensor(uniforms), exact=False, neighbours=False)
    screened = torch.isfinite(step.log_probs[:, :V]).any(dim=-1).numpy()
    mixed = torch.isfinite(step.log_probs[:, V : 2 * V]).any(dim=-1).numpy()
    assert (screened ^ mixed).all()  # one mode per text (no halt: the budget is far away)
    np.testing.assert_array_equal(screened, want > threshold)
    assert 0.25 < screened.mean() < 0.75  # the threshold does not screen every step (nor none)


def test_sampled_step_matches_exact_state_g_test():
    private, public = _logits()
    threshold = _median_threshold(private, public, BASE)
    n = 20000
    sampled = AdaPMixEDMechanism(AdaPMixEDConfig(**BASE, screen_threshold=threshold))
    exact = AdaPMixEDMechanism(AdaPMixEDConfig(**BASE, screen_threshold=threshold, screen_samples=200_000))
    rng = np.random.default_rng(11)
    # exact state: the screening probability from 200,000 shared draws
    aux = torch.tensor(rng.uniform(1e-12, 1 - 1e-12, size=(1, exact.aux_size(exact=True, at_start=False))))
    state = torch.zeros((1, 1 + B), dtype=torch.float64)
    expected = torch.exp(exact.step(private, public, state, aux, exact=True, neighbours=False).log_probs[0]).numpy()
    assert expected[-1] == 0.0  # no stop outcome within this budget
    # sampled (as deployed): n texts, each with its own normals, then its token
    aux_s = torch.tensor(rng.uniform(1e-12, 1 - 1e-12, size=(n, K)))
    step = sampled.step(private.expand(n, B, V), public.expand(n, V), torch.zeros((n, 1), dtype=torch.float64), aux_s,
                        exact=False, neighbours=False)
    gen = torch.Generator().manual_seed(3)
    outcomes = torch.multinomial(torch.exp(step.log_probs), 1, generator=gen)[:, 0].numpy()
    counts = np.bincount(outcomes, minlength=2 * V + 1)
    support = expected > 0
    assert counts[~support].sum() == 0
    assert 0.3 < counts[:V].sum() / n < 0.7  # both modes well represented
    g, p = stats.power_divergence(counts[support], n * expected[support] / expected[support].sum(), lambda_="log-likelihood")
    assert p > 1e-3, (g, p)
