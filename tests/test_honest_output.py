"""Nothing misleading: what the tools print, record and draw says what happened.

* a record says which public fields its batch was prompted with (``prompt_fields``), not the preset's;
* a preset's example label values ("a 4-star restaurant review") are never used silently;
* a release charged to no ledger says so;
* counts agree with their nouns ("1 text");
* audit headlines compare with the release's ε, and say when the sampled part confirms nothing;
* plots show what they claim (a readable title, the a-priori bound, every interval or a mark where it is cut);
* progress bars have a total (so an ETA), and ``quick_audit`` reports its phases.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

import invink_audit.generation as generation_module
from invink_audit.cli import main
from invink_audit.generation import GenerationConfig, GenerationHooks, generate, read_generation_output
from invink_audit.outputs import journal_path
from releases import generate_flat

CATEGORY = "Business Category: Restaurants"
STARS = ("Review Stars: 5.0", "Review Stars: 1.0")


@pytest.fixture()
def reviews(tmp_path):
    """Eight reviews: four at 5 stars, four at 1 star (two batches of B = 2 per rating)."""
    path = tmp_path / "reviews.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label1", "label2"])
        for i in range(8):
            writer.writerow([f"review {i}", CATEGORY, STARS[i % 2]])
    return path


def _labelled(tiny, path, **kwargs):
    options = dict(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=8.0, model=tiny, prompt="yelp")
    return generate_flat(path, label_columns=["label1", "label2"], **{**options, **kwargs})


# --------------------------------------------------------------------------------------------
# a. records carry the fields their batch was prompted with


def test_each_record_carries_the_prompt_fields_of_its_own_batch(tiny, reviews, tmp_path):
    output = tmp_path / "out.jsonl"
    result = _labelled(tiny, reviews, output=output)
    records = read_generation_output(output)
    assert len(records) == 4
    for record in records:
        stars = record["labels"]["label2"].removeprefix("Review Stars: ")
        assert record["prompt_fields"] == {"category": "Restaurants", "stars": stars}
        assert record["prompt_fields"] == dict(result.batch_template(record["batch_index"]).fields)
    assert {r["prompt_fields"]["stars"] for r in records} == {"5.0", "1.0"}
    # the shared run settings stay the release-wide template (compared on resume)
    assert len({json.dumps(r["run"], sort_keys=True) for r in records}) == 1


def test_an_output_written_before_prompt_fields_existed_still_resumes(tiny, reviews, tmp_path):
    output = tmp_path / "out.jsonl"
    _labelled(tiny, reviews, output=output)
    # as an older version wrote it: no prompt_fields, in the output and in the journal; batch 3 never sampled
    records = [r for r in read_generation_output(output) if r["batch_index"] != 3]
    for record in records:
        del record["prompt_fields"]
    output.write_text("".join(json.dumps(r) + "\n" for r in records))
    journal = journal_path(output.resolve())
    entries = [json.loads(line) for line in journal.read_text().splitlines()]
    kept = [e for e in entries if e["batch_index"] != 3]
    for entry in kept:
        entry["record"].pop("prompt_fields", None)
    journal.write_text("".join(json.dumps(e) + "\n" for e in kept))
    again = _labelled(tiny, reviews, output=output)
    assert again.num_resumed == 3 and len(again.texts) == 4
    fresh = [r for r in read_generation_output(output) if r["batch_index"] == 3]
    assert fresh[0]["prompt_fields"] == dict(again.batch_template(3).fields)


# --------------------------------------------------------------------------------------------
# b. a preset's example label values are refused unless given


def _never_load(*args, **kwargs):
    raise AssertionError("the model must not be loaded")


def test_the_yelp_presets_example_fields_are_refused_unless_given_or_filled(tiny, reviews, monkeypatch):
    monkeypatch.setattr(generation_module, "load_model", _never_load)
    options = dict(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=8.0, model="smollm2")
    for preset in ("yelp", "yelp-paper", "yelp-completion"):
        with pytest.raises(ValueError, match=r"example value.*'category', 'stars'.*--prompt-field"):
            generate_flat(reviews, prompt=preset, **options)
    # labels that fill one field leave the other one defaulted
    with pytest.raises(ValueError, match=r"field\(s\) \['category'\]"):
        generate_flat(reviews, prompt="yelp", label_columns=["label2"], **options)
    # given (the preset's own values, on purpose) or filled by labels, the preset runs
    monkeypatch.undo()
    options["model"] = tiny
    fields = {"category": "Restaurants", "stars": "4.0"}
    given = generate_flat(reviews, prompt="yelp", prompt_fields=fields, num_texts=1, **options)
    assert len(given.texts) == 1 and dict(given.template.fields) == fields
    assert len(_labelled(tiny, reviews, num_texts_per_group=1).texts) == 2
    # a preset without label fields (generic: a description of the collection) needs nothing
    assert len(generate_flat(reviews, num_texts=1, **options).texts) == 1


def test_the_cli_refuses_the_yelp_preset_without_fields(tiny_dir, reviews, tmp_path, capsys):
    args = ["generate", "--input", str(reviews), "--output", str(tmp_path / "o.jsonl"), "--model", str(tiny_dir),
            "--batch-size", "2", "--max-new-tokens", "3", "--epsilon", "8", "--delta", "1e-6", "--prompt", "yelp",
            "--no-progress"]  # fmt: skip
    assert main(args) == 2
    assert "--prompt-field category=Restaurants --prompt-field stars=4.0" in capsys.readouterr().err
    assert main([*args, "--prompt-field", "category=Restaurants", "--prompt-field", "stars=2.0", "--num-texts", "1"]) == 0
    assert read_generation_output(tmp_path / "o.jsonl")[0]["prompt_fields"]["stars"] == "2.0"


# --------------------------------------------------------------------------------------------
# c., d. the CLI says when nothing was charged, and counts agree with their nouns


def _cli(tiny_dir, references, output, *extra):
    return ["generate", "--input", str(references), "--output", str(output), "--model", str(tiny_dir),
            "--batch-size", "2", "--max-new-tokens", "3", "--epsilon", "8", "--delta", "1e-6", *extra]  # fmt: skip


def test_a_release_without_a_ledger_says_it_was_not_charged(tiny_dir, tmp_path, capsys):
    references = tmp_path / "refs.csv"
    references.write_text("text\nThe soup was cold.\nGreat tacos!\n")
    assert main(_cli(tiny_dir, references, tmp_path / "a.jsonl", "--no-progress")) == 0
    captured = capsys.readouterr()
    assert "not charged to any ledger" in captured.err
    assert "NOT CHARGED" in captured.out and "-DP" in captured.out
    assert main(_cli(tiny_dir, references, tmp_path / "b.jsonl", "--no-progress", "--json")) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["charged"] is False and summary["ledger"] is None
    assert summary["ledger_notice"].startswith("not charged to any ledger")
    assert "not charged to any ledger" in captured.err

    from accounting import BudgetLedger

    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=20.0, delta=1e-6, dataset="test")
    assert main(_cli(tiny_dir, references, tmp_path / "c.jsonl", "--no-progress", "--json", "--ledger",
                     str(ledger.path))) == 0  # fmt: skip
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["charged"] is True and summary["ledger"] == str(ledger.path) and "ledger_notice" not in summary
    assert "not charged" not in captured.err


def test_counts_agree_with_their_nouns(tiny_dir, tmp_path, capsys):
    import invink_audit.cli as cli

    references = tmp_path / "refs.csv"
    references.write_text("text\nThe soup was cold.\nGreat tacos!\n")
    assert main(_cli(tiny_dir, references, tmp_path / "one.jsonl", "--no-progress")) == 0
    out = capsys.readouterr().out
    assert re.search(r"wrote 1 text to ", out) and "1 batch of B = 2" in out
    assert not re.search(r"\b1 (texts|batches)\b", out)
    references.write_text("text\nThe soup was cold.\nGreat tacos!\nSlow.\nNice.\n")
    assert main(_cli(tiny_dir, references, tmp_path / "two.jsonl", "--no-progress")) == 0
    out = capsys.readouterr().out
    assert "wrote 2 texts to " in out and "2 batches of B = 2" in out
    assert [cli.plural(n, "text") for n in (0, 1, 2)] == ["0 texts", "1 text", "2 texts"]
    assert cli.plural(1, "batch", "batches") == "1 batch" and cli.plural(3, "batch", "batches") == "3 batches"


# --------------------------------------------------------------------------------------------
# g. progress: the generate bar has a total (texts x T), so it shows an ETA and ends full


def test_the_generate_progress_bar_has_a_total_and_ends_full(tiny, tiny_dir, tmp_path, capsys):
    references = tmp_path / "refs.csv"
    references.write_text("text\nThe soup was cold.\nGreat tacos!\nSlow.\nNice.\n")
    assert main(_cli(tiny_dir, references, tmp_path / "p.jsonl")) == 0
    err = capsys.readouterr().err
    # 2 texts x T = 3 token slots; without a total tqdm prints "6tok [..., ...]" and no ETA
    assert re.search(r"\b6/6 \[\d\d:\d\d<\d\d:\d\d", err), err
    starts = []
    generate(["a", "b", "c", "d"], GenerationConfig(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=8.0),
             model=tiny, hooks=GenerationHooks(on_start=starts.append))
    assert starts == [2]
    with pytest.raises(ValueError, match="on_start must be callable"):
        generate(["a", "b"], GenerationConfig(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=8.0), model=tiny,
                 hooks=GenerationHooks(on_start=3))


def test_progress_bars_redraw_rarely_into_a_log_and_often_on_a_terminal(monkeypatch, capsys):
    import io
    import sys

    from invink_audit.cli import LOG_REDRAW_SECONDS, tqdm_bar

    log = tqdm_bar(total=1000, desc="log")  # capsys: stderr is not a terminal
    for _ in range(1000):
        log.update(1)
    log.close()
    assert log.mininterval == LOG_REDRAW_SECONDS
    assert capsys.readouterr().err.count("\r") <= 3, "one draw at the start and one at the end, not one per update"

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = tqdm_bar(total=10, desc="tty")
    assert bar.mininterval < 1.0
    bar.close()


# --------------------------------------------------------------------------------------------
# e. audit headlines: against the release's ε; a sampled part too small to confirm anything says so

REPORTS = Path(__file__).resolve().parents[1] / "audits" / "reports"


def _committed(name):
    from invink_audit.audit.records import report_from_dict

    return report_from_dict(json.loads((REPORTS / name / "report.json").read_text()))


def _small_synthetic_audit(num_samples, num_is_samples):
    import torch

    from invink_audit.audit import analysis, synthetic
    from invink_audit.audit.whitebox import WhiteBoxConfig

    source = synthetic.HardestCaseSource(vocab_size=6, batch_size=3, temperature=1.0)
    mech = synthetic.correct_mechanism(clip_norm=0.5, temperature=1.0, top_k=3, batch_size=3, max_new_tokens=5)
    config = WhiteBoxConfig(alphas=(2.0, 4.0), num_samples=num_samples, num_is_samples=num_is_samples, min_samples=16)
    rec = synthetic.run_synthetic_audit(source, mech, config, generator=torch.Generator().manual_seed(7))
    return analysis.analyse(rec, mechanism=mech.name, source=source.name)


def test_the_epsilon_headline_compares_with_the_accountants_epsilon():
    report = _committed("yelp_smollm2")
    first = report.accountants[0]
    h = report.headroom_summary()
    # the release's claim (the accountant's ε), not the claimed curve's conversion on the α grid
    assert h["epsilon"] == pytest.approx(first.epsilon / first.epsilon_measured)
    assert h["epsilon"] != pytest.approx(first.epsilon_claimed_grid / first.epsilon_measured)
    assert h["epsilon_accountant"] == first.epsilon and h["accountant"] == first.accountant
    line = report.headline()[0]
    assert f"claims {first.epsilon:.4g} ({first.accountant})" in line and f"gives {first.epsilon_measured:.4g}" in line
    assert "overstates" in line  # its claimed grid ε (3.25) is above the accountant's (3.0): the caveat is given
    assert len(report.headline()) == 1  # its importance-sampling rows bound D_α below the claim: confirmed


def test_a_pass_whose_sampled_part_is_too_small_says_it_confirms_nothing():
    small = _small_synthetic_audit(16, 0)
    assert small.verdict.value == "PASS"
    assert "too small to confirm anything" in small.reason and "rests on the exact per-step checks" in small.reason
    assert small.sampled_confirmations == 0
    assert "too small to confirm anything" in small.headline()[-1]
    larger = _small_synthetic_audit(30, 10)
    assert larger.verdict.value == "PASS" and larger.sampled_confirmations > 0
    assert "confirm" not in larger.reason and len(larger.headline()) == 1


def test_the_quick_audit_summary_says_when_its_sampled_part_confirms_nothing():
    import dataclasses
    from types import SimpleNamespace

    from invink_audit.audit.quick import QuickAuditReport, _verdict
    from invink_audit.audit.stats import Verdict

    small = _small_synthetic_audit(16, 0)
    verdict, reason = _verdict({}, small, SimpleNamespace(a_priori=True))
    assert verdict is Verdict.PASS and "too few to confirm anything" in reason and "rests on the exact checks" in reason
    report = QuickAuditReport(
        verdict=verdict, reason=reason, texts_audited=3, step_checks=10, step_failures={}, max_loss_range_over_epsilon0=0.5,
        realised_loss_max=1.0, realised_loss_mean=0.5, a_priori_loss_bound=5.0, accountant_epsilon=1.457, sampled=small,
        seconds=1.0, uncharged_samples=small.num_texts,
    )  # fmt: skip
    text = report.summary()
    assert "eps headroom (claimed / measured curve)" not in text
    assert "the release claims 1.457" in text and "too small to confirm anything" in text
    confirmed = dataclasses.replace(small, sequence=tuple(dataclasses.replace(s, upper=0.0) for s in small.sequence))
    assert "confirm" not in _verdict({}, confirmed, SimpleNamespace(a_priori=True))[1]


def test_the_delta_table_keeps_its_informative_rows(tmp_path):
    from invink_audit.audit.report import write_report

    report = _committed("yelp_smollm2")
    positive = [d for d in report.delta if d.delta_estimate > 0]
    zero = len(report.delta) - len(positive)
    assert positive and zero > 40
    write_report(report, tmp_path, plots=False)
    markdown = (tmp_path / "report.md").read_text()
    section = markdown.split("## δ(ε)")[1]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| neighbour")]
    assert len(rows) == len(positive)
    assert f"{zero} of {len(report.delta)} row(s) with δ̂ = 0 omitted" in section
    # every row stays in the JSON
    assert len(json.loads((tmp_path / "report.json").read_text())["delta"]) == len(report.delta)


# --------------------------------------------------------------------------------------------
# f. plots show what they claim


@pytest.fixture()
def figures(monkeypatch):
    """The figures the report and sweep writers save, kept open (not closed) for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        close(fig)


def _figure(figures, xlabel: str):
    """The last kept figure whose first axes' x label starts with ``xlabel``, drawn."""
    fig = next(f for f in reversed(figures) if f.axes and f.axes[0].get_xlabel().startswith(xlabel))
    fig.canvas.draw()
    return fig


def test_the_renyi_plot_title_is_whole_and_inside_the_figure(figures, tmp_path):
    import dataclasses

    from invink_audit.audit.report import write_report

    report = _committed("yelp_smollm2_amin")
    label = report.worst_neighbour.label
    assert len(label) > 100
    write_report(report, tmp_path)
    fig = _figure(figures, "Rényi order")
    title = fig.axes[0].title
    assert "".join(label.split()) in "".join(title.get_text().split())  # the whole label, wrapped, not cut at 60
    box, frame = title.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    assert box.x0 >= frame.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1
    long = dataclasses.replace(report, worst_neighbour=dataclasses.replace(report.worst_neighbour, label="x " * 400))
    write_report(long, tmp_path)
    assert _figure(figures, "Rényi order").axes[0].title.get_text().endswith("…")


def test_the_loss_histogram_draws_the_a_priori_bound(figures, tmp_path):
    from invink_audit.audit.report import write_report

    report = _committed("yelp_smollm2")
    write_report(report, tmp_path)
    ax = _figure(figures, "privacy loss").axes[0]
    assert ax.get_legend() is not None, "no legend: the bound is not drawn"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    bound = report.claim.epsilon0 * report.claim.max_new_tokens
    assert any(t.startswith("a-priori bound T·ε0") for t in legend), legend
    assert any(t.startswith("claimed ε") for t in legend), legend
    drawn = [line.get_xdata()[0] for line in ax.get_lines()]
    clipped = any("beyond the axis" in t for t in legend if t.startswith("a-priori"))
    assert clipped or any(x == pytest.approx(bound) for x in drawn)


def _point(b, epsilon, estimate, lower, upper):
    from invink_audit.evaluation.sweep import SweepPoint

    metric = {"estimate": estimate, "lower": lower, "upper": upper}
    params = {"batch_size": b, "top_k": 100, "temperature": 1.0, "max_new_tokens": 8, "epsilon": epsilon}
    evaluation = {"mauve": metric, "mauve_c5": metric, "delta_ppl": metric}
    return SweepPoint(f"b{b}-e{epsilon}", "invisibleink", params, {"epsilon": epsilon, "clip_norm": 1.0}, 50.0 * b,
                      evaluation, 1.0)  # fmt: skip


def test_sweep_plots_show_every_group_and_mark_cut_intervals(figures, tmp_path):
    from invink_audit.evaluation.sweep import write_sweep_plots

    rows = [_point(3, 1.0, 0.5, 0.45, 0.55), _point(7, 1.0, 0.5, 0.45, 0.55),  # the same values at the same ε
            _point(3, 8.0, 0.6, -88.0, 0.65), _point(7, 8.0, 0.62, 0.58, 0.66)]  # fmt: skip
    write_sweep_plots(rows, tmp_path)
    ax = _figure(figures, "ε").axes[0]
    series = [line for line in ax.get_lines() if line.get_marker() not in (None, "None", "", "_")]
    markers = {line.get_marker() for line in series if len(line.get_xdata()) == 2}
    assert len(markers) == 2  # B = 3 and B = 7 have their own markers ...
    xs = [tuple(line.get_xdata()) for line in series if len(line.get_xdata()) == 2]
    assert len(set(xs)) == 2 and xs[0][0] != xs[1][0]  # ... and do not sit on each other
    bottom, top = ax.get_ylim()
    assert bottom > -10 and top < 2  # the axis spans the estimates, not one interval's -88
    notes = [t.get_text() for t in ax.texts]
    assert "-88" in notes and "cut" in ax.get_title()
    # one value and no interval: the axis still spans something (warnings are errors: no singular limits)
    write_sweep_plots([_point(3, 1.0, 0.0, 0.0, 0.0)], tmp_path)
    bottom, top = _figure(figures, "ε").axes[0].get_ylim()
    assert bottom < 0.0 < top


# --------------------------------------------------------------------------------------------
# g. quick_audit reports each phase's progress (the caller draws the bars)


def test_quick_audit_reports_each_phase_from_zero_to_its_total(tiny, capsys):
    from invink_audit.audit.quick import quick_audit

    refs = ["The soup was cold.", "Great tacos!", "Slow service.", "Lovely staff."]
    result = generate(refs, GenerationConfig(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=8.0), model=tiny)
    calls = []
    quick_audit(result, model=tiny, num_samples=16, progress=lambda *call: calls.append(call))
    from invink_audit.audit.quick import PHASE_EXACT, PHASE_SAMPLED
    from invink_audit.cli import phase_progress

    phases = list(dict.fromkeys(phase for phase, _, _ in calls))
    assert phases == [PHASE_EXACT, PHASE_SAMPLED]
    for phase in phases:
        mine = [(done, total) for p, done, total in calls if p == phase]
        assert mine[0][0] == 0 and mine[-1][0] == mine[-1][1] > 0
        assert all(a <= b for (a, _), (b, _) in zip(mine, mine[1:]))  # it only moves forward
    exact_total = [total for p, _, total in calls if p == PHASE_EXACT][0]
    assert exact_total == sum(t.num_tokens for t in result.texts)
    assert [total for p, _, total in calls if p == PHASE_SAMPLED][0] % 3 == 0  # texts x T token slots
    with pytest.raises(ValueError, match="progress must be callable"):
        quick_audit(result, model=tiny, sampled_batch=None, progress="bars")
    # the CLI's bars: one per phase, each with its total (so an ETA)
    progress, close = phase_progress()
    try:
        quick_audit(result, model=tiny, sampled_batch=None, progress=progress)
    finally:
        close()
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(PHASE_EXACT)}: 100%.*\b{exact_total}/{exact_total} \[\d\d:\d\d<\d\d:\d\d", err), err


def test_a_sweep_refuses_the_yelp_presets_example_fields_before_any_point_runs():
    from invink_audit.evaluation.sweep import SweepConfig

    with pytest.raises(ValueError, match=r"example value.*--prompt-field"):
        SweepConfig(epsilons=(1.0,), batch_sizes=(2,), prompt="yelp")
    SweepConfig(epsilons=(1.0,), batch_sizes=(2,), prompt="yelp", label_columns=("label1", "label2"))
    SweepConfig(epsilons=(1.0,), batch_sizes=(2,), prompt="yelp", prompt_fields={"category": "Bars", "stars": "2.0"})
