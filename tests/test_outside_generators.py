"""Generators this project did not write, audited through their own shipped code (issue 35, items 5 and 6).

Each adapter below is the user glue shown in docs/guide/outside-generators.md (at most 20 lines: a ``generate``
and a claim); the packages come from the package registry at test time (the ``registry`` fixture, tests/conftest.py)
and the tests skip only when it cannot be reached. Oracles: closed forms and Monte Carlo for the noisy-argmax law;
a package's reported ε recomputed (invink's CKS conversion), its accountant against dp-accounting (the pack),
its divergence computed exactly in float64 (dp-fusion's find_lambda).
"""

import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import special, stats

from accounting import PrivacyClaim
from invink_audit.audit import Verdict, audit_generator
from invink_audit.audit.intercept import noisy_argmax_log_probs, unreleased

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "outside-generators.md"
#: the most lines of user glue an adapter may take (issue 35): its block, less imports and blank lines
GLUE_LINES = 20


def guide_function(name: str):
    """The function ``name`` defined by a ```python block of the guide, run as it is shown there (its imports too);
    the block must stay within :data:`GLUE_LINES` lines of glue."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    (code,) = [b for b in blocks if f"def {name}(" in b]
    glue = [line for line in code.splitlines() if line.strip() and not line.startswith(("import ", "from "))]
    assert len(glue) <= GLUE_LINES, (name, len(glue))
    namespace: dict = {}
    exec(compile(code, f"{GUIDE}:{name}", "exec"), namespace)
    return namespace[name]


#: Monte Carlo draws for the noisy-argmax law, and the binomial interval's z (two-sided 1e-6)
MC_DRAWS, MC_Z = 400_000, 5.0


def rho_claim(name: str, rho_step: float, steps: int) -> PrivacyClaim:
    """An a-priori ρ-zCDP claim per step, composed over ``steps`` (Bun & Steinke 2016, Lemma 2.3)."""
    return PrivacyClaim.per_step(steps=steps, rho=rho_step, source=name)


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
                            rho_claim("toy report-noisy-max", 1 / (2 * SIGMA**2), T))  # fmt: skip
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
    # the argmax spends far less than the Gaussian's ρ (0.008 to 0.03 of its α·ρ over 80 runs of this toy): a claim a
    # thousand times smaller is caught
    assert audit_generator(lambda refs: _report_noisy_max(refs, vectorised), refs,
                           rho_claim("toy", 1 / (2000 * SIGMA**2), T)).verdict is Verdict.VIOLATION


def test_gumbel_max_is_recorded_as_the_exponential_mechanism():
    """argmax(s + b·Gumbel) over utilities in [0, 1] per reference, made by a default_rng inside the function: its law is
    softmax(s/b), a bounded range of 1/b per step for a reference replaced by null (McSherry & Talwar 2007)."""
    scale = 2.0

    def generate(references):
        rng, out = np.random.default_rng(), []
        for step in range(T):
            scores = sum(np.random.RandomState(100 + r + step).rand(V) for r in references if r is not None)
            noisy = rng.gumbel(0.0, scale, size=V) + scores
            out.append(int(np.argmax(noisy)))
            assert type(noisy[1:]) is np.ndarray and list(noisy[:2]) == [noisy[0], noisy[1]]  # derived arrays: plain
        return out

    epsilon0 = 1 / scale
    claim = PrivacyClaim.per_step(steps=T, epsilon0=epsilon0, rho=epsilon0**2 / 8, source="Gumbel-max")
    audit = audit_generator(generate, [1, 2, 3], claim)
    assert [c.sampler for c in audit.calls] == ["noisy argmax (gumbel noise)"] * T and audit.verdict is Verdict.PASS
    scores = sum(np.random.RandomState(100 + r).rand(V) for r in (1, 2, 3))
    np.testing.assert_allclose(audit.calls[0].log_probs[0].numpy(), scores / scale - special.logsumexp(scores / scale))
    assert audit.loss_range.max() <= epsilon0 + 1e-12


def test_a_nan_score_in_a_noisy_argmax_is_a_finding():
    def generate(references):
        scores = np.array([0.1, np.nan if None in references else 0.2, 0.3])
        return int(np.argmax(scores + np.random.RandomState().normal(0, 1.0, size=3)))

    audit = audit_generator(generate, [1, 2], rho_claim("toy", 1.0, 1))
    assert audit.verdict is Verdict.VIOLATION and audit.nonfinite == 2  # both neighbours' draws: NaN, counted


def test_unreleased_draws_pass_through_unrecorded():
    def generate(references):
        with unreleased("torch.multinomial"):
            torch.multinomial(torch.ones(5), 1)  # a draw whose token is discarded
        return _report_noisy_max(references)

    audit = audit_generator(generate, [1, 2], rho_claim("toy", 1 / (2 * SIGMA**2), T))
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


def invink_adapter(invink, model_dir, **options):
    """The guide's adapter (worked example 1) on the module's references: (generate, claim)."""
    return guide_function("invink_adapter")(model_dir, len(INVINK_REFS), **options)


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
    report = blackbox_audit(target, INVINK_REFS, CANARY, claimed_epsilon=2.0, claimed_delta=1e-6, num_trials=10)
    assert report.verdict is Verdict.INCONCLUSIVE and 0.0 <= report.epsilon_lower_bound <= 2.0


# ---------------------------------------------------------------------------------------------
# llama-index-packs-diff-private-simple-dataset 0.4.1 (Tang et al., ICLR 2024), driven by a local stand-in LLM

#: the pack and the part of its dependency closure this environment lacks, pinned to what pip resolved on 2026-11-28
#: (llama-index-core <= 0.14.20: 0.14.21 removed llama_index.core.llama_pack, which the pack's declared
#: range "<0.15" admits: installed as declared, it fails to import)
PACK_REQUIREMENTS = (
    "llama-index-packs-diff-private-simple-dataset==0.4.1", "llama-index-core==0.14.20",
    "llama-index-instrumentation==0.6.0", "llama-index-workflows==2.26.1", "prv-accountant==0.2.0", "banks==2.5.1",
    "colorama==0.4.6", "dataclasses-json==0.6.7", "deprecated==1.3.1", "filetype==1.2.0", "greenlet==3.5.6",
    "griffe==2.4.1", "griffecli==2.4.1", "griffelib==2.4.1", "marshmallow==3.26.2", "mypy-extensions==1.2.0",
    "platformdirs==4.14.8", "sqlalchemy==2.1.9", "tenacity==9.2.1", "tinytag==2.3.2", "typing-inspect==0.9.0",
)  # fmt: skip
#: top log-probabilities the stand-in LLM returns (as OpenAI's completion endpoint's ``logprobs=k``)
TOP_LOGPROBS = 8


@pytest.fixture(scope="module")
def pack(registry):
    registry(*PACK_REQUIREMENTS)
    import llama_index.packs.diff_private_simple_dataset.base as pack

    return pack


@pytest.fixture(scope="module")
def stand_in_llm(pack, tiny):
    """The guide's local stand-in for a completion LLM, over the tiny model (no network)."""
    return guide_function("stand_in_llm")(tiny.model, tiny.tokenizer, TOP_LOGPROBS)


#: ten examples: at four or eight (σ = 1) the pack's own accountant raises RuntimeError (its PRV discretisation)
PACK_REFS = ["great pasta, friendly staff", "the rooftop view was stunning", "cold soup and a long wait",
             "best tiramisu in town", "noisy room but kind staff", "the risotto was bland", "quick lunch, fair price",
             "lovely terrace in spring", "overpriced wine list", "we will come back"]  # fmt: skip


def pack_adapter(pack, llm, **options):
    """The guide's adapter (worked example 2) on the module's references: (generate, claim)."""
    return guide_function("pack_adapter")(llm, len(PACK_REFS), **options)


@pytest.fixture(scope="module")
def pack_glue(pack, stand_in_llm):
    """The adapter's (generate, claim) at its defaults, made once (its accountant takes seconds)."""
    return pack_adapter(pack, stand_in_llm)


@pytest.mark.parametrize("shuffle_seed", [0, 1, 2])
def test_pack_shipped_loop_white_box(pack_glue, shuffle_seed):
    """Its own loop: every token a Gaussian report-noisy-max (recorded exactly through its RandomState's noise and the
    scores added to it), within the per-step claim for a replaced example whatever its splits (Python's random, which
    shuffles them, is seeded here and held fixed by the replays); a claim a hundred times smaller is caught. The ε it
    reports (its PRV accountant: Poisson rate 1/N, δ = 1/N) is below what its per-token Gaussian composes to, and
    below the exact ε of t_max Gaussians at that δ (dp-accounting's PLD): its loop uses every example at every token."""
    generate, claim = pack_glue
    random.seed(shuffle_seed)
    audit = audit_generator(generate, PACK_REFS, claim)
    assert 1 <= len(audit.calls) <= 3 and {c.sampler for c in audit.calls} == {"noisy argmax (normal noise)"}
    assert audit.dtypes == ("float64",) and audit.calls[0].log_probs.shape[1] <= TOP_LOGPROBS  # its token universe
    assert audit.excesses["step Renyi over its claim"] <= 0 and audit.excesses["sequence Renyi over the claim"] <= 0
    assert audit.verdict is Verdict.VIOLATION and audit.reason.startswith("reports epsilon = "), audit.reason
    exact = _pld_epsilon(1.0, 1.0, 3, 1 / len(PACK_REFS))
    assert claim.reported_epsilon + 0.5 < exact <= audit.certified_epsilon
    strict = rho_claim("pack, a claim 100x smaller", claim.step.rho / 100, 3)
    random.seed(shuffle_seed)
    assert audit_generator(generate, PACK_REFS, strict).verdict is Verdict.VIOLATION


def test_pack_black_box(pack_glue):
    from invink_audit.audit import blackbox_audit
    from invink_audit.audit.targets import CallableTarget

    generate, claim = pack_glue
    target = CallableTarget(generate, label="llama-index DP simple dataset pack 0.4.1")
    report = blackbox_audit(target, PACK_REFS, CANARY, claimed_epsilon=2.0, claimed_delta=1e-6, num_trials=16)
    assert report.verdict is Verdict.INCONCLUSIVE and report.mechanism == target.label


def _pld_epsilon(sampling_rate: float, sigma: float, count: int, delta: float) -> float:
    """ε(δ) of ``count`` Poisson-subsampled Gaussian mechanisms (noise multiplier ``sigma``) by dp-accounting's PLD."""
    from dp_accounting import dp_event, pld

    accountant = pld.PLDAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(sampling_rate, dp_event.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("examples, size, num_splits, t_max", [(100, 10, 5, 20)])
def test_pack_accountant_against_dp_accounting(pack, stand_in_llm, examples, size, num_splits, t_max):
    """Its sigma_to_eps (PRV accountant, δ = 1/N) agrees with dp-accounting on the inputs it is given: Poisson rate
    size/N, t_max compositions. Its loop samples num_splits·num_samples_per_split of the label's examples afresh at
    every token of every one of the ``size`` examples: accounted so (Poisson as the pack's own approximation), ε differs,
    above or below its report."""
    from llama_index.core.llama_dataset.base import CreatedBy, CreatedByType
    from llama_index.core.llama_dataset.simple import LabelledSimpleDataExample, LabelledSimpleDataset

    example = LabelledSimpleDataExample(reference_label="r", text="x", text_by=CreatedBy(type=CreatedByType.HUMAN))
    bundle = pack.PromptBundle(instruction="i", text_heading="t", label_heading="l")
    dp_pack = pack.DiffPrivateSimpleDatasetPack(stand_in_llm, None, bundle, LabelledSimpleDataset(examples=[example] * examples))
    reported = dp_pack.sigma_to_eps(1.0, pack.PrivacyMechanism.GAUSSIAN, size, t_max)
    assert reported == pytest.approx(_pld_epsilon(size / examples, 1.0, t_max, 1 / examples), abs=0.02)
    # its LAPLACE branch is unreachable: PrivacyMechanism has no LAPLACE member (generate passes "gaussian")
    with pytest.raises(AttributeError, match="LAPLACE"):
        dp_pack._generate_noise(1.0, 3, "laplace")
    as_run = _pld_epsilon(num_splits / examples, 1.0, size * t_max, 1 / examples)
    assert as_run > reported + 0.5  # 2.20 as run vs 1.32 reported (at N=1000, size=100, t_max=50: 1.28 vs 3.31)


# ---------------------------------------------------------------------------------------------
# dp-fusion-lib 0.1.0 (white-box: tests/test_audit_intercept.py), black-box through its text path

DPF_PRIVATE = "John Doe was admitted to St Mary hospital on 3 May with a fracture."
DPF_PUBLIC = "_ was admitted to _ hospital on _ with a fracture."


def dp_fusion_adapter(dp_fusion, tiny, **options):
    """The guide's adapter (worked example 3) on the tiny model: (generate, claim)."""
    return guide_function("dp_fusion_adapter")(tiny.model, tiny.tokenizer, DPF_PUBLIC, **options)


@pytest.mark.filterwarnings("ignore:.*CUDA is not available:UserWarning", "ignore:.*past_key_values:FutureWarning")
def test_dp_fusion_black_box_text_path(dp_fusion, tiny):
    from invink_audit.audit import blackbox_audit
    from invink_audit.audit.targets import CallableTarget

    generate, claim = dp_fusion_adapter(dp_fusion, tiny)
    epsilon = claim.reported_epsilon  # over the T - 1 = 3 divergences it records
    assert epsilon == pytest.approx(4 * 0.5 * 3 + math.log(1e5) / (2.0 - 1.0)) and claim.reported_delta == 1e-5
    # white-box through the same glue: its text path pads the redacted context without an attention mask
    torch.manual_seed(0)
    audit = audit_generator(generate, [DPF_PRIVATE], claim)
    assert {c.sampler for c in audit.calls} == {"torch.multinomial"} and audit.verdict is Verdict.VIOLATION
    report = blackbox_audit(CallableTarget(generate, label="dp-fusion-lib 0.1.0"), [DPF_PRIVATE], CANARY,
                            claimed_epsilon=epsilon, claimed_delta=1e-5, num_trials=16)  # fmt: skip
    assert report.verdict is Verdict.INCONCLUSIVE and report.epsilon_lower_bound <= epsilon


DPF_ADAPTER_MODULE = f'''
import dp_fusion_lib
from invink_audit.models import build_tiny_model

tiny = build_tiny_model(seed=5)
dpf = dp_fusion_lib.DPFusion(model=tiny.model, tokenizer=tiny.tokenizer, max_tokens=4)


def generate(references):  # one private document; None: the redacted one
    return dpf.generate(private_context=references[0] or {DPF_PUBLIC!r}, public_context={DPF_PUBLIC!r}, alpha=2.0,
                        beta=0.5)["text"]
'''


@pytest.mark.filterwarnings("ignore:.*CUDA is not available:UserWarning", "ignore:.*past_key_values:FutureWarning")
def test_an_audit_spec_names_an_adapter(dp_fusion, tmp_path, monkeypatch):
    """``[target] kind = "callable"`` runs the dp-fusion adapter from a module beside the spec (black-box)."""
    from invink_audit.audit.spec import load_spec, run_spec

    (tmp_path / "dpf_adapter.py").write_text(DPF_ADAPTER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "dp_fusion.toml"
    path.write_text(f'kind = "black-box"\nseed = 1\n[target]\nkind = "callable"\nfunction = "dpf_adapter:generate"\n'
                    f'[data]\ninline = ["{DPF_PRIVATE}"]\n[mechanism]\nbatch_size = 1\nepsilon = 19.51\ndelta = 1e-5\n'
                    f'[blackbox]\ncanary = "{CANARY}"\nnum_trials = 16\n')  # fmt: skip
    report = run_spec(load_spec(path))
    assert report.mechanism == "callable dpf_adapter:generate" and report.verdict is Verdict.INCONCLUSIVE
    assert report.claimed_epsilon == 19.51 and report.claimed_delta == 1e-5


# ---------------------------------------------------------------------------------------------
# the self-test's rows for the adapter path (invink_audit.audit.selftest.ADAPTER_ROWS)


def test_selftest_adapter_rows():
    """The planted bugs of the adapter path are caught through audit_generator on the tiny model: generate's default
    top-k after a DP processor (a support chosen by private data: an infinite loss) and a claim one step short."""
    from invink_audit.audit.selftest import ADAPTER_ROWS, SelfTestResult, SelfTestSettings, adapter_entries, selftest_markdown

    entries = {e.mechanism: e for e in adapter_entries()}
    assert set(entries) == set(ADAPTER_ROWS) and all(e.passed for e in entries.values())
    assert {name: e.verdict for name, e in entries.items()} == {name: row[0] for name, row in ADAPTER_ROWS.items()}
    control, top_k, short = (entries[n].sources[0] for n in ADAPTER_ROWS)
    e0 = 2 * SelfTestSettings().clip_norm / len(SelfTestSettings().adapter_references)
    assert control["dtypes"] == ["float32"] and control["max_loss_range_over_epsilon0"] <= 1 + control["tolerance"] / e0
    assert control["max_loss_range_over_epsilon0"] > 0.9  # the clip binds: the control is not vacuous
    assert math.isinf(top_k["max_loss_range_over_epsilon0"]) and "step bounded range" in top_k["reason"]
    assert short["excesses"]["draws per text over the claim's steps"] == 1.0 and "draws per text" in short["reason"]
    md = selftest_markdown(SelfTestResult(tuple(entries.values()), {"passed": True, "num_outputs": 1, "covered": 1,
                                          "intervals": 1, "level": 0.95, "max_abs_error_importance_sampling": 0.0}, (), 0.0))
    assert "adapter-default-top-k" in md and "VIOLATION when generate's default top-k follows it" in md


@pytest.mark.parametrize("beta", [0.5, 0.1])
def test_dp_fusion_find_lambda_clamp_under_reports_the_divergence(dp_fusion, beta):
    """Its shipped find_lambda clamps probabilities at 1e-10 (in float32) before the Rényi divergence it bounds: where
    the public distribution puts less than 1e-10 on a token the private one favours, the λ it returns releases a
    mixture whose true D_α (float64, exact) is far above the αβ it reports holding."""
    alpha, v = 2.0, 50
    public = torch.full((v,), 1.0 / (v - 1), dtype=torch.float64)
    public[0] = 1e-14
    public /= public.sum()
    private = torch.full((v,), 0.5 / (v - 1), dtype=torch.float64)
    private[0] = 0.5
    lam, reported = dp_fusion.find_lambda(private.float(), public.float(), alpha, alpha * beta)
    mixture = lam * private + (1 - lam) * public
    true = max(math.log(float((mixture**alpha * public ** (1 - alpha)).sum())),
               math.log(float((public**alpha * mixture ** (1 - alpha)).sum()))) / (alpha - 1)  # fmt: skip
    assert reported <= alpha * beta + 1e-6 and true > 5 * alpha * beta  # 9.7x at beta = 0.5, 38x at 0.1
