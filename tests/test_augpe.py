"""AugPE end to end (invink_audit.augpe.augpe_generate) on the tiny model and MiniLM: it runs, seeded runs repeat,
the references enter only the histogram, the ledger is charged once before anything is generated, the paper's
convention is never charged, and bad input is refused before anything loads."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from accounting import AugPEEvent, AugPESensitivity, BudgetExceededError, BudgetLedger
from invink_audit.augpe import (
    AUGPE_PRESETS,
    AugPEConfig,
    AugPEPrompts,
    SamplingSettings,
    Selection,
    augpe_generate,
    get_augpe_prompts,
)
from invink_audit.generation import SEEDED_VOID_REASON
from invink_audit.mechanism import SeededGeneratorWarning

REFERENCES = (
    "Discharge Instructions: rest at home and drink fluids.",
    "The food was great and the service was slow.",
    "",  # a null reference: it votes like any other (the empty text's embedding)
    "Mr Smith was admitted to the hospital on Monday.",
    "Review stars: 5.0 out of 5.0.",
)
SMALL = {"num_texts": 3, "iterations": 2, "delta": 1e-6, "variations": 3, "max_new_tokens": 8, "batch_size": 8}


class Spy:
    """Counts calls to a LoadedModel's ``generate`` and an embedder's ``embed`` (and keeps the embedded lists)."""

    def __init__(self, loaded, embedder, monkeypatch):
        self.generated, self.embedded = 0, []
        real_generate, real_embed = loaded.model.generate, embedder.embed

        def generate(*args, **kwargs):
            out = real_generate(*args, **kwargs)
            self.generated += int(out.shape[0])
            return out

        def embed(texts):
            self.embedded.append(list(texts))
            return real_embed(texts)

        monkeypatch.setattr(loaded.model, "generate", generate)
        monkeypatch.setattr(embedder, "embed", embed)


@pytest.fixture(scope="module")
def minilm():
    from invink_audit.evaluation import Embedder

    return Embedder("minilm", cache=False, dtype="float32")


def run(config, tiny, minilm, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return augpe_generate(list(REFERENCES), config, model=tiny, embedder=minilm, **kwargs)


def test_the_presets_are_the_papers_table_and_the_official_prompts():
    mimic = AUGPE_PRESETS["mimic"]  # paper Table tab:augpe_prompts
    assert mimic.generation_messages()[0]["content"].startswith("Please act as a sentence generator for the medical")
    assert mimic.generation.endswith('Begin the output with the phrase: "Discharge Instructions:"')
    variation = mimic.variation_messages("TEXT", "STYLE")[1]["content"]
    assert variation.startswith('Please rephrase the following sentences "TEXT" as a patient discharge summary: "STYLE"')
    yelp = get_augpe_prompts("yelp", category="Bars", stars="4.0")
    assert yelp.generation_messages()[1]["content"] == "Business Category: Bars\tReview Stars: 4.0"
    assert yelp.variation_messages("x", "briefly")[1]["content"].startswith("Based on Business Category: Bars\t")
    assert len(yelp.styles) == 28 and len(mimic.styles) == 9
    with pytest.raises(ValueError, match="must contain {text} and {style}"):
        AugPEPrompts("bad", "write", "rephrase {text}", ("briefly",))
    with pytest.raises(ValueError, match="must not contain {text}"):
        AugPEPrompts("bad", "write {text}", "{text} {style}", ("briefly",))
    with pytest.raises(ValueError, match="use fields"):
        AugPEPrompts("bad", "write about {topic}", "{text} {style}", ("briefly",))
    with pytest.raises(ValueError, match="have no field"):
        get_augpe_prompts("mimic", category="Bars")
    # the label fields' example values are refused unless given (as generate refuses InvisibleInk's), in Python too
    with pytest.raises(ValueError, match=r"example value\(s\) \{'stars': '4.0'\} for field\(s\) \['stars'\]"):
        get_augpe_prompts("yelp", category="Bars")
    with pytest.raises(ValueError, match="example value"):
        AugPEConfig(epsilon=4.0, **{**SMALL, "prompts": "yelp"})
    assert get_augpe_prompts("yelp", category="Restaurants", stars="4.0") == AUGPE_PRESETS["yelp"]  # given: accepted


def test_the_config_plans_its_event_once_and_checks_itself():
    config = AugPEConfig(epsilon=4.0, **SMALL)
    assert config.event.epsilon(1e-6) <= 4.0 and config.event.iterations == 2
    assert config.num_candidates == 9 and config.num_generations == 3 + 2 * 2 * 3
    assert AugPEConfig(noise_std=5.0, **SMALL).event == AugPEEvent(5.0, 2)
    assert AugPEConfig(noise_std=5.0, sensitivity="paper", **SMALL).event.valid is False
    bad = [({"noise_std": 1.0, "epsilon": 1.0}, "exactly one of"), ({}, "exactly one of"),
           ({"noise_std": 1.0, "variations": 1}, "variations must be an integer >= 2"),
           ({"noise_std": 1.0, "delta": 0.0}, "delta must be in"), ({"noise_std": -1.0}, "noise_std must be in"),
           ({"noise_std": 1.0, "threshold": -1}, "threshold must be >= 0"),
           ({"noise_std": 1.0, "selection": "top"}, "selection must be one of"),
           ({"noise_std": 1.0, "prompts": "tab"}, "prompts must be one of"),
           ({"noise_std": 1.0, "num_texts": 0}, "num_texts must be"),
           ({"noise_std": 1.0, "allow_all_null": "yes"}, "allow_all_null must be a bool"),
           ({"noise_std": 1.0, "sampling": SamplingSettings(top_p=1.0), "accountant": "moments"},
            "accountant must be")]  # fmt: skip
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            AugPEConfig(**{**SMALL, **change})
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingSettings(top_p=0.0)


def test_a_run_releases_n_texts_and_a_seeded_run_repeats(tiny, minilm, monkeypatch):
    config = AugPEConfig(epsilon=4.0, **SMALL)
    spy = Spy(tiny, minilm, monkeypatch)
    with pytest.warns(SeededGeneratorWarning, match="no privacy guarantee"):
        first = augpe_generate(list(REFERENCES), config, model=tiny, embedder=minilm, seed=11)
    assert len(first.texts) == 3 and all(isinstance(t, str) for t in first.texts)
    assert len(first.noisy_counts) == 2 and all(len(h) == 9 and min(h) >= 0 for h in first.noisy_counts)
    assert spy.generated == config.num_generations == first.stats.generations
    # the references are embedded once; then 9 candidates, then only the 6 new paraphrases (parents reused)
    assert spy.embedded[0] == list(REFERENCES) and [len(e) for e in spy.embedded] == [5, 9, 6]
    assert not first.guarantee.holds and first.guarantee.void_reason == SEEDED_VOID_REASON
    assert first.guarantee.record_fields() == {"guarantee": None, "guarantee_void_reason": SEEDED_VOID_REASON}
    assert first.guarantee.epsilon <= 4.0 and first.guarantee.details["gaussian_epsilon"] < first.guarantee.epsilon
    assert first.guarantee == dataclasses.replace(config.guarantee(), void_reason=SEEDED_VOID_REASON)
    again = run(config, tiny, minilm, seed=11)
    assert again.texts == first.texts and again.noisy_counts == first.noisy_counts
    other = run(config, tiny, minilm, seed=12)
    assert other.noisy_counts != first.noisy_counts


def test_all_null_references_run_only_when_allowed(tiny, minilm):
    config = AugPEConfig(epsilon=4.0, allow_all_null=True, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        result = augpe_generate([""] * len(REFERENCES), config, model=tiny, embedder=minilm, seed=3)
    assert len(result.texts) == 3 and config.to_json()["allow_all_null"] is True
    with pytest.raises(ValueError, match="are empty"):
        augpe_generate([""] * len(REFERENCES), AugPEConfig(epsilon=4.0, **SMALL), model=tiny, embedder=minilm)


def test_the_references_enter_only_the_histogram(tiny, minilm, monkeypatch):
    """With the histogram replaced by a fixed one, other references give the same release bit for bit."""
    import invink_audit.augpe.generator as generator

    monkeypatch.setattr(generator, "dp_nn_histogram", lambda private, vectors, *rest: np.arange(len(vectors), 0, -1.0))
    config = AugPEConfig(noise_std=3.0, selection=Selection.PROBABILITY, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        one = augpe_generate(list(REFERENCES), config, model=tiny, embedder=minilm, seed=5)
        two = augpe_generate(["something else entirely", ""], config, model=tiny, embedder=minilm, seed=5)
    assert one.texts == two.texts


def test_the_ledger_is_charged_once_with_the_events_rho(tiny, minilm, tmp_path):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    config = AugPEConfig(epsilon=4.0, **SMALL)
    result = augpe_generate(list(REFERENCES), config, model=tiny, embedder=minilm, ledger=tmp_path / "ledger.json")
    status = ledger.status()
    assert len(status.releases) == 1
    release = status.releases[0]["release"]
    assert release["kind"] == "zcdp" and release["rho"] == config.event.rho and "augpe" in release["mechanism"]
    assert result.guarantee.holds and status.epsilon_spent == pytest.approx(result.guarantee.epsilon, rel=1e-9)
    # the guarantee as every release's records write it: AugPE's rho is the release's, composed in zCDP
    assert result.guarantee.record_fields()["guarantee"] == {
        "mechanism": "augpe", "kind": "a-priori", "epsilon": result.guarantee.epsilon, "delta": 1e-6,
        "rho_sequence": config.event.rho, "max_new_tokens": config.max_new_tokens, "composition": "zcdp",
        "description": config.event.describe()}  # fmt: skip


def test_over_budget_nothing_is_generated_or_embedded(tiny, minilm, tmp_path, monkeypatch):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=1.0, delta=1e-6)
    spy = Spy(tiny, minilm, monkeypatch)
    with pytest.raises(BudgetExceededError):
        augpe_generate(list(REFERENCES), AugPEConfig(epsilon=4.0, **SMALL), model=tiny, embedder=minilm, ledger=ledger)
    assert spy.generated == 0 and spy.embedded == [] and ledger.status().releases == ()


def test_a_context_too_short_for_the_longest_prompt_is_refused_before_the_charge(tiny, minilm, tmp_path, monkeypatch):
    """The longest variation prompt (a candidate of T tokens) plus T answer tokens must fit the model's context;
    otherwise the run is refused after loading and before the ledger is charged or anything is generated."""
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=100.0, delta=1e-6)
    spy = Spy(tiny, minilm, monkeypatch)
    monkeypatch.setattr(tiny.model.config, "max_position_embeddings", 40)
    with pytest.raises(ValueError, match="cannot hold AugPE's longest prompt"):
        augpe_generate(list(REFERENCES), AugPEConfig(epsilon=4.0, **SMALL), model=tiny, embedder=minilm, ledger=ledger)
    assert spy.generated == 0 and spy.embedded == [] and ledger.status().releases == ()
    monkeypatch.setattr(tiny.model.config, "max_position_embeddings", 4096)
    augpe_generate(list(REFERENCES), AugPEConfig(epsilon=4.0, **SMALL), model=tiny, embedder=minilm, ledger=ledger)
    assert len(ledger.status().releases) == 1


def test_the_papers_convention_holds_no_guarantee_and_is_never_charged(tiny, minilm, tmp_path):
    paper = AugPEConfig(noise_std=4.0, sensitivity=AugPESensitivity.PAPER, **{**SMALL, "iterations": 1})
    result = run(paper, tiny, minilm)
    assert not result.guarantee.holds and result.guarantee.void_reason.startswith("AugPE: ")
    assert "NOT A VALID GUARANTEE" in result.guarantee.void_reason
    assert result.guarantee.record_fields()["guarantee"] is None
    seeded = run(paper, tiny, minilm, seed=4)  # a seeded run of the paper's convention: both reasons
    assert seeded.guarantee.void_reason == f"{SEEDED_VOID_REASON}; {result.guarantee.void_reason}"
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=100.0, delta=1e-6)
    for sensitivity, message in [(AugPESensitivity.PAPER, "not a valid guarantee"),
                                 (AugPESensitivity.ADD_OR_REMOVE, "does not compose")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            augpe_generate(list(REFERENCES), AugPEConfig(noise_std=4.0, sensitivity=sensitivity, **SMALL), model=tiny,
                           embedder=minilm, ledger=ledger)  # fmt: skip
    assert ledger.status().releases == ()


@pytest.mark.parametrize(
    ("references", "kwargs", "message"),
    [
        ("one string", {}, "references must be a non-empty sequence"),
        ([], {}, "references must be a non-empty sequence"),
        (["a", None], {}, r"references\[1\] must be a string"),
        (["a"], {"config": "config"}, "config must be an AugPEConfig"),
        (["a"], {"seed": -1}, r"seed must be an integer in \[0, 2\*\*64 - 1\]"),
        (["a"], {"seed": True}, "seed must be an integer in"),
        (["a"], {"seed": 2**64}, "seed must be an integer in"),
        (["a"], {"ledger": 3}, "ledger must be a BudgetLedger"),
        (["a"], {"ledger": "/nonexistent/ledger.json"}, "no ledger at"),
        (["a"], {"embedder": "bert"}, "embedding model must be one of"),
        (["a"], {"embedder": 3}, "embedder must be"),
        (["a"], {"config": AugPEConfig(noise_std=1.0, sensitivity="paper", **SMALL), "ledger": "L"}, "not a valid"),
        (["", ""], {"ledger": "L"}, r"all 2 references are empty \(nulls\).*allow_all_null=True"),
    ],
)
def test_bad_input_is_refused_before_anything_loads(references, kwargs, message, monkeypatch, tmp_path):
    import invink_audit.augpe.generator as generator

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(generator, "load_model", no_loading)
    monkeypatch.chdir(tmp_path)
    if kwargs.get("ledger") == "L":
        BudgetLedger.create(tmp_path / "L", epsilon=10.0, delta=1e-6)
    config = kwargs.pop("config", AugPEConfig(noise_std=1.0, **SMALL))
    with pytest.raises(Exception, match=message) as raised:
        augpe_generate(references, config, **kwargs)
    assert not isinstance(raised.value, AssertionError)
    if kwargs.get("ledger") == "L":
        assert BudgetLedger(tmp_path / "L").status().releases == ()  # refused before the charge
