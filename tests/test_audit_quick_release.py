"""quick_audit of a GenerationResult uses the release the result records (plan, mechanism, template,
labels, partition) and refuses references or a prompt that disagree with it."""

from __future__ import annotations

import csv
import dataclasses
import warnings

import pytest

from invink_audit.audit.quick import AuditedRelease, quick_audit
from invink_audit.audit.stats import Verdict
from invink_audit.data import ReferencesFile, partition_references
from invink_audit.generation import GenerationConfig, PromptSpec, generate
from invink_audit.mechanisms import InvisibleInk
from invink_audit.mechanism import SeededGeneratorWarning
from invink_audit.prompts import template_for_labels
from releases import generate_flat

REFS = ["The food was great.", "Mr Smith was admitted.", "", "Slow service.", "Nice place.", "Cold soup.", "x"]


@pytest.fixture(scope="module")
def tiny():
    from invink_audit.models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def result(tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return generate(REFS, GenerationConfig(batch_size=3, max_new_tokens=4, delta=1e-6, epsilon=3.0, top_k=20),
                        model=tiny, seed=3)


def _numbers(report):
    d = report.to_dict()
    d.pop("seconds")
    return d


def test_the_result_alone_is_enough_and_gives_the_same_audit(tiny, result):
    alone = quick_audit(result, model=tiny, sampled_batch=None)
    given = quick_audit(result, REFS, model=tiny, prompt="generic", sampled_batch=None)
    assert alone.verdict is Verdict.PASS and _numbers(alone) == _numbers(given)
    release = AuditedRelease.of(result)
    assert release.partition is result.partition and release.template is result.template
    assert isinstance(release.mechanism, InvisibleInk) and release.mechanism.config == result.mechanism.config
    assert release.claim().max_new_tokens == 4 and release.claim().guarantee == result.mechanism.guarantee(4, 1e-6)


def test_references_or_prompt_that_disagree_are_refused(tiny, result):
    with pytest.raises(ValueError, match="references given disagree"):
        quick_audit(result, ["another"] + REFS[1:], model=tiny, sampled_batch=None)
    with pytest.raises(ValueError, match="references given disagree"):
        quick_audit(result, REFS[:4], model=tiny, sampled_batch=None)
    with pytest.raises(ValueError, match="prompt given .* disagrees"):
        quick_audit(result, REFS, model=tiny, prompt="yelp", sampled_batch=None)


def test_an_inconsistent_result_is_refused(result):
    # the guarantee is its mechanism's, so a disagreeing one comes from another mechanism
    other = InvisibleInk(dataclasses.replace(result.mechanism.config, temperature=0.5))
    bad = dataclasses.replace(result, guarantee=other.guarantee(4, 1e-6))
    with pytest.raises(ValueError, match="guarantee and mechanism .epsilon. do not match"):
        AuditedRelease.of(bad)
    with pytest.raises(ValueError, match="partition and mechanism .batch_size. do not match"):
        AuditedRelease.of(dataclasses.replace(result, partition=partition_references(REFS, 2)))


def test_texts_longer_than_the_recorded_plan_allows_are_rejected(tiny, result):
    bad = dataclasses.replace(result, guarantee=result.mechanism.guarantee(2, result.guarantee.delta))
    with pytest.raises(ValueError, match="do not match this configuration"):
        quick_audit(bad, model=tiny, sampled_batch=None)


def test_a_result_without_a_recorded_plan_needs_its_references(tiny, result):
    legacy = dataclasses.replace(result, mechanism=None, template=None, partition=None)
    with pytest.raises(ValueError, match="give the references"):
        quick_audit(legacy, model=tiny, sampled_batch=None)
    assert _numbers(quick_audit(legacy, REFS, model=tiny, sampled_batch=None)) == _numbers(
        quick_audit(result, model=tiny, sampled_batch=None)
    )


def _labelled_release(tiny, path, categories, **kwargs):
    """A seeded label-conditioned release over one review per category in ``categories`` (5 stars)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label1", "label2"])
        for i, category in enumerate(categories):
            writer.writerow([f"review {i}", f"Business Category: {category}", "Review Stars: 5.0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return generate_flat(path, label_columns=["label1", "label2"], batch_size=2, max_new_tokens=3, delta=1e-6,
                             epsilon=8.0, model=tiny, prompt="yelp", seed=3, **kwargs)  # fmt: skip


def test_a_label_conditioned_release_is_audited_with_each_batch_prompt(tiny, tmp_path):
    path = tmp_path / "reviews.csv"
    labelled = _labelled_release(tiny, path, ["Restaurants", "Shopping"] * 4)
    release = AuditedRelease.of(labelled, path)
    assert {release.batch_template(i).fields["category"] for i in range(len(labelled.partition.batches))} == {
        "Restaurants", "Shopping"
    }
    report = quick_audit(labelled, model=tiny, sampled_batch=None)
    assert report.verdict is Verdict.PASS and report.texts_audited == len(labelled.texts)
    with pytest.raises(ValueError, match="references given disagree"):
        AuditedRelease.of(labelled, ["review 0"])
    # the references and the prompt in the forms generate took them
    typed = AuditedRelease.of(labelled, ReferencesFile(path, label_columns=["label1", "label2"]), prompt=PromptSpec("yelp"))
    assert typed.partition == release.partition and typed.template == release.template
    with pytest.raises(ValueError, match="disagrees with the template"):
        AuditedRelease.of(labelled, prompt=PromptSpec("generic"))
    with pytest.raises(ValueError, match="not also as prompt_fields"):
        AuditedRelease.of(labelled, prompt=PromptSpec("yelp"), prompt_fields={"category": "Bars"})


def test_the_audit_places_labels_where_generate_placed_them(tiny, tmp_path):
    # custom label_fields (label column -> prompt field): the audit must prompt with generate's placement,
    # not the preset's default rule
    swapped = {"label1": "stars", "label2": "category"}
    labelled = _labelled_release(tiny, tmp_path / "reviews.csv", ["Restaurants"] * 4, label_fields=swapped)
    assert labelled.label_fields == swapped
    release = AuditedRelease.of(labelled)
    for i in range(len(labelled.partition.batches)):
        assert release.batch_template(i) == labelled.batch_template(i)
        assert release.batch_template(i) != template_for_labels(labelled.template, labelled.labels[i])  # default rule


def test_a_label_conditioned_result_without_its_record_is_refused(tiny, tmp_path):
    labelled = _labelled_release(tiny, tmp_path / "reviews.csv", ["Restaurants", "Shopping"] * 2)
    bare = dataclasses.replace(labelled, template=None, partition=None)
    with pytest.raises(ValueError, match="label-conditioned result records no mechanism"):
        AuditedRelease.of(bare, tmp_path / "reviews.csv")
