"""Generators this project did not write, audited through their own shipped code (issue 35, items 5 and 6).

Each adapter below is the user glue shown in docs/guide/outside-generators.md (at most 20 lines: a ``generate``
and a claim); the packages come from the package registry at test time (the ``registry`` fixture, tests/conftest.py)
and the tests skip only when it cannot be reached. Oracles: closed forms and Monte Carlo for the noisy-argmax law;
each package's own arithmetic recomputed (its clip, its noise scale) and its accountant against dp-accounting.
"""

import math
import sys

import numpy as np
import pytest
import torch
from scipy import special, stats

from invink_audit.audit import Verdict, audit_generator
from invink_audit.audit.intercept import noisy_argmax_log_probs, unreleased
from invink_audit.audit.whitebox import Claim
from invink_audit.mechanisms import MechanismGuarantee
from invink_audit.mechanisms.base import GuaranteeKind

#: Monte Carlo draws for the noisy-argmax law, and the binomial interval's z (two-sided 1e-6)
MC_DRAWS, MC_Z = 400_000, 5.0


def zcdp_claim(name: str, rho_step: float, steps: int, batch_size: int, *, delta: float = 1e-6) -> Claim:
    """An a-priori per-step ρ-zCDP claim composed over ``steps`` (Bun & Steinke 2016, Lemma 2.3)."""
    g = MechanismGuarantee(GuaranteeKind.A_PRIORI, name, epsilon=math.inf, delta=delta, max_new_tokens=steps,
                           composition="zcdp", rho_sequence=steps * rho_step, step_epsilon0=math.inf,
                           step_rho=rho_step)  # fmt: skip  (no bounded-range claim: epsilon0 = inf)
    return Claim(g, batch_size)


# ---------------------------------------------------------------------------------------------
# the noisy-argmax law (an argmax over scores plus noise of a declared law)


@pytest.mark.parametrize("gap", [0.0, 0.3, 2.0, 9.0])
def test_gaussian_noisy_argmax_two_scores_closed_form(gap):
    """Two scores: P(0 wins) = Φ((s0 − s1)/(b√2)) (the difference of two Gaussians)."""
    scale = 0.7
    got = noisy_argmax_log_probs([gap, 0.0], "normal", scale)
    expected = [special.log_ndtr(gap / (scale * math.sqrt(2))), special.log_ndtr(-gap / (scale * math.sqrt(2)))]
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_gumbel_noisy_argmax_is_softmax_and_gaussian_matches_monte_carlo():
    scores, scale = np.array([0.4, 0.1, -0.2, 0.35, 0.0]), 0.3
    np.testing.assert_allclose(noisy_argmax_log_probs(scores, "gumbel", scale), scores / scale - special.logsumexp(scores / scale))
    rng = np.random.default_rng(0)
    for law, sampler in (("normal", stats.norm), ("gumbel", stats.gumbel_r)):
        winners = np.argmax(scores + scale * sampler.rvs(size=(MC_DRAWS, scores.size), random_state=rng), 1)
        freq = np.bincount(winners, minlength=scores.size) / MC_DRAWS
        p = np.exp(noisy_argmax_log_probs(scores, law, scale))
        assert p.sum() == pytest.approx(1.0, abs=1e-12)
        assert np.all(np.abs(freq - p) <= MC_Z * np.sqrt(p * (1 - p) / MC_DRAWS)), (law, freq, p)


def test_noisy_argmax_rejects_bad_input():
    with pytest.raises(ValueError, match="law must be one of"):
        noisy_argmax_log_probs([0.0, 1.0], "laplace", 1.0)
    with pytest.raises(ValueError, match="scale must be a positive"):
        noisy_argmax_log_probs([0.0, 1.0], "normal", 0.0)
    with pytest.raises(ValueError, match="non-empty finite vector"):
        noisy_argmax_log_probs([0.0, math.nan], "normal", 1.0)


V, T, SIGMA = 6, 4, 0.5


def _report_noisy_max(references, vectorised: bool = False):
    """A Gaussian report-noisy-max over the mean of the references' score vectors in [0, 1]^V (ℓ2 sensitivity of the
    sum under replace-by-null: √V), noise σ·√V: per step ρ = 1/(2σ²) (Bun & Steinke 2016, Prop. 1.6), drawn the way
    llama-index's pack draws it (a fresh RandomState, a dict, Python's max) or as one array."""
    out, prev = [], 0
    for _ in range(T):
        total = sum(np.random.RandomState(100 + r).rand(V) * (1 + prev % 2) / 2 for r in references if r is not None)
        noise = np.random.RandomState().normal(0, SIGMA * math.sqrt(V), size=V)
        if vectorised:
            prev = int(np.argmax(np.asarray(total, dtype=float) + noise))
        else:
            noisy = {token: score + z for (token, score), z in zip(dict(enumerate(np.atleast_1d(total))).items(), noise)}
            prev = max(noisy, key=noisy.get)
        out.append(prev)
    return out


@pytest.mark.parametrize("vectorised", [False, True], ids=["dict-and-max", "array"])
def test_report_noisy_max_audited_through_its_noise(vectorised):
    audit = audit_generator(lambda refs: _report_noisy_max(refs, vectorised), [1, 2, 3],
                            zcdp_claim("toy report-noisy-max", 1 / (2 * SIGMA**2), T, 3))  # fmt: skip
    assert [c.sampler for c in audit.calls] == ["noisy argmax (normal noise)"] * T
    assert [int(c.tokens) for c in audit.calls] == audit.output  # the generator's own max picked the recorded token
    # the recorded law is the exact one of the scores it was given (recomputed independently)
    refs = [1, 2, 3]
    prev = [0] + audit.output[:-1]
    for step, p in enumerate(prev):
        scores = sum(np.random.RandomState(100 + r).rand(V) * (1 + p % 2) / 2 for r in refs)
        np.testing.assert_allclose(audit.calls[step].log_probs[0].numpy(),
                                   noisy_argmax_log_probs(scores, "normal", SIGMA * math.sqrt(V)), atol=1e-12)
    assert audit.verdict is Verdict.PASS, audit.reason
    # a claim a hundred times smaller is caught: the true per-step D_α of a noisy argmax is far above it
    assert audit_generator(lambda refs: _report_noisy_max(refs, vectorised), refs,
                           zcdp_claim("toy", 1 / (200 * SIGMA**2), T, 3)).verdict is Verdict.VIOLATION


def test_unreleased_draws_pass_through_unrecorded():
    def generate(references):
        with unreleased("torch.multinomial"):
            torch.multinomial(torch.ones(5), 1)  # a draw whose token is discarded
        return _report_noisy_max(references)

    audit = audit_generator(generate, [1, 2], zcdp_claim("toy", 1 / (2 * SIGMA**2), T, 2))
    assert {c.sampler for c in audit.calls} == {"noisy argmax (normal noise)"} and len(audit.calls) == T


# ---------------------------------------------------------------------------------------------
# the reference package invink 0.1.0 (InvisibleInk's authors' code), its own generate loop


@pytest.fixture(scope="module")
def invink(registry):
    """invink 0.1.0 from the registry. It declares Python >= 3.8, but its utils.py nests double quotes inside a
    double-quoted f-string (a print in load_hf_model: valid from Python 3.12, PEP 701, a SyntaxError before); below
    3.12 that one print's inner quotes are swapped in the temporary copy, nothing else (docs/results/outside-generators.md)."""
    site = registry("invink==0.1.0")
    if sys.version_info < (3, 12):
        path = site / "invink" / "utils.py"
        text = path.read_text()
        fixed = text.replace('{"all devices" if device_map == "auto" else device_map}',
                             "{'all devices' if device_map == 'auto' else device_map}")
        assert fixed.count("\n") == text.count("\n") and fixed != text
        path.write_text(fixed)
    import invink

    return invink


CANARY = "my card number is 4929 7310 5528 1746"
INVINK_REFS = ["the pasta was cold and the waiter rude", "lovely rooftop bar, great cocktails"]


def invink_adapter(invink, model_dir, *, epsilon=2.0, delta=1e-6, steps=4, **options):
    """The user glue (docs/guide/outside-generators.md): invink's own loop on B = len(references) references, one
    text, T = ``steps``; its claim: ρ = epsilon_to_zcdp(ε, δ) for T tokens (its get_clip inverts the same CKS
    conversion), ρ/T per token (its compute_rho), replace-by-null (its empty reference is its public prompt)."""
    from accounting import epsilon_to_zcdp

    def generate(references):  # None -> "" is invink's public prompt when drop_empty=False
        with unreleased("torch.multinomial"):  # its per-token model.generate(do_sample=True) token is discarded
            out = invink.generate(["" if r is None else r for r in references], model_name_or_path=str(model_dir),
                                  dataset_desc="short restaurant reviews", epsilon=epsilon, delta=delta,
                                  batch_size=len(INVINK_REFS) + 1, num=1, dtype="float32", device_map=-1,
                                  allow_download=False, **{"drop_empty": False, "max_toks": steps, **options})
        return out

    rho = epsilon_to_zcdp(epsilon, delta, "cks")
    return generate, zcdp_claim("invink 0.1.0", rho / steps, steps, len(INVINK_REFS), delta=delta)


#: invink passes past_key_values= to generate (deprecated in transformers 5)
INVINK_WARNINGS = pytest.mark.filterwarnings("ignore:.*past_key_values:FutureWarning")


@INVINK_WARNINGS
def test_invink_shipped_loop_white_box(invink, tiny_dir):
    """Honest (T fixed, no reference dropped): PASS, top-k+ included (its 2C/(B+1) expansion is narrower than the
    paper's 2C/B, but the set is a function of the public row: no privacy loss). Its defaults: max_toks="auto" makes T
    a function of the references (a neighbour's replay runs past the actual run's draws), drop_empty=True shifts the
    next reference into the batch (a replacement, sensitivity 2C/B: a VIOLATION of its C/B claim)."""
    from accounting import zcdp_to_epsilon
    from invink_audit.audit import InterceptionError

    generate, claim = invink_adapter(invink, tiny_dir, topk=5)
    honest = audit_generator(generate, INVINK_REFS, claim)
    assert honest.verdict is Verdict.PASS, honest.reason
    assert [c.sampler for c in honest.calls] == ["numpy.random.choice"] * 4 and honest.dtypes == ("float64",)
    per_step = np.maximum(honest.renyi_forward, honest.renyi_reverse).max((0, 1))
    assert np.all(per_step <= np.array(honest.alphas) * claim.step.rho + honest.tolerance)
    assert per_step[0] > 0.5 * honest.alphas[0] * claim.step.rho  # the clip binds: the check is not vacuous
    # its reported epsilon_spent is the CKS conversion of rho_tok times the realised length (not of T)
    length = honest.output.lens[0]
    assert honest.output.epsilon_spent[0] == pytest.approx(zcdp_to_epsilon(claim.step.rho * length, 1e-6), rel=1e-6)

    generate, claim = invink_adapter(invink, tiny_dir, max_toks="auto")
    with pytest.raises(InterceptionError, match=r"neighbour 0: sampling call \d+ \(numpy.random.choice\) has no counterpart"):
        audit_generator(generate, INVINK_REFS, claim)
    generate, claim = invink_adapter(invink, tiny_dir, drop_empty=True)
    dropped = audit_generator(generate, [*INVINK_REFS, "the pasta was cold"], claim)
    assert dropped.verdict is Verdict.VIOLATION and "step Renyi" in dropped.reason
    ratio = np.maximum(dropped.renyi_forward, dropped.renyi_reverse).max((0, 1)) / (np.array(dropped.alphas) * claim.step.rho)
    assert ratio.max() > 1.1  # up to 4x: a replacement moves the mean logit by up to 2C/B


@INVINK_WARNINGS
def test_invink_black_box(invink, tiny_dir):
    """The black box a new user reaches for (ReferencePackageTarget: one invink.generate per trial, a fresh seed each)
    on the honest configuration: nothing certified above the claim at this number of trials."""
    from invink_audit.audit import blackbox_audit
    from invink_audit.audit.targets import ReferencePackageTarget

    target = ReferencePackageTarget(str(tiny_dir), batch_size=2, dataset_desc="short restaurant reviews", epsilon=2.0,
                                    delta=1e-6, max_toks=4, drop_empty=False, dtype="float32", device_map=-1,
                                    allow_download=False, random_seed=None)  # fmt: skip
    report = blackbox_audit(target, INVINK_REFS, CANARY, claimed_epsilon=2.0, claimed_delta=1e-6, num_trials=16)
    assert report.verdict is Verdict.INCONCLUSIVE and 0.0 <= report.epsilon_lower_bound <= 2.0
