"""The planning profile (``invink-audit profile``): teacher-forced scores against a brute-force recomputation
(full forward passes, no cache, the mechanism written out in numpy), the pairing of points, and the command."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from invink_audit.evaluation.profile import SMOOTHING, ProfileConfig, run_profile
from invink_audit.prompts import encode_request, get_preset, template_for_labels

PROXY = [
    ("Great tacos, friendly staff.", "food", "5"),
    ("Slow service but the soup was good.", "food", "5"),
    ("Best burger in town, will return.", "food", "5"),
    ("The room was clean and quiet.", "hotel", "4"),
    ("Noisy hallway, comfy bed.", "hotel", "4"),
    ("Check-in took an hour.", "hotel", "4"),
]
REAL = [
    ("Lovely noodles and quick service.", "food", "5"),
    ("A fine stay, the pool was cold.", "hotel", "4"),
    ("Pizza was burnt but cheap.", "food", "5"),
]
T = 12


def _config(**changes):
    base = dict(epsilons=(1.0, 10.0), batch_sizes=(3,), top_ks=(None, 5), max_new_tokens=T, num_texts=len(REAL),
                prompt="yelp", prompt_fields=None, label_columns=("label1", "label2"), num_resamples=200)
    base.update(changes)
    return ProfileConfig(**base)


def _files(reviews_csv):
    return reviews_csv(PROXY, name="proxy.csv"), reviews_csv(REAL, name="real.csv")


def forced_rows(tiny, text: str, l1: str, l2: str):
    """The forced ids of a REAL text and its rows from full forward passes (no cache): public (t, V), private (t, B, V)."""
    refs = [r for r, a, b in PROXY if (a, b) == (l1, l2)]
    request = encode_request(tiny.tokenizer, template_for_labels(get_preset("yelp"), {"label1": l1, "label2": l2}), refs)
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)[:T]
    rows = []
    for prompt in (request.public_ids, *request.private_ids):
        with torch.no_grad():
            out = tiny.model(torch.tensor([list(prompt) + ids])).logits[0].double().numpy()
        rows.append(out[len(prompt) - 1 : len(prompt) - 1 + len(ids)])
    return ids, rows[0], np.stack(rows[1:], axis=1)


def _brute_force(tiny, point, *, kind="point"):
    """Token-weighted smoothed CE over REAL of one distribution, from full forward passes of every row."""
    total, count = 0.0, 0
    for text, l1, l2 in REAL:
        ids, public, private = forced_rows(tiny, text, l1, l2)
        tau, vocab = point["temperature"], public.shape[-1]
        if kind == "floor":
            scores, keep = public / tau, _top_k(public, point["top_k"], 0.0)
        elif kind == "null":  # every reference null: the public row on the point's Top-k+ set
            scores, keep = public / tau, _top_k(public, point["top_k"], 2 * point["clip_norm"] / private.shape[1])
        elif kind == "ensemble":
            scores, keep = private.mean(axis=1) / tau, np.ones_like(public, dtype=bool)
        else:
            c, b = point["clip_norm"], private.shape[1]
            scores = (public + np.clip(private - public[:, None], -c, c).mean(axis=1)) / tau
            keep = _top_k(public, point["top_k"], 2 * c / b)
        scores = np.where(keep, scores, -np.inf)
        lp = scores - np.logaddexp.reduce(scores, axis=-1, keepdims=True)
        p = np.exp(lp[np.arange(len(ids)), ids])
        total += float(-np.log((1 - SMOOTHING) * p + SMOOTHING / vocab).sum())
        count += len(ids)
    return total / count


def _top_k(public, k, band):
    if k is None:
        return np.ones_like(public, dtype=bool)
    kth = np.sort(public, axis=-1)[:, -k][:, None]
    return public >= kth - band - 1e-12


def write_texts(directory) -> tuple:
    """The proxy and real texts as CSV files in ``directory``: their paths."""
    proxy, real = directory / "proxy.csv", directory / "real.csv"
    for path, rows in ((proxy, PROXY), (real, REAL)):
        path.write_text("text,label1,label2\n" + "".join(f'"{t}",{a},{b}\n' for t, a, b in rows), encoding="utf-8")
    return proxy, real


@pytest.fixture(scope="module")
def profiled(tiny, tmp_path_factory):
    proxy, real = write_texts(tmp_path_factory.mktemp("profile"))
    return run_profile(proxy, real, _config(), model=tiny), proxy, real


def test_teacher_forced_scores_match_a_brute_force_recomputation(tiny, profiled):
    result = profiled[0]
    assert result.num_texts == len(REAL) and result.skipped_texts == 0
    for p in result.points:
        point = p.to_json()
        assert p.heldout_ce.estimate == pytest.approx(_brute_force(tiny, point), abs=1e-5)
        assert p.floor_ce.estimate == pytest.approx(_brute_force(tiny, point, kind="floor"), abs=1e-5)
        assert p.ensemble_ce.estimate == pytest.approx(_brute_force(tiny, point, kind="ensemble"), abs=1e-5)
        gain = p.floor_ce.estimate - p.heldout_ce.estimate
        assert p.gain_over_floor.estimate == pytest.approx(gain, abs=1e-12)
        null = _brute_force(tiny, point, kind="null")
        assert p.gain_over_null.estimate == pytest.approx(null - p.heldout_ce.estimate, abs=1e-5)
        assert p.gain_over_floor.lower <= gain <= p.gain_over_floor.upper


def test_coverage_and_clipping_are_shares_of_the_same_tokens(profiled):
    for p in profiled[0].points:
        assert 0.0 <= p.clipped_share <= 1.0
        if p.point.top_k is None:
            assert p.coverage == 1.0 and p.floor_coverage == 1.0
        else:
            assert p.floor_coverage <= p.coverage <= 1.0  # Top-k+ holds the public top-k
    one = {(p.point.epsilon, p.point.top_k): p for p in profiled[0].points}
    # a larger C clips fewer differences on the same logits
    assert one[(10.0, None)].clipped_share < one[(1.0, None)].clipped_share


def test_points_are_paired_across_grids(tiny, profiled):
    """A point's figures do not depend on which other points share the pass (the same texts, tokens and
    references), and B is nested: the first B of each text's max(B) references."""
    full, proxy, real = profiled
    alone = run_profile(proxy, real, _config(epsilons=(10.0,), top_ks=(5,)), model=tiny)
    a = next(p for p in full.points if p.point.epsilon == 10.0 and p.point.top_k == 5)
    assert alone.points[0].heldout_ce.estimate == pytest.approx(a.heldout_ce.estimate, abs=1e-12)
    small = run_profile(proxy, real, _config(batch_sizes=(2,), top_ks=(None,), epsilons=(1.0,)), model=tiny)
    nested = run_profile(proxy, real, _config(batch_sizes=(2, 3), top_ks=(None,), epsilons=(1.0,)), model=tiny)
    b2 = next(p for p in nested.points if p.point.batch_size == 2)
    # the same references and tokens; only float32 rounding differs (each forward pass holds B + 1 rows)
    assert small.points[0].heldout_ce.estimate == pytest.approx(b2.heldout_ce.estimate, abs=1e-7)


def test_comparisons_rank_only_points_with_the_same_floor(profiled):
    result = profiled[0]
    for c in result.comparisons:
        assert (c.better.top_k, c.better.temperature) == (c.worse.top_k, c.worse.temperature)
        assert c.separated == (c.difference.lower > 0)
        if not c.separated and c.difference.estimate > 0:
            assert c.texts_needed is not None and c.texts_needed >= 1
    assert "not ranked against each other" in result.recommendation  # two k values in the grid


def test_bad_input_is_refused_before_any_model_loads(reviews_csv, tiny):
    with pytest.raises(ValueError, match="epsilon"):
        _config(epsilons=(1.0, 1e9))
    with pytest.raises(ValueError, match="must not repeat"):
        _config(batch_sizes=(2, 2))
    proxy, real = _files(reviews_csv)
    with pytest.raises(ValueError, match="proxy references of its label group"):
        run_profile(proxy, real, _config(batch_sizes=(4,)), model=tiny)  # every group has only 3
    one = reviews_csv(REAL[:1], name="one.csv")
    with pytest.raises(ValueError, match="at least 2"):
        run_profile(proxy, one, _config(), model=tiny)


def test_a_text_is_cut_at_an_end_of_sequence_token_it_spells(tiny, reviews_csv):
    eos = tiny.tokenizer.decode([min(tiny.eos_token_ids)])
    proxy = reviews_csv(PROXY, name="proxy.csv")
    real = reviews_csv([(f"Good soup.{eos} Then more words", "food", "5"), REAL[2]], name="real.csv")
    result = run_profile(proxy, real, _config(epsilons=(1.0,), top_ks=(None,)), model=tiny)
    cut = len(tiny.tokenizer.encode("Good soup.", add_special_tokens=False))
    whole = len(tiny.tokenizer.encode(REAL[2][0], add_special_tokens=False))
    assert result.num_tokens == cut + min(whole, T)
    assert result.warnings and "below 20" in result.warnings[0]  # 2 texts: the bootstrap under-covers


def test_engine_force_refuses_sequences_that_cannot_end_where_they_end(tiny):
    from invink_audit.engine import Engine
    from invink_audit.mechanism import MechanismConfig

    engine = Engine(tiny, MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=1))
    request = encode_request(tiny.tokenizer, get_preset("generic", description="x"), ["a review"])
    for bad, match in (([5, 6, 7, 8, 9], "more than max_new_tokens"), ([], "non-empty"), ([tiny.vocab_size], r"ids in \[0,"),
                       ([5, 6], "ended after")):
        with pytest.raises(ValueError, match=match):
            engine.force([request], [bad], max_new_tokens=4, observer=lambda step: None)


def test_cli_json_and_report(tiny_dir, reviews_csv, tmp_path, capsys):
    from invink_audit.cli import main

    proxy, real = _files(reviews_csv)
    out = tmp_path / "report"
    status = main(["profile", "--input", str(proxy), "--real", str(real), "--epsilons", "1,3", "--batch-sizes", "2,3",
                   "--top-ks", "full", "--max-new-tokens", str(T), "--label-columns", "label1,label2", "--prompt", "yelp",
                   "--model", str(tiny_dir), "--json", "--output", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    payload = json.loads(captured.out)
    assert len(payload["points"]) == 4
    for point in payload["points"]:
        for key in ("epsilon", "batch_size", "clip_norm", "coverage", "clipped_share"):
            assert isinstance(point[key], (int, float))
        for key in ("heldout_ce", "floor_ce", "ensemble_ce", "gain_over_floor"):
            assert set(point[key]) >= {"estimate", "lower", "upper"}
            assert math.isfinite(point[key]["estimate"])
    assert "NOT differentially private" in captured.err and "NOT differentially private" in payload["notice"]
    assert {p.name for p in out.iterdir()} == {"profile.md", "profile.json", "gain.png", "clip_profile.png"}
    assert all(p.stat().st_mode & 0o077 == 0 for p in out.iterdir())  # owner-only
    assert "not a private release" in (out / "profile.md").read_text()


def test_scored_tokens_are_separate_from_the_planned_budget(tiny, reviews_csv):
    """--scored-tokens changes how much real text is scored, not the clip norms planned for T."""
    proxy, real = _files(reviews_csv)
    short = run_profile(proxy, real, _config(top_ks=(None,), scored_tokens=4), model=tiny)
    full = run_profile(proxy, real, _config(top_ks=(None,)), model=tiny)
    assert [p.point.clip_norm for p in short.points] == [p.point.clip_norm for p in full.points]
    assert short.num_tokens <= 4 * short.num_texts < full.num_tokens
    assert short.to_json()["scored_tokens"] == 4 and short.to_json()["max_new_tokens"] == T
    with pytest.raises(ValueError, match="scored_tokens"):
        _config(scored_tokens=0)


def test_cli_where_selects_the_proxy_references(tiny_dir, reviews_csv, tmp_path, capsys):
    """``profile --where`` takes the proxy records whose column has the value, as generate does: with only the
    hotel references left, no food text has references of its group and is skipped."""
    from invink_audit.cli import main

    proxy, real = _files(reviews_csv)
    argv = ["profile", "--input", str(proxy), "--real", str(real), "--epsilons", "1", "--batch-sizes", "2", "--top-ks",
            "full", "--max-new-tokens", str(T), "--label-columns", "label1,label2", "--prompt", "yelp", "--model",
            str(tiny_dir), "--json", "--no-progress"]
    assert main([*argv, "--where", "label1=hotel"]) == 2  # one text left: a paired bootstrap needs 2
    assert "1 held-out text(s) could be profiled (2 skipped" in capsys.readouterr().err
    assert main([*argv, "--where", "label1=nowhere"]) == 2
    assert "label1" in capsys.readouterr().err


def _point(batch_size, gain, half=0.01, epsilon=3.0):
    from invink_audit.evaluation.profile import GridPoint, ProfilePoint
    from invink_audit.evaluation.stats import Interval

    ce = Interval(2.0, 1.9, 2.1)
    return ProfilePoint(GridPoint(epsilon, batch_size, None, 1.0, 0.5), ce, ce, ce,
                        Interval(gain, gain - half, gain + half), ce, None, 1.0, 1.0, 0.0)


def test_the_recommendation_weighs_cost():
    """The cheapest point whose gain interval overlaps the best one's, with rows per token beside each gain."""
    from invink_audit.evaluation.profile import Comparison, _recommendation
    from invink_audit.evaluation.stats import Interval

    points = [_point(3, 0.090), _point(7, 0.115), _point(15, 0.120)]  # B=7 overlaps B=15; B=3 lies below
    close = Comparison(points[2].point, points[1].point, Interval(0.005, -0.01, 0.02), False, 90)
    text = _recommendation(points, [close], 30)
    assert text.startswith("eps=3 k=full tau=1: use B=7 (8 rows per token")
    assert "B=15 (16 rows per token, 2.0x the cost" in text and "not distinguishable" in text
    alone = [_point(3, 0.100), _point(15, 0.200)]
    apart = Comparison(alone[1].point, alone[0].point, Interval(0.1, 0.08, 0.12), True, None)
    text = _recommendation(alone, [apart], 30)
    assert "use B=15 (16 rows per token" in text and "no cheaper point's gain interval reaches it" in text
    assert "beats B=3" in text
