"""The batched canary audit: the exact log-likelihood ratio against a brute-force recomputation, one recorded
coin per batch, early stopping, and a planted bug caught on the tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from accounting import epsilon_for_clip_norm, plan_clip_norm
from invink_audit.audit.batched import LLR_SCORE, batched_canary_audit
from invink_audit.audit.stats import Verdict
from invink_audit.audit.targets import BlackBoxTarget, EngineTarget
from invink_audit.mechanism import MechanismConfig
from invink_audit.prompts import encode_request, get_preset

POOL = ["Great tacos, friendly staff.", "Slow service but good soup.", "The room was clean.", "Noisy hallway, comfy bed."]
CANARY = "Zelphine Quorrick lives at 42 Violet Lane"
B, T = 3, 6

pytestmark = pytest.mark.filterwarnings("ignore:sampling with a fixed seed")


def _engine(tiny, clip_norm: float, seed: int, **kwargs) -> EngineTarget:
    """InvisibleInk over the full vocabulary on the tiny model, seeded."""
    return EngineTarget(MechanismConfig(clip_norm=clip_norm, temperature=1.0, top_k=None, batch_size=B), model=tiny,
                        max_new_tokens=T, seed=seed, **kwargs)


def _log_prob(tiny, prompts, ids, *, clip_norm, drop=None):
    """log p(ids | batch) from full forward passes of every row, the mechanism written out in numpy
    (full vocabulary): row ``drop`` replaced by the public row (a null reference)."""
    rows = []
    for prompt in prompts:
        with torch.no_grad():
            logits = tiny.model(torch.tensor([list(prompt) + list(ids)])).logits[0].double().numpy()
        rows.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)])
    public, private = rows[0], np.stack(rows[1:], axis=1)
    if drop is not None:
        private[:, drop] = public
    scores = public + np.clip(private - public[:, None], -clip_norm, clip_norm).mean(axis=1)
    lp = scores - np.logaddexp.reduce(scores, axis=-1, keepdims=True)
    return float(lp[np.arange(len(ids)), ids].sum())


def test_log_likelihood_ratio_matches_brute_force(tiny):
    target = _engine(tiny, 0.8, 3)
    batches = [[CANARY, POOL[0], POOL[1]], ["", POOL[2], POOL[3]]]
    target.generate(batches)
    filled = [[CANARY, *b[1:]] for b in batches]
    llr = target.log_likelihood_ratios(filled, 0)
    template = get_preset("generic")
    for i, batch in enumerate(filled):
        request = encode_request(tiny.tokenizer, template, batch)
        prompts = [request.public_ids, *request.private_ids]
        ids = target.drawn[i].token_ids
        expected = _log_prob(tiny, prompts, ids, clip_norm=0.8) - _log_prob(tiny, prompts, ids, clip_norm=0.8, drop=0)
        assert llr[i] == pytest.approx(expected, abs=1e-5)
    assert np.all(np.abs(llr) <= T * 2 * 0.8 / B + 1e-9)  # each step's ratio is at most ε0 = 2C/(Bτ)


class _Recording(BlackBoxTarget):
    """A target that records the batches it was given; ``leak``: it prints the canary when it sees it."""

    def __init__(self, leak: bool) -> None:
        self.leak, self.seen = leak, []

    def generate(self, batches):
        self.seen += [list(b) for b in batches]
        return [("Zelphine Quorrick" if self.leak and CANARY in b else "a review") for b in batches]


def test_one_recorded_coin_per_batch_decides_its_canary_slot():
    target = _Recording(leak=False)
    report = batched_canary_audit(target, POOL, CANARY, batch_size=B, num_batches=64, claimed_epsilon=1.0,
                                  claimed_delta=1e-6, seed=5, num_looks=1)
    assert len(report.coins) == 64 and len(target.seen) == 64
    for coin, batch in zip(report.coins, target.seen):
        assert (batch[0] == CANARY) == coin and (batch[0] == "") == (not coin)
        assert all(r in POOL for r in batch[1:])
    assert 16 <= sum(report.coins) <= 48  # a fair coin: far inside its 99.99% range
    again = batched_canary_audit(_Recording(False), POOL, CANARY, batch_size=B, num_batches=64, claimed_epsilon=1.0,
                                 claimed_delta=1e-6, seed=5, num_looks=1)
    assert again.coins == report.coins  # seeded coins are reproducible; the report records them either way


def test_a_blatant_leak_stops_at_the_first_look_and_a_hopeless_claim_stops_early():
    leak = _Recording(leak=True)
    report = batched_canary_audit(leak, POOL, CANARY, batch_size=B, num_batches=2000, claimed_epsilon=1.0,
                                  claimed_delta=1e-6, seed=1, scores=["canary-overlap"])
    assert report.verdict is Verdict.VIOLATION and report.sequential["stopped"] == "violation"
    assert report.num_trials["evaluation"] <= 1500 // 8 + 1 and len(leak.seen) < 1000  # 500 select, then one look
    assert report.epsilon_lower_bound <= report.ceiling
    quiet = _Recording(leak=False)
    report = batched_canary_audit(quiet, POOL, CANARY, batch_size=B, num_batches=2000, claimed_epsilon=10.0,
                                  claimed_delta=1e-6, seed=1, scores=["canary-overlap"])
    assert report.verdict is Verdict.INCONCLUSIVE and report.sequential["stopped"] == "futile"
    assert len(quiet.seen) < 2000


def test_a_planted_clip_norm_bug_is_a_violation_and_the_correct_engine_is_not(tiny, tmp_path):
    claim = 0.5
    plan = plan_clip_norm(epsilon=claim, delta=1e-6, max_new_tokens=T, batch_size=B, temperature=1.0)
    outcomes = {}
    for factor in (1, 20):  # C twenty times the planned one: the true ε is far above the claim
        c = plan.clip_norm * factor
        target = _engine(tiny, c, 1)
        outcomes[factor] = batched_canary_audit(target, POOL, CANARY, batch_size=B, num_batches=400,
                                                claimed_epsilon=claim, claimed_delta=1e-6, seed=2)
    true = epsilon_for_clip_norm(clip_norm=plan.clip_norm * 20, max_new_tokens=T, batch_size=B, temperature=1.0,
                                 delta=1e-6).epsilon
    assert true > 2 * claim
    bug, ok = outcomes[20], outcomes[1]
    assert bug.verdict is Verdict.VIOLATION and bug.score == LLR_SCORE and claim < bug.epsilon_lower_bound <= true
    assert ok.verdict is Verdict.INCONCLUSIVE and ok.epsilon_lower_bound <= claim
    assert bug.gdp["epsilon"]["estimate"] > claim and "estimate" in bug.gdp["kind"]
    # the report round-trips through its JSON and renders the ceiling, the looks and the fit beside the bound
    from invink_audit.audit.records import report_from_dict
    from invink_audit.audit.report import write_report

    assert report_from_dict(bug.to_dict()) == bug
    write_report(bug, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "ceiling" in text and "sequential looks (violation)" in text and "an **estimate**" in text


def test_bad_input():
    with pytest.raises(ValueError, match="at least 16"):
        batched_canary_audit(_Recording(False), POOL, CANARY, batch_size=B, num_batches=8, claimed_epsilon=1.0,
                             claimed_delta=1e-6)
    with pytest.raises(ValueError, match="teacher-forces"):
        batched_canary_audit(_Recording(False), POOL, CANARY, batch_size=B, num_batches=32, claimed_epsilon=1.0,
                             claimed_delta=1e-6, scores=[LLR_SCORE])


def test_blackbox_selftest_rows_on_the_planted_bugs():
    """The self-test's planted bugs, black-box at 10^4 batches with the exact ratio, against the claim's curve:
    every bug whose true ε is at least twice its claim is a VIOLATION (the halved temperature on the
    hardest-case source, exactly; the private top-k on the random source, whose canary moves a token into a
    support the public top-k never has; the data-dependent budget); the correct mechanism never is, and its GDP
    estimate is within 20% of its accountant's ε; no bound passes its ceiling."""
    from invink_audit.audit.selftest import blackbox_rows

    rows = {(r["mechanism"], r["source"]): r for r in blackbox_rows(num_batches=10_000, seed=0)}
    assert {m for m, _ in rows} == {"correct", "naive-clipping", "low-temperature", "private-top-k", "data-dependent-budget",
                                    "unit-two-slots"}
    for source in ("random", "hardest-case"):
        assert rows["correct", source]["verdict"] != "VIOLATION"
    correct = rows["correct", "hardest-case"]
    assert abs(correct["gdp_epsilon"] / correct["claimed_epsilon"] - 1) <= 0.2
    assert correct["true_epsilon"] <= correct["claimed_epsilon"]
    doubled = [k for k, r in rows.items() if r["true_epsilon"] is not None and r["true_epsilon"] >= 2 * r["claimed_epsilon"]]
    assert doubled == [("low-temperature", "hardest-case")]
    for key in (*doubled, ("private-top-k", "random"), ("data-dependent-budget", "hardest-case")):
        assert rows[key]["verdict"] == "VIOLATION", key
    low = rows["low-temperature", "hardest-case"]
    assert low["epsilon_lower_bound"] < low["claimed_epsilon"]  # refuted on the curve, not at the quoted δ
    assert low["curve_epsilon_lower_bound"] > low["curve_claimed_epsilon"] and low["curve_delta"] > 1e-4
    assert all(r["epsilon_lower_bound"] <= r["ceiling"] + 1e-12 for r in rows.values())


def test_the_exact_epsilon_of_a_stationary_source_matches_full_enumeration():
    """exact_epsilon_stationary (count vectors with multinomial weights) against enumerate_outputs (every
    output, one by one): at the ε it returns the larger hockey-stick divergence is δ, and above δ a little below."""
    from invink_audit.audit import synthetic

    kw = dict(clip_norm=0.5, temperature=1.0, top_k=2, batch_size=3, max_new_tokens=4)
    source = synthetic.HardestCaseSource(vocab_size=4, batch_size=3, offset=0.3)
    bugs = synthetic.mutants(**kw, reference_lengths=source.reference_lengths)
    for mechanism in [synthetic.correct_mechanism(**kw), *bugs[:3]]:
        exact = synthetic.enumerate_outputs(source, mechanism)
        for delta in (1e-3, 0.05):
            eps = synthetic.exact_epsilon_stationary(source, mechanism, delta)
            assert max(exact.delta(eps, 0), exact.delta(eps, 0, reverse=True)) == pytest.approx(delta, rel=1e-6)
            assert max(exact.delta(0.99 * eps, 0), exact.delta(0.99 * eps, 0, reverse=True)) > delta
    with pytest.raises(ValueError, match="budget differs"):
        synthetic.exact_epsilon_stationary(source, bugs[3], 1e-3)
    with pytest.raises(ValueError, match="depend on the prefix"):
        synthetic.exact_epsilon_stationary(synthetic.RandomSource(batch_size=3), synthetic.correct_mechanism(**kw), 1e-3)


def test_a_spec_runs_the_batched_audit_of_the_engine(tiny_dir, tmp_path):
    from invink_audit.audit.spec import load_spec, run_spec

    body = f"""
name = "batched-engine"
kind = "black-box"
[model]
name = "{tiny_dir}"
[data]
inline = ["Great tacos, friendly staff.", "Slow service but good soup.", "The room was clean."]
[mechanism]
batch_size = 3
clip_norm = 0.5
max_new_tokens = 6
delta = 1e-6
[blackbox]
canary = "{CANARY}"
num_batches = 64
"""
    path = tmp_path / "spec.toml"
    path.write_text(body)
    spec = load_spec(path)
    assert spec.blackbox.num_batches == 64 and spec.blackbox.sequential and spec.blackbox.scores[0] == LLR_SCORE
    report = run_spec(spec, seed=3)
    assert len(report.coins) == 64 and report.score == LLR_SCORE and report.epsilon_lower_bound <= report.ceiling
    # our engine's claim is tested as its accountant's curve, quoted at the spec's δ
    assert report.profile["deltas"][0] == 1e-6 and report.profile["epsilons"][0] == report.claimed_epsilon
    assert report.sequential["profile"]["delta"] in report.profile["deltas"]
    path.write_text(body.replace("num_batches = 64", "num_batches = 64\nnum_trials = 20"))
    with pytest.raises(ValueError, match="not both"):
        load_spec(path)
    path.write_text(body.replace("num_batches = 64", "num_batches = 8"))
    with pytest.raises(ValueError, match="num_batches"):
        load_spec(path)


def test_a_surrogate_with_the_targets_model_reproduces_the_exact_ratio(tiny):
    """Black box: the ratio is computed from the released *strings* with a model the auditor has. With the target's
    own model and C it equals the exact ratio on every text whose string tokenizes back to the drawn tokens."""
    from invink_audit.audit.batched import SurrogateScorer

    target = _engine(tiny, 0.8, 1, stop_strings=False)  # texts end at their end-of-sequence token or T
    batches = [[CANARY, POOL[0], POOL[1]], ["", POOL[2], POOL[3]]] * 10
    target.generate(batches)
    texts = [tiny.tokenizer.decode(f.token_ids, skip_special_tokens=True) for f in target.drawn]  # as drawn, unstripped
    filled = [[CANARY, *b[1:]] for b in batches]
    exact = target.log_likelihood_ratios(filled, 0)
    surrogate = SurrogateScorer(model=tiny, clip_norm=0.8, batch_size=B, max_new_tokens=T)(filled, 0, texts)
    tok = tiny.tokenizer
    same = [i for i, f in enumerate(target.drawn)
            if tok.encode(texts[i], add_special_tokens=False) == [t for t in f.token_ids if t not in tiny.eos_token_ids]]
    assert same  # the seeded draw has texts that round-trip (the random tiny model's others do not)
    assert np.allclose(surrogate[same], exact[same], atol=1e-9)
    with pytest.raises(ValueError, match="needs a surrogate"):
        batched_canary_audit(_Recording(False), POOL, CANARY, batch_size=B, num_batches=32, claimed_epsilon=1.0,
                             claimed_delta=1e-6, scores=["surrogate-log-likelihood-ratio"])


@pytest.mark.parametrize("epsilon", [1.0, 2.0, 4.0])
def test_the_gdp_estimate_of_the_correct_mechanism_is_within_20_percent_of_its_accountant(epsilon):
    """With the worst-case (hardest-case) canary the claim is nearly tight, and the fit over all thresholds says so."""
    from accounting import composed_epsilon
    from invink_audit.audit import synthetic
    from invink_audit.audit.targets import SyntheticTarget

    steps = 10
    c = plan_clip_norm(epsilon=epsilon, delta=1e-6, max_new_tokens=steps, batch_size=4, temperature=1.0).clip_norm
    mechanism = synthetic.correct_mechanism(clip_norm=c, temperature=1.0, top_k=3, batch_size=4, max_new_tokens=steps)
    claim = composed_epsilon(1e-6, mechanism.claim().epsilon0, steps, "br-adaptive")
    report = batched_canary_audit(SyntheticTarget(synthetic.HardestCaseSource(vocab_size=6, batch_size=4), mechanism, seed=1),
                                  ["(null)"], "canary", batch_size=4, num_batches=10_000, claimed_epsilon=claim,
                                  claimed_delta=1e-6, seed=2, scores=[LLR_SCORE], num_looks=1)
    assert report.verdict is not Verdict.VIOLATION and report.epsilon_lower_bound <= report.ceiling
    assert abs(report.gdp["epsilon"]["estimate"] / claim - 1) <= 0.2


def test_exact_match_is_trained_on_the_selection_batches_and_read_on_the_evaluation_ones():
    report = batched_canary_audit(_Recording(leak=True), POOL, CANARY, batch_size=B, num_batches=400,
                                  claimed_epsilon=1.0, claimed_delta=1e-6, seed=4, scores=["exact-match"])
    assert report.verdict is Verdict.VIOLATION and report.true_positives == report.positives
    assert report.false_positives == 0


@pytest.mark.parametrize("change, match", [
    (dict(canary=""), "canary must be"), (dict(pool=[*POOL, CANARY]), "the canary not among them"),
    (dict(scores=["no-such-score"]), "scores must be"), (dict(scores=[]), "at least one score"),
    (dict(num_looks=0), "num_looks"), (dict(selection_fraction=0.99), "evaluation batches"),
])
def test_bad_arguments_are_refused_before_anything_is_generated(change, match):
    target = _Recording(leak=False)
    arguments = dict(pool=POOL, canary=CANARY, batch_size=B, num_batches=64, claimed_epsilon=1.0, claimed_delta=1e-6)
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        batched_canary_audit(target, **arguments)
    assert target.seen == []


def test_echo_canary_is_a_seeded_high_perplexity_suffix_after_an_ordinary_prefix(tiny):
    from invink_audit.audit.batched import echo_canary

    prefix = "The soup was hot and"
    one, again, other = (echo_canary(tiny.tokenizer, prefix, num_suffix_tokens=5, seed=s) for s in (1, 1, 2))
    assert one == again and one != other and one.startswith(prefix + " ")
    suffix = one[len(prefix) + 1 :].split(" ")
    assert len(suffix) == 5 and all(w.isalnum() for w in suffix)
    with pytest.raises(ValueError, match="prefix"):
        echo_canary(tiny.tokenizer, "  ")
