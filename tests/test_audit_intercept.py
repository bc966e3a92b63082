"""audit_generator: white-box audit of a generator's own loop through its sampling calls (issue 35, items 1-2).

Oracles: an exponential mechanism over references whose per-step bounded range is exactly ε0 (each reference's
utility holds a 0 and a 1), written with torch.multinomial, torch.distributions.Categorical and numpy; a two-step
toy whose texts' exact δ(ε) and D_α are enumerated; the tiny HF model's warped softmax computed directly;
dp-fusion-lib 0.1.0 from the package registry, its own loop and its own ε.
"""

import dataclasses
import math
import threading

import numpy as np
import pytest
import torch

from accounting import PrivacyClaim, composed_epsilon
from invink_audit.audit import GeneratorAudit, InterceptionError, Verdict, audit_generator
from invink_audit.audit.whitebox import Claim, tolerance_for
from invink_audit.mechanisms import MechanismGuarantee
from invink_audit.mechanisms.base import GuaranteeKind

V, T, EPS0 = 7, 5, 0.8
#: rounding of float64 log-probabilities of magnitude ≤ 10 (the exact checks' own tolerance is 1e-9)
ROUNDING = 1e-12


def _utility(references, prev: int) -> np.ndarray:
    """Σ_i u_i(y | prev), u_i ∈ [0, 1]^V holding a 0 and a 1 (so the range of a replacement's log-ratio is ε0)."""
    total = np.zeros(V)
    for r in references:
        if r is not None:
            total += np.roll(np.linspace(0, 1, V)[np.random.RandomState(1000 + r).permutation(V)], prev)
    return total


def toy_torch(references, rows: int = 2):
    tokens, prev = [], [0] * rows
    gen = torch.Generator().manual_seed(3)
    for _ in range(T):
        logits = torch.tensor(np.stack([EPS0 * _utility(references, p) for p in prev]))
        draw = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1)
        prev = draw.tolist()
        tokens.append(prev)
    return tokens


def toy_categorical(references):
    tokens, prev = [], 0
    for _ in range(T):
        prev = int(torch.distributions.Categorical(logits=torch.tensor(EPS0 * _utility(references, prev))).sample())
        tokens.append(prev)
    return tokens


def toy_numpy(references, legacy: bool = False):
    rng = np.random.default_rng(11)
    tokens, prev = [], 0
    for _ in range(T):
        w = np.exp(EPS0 * _utility(references, prev))
        p = w / w.sum()
        prev = int(np.random.choice(V, p=p) if legacy else rng.choice(np.arange(V), p=p))
        tokens.append(prev)
    return tokens


def br_claim(epsilon0: float, max_new_tokens: int = T, **fields) -> PrivacyClaim:
    """A bounded-range claim: ε0 per step, ε0²/8-zCDP per step (Cesar & Rogers 2021, Lemma 3.2), T steps."""
    return PrivacyClaim.per_step(steps=max_new_tokens, epsilon0=epsilon0, rho=epsilon0**2 / 8, **fields)


def br_guarantee(epsilon0: float, max_new_tokens: int = T) -> MechanismGuarantee:
    """The same claim as a mechanism's guarantee (what our own mechanisms state)."""
    rho = epsilon0**2 / 8
    return MechanismGuarantee(GuaranteeKind.A_PRIORI, "toy exponential", epsilon=math.inf, delta=1e-6,
                              max_new_tokens=max_new_tokens, composition="bounded-range",
                              rho_sequence=max_new_tokens * rho, step_epsilon0=epsilon0, step_rho=rho)  # fmt: skip


REFS = [1, 2, 3]


@pytest.mark.parametrize(
    "generate, sampler",
    [(toy_torch, "torch.multinomial"), (toy_categorical, "torch.multinomial"),
     (toy_numpy, "numpy Generator.choice"), (lambda r: toy_numpy(r, legacy=True), "numpy.random.choice")],
    ids=["multinomial", "categorical", "numpy-generator", "numpy-legacy"],
)
def test_exponential_mechanism_exact_epsilon(generate, sampler):
    audit = audit_generator(generate, REFS, br_claim(EPS0))
    assert isinstance(audit, GeneratorAudit)
    assert len(audit.calls) == T and {c.sampler for c in audit.calls} == {sampler}
    assert audit.dtypes == ("float64",)
    # the audit finds the true ε0: every neighbour's range is exactly ε0 at every step
    np.testing.assert_allclose(audit.loss_range, EPS0, atol=ROUNDING)
    assert audit.max_abs_log_ratio.max() <= EPS0 + ROUNDING
    assert audit.verdict is Verdict.PASS, audit.reason
    # the released tokens are the generator's own (the interception drew them; replays forced them)
    assert [c.tokens.reshape(-1).tolist() for c in audit.calls] == [np.atleast_1d(t).tolist() for t in audit.output]
    smaller = audit_generator(generate, REFS, br_claim(0.9 * EPS0))
    assert smaller.verdict is Verdict.VIOLATION
    assert smaller.excesses["step bounded range over epsilon0"] == pytest.approx(0.1 * EPS0, abs=1e-9)


def test_pure_epsilon_per_step_claim():
    """|log p - log p'| ≤ ε0 here (dropping u_j ∈ [0, 1] moves every logit by at most ε0 and the normaliser within)."""
    honest = audit_generator(toy_torch, REFS, PrivacyClaim.per_step(steps=T, epsilon=EPS0))
    assert honest.verdict is Verdict.PASS, honest.reason
    assert 0.5 * EPS0 < honest.max_abs_log_ratio.max() <= EPS0 + ROUNDING
    tight = audit_generator(toy_torch, REFS, PrivacyClaim.per_step(steps=T, epsilon=0.5 * EPS0))
    assert tight.verdict is Verdict.VIOLATION and "step |log-ratio| over epsilon" in tight.reason
    excess = tight.excesses["step |log-ratio| over epsilon"]
    assert excess == pytest.approx(honest.max_abs_log_ratio.max() - 0.5 * EPS0)


def test_guarantee_and_whitebox_claim_still_accepted():
    g = br_guarantee(EPS0)
    expected = br_claim(EPS0, reported_epsilon=math.inf, reported_delta=1e-6, source="toy exponential")
    assert PrivacyClaim.of(g) == PrivacyClaim.of(Claim(g, 3)) == expected
    for claim in (g, Claim(g, 3)):
        audit = audit_generator(toy_categorical, REFS, claim)
        assert audit.claim == expected and audit.verdict is Verdict.PASS, audit.reason
    assert audit_generator(toy_categorical, REFS, br_guarantee(0.9 * EPS0)).verdict is Verdict.VIOLATION
    # a guarantee read back from a report without its ε (NaN) reports nothing; one whose ε understates its own
    # per-step claim is a finding
    unknown = PrivacyClaim.of(dataclasses.replace(g, epsilon=math.nan))
    assert unknown.reported_epsilon is None and unknown.step == expected.step
    understated = audit_generator(toy_categorical, REFS, dataclasses.replace(g, epsilon=1.0))
    assert understated.verdict is Verdict.VIOLATION and "reports epsilon = 1" in understated.reason


def test_batch_rows_are_separate_texts_and_sums_compose():
    audit = audit_generator(toy_torch, REFS, br_claim(EPS0))
    assert audit.calls[0].shape == (2, V, 1)
    assert audit.loss_range.shape == (2 * T, 3) and audit.renyi_forward.shape == (2 * T, 3, 4)
    assert audit.sequence_renyi_forward.shape == (2, 3, 4)
    rows = audit.step_call.reshape(T, 2)
    np.testing.assert_array_equal(rows, np.repeat(np.arange(T), 2).reshape(T, 2))
    per_row = audit.renyi_forward.reshape(T, 2, 3, 4).sum(0)
    np.testing.assert_allclose(audit.sequence_renyi_forward, per_row)
    # each replay is forced to the actual tokens and its distributions are the neighbour's own
    j = 1
    replay = audit.neighbour_calls[j]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(audit.calls, replay))
    refs = [r if i != j else None for i, r in enumerate(REFS)]
    prev = audit.calls[0].tokens.squeeze(1).tolist()
    expected = torch.log_softmax(torch.tensor(np.stack([EPS0 * _utility(refs, p) for p in prev])), -1)
    torch.testing.assert_close(replay[1].log_probs, expected)


def test_torch_rng_is_restored_and_run_is_reproducible():
    torch.manual_seed(0)
    audit = audit_generator(toy_categorical, REFS, br_claim(EPS0))
    after_audit = torch.rand(3)
    torch.manual_seed(0)
    direct = toy_categorical(REFS)
    after_direct = torch.rand(3)
    assert audit.output == direct
    torch.testing.assert_close(after_audit, after_direct)


def test_no_sampling_call_is_a_clear_error():
    def greedy(references):
        return [int(torch.argmax(torch.tensor(_utility(references, 0))))]

    with pytest.raises(InterceptionError, match=r"no sampling call was intercepted.*1 argmax call\(s\) seen"):
        audit_generator(greedy, REFS, br_claim(EPS0))
    assert torch.multinomial.__module__ == "torch" or torch.multinomial is torch._C._VariableFunctions.multinomial


def test_diverging_replay_names_the_step():
    def shorter_without_reference(references):
        steps = T if None not in references else T - 2
        return [int(torch.multinomial(torch.ones(V), 1)) for _ in range(steps)]

    with pytest.raises(InterceptionError, match=r"neighbour 0: the replay made 3 sampling call\(s\), the actual run 5"):
        audit_generator(shorter_without_reference, REFS, br_claim(EPS0))

    def wider_without_reference(references):
        width = V + (None in references)
        return [int(torch.multinomial(torch.ones(width), 1)) for _ in range(T)]

    with pytest.raises(InterceptionError, match=r"neighbour 0: sampling call 0 differs.*\(1, 8\).*\(1, 7\)"):
        audit_generator(wider_without_reference, REFS, br_claim(EPS0))


def test_patches_restored_and_concurrent_use_refused():
    originals = (torch.multinomial, torch.Tensor.multinomial, np.random.choice, np.random.default_rng, torch.argmax)

    def nested(references):
        audit_generator(toy_torch, REFS, br_claim(EPS0))

    with pytest.raises(RuntimeError, match="another audit_generator run is in progress"):
        audit_generator(nested, REFS, br_claim(EPS0))
    assert (torch.multinomial, torch.Tensor.multinomial, np.random.choice, np.random.default_rng, torch.argmax) == originals

    seen = []

    def with_other_thread(references):
        worker = threading.Thread(target=lambda: seen.append(torch.multinomial(torch.ones(3), 1)))
        worker.start()
        worker.join()
        return toy_categorical(references)

    audit = audit_generator(with_other_thread, REFS, br_claim(EPS0))
    assert len(audit.calls) == T and len(seen) == 4  # the other thread's draws pass through, unrecorded


def test_data_dependent_claim_is_never_a_pass():
    """A Rényi filter's budget (data-dependent, sequence level): its stop rule bounds each path's sum."""
    audit = audit_generator(toy_categorical, REFS, PrivacyClaim.rdp({2.0: 100.0}, steps=T, data_dependent=True))
    assert audit.alphas == (2.0,)
    assert audit.verdict is Verdict.INCONCLUSIVE and "data-dependent" in audit.reason
    tight = audit_generator(toy_categorical, REFS, PrivacyClaim.rdp({2.0: 1e-3}, steps=T, data_dependent=True))
    assert tight.verdict is Verdict.VIOLATION and "sequence Renyi" in tight.reason
    # AdaPMixED's guarantee form: the filter's budget at its order, its ε by Mironov's conversion (above CKS's: no finding)
    budget, delta = 100.0, 1e-6
    g = MechanismGuarantee(GuaranteeKind.DATA_DEPENDENT, "toy", epsilon=budget + math.log(1 / delta), delta=delta,
                           max_new_tokens=T, composition="renyi-filter", renyi_order=2.0, renyi_budget=budget)  # fmt: skip
    assert PrivacyClaim.of(g).form == "renyi" and PrivacyClaim.of(g).data_dependent
    assert audit_generator(toy_categorical, REFS, g).verdict is Verdict.INCONCLUSIVE


# ---------------------------------------------------------------------------------------------
# adjacency, sequence-level claims, the reported epsilon


def test_add_remove_neighbours_leave_the_reference_out():
    seen = []

    def generate(references):
        seen.append(list(references))
        return toy_categorical(references)

    audit = audit_generator(generate, REFS, br_claim(EPS0, adjacency="add-remove"))
    assert seen == [REFS, [2, 3], [1, 3], [1, 2]]  # no None: each neighbour is the list without one reference
    assert audit.verdict is Verdict.PASS, audit.reason
    prev = [0] + [int(c.tokens) for c in audit.calls[:-1]]
    for j in range(3):
        without = REFS[:j] + REFS[j + 1:]
        expected = torch.stack([torch.log_softmax(torch.tensor(EPS0 * _utility(without, p)), -1) for p in prev])
        torch.testing.assert_close(torch.cat([c.log_probs for c in audit.neighbour_calls[j]]), expected)
    seen.clear()
    audit_generator(generate, REFS, br_claim(EPS0), neighbours=[1])
    assert seen == [REFS, [1, None, 3]]


TEXTS, STRENGTH = 4000, 1.5
SEQ_V = 3


def _seq_log_probs(references, prev: int | None) -> torch.Tensor:
    """Step distribution of the two-step toy: logits STRENGTH·(1 + prev)·u (u of reference 0), uniform for None: the
    second step's divergence depends on the first token (an adaptive composition)."""
    scale = 0.0 if references[0] is None else STRENGTH * (1 + (prev or 0))
    u = torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)
    return torch.log_softmax(scale * u.roll(prev or 0), -1)


def toy_two_steps(references):
    """TEXTS independent texts of two tokens, drawn as TEXTS rows of each torch.multinomial call."""
    gen = torch.Generator().manual_seed(7)
    first = torch.multinomial(_seq_log_probs(references, None).exp().expand(TEXTS, SEQ_V), 1, generator=gen)
    second_rows = torch.stack([_seq_log_probs(references, int(y)).exp() for y in first.squeeze(1)])
    return torch.cat([first, torch.multinomial(second_rows, 1, generator=gen)], 1)


def _exact_text_laws():
    """P and P' (null) over the V² texts, by enumeration."""
    p = {(a, b): float(_seq_log_probs([0], None)[a] + _seq_log_probs([0], a)[b]) for a in range(SEQ_V) for b in range(SEQ_V)}
    q = {(a, b): float(_seq_log_probs([None], None)[a] + _seq_log_probs([None], a)[b]) for a in range(SEQ_V) for b in range(SEQ_V)}
    return np.exp(np.array(list(p.values()))), np.exp(np.array(list(q.values())))


def _exact_delta(epsilon: float) -> tuple[float, float]:
    """δ(ε) of the texts in both directions: Σ_x (P(x) - e^ε P'(x))_+ and the reverse."""
    p, q = _exact_text_laws()
    return np.clip(p - math.exp(epsilon) * q, 0, None).sum(), np.clip(q - math.exp(epsilon) * p, 0, None).sum()


def _exact_renyi(alpha: float) -> float:
    p, q = _exact_text_laws()
    return max(np.log(np.sum(p**alpha * q ** (1 - alpha))), np.log(np.sum(q**alpha * p ** (1 - alpha)))) / (alpha - 1)


@pytest.mark.parametrize("epsilon", [0.5, 1.0])
def test_sequence_epsilon_delta_claim_violated_and_honoured(epsilon):
    # the run's texts are draws from P (the forward δ); the neighbour's own texts, from P' (the reverse δ)
    forward, reverse = _exact_delta(epsilon)
    assert 0.1 < forward < 0.9 and 0.1 < reverse < 0.9
    honoured = audit_generator(toy_two_steps, [0], PrivacyClaim.approx_dp(epsilon, max(forward, reverse) + 0.05, steps=2))
    assert honoured.verdict is Verdict.PASS, honoured.reason
    assert [c.direction for c in honoured.sequence_checks] == ["forward", "reverse"]
    for check, exact in zip(honoured.sequence_checks, (forward, reverse)):
        assert check.quantity == "delta" and check.num_texts == TEXTS and check.lower <= exact <= check.upper
        assert check.estimate == pytest.approx(exact, abs=0.03) and check.significance == 0.05 / 2
    violated = audit_generator(toy_two_steps, [0], PrivacyClaim.approx_dp(epsilon, min(forward, reverse) - 0.05, steps=2))
    assert violated.verdict is Verdict.VIOLATION and "sampled delta" in violated.reason
    # the realised losses are exact: each text's loss is log P(x) - log P'(x) of the enumeration
    p, q = _exact_text_laws()
    texts = violated.output[:, 0] * SEQ_V + violated.output[:, 1]
    np.testing.assert_allclose(violated.text_losses[:, 0], np.log(p / q)[texts.numpy()], atol=1e-12)
    # at the truth: neither refuted nor supported by these texts, stated as such
    close = audit_generator(toy_two_steps, [0], PrivacyClaim.approx_dp(epsilon, max(forward, reverse), steps=2))
    assert close.verdict is Verdict.INCONCLUSIVE and "more texts" in close.reason


def test_sequence_renyi_claim_is_not_refuted_by_one_paths_sum():
    """The exact sequence D_2 is below the largest path's sum of per-step divergences (adaptive composition bounds it by
    the supremum): a sequence-level claim at the exact value is no VIOLATION; a claim far below it is."""
    exact = _exact_renyi(2.0)
    audit = audit_generator(toy_two_steps, [0], PrivacyClaim.rdp({2.0: exact}, steps=2))
    path_sums = np.maximum(audit.sequence_renyi_forward, audit.sequence_renyi_reverse)[:, 0, 0]
    assert path_sums.max() > exact * 1.1  # the old check would have called this a violation
    assert audit.verdict is Verdict.INCONCLUSIVE and "sequence Renyi" not in audit.reason
    assert [c.direction for c in audit.sequence_checks] == ["forward", "reverse"]
    for check in audit.sequence_checks:  # no a-priori range: a Rényi claim is never supported
        assert check.lower <= exact and check.upper == math.inf
    low = audit_generator(toy_two_steps, [0], PrivacyClaim.zcdp(exact / 2 / 4, steps=2))
    assert low.verdict is Verdict.VIOLATION and "sampled renyi at 2" in low.reason


def test_gdp_claim_checked_on_a_grid():
    mu = 0.3
    assert _exact_delta(0.0)[0] > 2 * _norm_tv(mu)  # the toy is further apart than 0.3-GDP allows at epsilon = 0
    audit = audit_generator(toy_two_steps, [0], PrivacyClaim.gdp(mu, steps=2))
    assert audit.verdict is Verdict.VIOLATION
    assert [c.at for c in audit.sequence_checks][0] == 0.0 and len(audit.sequence_checks) == 2 * 4  # both directions
    assert audit_generator(toy_two_steps, [0], PrivacyClaim.gdp(5.0, steps=2)).verdict is not Verdict.VIOLATION


def _norm_tv(mu: float) -> float:
    """δ(0) of μ-GDP: 2Φ(μ/2) - 1."""
    return math.erf(mu / 2 / math.sqrt(2))


def test_reported_epsilon_below_its_own_claim_is_a_finding():
    certified = composed_epsilon(1e-6, EPS0, T)
    honest = audit_generator(toy_categorical, REFS, br_claim(EPS0, reported_epsilon=certified, reported_delta=1e-6))
    assert honest.verdict is Verdict.PASS and honest.certified_epsilon == pytest.approx(certified, rel=1e-9)
    low = audit_generator(toy_categorical, REFS, br_claim(EPS0, reported_epsilon=certified / 2, reported_delta=1e-6))
    assert low.verdict is Verdict.VIOLATION
    assert f"reports epsilon = {certified / 2:.6g}" in low.reason and f"composes to {certified:.6g}" in low.reason
    assert low.claim_lower_epsilon == PrivacyClaim.per_step(steps=T, epsilon0=EPS0).epsilon_lower_at(1e-6)


def test_reported_epsilon_from_a_tighter_accountant_is_no_violation():
    """br-adaptive at a finer lattice certifies a smaller ε than ours (both valid upper bounds): the report is between
    the claim's lower bound (the worst ε0-BR composition's bracket) and our upper bound, so INCONCLUSIVE, never a
    VIOLATION; below the lower bound it is one."""
    from accounting.bounded_range import br_adaptive_epsilon

    finer = br_adaptive_epsilon(1e-6, EPS0, T, lattice_steps=200)
    audit = audit_generator(toy_categorical, REFS, br_claim(EPS0, reported_epsilon=finer, reported_delta=1e-6))
    assert audit.claim_lower_epsilon < finer < audit.certified_epsilon
    assert audit.verdict is Verdict.INCONCLUSIVE and "rests on more than the claim states" in audit.reason
    below = audit_generator(toy_categorical, REFS, br_claim(EPS0, reported_epsilon=0.99 * audit.claim_lower_epsilon,
                                                            reported_delta=1e-6))  # fmt: skip
    assert below.verdict is Verdict.VIOLATION and "a mechanism meeting it exactly has epsilon >=" in below.reason


def _two_point(p, q, rows: int = 400, draws: int = 1, calls: int = 1):
    """A generator drawing ``calls`` times from p (reference present) or q (None), ``rows`` rows of ``draws`` each."""

    def generate(references):
        probs = torch.tensor(p if references[0] is not None else q, dtype=torch.float64)
        gen = torch.Generator().manual_seed(1)
        return [torch.multinomial(probs.expand(rows, len(p)), draws, replacement=True, generator=gen) for _ in range(calls)]

    return generate


def test_sequence_claims_are_checked_in_both_directions():
    """P = (.5, .5, 0), P' = (.25, .25, .5): forward δ(1) = 0 (P's texts see no loss above log 2), reverse δ(1) =
    P'(token 2) = 0.5 (an infinite loss: P gives it 0). Only the neighbour's own texts can show it."""
    seen = []
    generate = _two_point((0.5, 0.5, 0.0), (0.25, 0.25, 0.5))

    def counted(references):
        seen.append(references[0])
        return generate(references)

    audit = audit_generator(counted, ["secret"], PrivacyClaim.approx_dp(1.0, 0.1, steps=1))
    assert seen == ["secret", None, None, "secret"]  # the run, the forced replay, the neighbour free, the replay
    forward, reverse = audit.sequence_checks
    assert forward.direction == "forward" and forward.upper < 0.1 and forward.lower == 0.0
    assert reverse.direction == "reverse" and reverse.lower > 0.1 and reverse.lower <= 0.5 <= reverse.upper
    tokens = torch.cat(audit.output).numpy()[:, 0]
    np.testing.assert_allclose(audit.text_losses[:, 0], math.log(2.0))  # log(.5/.25) on every token P draws
    assert (tokens < 2).all() and np.isinf(audit.reverse_text_losses[0]).sum() > 100  # token 2: +inf, kept
    assert audit.verdict is Verdict.VIOLATION and "(neighbour 0, reverse)" in audit.reason
    # a per-step claim keeps its cost: the run and one replay per neighbour, no reverse runs
    seen.clear()
    per_step = audit_generator(counted, ["secret"], PrivacyClaim.per_step(steps=1, epsilon=1.0))
    assert seen == ["secret", None] and per_step.reverse_text_losses == ()
    assert per_step.verdict is Verdict.VIOLATION  # |log .5 - log 0| = inf on the union support


def test_a_calls_draws_are_steps_of_its_rows_text():
    """One multinomial(p, 50, replacement=True) per row is 50 steps of that row's text: a per-step claim for one step
    is exceeded by 49 steps; the text's loss is the sum of its 50 draws' (k draws of token 1 give k·l1 + (50-k)·l0)."""
    e = 0.5
    p = (1 / (1 + math.exp(e)), math.exp(e) / (1 + math.exp(e)))
    generate = _two_point(p, (0.5, 0.5), rows=3, draws=50, calls=2)
    one = audit_generator(generate, ["x"], PrivacyClaim.per_step(steps=1, epsilon=e))
    assert one.verdict is Verdict.VIOLATION and one.excesses["draws per text over the claim's steps"] == 99
    honest = audit_generator(generate, ["x"], PrivacyClaim.per_step(steps=100, epsilon=e))
    assert honest.verdict is Verdict.PASS, honest.reason
    assert honest.text_losses.shape == (3, 1) and honest.sequence_renyi_forward.shape == (3, 1, len(honest.alphas))
    k = sum(c.tokens.sum(1).numpy() for c in honest.calls)  # draws of token 1 per row, over both calls
    l1, l0 = math.log(2 * p[1]), math.log(2 * p[0])
    np.testing.assert_allclose(honest.text_losses[:, 0], k * l1 + (100 - k) * l0, atol=1e-12)
    np.testing.assert_allclose(honest.sequence_renyi_forward[:, 0], np.tile(100 * honest.renyi_forward[0, 0], (3, 1)), rtol=1e-12)


def test_pure_sequence_claim_is_violated_by_one_realised_text():
    """Pure ε-DP bounds the loss of every output: P = (.9, .1) against (.1, .9) over 2 steps gives |L| ∈ {0, 2 log 9}."""
    generate = _two_point((0.9, 0.1), (0.1, 0.9), rows=20, calls=2)
    audit = audit_generator(generate, ["x"], PrivacyClaim.approx_dp(0.5, 0.0, steps=2))
    worst = max(np.abs(audit.text_losses).max(), np.abs(audit.reverse_text_losses[0]).max())
    assert worst == pytest.approx(2 * math.log(9))
    assert audit.verdict is Verdict.VIOLATION and "sequence |realised loss| over pure epsilon" in audit.reason
    assert audit.excesses["sequence |realised loss| over pure epsilon"] == pytest.approx(2 * math.log(9) - 0.5)
    within = audit_generator(generate, ["x"], PrivacyClaim.approx_dp(2 * math.log(9), 0.0, steps=2))
    assert within.verdict is not Verdict.VIOLATION, within.reason


# ---------------------------------------------------------------------------------------------
# transformers' generate(do_sample=True), its warpers included


def _prompt_ids(tokenizer, references):
    text = " | ".join("" if r is None else r for r in references)
    return tokenizer(text, return_tensors="pt").input_ids


def test_hf_generate_records_the_warped_softmax(tiny):
    model, tokenizer = tiny.model, tiny.tokenizer
    references = ["alice lives in paris", "bob likes green tea"]

    def generate(refs):
        out = model.generate(_prompt_ids(tokenizer, refs), do_sample=True, max_new_tokens=3, top_k=20,
                             temperature=0.7, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        return out[0].tolist()

    torch.manual_seed(1)
    audit = audit_generator(generate, references, br_claim(1.0, max_new_tokens=3))
    assert len(audit.calls) == 3 and audit.dtypes == ("float32",)
    ids = _prompt_ids(tokenizer, references)
    prompt_len = ids.shape[1]
    assert [int(c.tokens) for c in audit.calls] == audit.output[prompt_len:]
    for step in (0, 2):
        prefix = torch.tensor([audit.output[: prompt_len + step]])
        with torch.no_grad():
            scores = model(prefix).logits[0, -1].float() / 0.7
        kth = torch.topk(scores, 20).values[-1]
        expected = torch.softmax(torch.where(scores < kth, -math.inf, scores), -1)
        torch.testing.assert_close(audit.calls[step].log_probs[0].exp(), expected.double(), atol=1e-6, rtol=1e-5)
        assert int((audit.calls[step].log_probs > -math.inf).sum()) == 20
    # a top-k release is not DP: a token in one support and not the other is an infinite loss
    assert audit.verdict is Verdict.VIOLATION and np.isinf(audit.loss_range).any()


# ---------------------------------------------------------------------------------------------
# dp-fusion-lib 0.1.0, its shipped loop, installed from the package registry at test time


# the dp_fusion fixture (tests/conftest.py) installs it from the package registry


PRIVATE_DOC = "John Doe was admitted to St Mary hospital on 3 May with a fracture."
PUBLIC_DOC = "_ was admitted to _ hospital on _ with a fracture."


def _dp_fusion_audit(dp_fusion, tiny, alpha: float, beta: float, aligned: bool, steps: int = 8) -> GeneratorAudit:
    """The user's glue (DP-Fusion's shipped loop). The neighbour (None) is the redacted document. ``aligned``: its
    token path, private and public token ids of equal length (its tagger's form: the private span's tokens replaced
    by the placeholder's id); else ``DPFusion.generate`` with the two documents as text.

    The claim, read from its code: ``find_lambda`` bisects λ until its symmetric D_α(mixture, public) ≤ αβ
    (``internal_beta = alpha * beta``) at every step, so per step D_α ≤ αβ both ways at the one order α, composed over
    T draws; its own ε (``compute_epsilon_single_group(..., beta)["theoretical"]``, 4β per recorded step plus
    log(1/δ)/(α-1), over the T - 1 steps it records) is the reported figure."""
    dpf, tok = dp_fusion.DPFusion(model=tiny.model, tokenizer=tiny.tokenizer, max_tokens=steps), tiny.tokenizer
    private = tok(PRIVATE_DOC, return_tensors="pt").input_ids[0]
    public = private.clone()
    public[:6] = tok.convert_tokens_to_ids("_")

    def generate(refs):
        if aligned:
            return dpf.generate_from_tokens(public if refs[0] is None else private, public, alpha=alpha, beta=beta)
        return dpf.generate(private_context=refs[0] or PUBLIC_DOC, public_context=PUBLIC_DOC, alpha=alpha, beta=beta)

    reported = dp_fusion.compute_epsilon_single_group([0.0] * (steps - 1), alpha, 1e-5, beta)["theoretical"]
    claim = PrivacyClaim.per_step(steps=steps, renyi={alpha: alpha * beta}, reported_epsilon=reported,
                                  reported_delta=1e-5, source="dp-fusion-lib 0.1.0")  # fmt: skip
    torch.manual_seed(0)
    return audit_generator(generate, [PRIVATE_DOC], claim)


def _per_step(audit: GeneratorAudit) -> np.ndarray:
    return np.maximum(audit.renyi_forward, audit.renyi_reverse)[:, 0, 0]


# its torch.amp.autocast("cuda") on a CPU, and its past_key_values= keyword, warn
@pytest.mark.filterwarnings("ignore:.*CUDA is not available:UserWarning", "ignore:.*past_key_values:FutureWarning")
def test_dp_fusion_lib_shipped_loop(dp_fusion, tiny):
    honest = _dp_fusion_audit(dp_fusion, tiny, alpha=2.0, beta=0.5, aligned=True)
    collapse = _dp_fusion_audit(dp_fusion, tiny, alpha=8.0, beta=0.5, aligned=True)
    padded = _dp_fusion_audit(dp_fusion, tiny, alpha=2.0, beta=0.5, aligned=False)
    for audit in (honest, collapse, padded):
        assert {c.sampler for c in audit.calls} == {"torch.multinomial"} and audit.dtypes == ("float32",)
        assert len(audit.calls) == len(audit.output["lambdas"]["PRIVATE"]) + 1  # its first step is never recorded
    # honest: every step's true D_2 within αβ = 1 up to float32 rounding (its tolerance 3.1e-5, resolvable against
    # 1), its reported ε above what its per-step claim composes to; its own records are our steps 1..T-1
    assert honest.verdict is Verdict.PASS, honest.reason
    assert _per_step(honest).max() <= 1.0 + honest.tolerance and honest.tolerance == tolerance_for(torch.float32)
    assert honest.claim.reported_epsilon > honest.certified_epsilon
    np.testing.assert_allclose(honest.output["divergences"]["PRIVATE"], _per_step(honest)[1:], atol=1e-5)
    # α = 8: every λ is 1 - 2^-20 (its bisection reads NaN as "within the bound"), every divergence it records is
    # NaN, and the released distribution's true D_8 passes αβ = 4 and the composed budget
    assert np.allclose(collapse.output["lambdas"]["PRIVATE"], 1 - 2.0**-20)
    assert np.isnan(collapse.output["divergences"]["PRIVATE"]).all()
    assert _per_step(collapse).max() > 2 * 4.0 and collapse.verdict is Verdict.VIOLATION
    # and its own ε (4β per step at α = 8) is below what its per-step claim αβ composes to
    assert collapse.claim.reported_epsilon < collapse.certified_epsilon / 2
    # but not below the ε of the Gaussian that meets the claim exactly (ρ = 4/8 per step, 15.46 at δ = 1e-5): its
    # 15.64 is no VIOLATION on its own, it rests on more than the claim states (the VIOLATION is the released D_8)
    assert collapse.claim_lower_epsilon < collapse.claim.reported_epsilon < collapse.certified_epsilon
    assert "step Renyi over its claim" in collapse.reason and honest.claim_lower_epsilon is None
    # text contexts of unequal length: its public row is right-padded without an attention mask, so its "public"
    # distribution is not the redacted document's and the release is far from the neighbour's
    assert padded.verdict is Verdict.VIOLATION and _per_step(padded).max() > 4.0
