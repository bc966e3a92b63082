"""The baselines' teacher-forced distributions (``profile --mechanism``) against a brute-force Monte Carlo of the
same mechanism: texts sampled freely from the deployed (sampled-state) mechanism on a tiny vocabulary, whose
empirical prefix frequencies must match the exact forward recursion's prefix probabilities."""

from __future__ import annotations

import json
import math

import numpy as np

import pytest
import torch

from invink_audit.evaluation.profile import SMOOTHING, run_profile
from invink_audit.mechanisms import (
    AdaPMixEDConfig,
    AdaPMixEDMechanism,
    AminConfig,
    AminMechanism,
    AminSensitivity,
    plan_amin,
)

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
        if not alive.any():  # every text has stopped: no later step emits or counts anything
            break
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


def test_adapmixed_without_a_budget_stops_before_its_first_token_in_the_recursion_too():
    """ε = 0.5 at δ = 1e-6, α = 15: the filter's budget is below 0, so the mechanism stops at once (no text);
    the recursion releases nothing either (a smaller ε never scores above the public floor)."""
    mech = AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=B, epsilon=0.5, screen_samples=1_000))
    assert mech.config.budget <= 0
    assert not _monte_carlo(mech, DRAWS)  # no sampled text emits a token
    private, public = _logits(())
    log_probs, after = mech.forced_step(private[None], public[None], mech.forced_state(1), torch.tensor([0]))
    assert torch.isneginf(log_probs).all() and not after.any()
    _check(mech, {})


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


# ---------------------------------------------------------------------------------------------------------
# through ``profile``: the same recursion on the tiny model's rows, and the compute ratio's crossing


@pytest.fixture(scope="module")
def baselines(tiny, tmp_path_factory):
    from test_profile import _config, write_texts

    proxy, real = write_texts(tmp_path_factory.mktemp("profile-baselines"))
    config = _config(epsilons=(30.0, 100.0), batch_sizes=(1, 2, 3), top_ks=(None,), amin_private_tokens=2,
                     mechanisms=("invisibleink", "amin", "amin-paper", "adapmixed"))
    return run_profile(proxy, real, config, model=tiny)


def test_profiled_baselines_match_their_recursion_on_full_forward_passes(tiny, baselines):
    from test_profile import REAL, forced_rows

    # B = 3: every reference of the text's group (a smaller B takes a seeded subset); B = 1 is infeasible here
    scored = [p for p in baselines.points if p.point.mechanism in ("amin", "amin-paper") and p.point.batch_size == 3]
    assert len(scored) == 3 and "amin eps=30 B=3 tau=1" in baselines.infeasible
    for p in scored:
        g = p.point
        sensitivity = AminSensitivity.PAPER if g.mechanism == "amin-paper" else AminSensitivity.REPLACE_BY_NULL
        mech = AminMechanism(AminConfig(clip_norm=g.clip_norm, batch_size=g.batch_size, temperature=g.temperature,
                                        max_private_tokens=2, sensitivity=sensitivity))
        assert g.clip_norm == plan_amin(epsilon=g.epsilon, delta=1e-6, max_private_tokens=2, batch_size=g.batch_size,
                                        sensitivity=sensitivity).clip_norm
        total, null, count = 0.0, 0.0, 0
        for text, l1, l2 in REAL:
            ids, public, private = forced_rows(tiny, text, l1, l2)
            null_rows = np.repeat(public[:, None], g.batch_size, axis=1)  # every reference replaced by null
            for rows, sign in ((private, 1.0), (null_rows, -1.0)):
                state, loss = mech.forced_state(1), 0.0
                for t, x in enumerate(ids):
                    lp, state = mech.forced_step(torch.tensor(rows[t][None]), torch.tensor(public[t][None]), state,
                                                 torch.tensor([x]))
                    loss -= math.log((1 - SMOOTHING) * math.exp(float(lp[0, x])) + SMOOTHING / public.shape[-1])
                total, null = (total + loss, null) if sign > 0 else (total, null + loss)
            count += len(ids)
        assert p.heldout_ce.estimate == pytest.approx(total / count, abs=1e-6)
        assert p.gain_over_null.estimate == pytest.approx((null - total) / count, abs=1e-6)


def test_compute_ratios_read_the_crossing_off_each_curve(baselines):
    assert baselines.compute
    for c in baselines.compute:
        ours = sorted((q for q in baselines.points if q.point.mechanism == "invisibleink"
                       and q.point.epsilon == c.baseline.epsilon), key=lambda q: q.point.batch_size)
        rows, gains = [q.point.batch_size + 1 for q in ours], [q.gain_over_floor.estimate for q in ours]
        target, needed = c.target_gain.estimate, c.invisibleink_rows.estimate
        assert target == pytest.approx(next(q.gain_over_floor.estimate for q in baselines.points if q.point == c.baseline))
        if math.isinf(needed):
            assert max(gains) < target
        elif needed == rows[0]:
            assert gains[0] >= target
        else:  # strictly inside: the measured points either side bracket the target
            i = next(i for i, r in enumerate(rows) if r >= needed)
            assert gains[i - 1] < target <= gains[i]
            assert c.ratio.estimate == pytest.approx(c.baseline_rows.estimate / needed)
        assert c.baseline_rows.estimate <= c.baseline.batch_size + 1
        assert c.ratio.lower <= c.ratio.estimate <= c.ratio.upper


def test_rows_to_reach_interpolates_the_first_crossing_in_log_rows():
    from invink_audit.evaluation.profile import rows_to_reach

    rows = np.array([4.0, 8.0, 16.0, 32.0])
    gains = np.array([[0.1, 0.1], [0.3, 0.5], [0.2, 0.6], [0.5, 0.7]])  # two resamples; the first is not monotone
    got = rows_to_reach(rows, gains, np.array([0.2, 0.55]))
    assert got[0] == pytest.approx(math.exp(math.log(4) + 0.5 * math.log(2)))  # halfway from 0.1 to 0.3: √(4·8)
    assert got[1] == pytest.approx(math.exp(math.log(8) + 0.5 * math.log(2)))
    assert rows_to_reach(rows, gains, np.array([0.05, 0.9])).tolist() == [4.0, math.inf]  # at most 4; never
    assert rows_to_reach(rows, gains, np.array([0.3, 0.5])).tolist() == [8.0, 8.0]  # reached exactly at a point


def test_cli_scores_the_baselines_and_refuses_an_unknown_one(tiny_dir, reviews_csv, capsys):
    from test_profile import T, _files

    from invink_audit.cli import main

    proxy, real = _files(reviews_csv)
    common = ["profile", "--input", str(proxy), "--real", str(real), "--epsilons", "30,100", "--batch-sizes", "2,3",
              "--top-ks", "full", "--max-new-tokens", str(T), "--label-columns", "label1,label2", "--prompt", "yelp",
              "--model", str(tiny_dir), "--no-progress", "--amin-private-tokens", "2"]
    assert main([*common, "--json", "--mechanism", "invisibleink,amin"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert {p["mechanism"] for p in payload["points"]} == {"invisibleink", "amin"}
    assert payload["infeasible"] == ["amin eps=30 B=2 tau=1", "amin eps=30 B=3 tau=1"]  # plan_amin: none below ε = 100
    assert "infeasible" in captured.err and len(payload["compute"]) == 2  # amin at ε = 100, B = 2 and 3
    assert main([*common, "--mechanism", "amin2024"]) == 2
    assert "--mechanism must be one of invisibleink, amin, amin-paper, adapmixed; got 'amin2024'" in capsys.readouterr().err
    # before any model loads, one line each: r given without Amin et al., and a grid with no feasible point
    assert main([*common, "--mechanism", "invisibleink,adapmixed"]) == 2
    err = capsys.readouterr().err
    assert "(--amin-private-tokens) applies to amin and amin-paper only" in err and len(err.strip().splitlines()) == 1
    only_30 = [("30" if arg == "30,100" else arg) for arg in common]
    assert main([*only_30, "--mechanism", "amin"]) == 2
    err = capsys.readouterr().err
    assert "no grid point is feasible (no clip norm): amin eps=30 B=2 tau=1, amin eps=30 B=3 tau=1" in err
    assert len(err.strip().splitlines()) == 1


def test_a_step_with_no_scored_token_is_skipped(tiny, reviews_csv):
    """Two texts of one length end together: their end-of-sequence step scores nothing (and must not fail)."""
    from test_profile import PROXY, T, _config

    proxy, real = reviews_csv(PROXY, name="proxy.csv"), reviews_csv([("Good soup.", "food", "5")] * 2, name="real.csv")
    result = run_profile(proxy, real, _config(epsilons=(100.0,), batch_sizes=(3,), top_ks=(None,), num_texts=2,
                                              amin_private_tokens=2, mechanisms=("invisibleink", "amin", "adapmixed")), model=tiny)
    assert result.num_tokens == 2 * len(tiny.tokenizer.encode("Good soup.", add_special_tokens=False)) < 2 * T
    assert len(result.points) == 3
