"""The baselines' teacher-forced distributions (``profile --mechanism``) against a brute-force Monte Carlo of the
same mechanism: texts sampled freely from the deployed (sampled-state) mechanism on a tiny vocabulary, whose
empirical prefix frequencies must match the exact forward recursion's prefix probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism

V, B, T = 3, 3, 4
#: Monte Carlo texts; the tolerance is Z binomial standard errors plus the recursion's quadrature error (relative)
#: (Amin et al.'s threshold grid ~1e-4; AdaPMixED's screening probability from 200,000 draws, ~1e-3 absolute)
DRAWS, Z, QUADRATURE = 200_000, 5.0, {"amin2024": 2e-3, "adapmixed": 1e-2}


def _logits(prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy model: private (B, V) and public (V,) logits, a fixed random function of the prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    rows = 2.0 * torch.randn((B + 1, V), generator=g, dtype=torch.float64)
    return rows[1:], rows[0]


def _batch(prefixes) -> tuple[torch.Tensor, torch.Tensor]:
    cache = {p: _logits(p) for p in set(prefixes)}
    return torch.stack([cache[p][0] for p in prefixes]), torch.stack([cache[p][1] for p in prefixes])


def _monte_carlo(mech, draws: int, seed: int = 0) -> dict[tuple, int]:
    """How many of ``draws`` freely sampled texts emitted each prefix (the deployed mechanism's sampled state)."""
    g = torch.Generator().manual_seed(seed)
    uniform = lambda *shape: torch.rand(shape, generator=g, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)  # noqa: E731
    state = mech.initial_state(uniform(draws, mech.aux_size(exact=False, at_start=True)), exact=False)
    texts, alive, counts = [()] * draws, torch.ones(draws, dtype=torch.bool), {}
    for _ in range(T):
        private, public = _batch(texts)
        aux = uniform(draws, mech.aux_size(exact=False, at_start=False))
        step = mech.step(private, public, state, aux, exact=False, neighbours=False)
        outcomes = torch.multinomial(step.log_probs.exp(), 1, generator=g)[:, 0]
        state, stop = mech.advance(step, state, outcomes, aux, exact=False)
        alive &= outcomes < mech.num_modes * V  # the stop outcome releases no token
        tokens = (outcomes % V).tolist()
        texts = [t + (x,) if a else t for t, x, a in zip(texts, tokens, alive.tolist())]
        for t, a in zip(texts, alive.tolist()):
            if a:
                counts[t] = counts.get(t, 0) + 1
        alive &= ~stop
    return counts


def _recursion(mech) -> dict[tuple, tuple[float, float]]:
    """Every prefix's log P(prefix emitted) by the forward recursion, and the largest stopped share along it."""
    out, frontier = {}, {(): (0.0, mech.forced_state(1), 0.0)}
    for t in range(T):
        grown = {}
        for prefix, (total, state, stopped) in frontier.items():
            private, public = _logits(prefix)
            for x in range(V):
                extra = {"generator": torch.Generator().manual_seed(t)} if isinstance(mech, AdaPMixEDMechanism) else {}
                log_probs, after = mech.forced_step(private[None], public[None], state, torch.tensor([x]), **extra)
                # the share the budget stopped: Amin et al.'s after the r-th private token, AdaPMixED's stop outcome
                stop = float(after[0, -1]) if isinstance(mech, AminMechanism) else 1 - float(log_probs.exp().sum())
                grown[prefix + (x,)] = (total + float(log_probs[0, x]), after, max(stopped, stop))
        out.update({p: (v[0], v[2]) for p, v in grown.items()})
        frontier = grown
    return out


def _check(mech, counts: dict[tuple, int]) -> float:
    worst, stops = 0.0, 0.0
    for prefix, (log_p, stop) in _recursion(mech).items():
        p, stops = math.exp(log_p), max(stops, stop)
        estimate = counts.get(prefix, 0) / DRAWS
        bound = Z * math.sqrt(max(p * (1 - p), 1e-12) / DRAWS) + QUADRATURE[mech.name] * p
        worst = max(worst, abs(estimate - p) / bound)
    assert worst <= 1.0, f"recursion and Monte Carlo differ by {worst:.2f} tolerances"
    return stops


@pytest.mark.parametrize("clip_norm,threshold,noise", [(1.0, 0.7, 0.3), (4.0, 0.4, 0.1)])
def test_amin_recursion_matches_a_monte_carlo_of_the_sampled_mechanism(clip_norm, threshold, noise):
    mech = AminMechanism(AminConfig(clip_norm=clip_norm, batch_size=B, svt_threshold=threshold, svt_noise=noise,
                                    max_private_tokens=2))
    stops = _check(mech, _monte_carlo(mech, DRAWS))
    assert stops > 0.05  # the budget's stop is exercised, not only the sparse-vector step


def test_adapmixed_recursion_matches_a_monte_carlo_of_the_sampled_mechanism():
    """Screening at about even odds, a budget that stops some paths within four steps."""
    mech = AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=B, epsilon=2.5, screen_threshold=2.0, screen_noise=0.1,
                                              screen_mixing=1e-3, screen_samples=200_000))
    stops = _check(mech, _monte_carlo(mech, DRAWS))
    assert stops > 0.05


def test_a_recursion_that_forgets_the_threshold_fails_the_check(monkeypatch):
    """The check can fail: drawing a fresh threshold every step (no memory of the public steps) is caught."""
    mech = AminMechanism(AminConfig(clip_norm=4.0, batch_size=B, svt_threshold=0.4, svt_noise=0.1, max_private_tokens=2))
    counts = _monte_carlo(mech, DRAWS)
    original = AminMechanism.forced_step

    def forgetful(self, private, public, state, tokens):
        log_probs, out = original(self, private, public, state, tokens)
        n = self.config.posterior_grid
        w = out[:, :-1].view(out.shape[0], -1, n)
        out[:, :-1] = (w.sum(dim=-1, keepdim=True) / n).expand_as(w).reshape(out.shape[0], -1)
        return log_probs, out

    monkeypatch.setattr(AminMechanism, "forced_step", forgetful)
    with pytest.raises(AssertionError, match="tolerances"):
        _check(mech, counts)
