"""White-box auditor: exact per-step quantities against brute force, exact sequence log-probabilities
against teacher forcing, interval coverage against exact enumeration, and the self-test's verdicts."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from invink_audit.audit import analysis, selftest, synthetic
from invink_audit.audit.stats import Verdict
from invink_audit.audit.whitebox import (
    Claim,
    Direction,
    SamplingPlan,
    WhiteBoxConfig,
    WhiteBoxRecorder,
    _geometric_mixture,
    compact_support,
    step_quantities,
)
from invink_audit.mechanism import sample_tokens
from invink_audit.mechanisms import GuaranteeKind, MechanismGuarantee
from profiles import examples

TOL = 1e-9


def _claim(epsilon0, rho_token, max_new_tokens, batch_size, delta=1e-6):
    """The claim of a bounded-range guarantee with per-step ``epsilon0`` and ``rho_token``."""
    guarantee = MechanismGuarantee(GuaranteeKind.A_PRIORI, "test", 1.0, delta, max_new_tokens, "bounded-range",
                                   rho_sequence=1.0, step_epsilon0=epsilon0, step_rho=rho_token)
    return Claim(guarantee, batch_size)


def _step(audited, private, public):
    """(actual, neighbours) log-probabilities of a stateless mechanism's step."""
    out = audited.mechanism.step(private, public, None, None, exact=True, neighbours=True)
    return out.log_probs, out.neighbours


def _brute(lp, lq, alphas, epsilons):
    """Independent float64 numpy computation of the per-step quantities for one pair."""
    p, q = np.exp(lp), np.exp(lq)
    sp, sq = p > 0, q > 0
    both = sp & sq
    fwd_inf = bool((sp & ~sq).any())
    rev_inf = bool((sq & ~sp).any())
    r = np.log(p[both]) - np.log(q[both])
    rng = math.inf if (fwd_inf or rev_inf) else float(r.max() - r.min())
    fwd = [math.inf if fwd_inf else max(0.0, math.log(np.sum(p[both] ** a * q[both] ** (1 - a))) / (a - 1)) for a in alphas]
    rev = [math.inf if rev_inf else max(0.0, math.log(np.sum(q[both] ** a * p[both] ** (1 - a))) / (a - 1)) for a in alphas]
    dfw = [float(np.clip(p - math.exp(e) * q, 0, None).sum()) for e in epsilons]
    drv = [float(np.clip(q - math.exp(e) * p, 0, None).sum()) for e in epsilons]
    return rng, fwd, rev, dfw, drv


def _logits(draw, shape):
    return torch.tensor(draw(st.lists(st.floats(-6, 6), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))), dtype=torch.float64).reshape(shape)


@st.composite
def _pairs(draw):
    g, b, v = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(2, 6))
    actual = torch.log_softmax(_logits(draw, (g, v)), -1)
    neigh = torch.log_softmax(_logits(draw, (g, b, v)), -1)
    if draw(st.booleans()):  # shared support (Top-k+-like)
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=v, max_size=v)))
        mask[0] = True
        actual = torch.log_softmax(actual.masked_fill(~mask, -math.inf), -1)
        neigh = torch.log_softmax(neigh.masked_fill(~mask, -math.inf), -1)
    if draw(st.booleans()):  # a token only the neighbour can produce (support mismatch)
        actual = actual.clone()
        actual[..., -1] = -math.inf
        actual = torch.log_softmax(actual, -1)
    return actual, neigh


@given(_pairs())
@settings(max_examples=examples(60))
def test_step_quantities_match_brute_force(pair):
    actual, neigh = pair
    alphas, eps = (1.5, 2.0, 8.0), (0.0, 0.3)
    q = step_quantities(actual, neigh, alphas, eps)
    for g in range(actual.shape[0]):
        for j in range(neigh.shape[1]):
            rng, fwd, rev, dfw, drv = _brute(actual[g].numpy(), neigh[g, j].numpy(), alphas, eps)
            assert q.loss_range[g, j].item() == pytest.approx(rng, abs=1e-9)
            np.testing.assert_allclose(q.renyi_forward[g, j].numpy(), fwd, atol=1e-9)
            np.testing.assert_allclose(q.renyi_reverse[g, j].numpy(), rev, atol=1e-9)
            np.testing.assert_allclose(q.delta_forward[g, j].numpy(), dfw, atol=1e-12)
            np.testing.assert_allclose(q.delta_reverse[g, j].numpy(), drv, atol=1e-12)
    # compaction to the union of supports changes nothing
    ca, cn, _ = compact_support(actual, neigh)
    qc = step_quantities(ca, cn, alphas, eps)
    for name in ("loss_range", "renyi_forward", "renyi_reverse", "delta_forward", "delta_reverse"):
        torch.testing.assert_close(getattr(qc, name), getattr(q, name), atol=1e-12, rtol=0)


def test_compaction_keeps_only_the_union_of_supports():
    v = 1000
    actual = torch.full((2, v), -math.inf, dtype=torch.float64)
    actual[:, :5] = torch.log_softmax(torch.randn(2, 5, dtype=torch.float64), -1)
    neigh = actual.unsqueeze(1).repeat(1, 3, 1)
    ca, cn, kept = compact_support(actual, neigh)
    assert ca.shape == (2, 5) and cn.shape == (2, 3, 5)
    assert sorted(kept[0].tolist()) == [0, 1, 2, 3, 4]


def test_geometric_mixture_is_normalised_power_product():
    lp = torch.log_softmax(torch.randn(3, 5, dtype=torch.float64), -1)
    lq = torch.log_softmax(torch.randn(3, 5, dtype=torch.float64), -1)
    alpha = torch.tensor([[1.5], [2.0], [4.0]], dtype=torch.float64)
    w = _geometric_mixture(lp, lq, alpha)
    expected = np.exp(lp.numpy()) ** alpha.numpy() * np.exp(lq.numpy()) ** (1 - alpha.numpy())
    np.testing.assert_allclose(torch.softmax(w, -1).numpy(), expected / expected.sum(-1, keepdims=True), rtol=1e-10)


def _small_setup():
    source = synthetic.RandomSource(vocab_size=4, batch_size=3, period=2, scale=1.5, private_scale=1.0, eos_shift=1.0, seed=3)
    mech = synthetic.correct_mechanism(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=3, max_new_tokens=4)
    return source, mech


def test_recorded_sequence_log_probs_equal_teacher_forcing():
    """log P_R(x) and log P_{R'_j}(x) of every sampled text, recomputed token by token."""
    source, mech = _small_setup()
    config = WhiteBoxConfig(alphas=(2.0,), num_samples=30, num_is_samples=5, significance=0.05)
    rec = synthetic.run_synthetic_audit(source, mech, config, generator=torch.Generator().manual_seed(0))
    for n in range(rec.plan.num_texts):
        toks = [int(t) for t in rec.tokens[n, : rec.lengths[n]]]
        assert len(toks) <= mech.max_new_tokens and (len(toks) == mech.max_new_tokens or toks[-1] == source.eos_token)
        lp_a, lp_n = 0.0, np.zeros(3)
        for t, tok in enumerate(toks):
            private, public = source.logits(torch.tensor([toks[:t]], dtype=torch.int64), t)
            actual, neighbours = _step(mech, private, public)
            lp_a += float(actual[0, tok])
            lp_n += neighbours[0, :, tok].numpy()
        assert rec.log_prob_actual[n] == pytest.approx(lp_a, abs=1e-9)
        np.testing.assert_allclose(rec.log_prob_neighbours[n], lp_n, atol=1e-9)


def test_intervals_cover_exact_divergences_at_the_stated_rate():
    """Exact enumeration (V=4, T=4): over repeated audits, every interval covers at rate >= 1 - beta."""
    source, mech = _small_setup()
    exact = synthetic.enumerate_outputs(source, mech)
    assert exact.log_prob_actual.size > 50
    # the enumeration is a probability distribution under R and under every R'_j
    assert np.exp(exact.log_prob_actual).sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(np.exp(exact.log_prob_neighbours).sum(0), 1.0, atol=1e-12)
    beta = 0.1
    config = WhiteBoxConfig(alphas=(1.5, 3.0), num_samples=150, num_is_samples=60, significance=beta, neighbours=(0, 2))
    gen = torch.Generator().manual_seed(123)
    misses = total = 0
    delta_misses = delta_total = 0
    reps = 40
    for _ in range(reps):
        rec = synthetic.run_synthetic_audit(source, mech, config, generator=gen)
        rep = analysis.analyse(rec, mechanism="correct", source="enumerable", exact=exact)
        for s in rep.sequence:
            total += 1
            misses += not (s.lower - TOL <= s.exact <= s.upper + TOL)
        for d in rep.delta:
            ex = exact.delta(d.epsilon, d.neighbour, reverse=d.direction == "reverse")
            delta_total += 1
            delta_misses += not (d.band_lower - TOL <= ex <= d.band_upper + TOL)
        assert rep.verdict is Verdict.PASS
    # each interval misses with probability <= beta; allow the binomial 1e-4 upper quantile
    assert misses <= sps.binom.ppf(1 - 1e-4, total, beta), (misses, total)
    assert delta_misses <= sps.binom.ppf(1 - 1e-4, delta_total, beta)
    # and the IS point estimates are accurate: the last run's are within 0.05 nats
    assert max(abs(s.estimate - s.exact) for s in rep.sequence if s.estimator == "importance-sampling") < 0.05


def test_hardest_case_source_is_the_worst_bounded_range_pair():
    """Under the canary's neighbour the up group has probability 0.45, and the loss pair spans eps0."""
    source = synthetic.HardestCaseSource(vocab_size=6, batch_size=4, temperature=1.0)
    mech = synthetic.correct_mechanism(clip_norm=0.5, temperature=1.0, top_k=None, batch_size=4, max_new_tokens=5)
    private, public = source.logits(torch.zeros(1, 0, dtype=torch.int64), 0)
    actual, neigh = _step(mech, private, public)
    q = neigh[0, 0].exp()
    assert float(q[1:5].sum()) == pytest.approx(0.45, abs=1e-12)
    loss = actual[0] - neigh[0, 0]
    eps0 = 2 * 0.5 / (4 * 1.0)
    assert float(loss.max() - loss.min()) == pytest.approx(eps0, abs=1e-12)
    # t (loss of the up group) is about 0.53 eps0 (docs/accounting_notes.md §8)
    assert float(loss[1]) / eps0 == pytest.approx(0.53, abs=0.03)
    # every other neighbour is null: identical distributions
    torch.testing.assert_close(neigh[0, 1:], actual.expand(3, -1), atol=1e-12, rtol=0)


def test_recorder_protocol_errors():
    plan = SamplingPlan.build(WhiteBoxConfig(num_samples=2, num_is_samples=0, directions=("forward",)), 2)
    claim = _claim(0.5, 0.5**2 / 8, 3, 2)
    rec = WhiteBoxRecorder(plan, claim, WhiteBoxConfig(num_samples=2, num_is_samples=0, directions=("forward",)), max_steps=3)
    with pytest.raises(RuntimeError, match="without a preceding"):
        rec.record(torch.tensor([0]), torch.tensor([0]))
    lp = torch.log_softmax(torch.randn(2, 4, dtype=torch.float64), -1)
    w = rec.sampling_log_weights(torch.tensor([0, 1]), lp, lp.unsqueeze(1).repeat(1, 2, 1))
    with pytest.raises(RuntimeError, match="must be called after"):
        rec.sampling_log_weights(torch.tensor([0, 1]), lp, lp.unsqueeze(1).repeat(1, 2, 1))
    rec.record(torch.tensor([0, 1]), sample_tokens(w, torch.Generator().manual_seed(0)))
    out = rec.finish()
    assert out.failures == {"support": 0, "range": 0, "renyi": 0, "delta": 0, "nonfinite": 0}
    assert out.within_tolerance == {"range": 0, "renyi": 0, "delta": 0}
    with pytest.raises(ValueError, match="batch_size"):
        WhiteBoxConfig(neighbours=(5,)).audited_neighbours(3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(alphas=(1.0,)), "alphas"),
        (dict(num_samples=0), "num_samples"),
        (dict(neighbours=(1, 1)), "distinct"),
        (dict(significance=0.0), "significance"),
        (dict(delta_grid=(1.5,)), "delta_grid"),
        (dict(directions=()), "directions"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WhiteBoxConfig(**kwargs)


def test_claim_validation_and_curve():
    c = _claim(0.25, 0.25**2 / 8, 10, 4)
    assert c.rho_sequence == pytest.approx(10 * 0.25**2 / 8)
    assert c.renyi(3.0) == pytest.approx(3 * c.rho_sequence)
    for bad in (dict(epsilon0=0.0), dict(max_new_tokens=0), dict(delta=1.0), dict(batch_size=0)):
        args = dict(epsilon0=0.25, rho_token=0.01, max_new_tokens=3, batch_size=2)
        args.update(bad)
        with pytest.raises(ValueError):
            _claim(**args)
    with pytest.raises(ValueError, match="MechanismGuarantee"):
        Claim("not a guarantee", 2)
    # derived from the mechanism's guarantee, not copied: InvisibleInk's per-step figures are its config's
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import InvisibleInk

    config = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=5, batch_size=4)
    derived = Claim.from_mechanism(InvisibleInk(config), 10, 1e-6)
    assert derived.epsilon0 == config.epsilon0 and derived.rho_token == config.rho_token and derived.batch_size == 4
    assert derived.guarantee == InvisibleInk(config).guarantee(10, 1e-6) and derived.kind == "a-priori"


def test_selftest_pass_on_correct_and_violation_on_every_mutant():
    # 75 texts (and 20 importance-sampled) per audit: every mutant's VIOLATION rests on thousands of failed exact
    # per-step checks, and its statistical claims are rejected at 75 as at 150 (the same mutants, 2 to 31 of 72)
    settings_ = selftest.SelfTestSettings(num_samples=75, num_is_samples=20)
    result = selftest.run_selftest(settings_, generator=torch.Generator().manual_seed(2024))
    verdicts = {e.mechanism: e.verdict for e in result.entries}
    assert verdicts == {
        "correct": "PASS",
        "naive-clipping": "VIOLATION",
        "low-temperature": "VIOLATION",
        "private-top-k": "VIOLATION",
        "data-dependent-budget": "VIOLATION",
        "unit-two-slots": "VIOLATION",  # a unit in two slots of one batch at the per-reference epsilon
        # the paper's baselines through the mechanism interface
        "amin-paper-sensitivity": "VIOLATION",
        "amin-correct": "PASS",
        "adapmixed-stop-rule": "VIOLATION",
        "adapmixed-within-budget": "INCONCLUSIVE",
        # AugPE's histogram, exactly (invink_audit.augpe.audit; tests/test_augpe_audit.py)
        "augpe-correct": "PASS",
        "augpe-paper-sensitivity": "VIOLATION",
        # the adapter path: audit_generator on transformers' generate (tests/test_outside_generators.py)
        "adapter-dp-processor": "PASS",
        "adapter-default-top-k": "VIOLATION",
        "adapter-claim-omits-a-step": "VIOLATION",
    }
    assert result.passed
    assert result.coverage["passed"]
    by_name = {e.mechanism: e for e in result.entries}
    # what each mutant breaks, seen by the exact checks (an independent fact, not a statistic)
    naive = by_name["naive-clipping"].sources[1]  # hardest-case: the factor 2 of paper Property 9
    assert naive["max_loss_range_over_epsilon0"] == pytest.approx(2.0, abs=1e-9)
    cold = by_name["low-temperature"].sources[1]
    assert cold["max_loss_range_over_epsilon0"] == pytest.approx(2.0, abs=1e-9)
    assert by_name["private-top-k"].sources[0]["step_failures"]["support"] > 0
    assert by_name["data-dependent-budget"].sources[0]["step_failures"]["support"] > 0
    # per-unit neighbours: the unit's two slots move each step by twice the per-reference range
    assert by_name["unit-two-slots"].sources[1]["max_loss_range_over_epsilon0"] == pytest.approx(2.0, abs=1e-9)
    correct = by_name["correct"].sources[1]
    assert correct["max_loss_range_over_epsilon0"] == pytest.approx(1.0, abs=1e-9)
    # Amin et al.: the exponential mechanism moves by 2C/B (paper Prop. amin-sens), the hardest case attains it
    assert by_name["amin-paper-sensitivity"].sources[1]["max_loss_range_over_epsilon0"] == pytest.approx(2.0, abs=1e-9)
    assert by_name["amin-correct"].sources[1]["max_loss_range_over_epsilon0"] == pytest.approx(1.0, abs=1e-9)
    # AdaPMixED: labelled data-dependent, never PASS; its stop rule separates R from R'_j exactly
    for name in ("adapmixed-stop-rule", "adapmixed-within-budget"):
        assert by_name[name].guarantee == "data-dependent" and by_name[name].verdict != "PASS"
        assert all("reported_epsilon" in src for src in by_name[name].sources)
    assert by_name["adapmixed-stop-rule"].sources[0]["step_failures"]["support"] > 0
    assert sum(by_name["adapmixed-within-budget"].sources[0]["step_failures"].values()) == 0
    json_list = result.to_json()
    assert [d["mechanism"] for d in json_list][0] == "correct" and "coverage" in json_list[0]


def test_sequence_losses_direction_conventions():
    source, mech = _small_setup()
    config = WhiteBoxConfig(alphas=(2.0,), num_samples=40, num_is_samples=0, significance=0.05)
    rec = synthetic.run_synthetic_audit(source, mech, config, generator=torch.Generator().manual_seed(1))
    fwd = analysis.sequence_losses(rec, 1, Direction.FORWARD)
    rev = analysis.sequence_losses(rec, 1, Direction.REVERSE)
    assert fwd.size == 40 and rev.size == 40
    # E_P[exp(-L)] = 1 for the forward losses (P' is a distribution with the same support)
    exact = synthetic.enumerate_outputs(source, mech)
    lp, lq = exact.log_prob_actual, exact.log_prob_neighbours[:, 1]
    assert np.sum(np.exp(lp) * np.exp(-(lp - lq))) == pytest.approx(1.0, abs=1e-12)


# -- numerics: a tolerance from the dtype, NaN a finding, no claim at a level is math.inf ----------------------------


def _zcdp_claim(epsilon0, rho_token, batch_size=2):
    """A one-step claim whose composition does not use ε0 (a sequence ρ), per step ``epsilon0`` and ``rho_token``."""
    guarantee = MechanismGuarantee(GuaranteeKind.A_PRIORI, "test", 3.0, 1e-6, 1, "zcdp", rho_sequence=rho_token,
                                   step_epsilon0=epsilon0, step_rho=rho_token)
    return Claim(guarantee, batch_size)


def _one_step_report(actual, neighbours, claim, **config):
    """The report of a one-token audit whose step is ``actual`` (V,) and ``neighbours`` (B, V) for every text."""
    cfg = WhiteBoxConfig(alphas=(2.0,), num_samples=50, num_is_samples=0, **config)
    plan = SamplingPlan.build(cfg, claim.batch_size)
    rec = WhiteBoxRecorder(plan, claim, cfg, max_steps=1)
    ids, n = torch.arange(plan.num_texts), plan.num_texts
    weights = rec.sampling_log_weights(ids, actual.expand(n, -1), neighbours.expand(n, -1, -1))
    rec.record(ids, sample_tokens(weights, torch.Generator().manual_seed(0)))
    return analysis.analyse(rec.finish(), mechanism="test", source="test")


def _range_pair(span):
    """(actual, neighbours): a two-token step whose privacy-loss range against neighbour 0 is ``span``."""
    actual = torch.log_softmax(torch.tensor([span / 2, -span / 2], dtype=torch.float64), -1)
    return actual, torch.stack([torch.log_softmax(torch.zeros(2, dtype=torch.float64), -1), actual])


@pytest.mark.parametrize("epsilon0", [1e6, math.inf])
def test_a_huge_or_infinite_step_claim_does_not_overflow(epsilon0):
    # "no per-step range claim" once had to be written 1e6, and crashed with OverflowError; inf is no claim
    report = _one_step_report(*_range_pair(3.0), _zcdp_claim(epsilon0, 0.125 * 3.0**2))
    assert report.step_checks.failures["range"] == 0 and report.verdict is not Verdict.VIOLATION
    report = _one_step_report(*_range_pair(3.0), _zcdp_claim(epsilon0, 0.01))  # the Rényi claim still binds
    assert report.step_checks.failures["renyi"] > 0 and report.verdict is Verdict.VIOLATION


def test_tolerance_for_follows_the_dtype():
    from invink_audit.audit.whitebox import EXACT_TOLERANCE, tolerance_for

    assert tolerance_for(torch.float64) == EXACT_TOLERANCE  # InvisibleInk's audits keep their checks
    assert 3e-7 < tolerance_for(torch.float32) < 1e-4 < tolerance_for(torch.bfloat16)
    assert tolerance_for(torch.float32) == pytest.approx(tolerance_for(torch.float32, log_prob_bound=64.0) / 2)
    with pytest.raises(ValueError, match="floating"):
        tolerance_for(torch.int64)


def test_a_float32_rounding_excess_is_within_tolerance_not_a_violation():
    from invink_audit.audit.report import whitebox_markdown
    from invink_audit.audit.whitebox import Numerics

    claim = _claim(1.0, 1.0 / 8, 1, 2)
    float32 = Numerics.of(torch.float32)
    rounded = _one_step_report(*_range_pair(1.0 + 3e-7), claim, numerics=float32)
    assert rounded.verdict is not Verdict.VIOLATION and sum(rounded.step_checks.failures.values()) == 0
    assert rounded.step_checks.numerics["within_tolerance"]["range"] > 0  # shown, not counted as a failure
    assert rounded.step_checks.max_loss_range > 1.0
    markdown = whitebox_markdown(rounded)
    assert "float32" in markdown and "within the tolerance" in markdown
    assert rounded.to_dict()["step_checks"]["numerics"]["dtype"] == "float32"
    # float64 distributions: the same excess is a VIOLATION (as before); a real leak is one in float32 too
    assert _one_step_report(*_range_pair(1.0 + 3e-7), claim).verdict is Verdict.VIOLATION
    assert _one_step_report(*_range_pair(1.01), claim, numerics=float32).verdict is Verdict.VIOLATION


def test_a_rounding_excess_in_a_coarse_dtype_leaves_the_claim_unresolved_not_passed():
    from invink_audit.audit.whitebox import RESOLVABLE_SHARE
    from invink_audit.audit.whitebox import Numerics

    # bfloat16's tolerance (about 2 nats) hides a leak larger than the claim itself: never a PASS on it
    claim = _claim(1.0, 1.0 / 8, 1, 2)
    bf16 = Numerics.of(torch.bfloat16)
    assert bf16.tolerance > RESOLVABLE_SHARE * claim.epsilon0
    report = _one_step_report(*_range_pair(1.05), claim, numerics=bf16)
    assert report.verdict is Verdict.INCONCLUSIVE and "bfloat16" in report.reason and "wider dtype" in report.reason
    assert report.step_checks.numerics["within_tolerance"]["range"] > 0
    # within the claim (nothing forgiven), the same dtype does not stand in the way
    assert "wider dtype" not in _one_step_report(*_range_pair(0.9), claim, numerics=bf16).reason


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["actual", "neighbour"])
def test_a_nonfinite_released_distribution_is_a_finding_never_a_pass(bad, where):
    actual, neighbours = _range_pair(0.5)
    actual, neighbours = torch.cat([actual, torch.tensor([-5.0])]), torch.cat([neighbours, torch.full((2, 1), -5.0)], -1)
    (actual if where == "actual" else neighbours[1])[2] = bad
    report = _one_step_report(actual, neighbours, _claim(1.0, 1.0 / 8, 1, 2))
    assert report.verdict is Verdict.VIOLATION and report.step_checks.failures["nonfinite"] > 0
    assert "NaN or +inf" in report.reason


def test_a_negative_sampled_divergence_estimate_reads_as_zero_epsilon():
    """A sampled Rényi point estimate can fall below 0 where the divergence is small; the analysis bounds it by
    D_α ≥ 0 (measured ε 0) instead of refusing it."""
    source = synthetic.RandomSource(vocab_size=6, batch_size=2, private_scale=0.05, seed=0)
    audited = synthetic.correct_mechanism(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=2, max_new_tokens=3)
    config = WhiteBoxConfig(num_samples=16, num_is_samples=0, neighbours=(0,), directions=(Direction.FORWARD,),
                            min_samples=16)
    negative = 0
    for seed in range(6):
        record = synthetic.run_synthetic_audit(source, audited, config, generator=torch.Generator().manual_seed(seed))
        report = analysis.analyse(record, mechanism="m", source="s")
        negative += any(row.estimate < 0 for row in report.sequence)
        assert report.verdict is Verdict.PASS
        assert all(row.epsilon_measured >= 0 for row in report.accountants)
    assert negative  # the case this test is for occurred
