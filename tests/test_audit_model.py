"""Model audits through the engine (tiny random model), quick_audit of generated texts, specs and CLI."""

import dataclasses
import json
import math
import warnings

import numpy as np
import pytest
import torch

from invink_audit.audit import model_audit, spec
from invink_audit.audit.stats import Verdict
from invink_audit.audit.whitebox import WhiteBoxConfig
from invink_audit.mechanism import SeededGeneratorWarning, make_generator
from invink_audit.generation import GenerationConfig


@pytest.fixture(scope="module")
def tiny():
    from invink_audit.models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="module")
def tiny_in_dtype(cpu_dtype):
    """The tiny model in float32, and in bfloat16 where this CPU computes it natively: the audit's exact
    checks hold in the dtype the model runs in."""
    from invink_audit.models import build_tiny_model

    return build_tiny_model(dtype=cpu_dtype)


def _gen(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed)


def test_hardest_case_row_is_the_worst_pair():
    torch.manual_seed(0)
    public = torch.randn(3, 40, dtype=torch.float64)
    neighbour = torch.log_softmax(public, -1)
    c = 0.3
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import InvisibleInk

    row = InvisibleInk(MechanismConfig(clip_norm=c, temperature=1.0, top_k=None, batch_size=2)).hardest_case_logits(
        public, neighbour)
    diff = torch.clamp(row - public, -c, c)
    assert set(torch.unique(diff.abs()).tolist()) == {c}  # clipped to exactly +-C
    up = diff > 0
    probs = neighbour.exp()
    # the up group is a most-probable prefix whose mass is the closest to 0.45
    for g in range(3):
        srt = torch.sort(probs[g], descending=True).values.cumsum(0)
        best = float(srt[torch.argmin((srt - 0.45).abs())])
        assert float(probs[g][up[g]].sum()) == pytest.approx(best, abs=1e-12)
        assert bool((probs[g][up[g]].min() >= probs[g][~up[g]].max()))


def test_model_audit_on_tiny_model(tiny_in_dtype):
    tiny = tiny_in_dtype
    refs = ["The food was great.", None, "The service was slow."]
    config = WhiteBoxConfig(num_samples=8, num_is_samples=3, neighbours=(0, 1), alphas=(2.0,), min_samples=8)
    rep = model_audit.audit_model(
        refs, model_audit.ModelAuditSettings(max_new_tokens=4, clip_norm=1.0, top_k=20), config, model=tiny,
        canaries={0: "a text canary"}, hardest_case_slot=1, generator=_gen(0),
    )
    assert rep.verdict is Verdict.PASS
    sc = rep.step_checks
    assert sum(sc.failures.values()) == 0
    # the hardest-case canary saturates the per-token range: the max loss range is eps0 (to rounding)
    assert sc.max_loss_range == pytest.approx(sc.epsilon0, rel=1e-9)
    # every (text, step) was checked for all 3 neighbours
    assert sc.num_checks % 3 == 0 and sc.num_checks >= 3 * rep.num_texts
    assert rep.canaries[1].startswith("hardest-case")
    assert {s.neighbour for s in rep.sequence} == {0, 1}
    assert 0 <= rep.timings["audit_overhead_ratio"] < 10
    assert rep.claim["epsilon0"] == pytest.approx(2 * 1.0 / (3 * 1.0))
    assert rep.settings["model_dtype"] == tiny.dtype_choice.to_json()  # the report says which dtype ran, and why


def test_quick_audit_of_generated_texts(tiny_in_dtype):
    from invink_audit.audit.quick import quick_audit

    tiny = tiny_in_dtype
    from invink_audit.generation import generate

    refs = ["The food was great.", "Mr Smith was admitted.", "", "Slow service.", "Nice place.", "Cold soup."]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        res = generate(refs, GenerationConfig(batch_size=3, max_new_tokens=4, delta=1e-6, epsilon=3.0, top_k=20),
                       model=tiny, seed=3)
    rep = quick_audit(res, refs, model=tiny, sampled_batch=None)
    assert rep.verdict is Verdict.PASS
    assert rep.texts_audited == 2
    assert rep.step_checks == 3 * sum(t_.num_tokens if hasattr(t_, "num_tokens") else len(t_.token_ids) for t_ in res.texts)
    assert rep.max_loss_range_over_epsilon0 <= 1 + 1e-9
    # the realised loss of a released text can never exceed the a-priori bound T * eps0
    assert rep.realised_loss_max <= rep.a_priori_loss_bound + 1e-9
    assert "audit verdict: PASS" in rep.summary()
    # texts that the configuration cannot have produced are rejected
    bad = dataclasses.replace(res, guarantee=res.mechanism.guarantee(2, res.guarantee.delta))
    with pytest.raises(ValueError, match="do not match"):
        quick_audit(bad, refs, model=tiny, sampled_batch=None)


def test_spec_validation(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('kind = "nope"\n')
    with pytest.raises(ValueError, match="kind"):
        spec.load_spec(p)
    p.write_text('kind = "selftest"\nbogus = 1\n')
    with pytest.raises(ValueError, match="unknown keys"):
        spec.load_spec(p)
    with pytest.raises(ValueError, match="not found"):
        spec.load_spec(tmp_path / "missing.toml")
    p.write_text('kind = "white-box"\n[mechanism]\nbatch_size = 2\nmax_new_tokens = 3\nclip_norm = 1.0\n[audit]\nfoo = 1\n')
    with pytest.raises(ValueError, match=r"\[audit\]"):
        spec._whitebox_config(spec.load_spec(p).section("audit"), 2)


def test_spec_batch_fills_non_canary_slots_in_file_order(tmp_path):
    data = tmp_path / "refs.csv"
    data.write_text("text\nfirst\nsecond\nthird\nfourth\n")
    p = tmp_path / "s.toml"
    p.write_text(
        'kind = "white-box"\n[data]\npath = "refs.csv"\noffset = 1\n'
        '[canaries]\nsecret = 0\nhardest_case = 2\n[mechanism]\nbatch_size = 4\nmax_new_tokens = 3\nclip_norm = 1.0\n'
    )
    refs, labels, hardest = spec._batch(spec.load_spec(p), 4)
    assert refs[0] == model_audit.DEFAULT_CANARIES["secret"]
    assert refs[1] == "second" and refs[2] is None and refs[3] == "third"
    assert hardest == 2 and set(labels) == {0}


def test_committed_specs_parse():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "audits"
    specs = sorted(root.glob("*.toml"))
    assert specs, "audits/ must hold the committed specs"
    for path in specs:
        s = spec.load_spec(path)
        if s.kind == "white-box":
            spec._whitebox_config(s.section("audit"), int(s.section("mechanism")["batch_size"]))


def test_cli_selftest_spec_writes_reports(tmp_path, capsys):
    from invink_audit.cli import main

    p = tmp_path / "st.toml"
    p.write_text(
        'kind = "selftest"\nname = "mini"\nseed = 11\n[selftest]\nnum_samples = 120\nnum_is_samples = 30\n'
        "alphas = [2.0, 8.0]\nbaselines = false\n"
    )
    code = main(["audit", str(p), "--output", str(tmp_path / "out"), "--json", "--no-plots"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(d["mechanism"], d["verdict"]) for d in out] == [
        ("correct", "PASS"),
        ("naive-clipping", "VIOLATION"),
        ("low-temperature", "VIOLATION"),
        ("private-top-k", "VIOLATION"),
        ("data-dependent-budget", "VIOLATION"),
        ("unit-two-slots", "VIOLATION"),  # a unit in two slots of one batch at the per-reference epsilon
        ("adapter-dp-processor", "PASS"),  # the adapter path: a DP logits processor in transformers' generate
        ("adapter-default-top-k", "VIOLATION"),  # ... followed by generate's default top-k
        ("adapter-claim-omits-a-step", "VIOLATION"),  # ... claimed one step short
    ]
    assert (tmp_path / "out" / "report.json").is_file() and (tmp_path / "out" / "report.md").is_file()
    assert "PASSED" in (tmp_path / "out" / "report.md").read_text()


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from invink_audit.cli import main

    assert main(["audit"]) == 2
    assert "give one of: a spec file, --selftest, --release OUT.jsonl" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "missing.toml")]) == 2
    assert main(["audit", "--selftest", "--release", "x.jsonl"]) == 2  # one kind of audit at a time
    assert main(["audit", "--selftest", "--input", "refs.csv"]) == 2
    assert "go with --release" in capsys.readouterr().err


def test_write_report_renders_whitebox(tmp_path):
    from invink_audit.audit import analysis, synthetic
    from invink_audit.audit.report import write_report

    source = synthetic.HardestCaseSource(vocab_size=5, batch_size=2)
    mech = synthetic.correct_mechanism(clip_norm=0.5, temperature=1.0, top_k=None, batch_size=2, max_new_tokens=4)
    rec = synthetic.run_synthetic_audit(source, mech, WhiteBoxConfig(num_samples=60, num_is_samples=10, alphas=(2.0,)), generator=_gen(1))
    rep = analysis.analyse(rec, mechanism="correct", source="hardest", canaries=source.canaries)
    files = write_report(rep, tmp_path)
    names = {f.name for f in files}
    assert {"report.json", "report.md", "renyi.png", "loss_histogram.png", "step_loss_range.png"} <= names
    data = json.loads((tmp_path / "report.json").read_text())
    from invink_audit.audit.records import report_from_dict

    again = report_from_dict(data)
    assert again.to_dict() == data  # JSON round trip (re-rendering committed reports)
    assert data["verdict"] == "PASS" and data["kind"] == "white-box"
    assert data["claim"]["epsilon0"] == pytest.approx(0.5)
    md = (tmp_path / "report.md").read_text()
    assert "Verdict: PASS" in md and "br-adaptive" in md
    # headroom: the hardest case is tight per step (range = eps0)
    assert rep.headroom_summary()["per_step_range"] == pytest.approx(1.0, abs=1e-9)
    assert all(math.isfinite(a.epsilon) for a in rep.accountants)
    assert np.isfinite(rep.step_checks.max_loss_range)


def test_blackbox_engine_spec_runs_end_to_end(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path / "m")
    tiny.tokenizer.save_pretrained(tmp_path / "m")
    p = tmp_path / "bb.toml"
    p.write_text(
        f'kind = "black-box"\nseed = 5\n[model]\nname = "{tmp_path / "m"}"\n[target]\nkind = "engine"\n'
        '[data]\ninline = ["Great tacos.", "Cold soup.", "Slow wifi."]\n'
        "[mechanism]\nbatch_size = 3\nmax_new_tokens = 3\nclip_norm = 0.5\ntop_k = 20\ndelta = 1e-6\n"
        '[blackbox]\nnum_trials = 12\ncanary = "Zelphine Quorrick lives at 42 Violet Lane"\n'
    )
    report = spec.run_spec(spec.load_spec(p))
    assert report.kind == "black-box" and report.verdict is Verdict.INCONCLUSIVE
    assert report.positives + report.negatives == 6
    assert math.isfinite(report.claimed_epsilon) and report.claimed_epsilon > 0


def test_shared_prefill_engine_decodes_exactly_like_the_engine(tiny_in_dtype):
    """Teacher-forced through both engines, the same requests give the same per-step distributions."""
    tiny = tiny_in_dtype
    import functools

    from invink_audit.engine import Engine
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.prompts import encode_request, get_preset

    mech = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=20, batch_size=3)
    template = get_preset("generic")
    a = encode_request(tiny.tokenizer, template, ["The food was great.", None, "Slow."])
    b = encode_request(tiny.tokenizer, template, ["Another one entirely, longer than the rest.", "x", None])
    requests = [a, b, a, a, b]  # duplicates within one admission
    forced = torch.tensor([5, 9, 7, 11], dtype=torch.long)
    seen = {}

    def run(engine_class, key):
        store = seen.setdefault(key, {})

        def rule(step):
            for i, r in enumerate(step.request_indices.tolist()):
                store[(r, int(step.positions[i]))] = step.log_probs[i].clone()
            w = torch.full_like(step.log_probs, -math.inf)
            w[:, forced[step.positions]] = 0.0
            w = torch.where(torch.isfinite(step.log_probs), w, torch.full_like(w, -math.inf))
            w[torch.isinf(w).all(-1)] = step.log_probs[torch.isinf(w).all(-1)]
            return w

        engine = engine_class(tiny, mech, max_batch_rows=6)  # forces several shards
        list(engine.generate(requests, max_new_tokens=4, generator=_gen(0), sampling_rule=rule, stop_at_eos=False))

    run(Engine, "plain")
    run(functools.partial(Engine, share_prefill=True), "shared")  # what the model audit runs
    assert seen["plain"].keys() == seen["shared"].keys()
    for k in seen["plain"]:
        assert torch.equal(seen["shared"][k], seen["plain"][k])  # copies of the same rows, bitwise


@pytest.mark.slow
def test_model_audit_on_the_embedded_model():
    """End to end on SmolLM2-135M-Instruct: exact checks hold and the hardest-case canary saturates eps0."""
    from invink_audit.models import embedded_gguf_path

    try:
        embedded_gguf_path()
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        pytest.skip(f"embedded model unavailable: {err}")
    config = WhiteBoxConfig(num_samples=4, num_is_samples=2, neighbours=(1,), alphas=(2.0,), min_samples=4)
    rep = model_audit.audit_model(
        ["Great tacos and a friendly waiter named Sam.", None],
        model_audit.ModelAuditSettings(max_new_tokens=3, epsilon=3.0, delta=1e-6, top_k=50),
        config, prompt="yelp", hardest_case_slot=1, generator=_gen(1),
    )
    assert sum(rep.step_checks.failures.values()) == 0
    assert rep.step_checks.max_loss_range == pytest.approx(rep.step_checks.epsilon0, rel=1e-9)
    assert rep.verdict is Verdict.PASS
    assert rep.step_checks.worst_prefix["prefix"] is not None
