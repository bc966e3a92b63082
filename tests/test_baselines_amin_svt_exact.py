"""Amin et al.'s sparse-vector step, by exact enumeration: the half of the accounting the auditor cannot see.

The white-box auditor checks Amin et al.'s per-step claim on the exponential mechanism only
(``check_actual``/``check_neighbours``); its sequence-level tests estimate the loss of whole texts
from samples. A variant whose only error is an understated SVT query sensitivity would pass the
per-step checks. This test computes the exact privacy loss of one AboveThreshold run (public, public,
private) on a three-token vocabulary, through the mechanism's exact (audit) state and, independently,
by quadrature over the noisy threshold, and compares it with the per-run claim ε_svt = 2Δ_q/σ:

* with the paper's Δ_q = 1/B (``AminSensitivity.PAPER``) the exact loss **exceeds** the claim
  (≈ 2.23 against 1.67 at B = 4, σ = 0.3);
* with the replace-by-null Δ_q = 2/B (the default) the claim (3.33) holds for every event of the run.

The query pairs are attained by a replace-by-null neighbour: at the public steps every member puts
its mass on token b and the public row on token a (q = 2 under R, 2 − 2/B under R'_1); at the
private step the mean of the members equals the public distribution (q = 0 under R, 0.375 under R'_1).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import integrate, stats

from invink_audit.mechanisms import AminConfig, AminMechanism, AminSensitivity

B, SIGMA, THETA = 4, 0.3, 0.7
BIG = 60.0  # logit gap: softmax mass e^-60 off the intended tokens


def _one_hot_logits(token: int, vocab: int = 3) -> list[float]:
    row = [-BIG] * vocab
    row[token] = 0.0
    return row


def _steps():
    """(private (1, B, V), public (1, V)) for the three steps: two 'far' steps, then one 'cancelling' step."""
    a, b = 0, 1
    far_private = torch.tensor([[_one_hot_logits(b)] * B], dtype=torch.float64)
    far_public = torch.tensor([_one_hot_logits(a)], dtype=torch.float64)
    # the public distribution (1/4, 3/4) on (a, b); member 1 on a, the others on b: their mean IS the public row
    cancel_public = torch.tensor([[math.log(0.25), math.log(0.75), -BIG]], dtype=torch.float64)
    cancel_private = torch.tensor([[_one_hot_logits(a)] + [_one_hot_logits(b)] * (B - 1)], dtype=torch.float64)
    return [(far_private, far_public), (far_private, far_public), (cancel_private, cancel_public)]


def _queries():
    """The SVT queries under R and R'_1 at each step (the mechanism's own formula, for the quadrature)."""
    from invink_audit.mechanisms.amin import amin_svt_distance

    out = []
    for private, public in _steps():
        neighbour = private.clone()
        neighbour[:, 0] = public  # replace-by-null: reference 1's row is the public row
        out.append((float(amin_svt_distance(private, public)[0]), float(amin_svt_distance(neighbour, public)[0])))
    return out


def _mechanism(sensitivity) -> AminMechanism:
    return AminMechanism(AminConfig(clip_norm=1.0, batch_size=B, svt_threshold=THETA, svt_noise=SIGMA,
                                    max_private_tokens=10, sensitivity=sensitivity))


def _exact_mode_log_probs(mech: AminMechanism, modes: tuple[int, ...]) -> tuple[float, float]:
    """log P(modes) under R and under R'_1, chained through the mechanism's exact state."""
    vocab = 3
    state = mech.initial_state(torch.zeros((1, 0), dtype=torch.float64), exact=True)
    aux = torch.zeros((1, 0), dtype=torch.float64)
    log_r = log_n = 0.0
    for (private, public), mode in zip(_steps(), modes):
        step = mech.step(private, public, state, aux, exact=True, neighbours=True)
        block = slice(mode * vocab, (mode + 1) * vocab)
        log_r += float(torch.logsumexp(step.log_probs[0, block], dim=-1))
        log_n += float(torch.logsumexp(step.neighbours[0, 0, block], dim=-1))
        # the exact state depends on the outcome's mode only (the logits here do not depend on the tokens)
        state, _ = mech.advance(step, state, torch.tensor([mode * vocab]), aux, exact=True)
    return log_r, log_n


def _quadrature_log_prob(queries: list[float], modes: tuple[int, ...]) -> float:
    """log P(modes) of AboveThreshold runs, by quadrature over each run's noisy threshold θ̂ ~ θ + Lap(σ)
    (query noise Lap(2σ); a private token ends the run and a fresh threshold is drawn)."""
    total, run = 0.0, []
    runs = []
    for q, m in zip(queries, modes):
        run.append((q, m))
        if m == 1:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    for run in runs:
        def integrand(t, run=run):
            v = stats.laplace.pdf(t, THETA, SIGMA)
            for q, m in run:
                below = stats.laplace.cdf(t - q, 0.0, 2 * SIGMA)
                v *= (1.0 - below) if m == 1 else below
            return v

        cuts = sorted({THETA, *[q for q, _ in run]})
        edges = [-40.0, *cuts, 40.0]
        p = sum(integrate.quad(integrand, lo, hi, epsabs=0, epsrel=1e-11, limit=400)[0] for lo, hi in zip(edges, edges[1:]))
        total += math.log(p)
    return total


def test_queries_are_the_intended_replace_by_null_pairs():
    q = _queries()
    assert q[0] == pytest.approx((2.0, 2.0 - 2.0 / B), abs=1e-12)
    assert q[1] == q[0]
    assert q[2] == pytest.approx((0.0, 0.375), abs=1e-12)
    # every pair is within the correct sensitivity 2/B; the first exceeds the paper's 1/B
    assert all(abs(r - n) <= 2.0 / B + 1e-12 for r, n in q)
    assert abs(q[0][0] - q[0][1]) > 1.0 / B


@pytest.mark.parametrize("sensitivity", [AminSensitivity.PAPER, AminSensitivity.REPLACE_BY_NULL])
def test_exact_state_matches_quadrature(sensitivity):
    """The mechanism's exact (audit) state gives the run's mode probabilities (2,048-point posterior grid)."""
    mech = _mechanism(sensitivity)
    q = _queries()
    for modes in itertools.product((0, 1), repeat=3):
        log_r, log_n = _exact_mode_log_probs(mech, modes)
        assert log_r == pytest.approx(_quadrature_log_prob([r for r, _ in q], modes), abs=2e-3)
        assert log_n == pytest.approx(_quadrature_log_prob([n for _, n in q], modes), abs=2e-3)


def _run_losses(mech: AminMechanism) -> dict[tuple[int, ...], float]:
    """|log P_R − log P_R'_1| of every event within ONE AboveThreshold run (prefixes of ⊥⊥⊤ and ⊥⊥⊥)."""
    events = [(1,), (0,), (0, 1), (0, 0), (0, 0, 1), (0, 0, 0)]
    out = {}
    for e in events:
        log_r, log_n = _exact_mode_log_probs(mech, e)
        out[e] = abs(log_r - log_n)
    return out


def test_understated_query_sensitivity_exceeds_its_svt_claim():
    """The paper's Δ_q = 1/B: the exact loss of the run public, public, private exceeds ε_svt = 2Δ_q/σ."""
    mech = _mechanism(AminSensitivity.PAPER)
    claim = mech.accounting.epsilon_svt
    assert claim == pytest.approx(2 * (1 / B) / SIGMA)
    losses = _run_losses(mech)
    worst = max(losses.values())
    assert losses[(0, 0, 1)] == worst
    assert worst > 1.25 * claim, (worst, claim)  # ≈ 2.23 against 1.67
    # independent of the grid: the same by quadrature
    q = _queries()
    exact = _quadrature_log_prob([n for _, n in q], (0, 0, 1)) - _quadrature_log_prob([r for r, _ in q], (0, 0, 1))
    assert exact == pytest.approx(worst, abs=2e-3)
    assert exact > 1.25 * claim


def test_correct_query_sensitivity_claim_holds_on_the_same_run():
    """Δ_q = 2/B (replace-by-null): every event of the same run stays within ε_svt = 2Δ_q/σ."""
    mech = _mechanism(AminSensitivity.REPLACE_BY_NULL)
    claim = mech.accounting.epsilon_svt
    assert claim == pytest.approx(2 * (2 / B) / SIGMA)
    losses = _run_losses(mech)
    assert max(losses.values()) <= claim
    # and the SVT's loss does not depend on the clip norm or the sensitivity label (same mechanism output)
    other = _run_losses(_mechanism(AminSensitivity.PAPER))
    for e, v in losses.items():
        assert v == pytest.approx(other[e], abs=1e-12)
