"""Black-box canary auditor: validity on a mechanism with known epsilon, power on a leaky one,
held-out threshold selection; the targets (invink_audit.audit.targets): a callable (from a spec too), the engine
for any mechanism, the reference package (when importable)."""

import math
import random
import re

import numpy as np
import pytest
from scipy import stats as sps

from invink_audit.audit import blackbox
from invink_audit.audit.stats import Verdict
from invink_audit.audit.targets import CallableTarget, EngineTarget, ReferencePackageTarget
from invink_audit.mechanism import MechanismConfig

CANARY = "the zebra named Quorrick lives at 42 Violet Lane"


def _randomized_response(epsilon, seed):
    """Emits the canary with probability e^eps/(1+e^eps) when present, 1/(1+e^eps) when absent: exactly eps-DP."""
    rng = random.Random(seed)
    p = math.exp(epsilon) / (1 + math.exp(epsilon))

    def generate(refs):
        present = any(CANARY == r for r in refs)
        emit = rng.random() < (p if present else 1 - p)
        return ("a review mentioning " + CANARY) if emit else "a plain review of a restaurant"

    return generate


def test_blackbox_bound_is_valid_for_an_eps_dp_generator():
    """Over repeated audits of an exactly 1-DP generator, the bound exceeds 1 at most at the stated rate."""
    beta, reps, over = 0.1, 40, 0
    bounds = []
    for seed in range(reps):
        rep = blackbox.blackbox_audit(
            _randomized_response(1.0, seed), ["a", "b", "c"], CANARY, claimed_epsilon=1.0, claimed_delta=0.0,
            num_trials=200, significance=beta,
        )
        over += rep.verdict is Verdict.VIOLATION
        bounds.append(rep.epsilon_lower_bound)
        assert rep.verdict in (Verdict.VIOLATION, Verdict.INCONCLUSIVE)
        assert rep.positives + rep.negatives == 100  # the held-out half only
    assert over <= sps.binom.ppf(1 - 1e-4, reps, beta)
    assert np.median(bounds) > 0.2  # it has power: the true epsilon is 1


def test_blackbox_detects_a_generator_that_leaks_the_canary():
    leaky = lambda refs: " ".join(r for r in refs if r) or "nothing"  # noqa: E731
    rep = blackbox.blackbox_audit(leaky, ["x", "y", "z"], CANARY, claimed_epsilon=1.0, claimed_delta=1e-6, num_trials=120)
    assert rep.verdict is Verdict.VIOLATION
    # perfect separation on 60 held-out trials: the closed form of the CP bound (one-sided beta/2 limits)
    t = (0.05 / 2) ** (1 / 30)
    assert rep.epsilon_lower_bound == pytest.approx(math.log((t - 1e-6) / (1 - t)), rel=1e-6)
    assert rep.true_positives == 30 and rep.false_positives == 0


def test_threshold_is_chosen_on_the_selection_half_only():
    """A generator whose two halves behave differently: the threshold picked on the first half is
    evaluated on the second, where it has no power, so no violation is reported."""
    calls = {"n": 0}

    def generate(refs):
        calls["n"] += 1
        first_half = calls["n"] <= 100
        present = CANARY in refs
        return (CANARY if present else "nothing") if first_half else "nothing"

    rep = blackbox.blackbox_audit(generate, ["a", "b"], CANARY, claimed_epsilon=0.5, claimed_delta=0.0, num_trials=200)
    assert rep.verdict is Verdict.INCONCLUSIVE
    assert rep.true_positives in (0, rep.positives)  # all-or-nothing: the score is constant there


def test_deterministic_generator_is_flagged_and_refuted_by_the_trained_exact_match_score():
    """A fixed seed makes each arm a point mass: the exact-match score, trained on the selection
    half, separates the held-out trials perfectly (no canary word in the outputs at all)."""
    gen = lambda refs: "gibberish xq" if CANARY in refs else "gibberish zv"  # noqa: E731
    rep = blackbox.blackbox_audit(gen, ["a"], CANARY, claimed_epsilon=1.0, claimed_delta=1e-6, num_trials=100)
    assert any("deterministic" in n for n in rep.notes)
    assert rep.score == "exact-match" and rep.verdict is Verdict.VIOLATION
    assert (rep.true_positives, rep.false_positives) == (25, 0)
    t = 0.025 ** (1 / 25)
    assert rep.epsilon_lower_bound == pytest.approx(math.log((t - 1e-6) / (1 - t)), rel=1e-6)


def test_exact_match_score_is_trained_on_given_texts_only():
    score = blackbox.exact_match(["a", "a", "b"], ["b", "c"])
    assert score("a") == pytest.approx(2 / 3)
    assert score("b") == pytest.approx(1 / 3 - 1 / 2)
    assert score("unseen") == 0.0


def test_scores():
    s = blackbox.canary_overlap("Violet quasar 7719")
    assert s("the VIOLET quasar was seen") == pytest.approx(2 / 3)
    assert blackbox.word_count("a b  c") == 3.0
    with pytest.raises(ValueError, match="canary"):
        blackbox.canary_overlap("a b")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_trials=4), "num_trials"),
        (dict(canary_slot=5), "canary_slot"),
        (dict(selection_fraction=1.0), "selection_fraction"),
        (dict(scores=("nope",)), "scores"),
        (dict(claimed_epsilon=-1.0), "claimed_epsilon"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(claimed_epsilon=1.0, claimed_delta=0.0, num_trials=20)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        blackbox.blackbox_audit(lambda r: "x", ["a", "b"], CANARY, **args)


def test_the_engine_target_on_the_tiny_model_finds_no_violation():
    """Our own engine as a black box: the bound stays below the claim (no false alarm)."""
    import warnings

    from invink_audit.mechanism import SeededGeneratorWarning, make_generator
    from invink_audit.models import build_tiny_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        gen = make_generator(7)
    target = EngineTarget(MechanismConfig(clip_norm=0.5, temperature=1.0, top_k=20, batch_size=3), model=build_tiny_model(),
                          max_new_tokens=3, generator=gen)
    rep = blackbox.blackbox_audit(target, ["The food was great.", "Slow service.", "Nice staff."], CANARY,
                                  claimed_epsilon=2.0, claimed_delta=1e-6, num_trials=16)
    assert rep.verdict is Verdict.INCONCLUSIVE
    assert rep.epsilon_lower_bound <= 2.0
    assert rep.mechanism.startswith("InvisibleInk engine (") and target.batched


@pytest.mark.filterwarnings("ignore:sampling with a fixed seed")
def test_the_engine_target_runs_any_mechanism(tiny):
    """A generic mechanism (Amin et al.) on the engine: texts released by its stop rule, and exact ratios by teacher
    forcing its outcomes; a null canary (the slot emptied on both sides) has a ratio of exactly 0."""
    from invink_audit.mechanisms import AminConfig, AminMechanism

    amin = AminMechanism(AminConfig(clip_norm=2.0, batch_size=2, max_private_tokens=2, svt_noise=1.0))
    target = EngineTarget(amin, model=tiny, max_new_tokens=4, seed=1)
    batches = [[CANARY, "Cold soup."], ["", "Slow wifi."]] * 3
    texts = target.generate(batches)
    assert len(texts) == 6 and all(isinstance(t, str) for t in texts) and target.label.startswith("amin")
    llr = target.log_likelihood_ratios([[CANARY, b[1]] for b in batches], 0)
    assert llr.shape == (6,) and np.all(np.isfinite(llr)) and np.any(llr != 0)
    assert np.all(target.log_likelihood_ratios([["", b[1]] for b in batches], 0) == 0)


def test_a_callable_target_gets_none_in_the_null_slot_and_a_partition_when_batched():
    seen = []
    one = CallableTarget(lambda refs: seen.append(refs) or "x")
    assert one.texts([["a", ""], ["", "b"]]) == ["x", "x"] and seen == [["a", None], [None, "b"]]
    many = CallableTarget(lambda batches: [str(len(batches))] * len(batches), batched=True)
    assert many.texts([["a"], [""], ["c"]]) == ["3", "3", "3"]
    with pytest.raises(ValueError, match="one string per batch"):
        CallableTarget(lambda batches: ["only one"], batched=True).texts([["a"], ["b"]])
    with pytest.raises(ValueError, match="module:function"):
        CallableTarget.named("no_colon")
    with pytest.raises(ValueError, match="cannot be imported"):
        CallableTarget.named("no_such_module_here:generate")


LEAKY = """
def generate(references):  # one batch; the emptied slot is None
    return " ".join(r for r in references if r is not None)


def generate_all(batches):  # a partition: every batch at once
    return [generate(b) for b in batches]
"""


@pytest.mark.parametrize("batched", [False, True], ids=["one-batch", "partition"])
def test_a_spec_audits_a_python_callable(tmp_path, monkeypatch, batched):
    """``[target] kind = "callable"`` imports ``module:function`` at run time; a generator that prints its references
    is refuted (alternating trials, or batched with ``batched = true``), against the ε of ``[mechanism]``."""
    from invink_audit.audit.spec import load_spec, run_spec

    (tmp_path / "leaky_generator.py").write_text(LEAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    function, trials = ("generate_all", "num_batches = 64") if batched else ("generate", "num_trials = 100")
    path = tmp_path / "callable.toml"
    path.write_text(
        f'kind = "black-box"\nseed = 1\n[target]\nkind = "callable"\nfunction = "leaky_generator:{function}"\n'
        f"batched = {str(batched).lower()}\n"
        '[data]\ninline = ["Great tacos.", "Cold soup.", "Slow wifi."]\n[mechanism]\nbatch_size = 3\nepsilon = 1.0\n'
        f'[blackbox]\ncanary = "{CANARY}"\n{trials}\n'
    )
    spec = load_spec(path)
    assert spec.target.function == f"leaky_generator:{function}" and spec.mechanism is None
    report = run_spec(spec)
    assert report.verdict is Verdict.VIOLATION and report.claimed_epsilon == 1.0
    assert report.mechanism == f"callable leaky_generator:{function}"
    path.write_text(path.read_text().replace('function = "leaky_generator', 'function = "leaky_generator.nope'))
    with pytest.raises(ValueError, match=rf"^audit spec {re.escape(repr(str(path)))}: .*cannot be imported"):
        run_spec(load_spec(path))  # imported at run time (the spec itself loads), named in one line


@pytest.mark.parametrize("edit, match", [
    ('function = "leaky_generator:generate"\n', "needs function"),
    ('kind = "callable"\n', "are for kind = 'callable'"),
    ('function = "leaky_generator:generate"\n', "must be 'module:function'"),
], ids=["no-function", "function-for-engine", "not-module-function"])
def test_callable_target_keys_are_checked_at_load(tmp_path, edit, match):
    from invink_audit.audit.spec import load_spec

    body = ('kind = "black-box"\n[target]\nkind = "callable"\nfunction = "leaky_generator:generate"\n'
            '[data]\ninline = ["a"]\n[mechanism]\nbatch_size = 1\nepsilon = 1.0\n')
    replacement = {"needs function": "", "are for kind = 'callable'": 'kind = "engine"\n',
                   "must be 'module:function'": 'function = "leaky_generator"\n'}[match]
    path = tmp_path / "bad.toml"
    path.write_text(body.replace(edit, replacement))
    with pytest.raises(ValueError, match=match) as err:
        load_spec(path)
    assert str(err.value).startswith(f"audit spec {str(path)!r}: [target] ")


def test_invink_adapter_when_importable(tmp_path):
    """The reference package, when importable (pandas; on Python 3.11 its one-line f-string fix in a
    temporary copy): one call through the adapter returns a text, and its default seed makes it
    deterministic."""
    pytest.importorskip("pandas")
    pytest.importorskip("invink")
    from invink_audit.models import build_tiny_model

    tiny = build_tiny_model()
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    target = ReferencePackageTarget(
        str(tmp_path), batch_size=2, dataset_desc="reviews", epsilon=1.0, delta=1e-6,
        max_toks=3, device_map=-1, dtype="float32", topk=10,
    )
    refs = ["Great tacos.", "Cold soup.", "Slow wifi."]
    first, second = target.generate([refs, refs])
    assert isinstance(first, str) and first == second  # random_seed=42 by default: reproducible
    with pytest.raises(ValueError, match="batch_size"):
        ReferencePackageTarget(str(tmp_path), batch_size=0, dataset_desc="x", epsilon=1.0, delta=1e-6)


def test_exact_match_does_not_overfit_unique_outputs():
    """Every output unique (a randomised generator): the trained exact-match score must not be
    chosen for a perfect separation it only has on its own training split."""
    counter = {"n": 0}

    def gen(refs):
        counter["n"] += 1
        return f"text number {counter['n']}"

    rep = blackbox.blackbox_audit(gen, ["a"], CANARY, claimed_epsilon=0.5, claimed_delta=0.0, num_trials=100,
                                  scores=("exact-match",))
    assert rep.epsilon_lower_bound == 0.0 and rep.verdict is Verdict.INCONCLUSIVE
    loo = blackbox._exact_match_leave_one_out(["x", "x", "y"], np.array([True, True, False]))
    np.testing.assert_allclose(loo, [1.0, 1.0, 0.0])
