"""Any mechanism through the one release pipeline (``generate`` with a ``ReleaseConfig``): the paper's baselines
get InvisibleInk's partition, labels, resume, ledger charge and audit, with their own guarantee."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest

import invink_audit.generation as generation_module
from accounting import BudgetLedger, Clipping, GenerationEvent
from invink_audit.audit import quick_audit
from invink_audit.audit.quick import audit_release_file
from invink_audit.audit.stats import Verdict
from invink_audit.data import ReferencesFile
from invink_audit.generation import SEEDED_VOID_REASON, GenerationHooks, ModelSpec, PromptSpec, ReleaseConfig, generate
from invink_audit.mechanism import MechanismConfig
from invink_audit.mechanisms import (
    AdaPMixEDConfig,
    AdaPMixEDMechanism,
    AminConfig,
    AminMechanism,
    InvisibleInk,
    Mechanism,
    mechanism_from_json,
    mechanism_to_json,
)

TEXTS = [f"review {i}: the soup was {'great' if i % 2 else 'cold'}" for i in range(12)]
STARS = ["1.0", "5.0"]


def _amin(**overrides):
    return AminMechanism(AminConfig(**{"clip_norm": 2.0, "batch_size": 3, "max_private_tokens": 4, "svt_noise": 2.0,
                                       **overrides}))  # fmt: skip


@pytest.fixture
def labelled(reviews_csv):
    return reviews_csv([(t, STARS[i % 2]) for i, t in enumerate(TEXTS)], columns=("text", "stars"))


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_a_mechanism_release_is_checked_at_construction():
    release = ReleaseConfig(_amin(), max_new_tokens=6, delta=1e-6)
    assert release.batch_size == 3 and release.guarantee().a_priori and release.guarantee().max_new_tokens == 6
    with pytest.raises(ValueError, match="must be an invink_audit.mechanisms.Mechanism"):
        ReleaseConfig(AminConfig(clip_norm=2.0, batch_size=3), max_new_tokens=6, delta=1e-6)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ReleaseConfig(_amin(), max_new_tokens=0, delta=1e-6)
    with pytest.raises(ValueError, match="delta"):
        ReleaseConfig(_amin(), max_new_tokens=6, delta=1.5)
    with pytest.raises(ValueError, match="num_texts_per_group"):
        ReleaseConfig(_amin(), max_new_tokens=6, delta=1e-6, num_texts_per_group=0)


def test_invisibleink_is_an_ordinary_mechanism_release(tiny, tmp_path, reviews_csv):
    """InvisibleInk with a given clip norm through a ReleaseConfig is the release GenerationConfig builds for the same
    C: token for token (one pipeline, the engine's Top-k+ fast path from the capability), its guarantee the
    planner's ε, its records InvisibleInk's, its ledger charge InvisibleInk's event, and its file audits."""
    from invink_audit.generation import GenerationConfig

    mechanism = InvisibleInk(MechanismConfig(clip_norm=1.5, temperature=1.1, top_k=8, batch_size=3))
    release = ReleaseConfig(mechanism, max_new_tokens=6, delta=1e-6)
    planned = GenerationConfig(clip_norm=1.5, temperature=1.1, top_k=8, batch_size=3, max_new_tokens=6, delta=1e-6)
    output = tmp_path / "invisibleink.jsonl"
    references = reviews_csv([(t,) for t in TEXTS], columns=("text",))
    ours = _quiet(generate, references, release, model=tiny, output=output, seed=9)
    theirs = _quiet(generate, TEXTS, planned, model=tiny, seed=9)
    assert [t.token_ids for t in ours.texts] == [t.token_ids for t in theirs.texts]
    assert ours.guarantee == theirs.guarantee and release.run_parameters() == planned.run_parameters()
    record = json.loads(output.read_text().splitlines()[0])
    assert record["run"]["clip_norm"] == 1.5 and "mechanism" not in record["run"]
    assert record["guarantee"] is None and record["guarantee_void_reason"] == SEEDED_VOID_REASON
    assert release.guarantee().to_json()["batch_size"] == 3 and release.guarantee().to_json()["clip_norm"] == 1.5
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=1000.0, delta=1e-6)
    charged = generate(TEXTS, release, model=tiny, ledger=ledger)
    charge = ledger.status().releases[0]["release"]
    assert (charge["clip_norm"], charge["batch_size"], charge["max_new_tokens"]) == (1.5, 3, 6)  # its GenerationEvent
    report = audit_release_file(output, references, model=tiny, sampled_batch=None)
    assert report.mechanism == "invisibleink" and sum(report.step_failures.values()) == 0
    assert quick_audit(charged, model=tiny, sampled_batch=None).verdict is Verdict.PASS


def test_a_label_conditioned_amin_release_is_charged_resumed_and_audited(tiny, labelled, tmp_path):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=1000.0, delta=1e-6)
    config = ReleaseConfig(_amin(), max_new_tokens=6, delta=1e-6, num_texts_per_group=1)
    references = ReferencesFile(labelled, label_columns=["stars"])
    prompt = PromptSpec("yelp", fields={"category": "Restaurants"})
    output = tmp_path / "amin.jsonl"
    result = generate(references, config, model=tiny, prompt=prompt, output=output, ledger=ledger)
    assert sorted(t.labels["stars"] for t in result.texts) == STARS
    assert all(len(t.modes) == t.num_tokens and set(t.modes) <= {0, 1} for t in result.texts)
    assert result.mechanism is config.mechanism
    entry = ledger.status().releases[0]
    assert entry["release"]["kind"] == "zcdp" and entry["rho"] == pytest.approx(config.guarantee().rho_sequence)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["modes"] for r in records] == [list(t.modes) for t in result.texts]
    assert records[0]["run"]["mechanism"] == mechanism_to_json(config.mechanism)
    assert records[0]["guarantee"]["kind"] == "a-priori" and records[0]["guarantee"]["mechanism"] == "amin2024"
    again = generate(references, config, model=tiny, prompt=prompt, output=output, ledger=ledger)
    assert again.num_resumed == len(result.texts) and len(ledger.status().releases) == 1
    assert [t.token_ids for t in again.texts] == [t.token_ids for t in result.texts]
    # audited from the result and from its file: every token's outcome (mode and token) teacher-forced exactly
    for report in (quick_audit(result, model=tiny, sampled_batch=None),
                   audit_release_file(output, labelled, model=tiny, sampled_batch=None)):
        assert report.verdict is Verdict.PASS and report.mechanism == "amin2024"
    # another mechanism's parameters cannot resume this output
    with pytest.raises(ValueError):
        generate(references, ReleaseConfig(_amin(clip_norm=3.0), max_new_tokens=6, delta=1e-6, num_texts_per_group=1),
                 model=tiny, prompt=prompt, output=output)


def test_a_data_dependent_mechanism_is_refused_with_a_ledger_before_the_model_loads(tmp_path, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(generation_module, "load_model", never)
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    config = ReleaseConfig(AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=2, epsilon=5.0)), max_new_tokens=4, delta=1e-6)
    with pytest.raises(ValueError, match="data-dependent"):
        generate(TEXTS, config, model="smollm2", ledger=ledger)
    assert ledger.status().releases == ()


def test_a_seeded_mechanism_release_carries_no_guarantee(tiny, tmp_path):
    output = tmp_path / "seeded.jsonl"
    config = ReleaseConfig(_amin(), max_new_tokens=5, delta=1e-6, num_texts=2)
    first = _quiet(generate, TEXTS, config, model=tiny, output=output, seed=4)
    second = _quiet(generate, TEXTS, config, model=tiny, seed=4)
    assert [t.token_ids for t in first.texts] == [t.token_ids for t in second.texts]
    assert not first.guarantee.holds and first.guarantee.void_reason == SEEDED_VOID_REASON
    record = json.loads(output.read_text().splitlines()[0])
    assert record["guarantee"] is None and record["guarantee_void_reason"] == SEEDED_VOID_REASON


def test_naive_clipping_invisibleink_is_recorded_and_charged_as_its_mechanism():
    """Only paper Algorithm 1 (difference clipping) keeps InvisibleInk's records, whose settings name no clipping."""
    naive = InvisibleInk(MechanismConfig(clip_norm=1.5, temperature=1.0, top_k=None, batch_size=3, clipping=Clipping.NAIVE))
    config = ReleaseConfig(naive, max_new_tokens=6, delta=1e-6)
    assert config.run_parameters()["mechanism"] == mechanism_to_json(naive)
    assert not isinstance(config.event(), GenerationEvent)  # the zCDP event of any mechanism, not Algorithm 1's
    assert "clip_norm" not in config.guarantee().to_json() and config.guarantee().to_json()["mechanism"] == "invisibleink"
    assert config.event().rho == pytest.approx(config.guarantee().rho_sequence)


def test_a_mechanism_is_rebuilt_from_its_record_only_when_known():
    for mechanism in (_amin(sensitivity="paper"), AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=2, epsilon=5.0)),
                      InvisibleInk(MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=2), accountant="cks")):
        again = mechanism_from_json(json.loads(json.dumps(mechanism_to_json(mechanism))))
        assert type(again) is type(mechanism) and again.config == mechanism.config
        assert getattr(again, "accountant", None) == getattr(mechanism, "accountant", None)

    class Custom(Mechanism):  # only its name matters here
        name = "custom"

    with pytest.raises(ValueError, match="cannot be rebuilt from its record"):
        mechanism_from_json({"name": Custom.name, "config": None})


class _Stop(Exception):
    pass


def test_a_custom_mechanism_release_does_not_resume_with_other_parameters(tiny, tmp_path):
    """A mechanism without a config dataclass (the custom-mechanism example) is told apart on resume by its
    guarantee: an interrupted release does not resume with another clip norm."""
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_mechanism.py"
    spec = importlib.util.spec_from_file_location("custom_mechanism_for_resume", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    output = tmp_path / "custom.jsonl"

    def release(clip_norm):
        return ReleaseConfig(example.FullVocabularyDClip(clip_norm=clip_norm, batch_size=3, temperature=1.0),
                                max_new_tokens=4, delta=1e-6)

    def stop(text):
        raise _Stop

    with pytest.raises(_Stop):  # one text written, the release interrupted
        generate(TEXTS, release(1.0), model=ModelSpec(tiny, max_batch_rows=4), output=output,
                 hooks=GenerationHooks(on_text=stop))
    with pytest.raises(ValueError):
        generate(TEXTS, release(50.0), model=ModelSpec(tiny, max_batch_rows=4), output=output)
    resumed = generate(TEXTS, release(1.0), model=ModelSpec(tiny, max_batch_rows=4), output=output)
    assert resumed.num_resumed >= 1 and len(resumed.texts) == 4
