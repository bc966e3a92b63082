"""The model's dtype: ``auto`` on a CPU with native bfloat16 decides by a probe on public text,
every choice says why, records and reports carry it, an explicit dtype is kept, and every process of a
launch follows process 0's choice.

Oracles: the probe's total variation recomputed independently (the float32 and the bfloat16 tiny model
built separately, numpy); the bfloat16 model against one built in bfloat16 directly, and the float32
fallback against one built in float32, bitwise. The probe runs on any CPU (bfloat16 is emulated where it
is not native): ``cpu_bfloat16_support`` is patched to say which CPU the test is about.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import invink_audit.generation as generation
import invink_audit.models as models
from invink_audit.cli._generate import format_summary, summarise
from invink_audit.distributed import Cluster
from invink_audit.engine import Engine
from invink_audit.generation import GenerationConfig, ModelSpec, generate, read_generation_output
from invink_audit.models import (
    BFLOAT16_PROBE_TEXTS,
    BFloat16Probe,
    DtypeChoice,
    build_tiny_model,
    follow_dtype,
    load_model,
    resolve_dtype,
)
from releases import generate_flat

# the tiny model with a small initialisation: logits of ordinary size, so bfloat16 is plainly close
SMALL_INIT = 0.02
REFERENCES = ["Anna liked the soup.", "", "Bo found the waiter rude.", "Cy came back twice."]


@pytest.fixture
def native(monkeypatch):
    """A CPU that computes bfloat16 natively (as far as ``dtype="auto"`` can tell)."""
    monkeypatch.setattr(models, "cpu_bfloat16_support", lambda: "avx512_bf16")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=5, initializer_range=SMALL_INIT)


def _parameters_equal(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def test_auto_on_a_cpu_without_native_bfloat16_is_float32_without_a_probe(monkeypatch):
    monkeypatch.setattr(models, "cpu_bfloat16_support", lambda: None)
    monkeypatch.setattr(models, "_probe_bfloat16", lambda *a: pytest.fail("no probe without native bfloat16"))
    auto = build_tiny_model(seed=5, dtype="auto")
    choice = auto.dtype_choice
    assert auto.dtype == torch.float32 and choice.dtype == "float32" and choice.requested == "auto"
    assert choice.probe is None and "no native bfloat16" in choice.reason
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32  # the dtype it is loaded in, everywhere


def test_the_probe_reads_the_public_probe_text_only_and_measures_total_variation(native, monkeypatch):
    seen = []
    real = models._next_token_distributions

    def spy(network, ids):
        seen.append(ids.clone())
        return real(network, ids)

    monkeypatch.setattr(models, "_next_token_distributions", spy)
    auto = build_tiny_model(seed=5, dtype="auto", initializer_range=SMALL_INIT)
    probe = auto.dtype_choice.probe

    # its only input: the fixed public texts, each cut to one length (one unpadded batch)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    ids = seen[0]
    assert ids.shape[0] == len(BFLOAT16_PROBE_TEXTS) and probe.positions == ids.numel()
    for row, text in zip(ids.tolist(), BFLOAT16_PROBE_TEXTS):
        assert row == auto.tokenizer(text)["input_ids"][: len(row)]

    # oracle: the two models built separately, the distance in numpy
    float32 = build_tiny_model(seed=5, dtype="float32", initializer_range=SMALL_INIT)
    bfloat16 = build_tiny_model(seed=5, dtype="bfloat16", initializer_range=SMALL_INIT)
    with torch.inference_mode():
        p, q = (torch.softmax(m.model(input_ids=ids).logits.double(), -1).numpy() for m in (float32, bfloat16))
    distance = 0.5 * np.abs(p - q).sum(axis=-1)
    assert probe.max_total_variation == pytest.approx(float(distance.max()), abs=1e-12)
    assert probe.mean_total_variation == pytest.approx(float(distance.mean()), abs=1e-12)
    assert probe.bound == models.BFLOAT16_MAX_TOTAL_VARIATION and probe.passed and probe.seconds >= 0

    # kept: the float32 model converted, bitwise the model built in bfloat16
    assert auto.dtype == torch.bfloat16 and auto.dtype_choice.dtype == "bfloat16"
    assert _parameters_equal(auto, bfloat16)
    assert "avx512_bf16" in auto.dtype_choice.reason and f"{probe.max_total_variation:.4f}" in auto.dtype_choice.reason


def test_auto_falls_back_to_float32_when_the_probe_fails(native, monkeypatch):
    monkeypatch.setattr(models, "BFLOAT16_MAX_TOTAL_VARIATION", 1e-12)
    auto = build_tiny_model(seed=5, dtype="auto")
    probe = auto.dtype_choice.probe
    assert not probe.passed and probe.max_total_variation > probe.bound == 1e-12
    assert auto.dtype == torch.float32 and auto.dtype_choice.dtype == "float32"
    assert "bound" in auto.dtype_choice.reason
    # read again in float32 (the probe converted the first copy in place): bitwise the explicit float32 model
    assert _parameters_equal(auto, build_tiny_model(seed=5, dtype="float32"))


def test_a_model_the_probe_cannot_run_stays_in_float32(native, monkeypatch):
    real, calls = models._next_token_distributions, []

    def fails_in_bfloat16(network, ids):
        calls.append(1)
        if len(calls) == 2:  # after the in-place conversion
            raise RuntimeError("no bfloat16 kernel for this layer")
        return real(network, ids)

    monkeypatch.setattr(models, "_next_token_distributions", fails_in_bfloat16)
    auto = build_tiny_model(seed=5, dtype="auto")
    assert auto.dtype == torch.float32 and auto.dtype_choice.probe is None
    assert "no bfloat16 kernel" in auto.dtype_choice.reason
    assert _parameters_equal(auto, build_tiny_model(seed=5, dtype="float32"))


def test_non_finite_logits_fail_the_probe():
    probe = BFloat16Probe(max_total_variation=math.nan, mean_total_variation=math.nan, positions=8, bound=0.1, seconds=0.0)
    assert not probe.passed and probe.to_json()["max_total_variation"] is None


def test_an_explicit_dtype_is_kept_whatever_the_cpu(native, monkeypatch, tiny_dir):
    monkeypatch.setattr(models, "_probe_bfloat16", lambda *a: pytest.fail("an explicit dtype needs no probe"))
    for name, alias in (("float32", "fp32"), ("bfloat16", "bf16"), ("float32", "float32")):
        loaded = load_model(tiny_dir, device="cpu", dtype=alias)
        assert loaded.dtype == models._DTYPES[name]
        assert loaded.dtype_choice == DtypeChoice(name, name, "cpu", "requested")


def test_choices_and_probes_validate_themselves(tiny):
    good = dict(requested="auto", dtype="bfloat16", device_type="cpu", reason="why")
    for bad, match in (
        (dict(dtype="int8"), "dtype must name"), (dict(dtype="half"), "dtype must name"),
        (dict(requested="fp32"), "requested must be"),
        (dict(device_type=""), "device_type"),
        (dict(reason=" "), "reason"),
        (dict(probe="0.05"), "probe"),
    ):
        with pytest.raises(ValueError, match=match):
            DtypeChoice(**{**good, **bad})
    probe = dict(max_total_variation=0.01, mean_total_variation=0.005, positions=8, bound=0.1, seconds=0.1)
    for bad, match in ((dict(positions=0), "positions"), (dict(bound=0.0), "bound"), (dict(max_total_variation=2.0), "max_total"),
                       (dict(seconds=-1.0), "seconds")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            BFloat16Probe(**{**probe, **bad})
    # a LoadedModel's choice must be of its dtype; one built without a choice says it was given
    with pytest.raises(ValueError, match="dtype_choice"):
        dataclasses.replace(tiny, dtype_choice=DtypeChoice(**good))
    given = dataclasses.replace(tiny, dtype_choice=None)
    assert given.dtype_choice.dtype == "float32" and given.dtype_choice.reason.startswith("given")


def test_a_choice_travels_and_is_followed(native, monkeypatch, tiny_dir):
    decided = load_model(tiny_dir, device="cpu").dtype_choice  # auto: bfloat16 after the probe
    assert decided.dtype == "bfloat16" and decided.probe is not None
    monkeypatch.setattr(models, "_probe_bfloat16", lambda *a: pytest.fail("a followed choice needs no probe"))
    followed = load_model(tiny_dir, device="cpu", dtype=decided)
    assert followed.dtype == torch.bfloat16 and followed.dtype_choice == decided

    float32 = load_model(tiny_dir, device="cpu", dtype="float32")
    reloads = []
    assert follow_dtype(float32, decided, lambda c: reloads.append(c) or followed) is followed and reloads == [decided]
    # the same dtype: the weights stay, the record becomes the decision's
    same = DtypeChoice("auto", "float32", "cpu", "process 0's probe failed")
    kept = follow_dtype(float32, same, lambda c: pytest.fail("no reload for the same dtype"))
    assert kept.model is float32.model and kept.dtype_choice == same
    # a choice made for another kind of device does not apply here
    cuda = DtypeChoice("auto", "bfloat16", "cuda", "auto on CUDA: bfloat16")
    assert follow_dtype(float32, cuda, lambda c: pytest.fail("not for this device")) is float32
    assert resolve_dtype(cuda, torch.device("cpu")) == torch.float32  # decided afresh: auto on CPU loads float32


@dataclasses.dataclass(frozen=True)
class _Rank1(Cluster):
    """Process 1 of 2, to which process 0 broadcasts its dtype decision."""

    decided: object = None

    def broadcast(self, obj=None):
        return self.decided

    def agree(self, error):
        if error is not None:
            raise error


def test_every_process_runs_in_the_dtype_process_0_chose(native, tiny_dir):
    release = generation.prepare_release(
        REFERENCES, generation.GenerationConfig(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=5.0, top_k=8),
        model=str(tiny_dir),
    )
    rank0 = load_model(tiny_dir, device="cpu")  # auto: bfloat16 after the probe
    mine = load_model(tiny_dir, device="cpu", dtype="float32")  # this process decided otherwise
    release.cluster = _Rank1(rank=1, world_size=2, decided=rank0.dtype_choice)
    loaded, engine = release._follow_dtype(mine, Engine(mine, release.mechanism))
    assert loaded.dtype == torch.bfloat16 and loaded.dtype_choice == rank0.dtype_choice and engine.model is loaded
    assert _parameters_equal(loaded, rank0)
    # the settings digest every process sends process 0 names the dtype: it now matches process 0's
    assert release._identity_digest(loaded) == release._identity_digest(rank0) != release._identity_digest(mine)


def test_records_results_and_the_summary_say_which_dtype_ran_and_why(native, tiny_dir, tmp_path):
    output = tmp_path / "out.jsonl"
    options = dict(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=5.0, model=str(tiny_dir), top_k=8)
    result = generate_flat(REFERENCES, output=output, **options)
    choice = result.dtype_choice
    assert choice.dtype == "bfloat16" and choice.requested == "auto" and choice.probe.passed
    records = read_generation_output(output)
    assert records and all(r["model_dtype"] == choice.to_json() for r in records)
    assert "dtype" not in records[0]["run"]  # a release may resume in another dtype; each record says its own
    assert summarise(result)["model_dtype"] == choice.to_json()
    assert f"dtype            bfloat16 ({choice.reason})" in format_summary(result)

    explicit = generate_flat(REFERENCES, dtype="float32", **options)  # --dtype float32 stays float32
    assert explicit.dtype_choice == DtypeChoice("float32", "float32", "cpu", "requested")


def test_cli_generate_with_dtype_float32_gives_float32(native, tiny_dir, tmp_path):
    from invink_audit.cli import main

    references = tmp_path / "refs.jsonl"
    references.write_text("".join(f'{{"text": "{r}"}}\n' for r in REFERENCES))
    output = tmp_path / "out.jsonl"
    status = main(["generate", "--input", str(references), "--model", str(tiny_dir), "--dtype", "float32",
                   "--batch-size", "2", "--max-new-tokens", "3", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
                   "--output", str(output), "--no-progress"])  # fmt: skip
    assert status == 0
    assert {r["model_dtype"]["dtype"] for r in read_generation_output(output)} == {"float32"}


def test_baselines_quick_audit_and_black_box_say_which_dtype_ran(native, tiny_dir, tmp_path):
    """The other users of a model record its dtype too: a baseline's run and records, the quick audit
    (teacher-forced in the dtype the release ran in, not re-chosen), and the engine as a black box."""
    from invink_audit.audit.targets import EngineTarget
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.audit.quick import quick_audit
    from invink_audit.mechanisms import AminConfig, AminMechanism
    from invink_audit.generation import ReleaseConfig

    amin = AminMechanism(AminConfig(clip_norm=2.0, batch_size=2))
    output = tmp_path / "amin.jsonl"
    run = generate(REFERENCES, ReleaseConfig(amin, max_new_tokens=3, delta=1e-6), model=str(tiny_dir), output=output)
    assert run.dtype_choice.dtype == "bfloat16" and run.dtype_choice.probe.passed
    assert all(r["model_dtype"] == run.dtype_choice.to_json() for r in read_generation_output(output))

    float32 = generate(REFERENCES, GenerationConfig(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=5.0, top_k=8),
                       model=ModelSpec(str(tiny_dir), dtype="float32"))
    report = quick_audit(float32, REFERENCES, model=str(tiny_dir), sampled_batch=None)
    assert report.model_dtype == float32.dtype_choice.to_json()  # not the bfloat16 that "auto" would pick here
    assert "model dtype float32" in report.summary() and report.to_dict()["model_dtype"]["dtype"] == "float32"

    target = EngineTarget(MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=8, batch_size=2), model=str(tiny_dir),
                          max_new_tokens=2, generator=torch.Generator().manual_seed(0))
    assert target.loaded.dtype_choice.dtype == "bfloat16" and len(target.generate([["a", "b"]])) == 1
    assert target.label.endswith(", bfloat16)")
