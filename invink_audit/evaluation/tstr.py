r"""Train on synthetic, test on real (TSTR; Esteban et al. 2017): does the synthetic text carry its labels' signal?

A fixed TF-IDF + logistic-regression classifier trained on the synthetic texts, against a real-data **ceiling** and
the labels-only **floor** (chance, :math:`\sum_c p_{syn}(c)\, p_{test}(c)`, computed exactly), all tested on the
same held-out real texts; the headline is the fraction of the gap closed, ``(acc_syn − acc_floor) / (acc_ceiling −
acc_floor)``, with percentile-bootstrap intervals that retrain both classifiers. Design and the choices behind the
classifier: docs/guide/evaluating.md (the ``tstr`` row and §"TSTR").
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence

import numpy as np

from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval, percentile_interval

__all__ = ["TstrResult", "train_on_synthetic_test_on_real"]


def _hashed_counts(texts: Sequence[str]):
    """Word 1–2-gram counts, hashed into 2^20 columns (stateless: every text is tokenised once per
    evaluation, however many times the classifiers are retrained; collisions are negligible at this width)."""
    from sklearn.feature_extraction.text import HashingVectorizer

    vectorizer = HashingVectorizer(ngram_range=(1, 2), n_features=2**20, alternate_sign=False, norm=None)
    return vectorizer.transform(list(texts))


def _fit_predict(train_counts, train_labels: Sequence[str], test_counts) -> np.ndarray:
    """TF-IDF (idf from the training texts, sublinear tf, l2) + logistic regression, predictions on the test rows."""
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.linear_model import LogisticRegression

    majority = np.asarray([Counter(train_labels).most_common(1)[0][0]] * test_counts.shape[0], dtype=object)
    if len(set(train_labels)) == 1 or train_counts.nnz == 0:
        return majority  # one class, or no word in any training text: only the majority can be predicted
    # the columns of n-grams seen in training: the vocabulary a TfidfVectorizer fitted on them would have
    columns = np.flatnonzero(train_counts.getnnz(axis=0))
    train, test = train_counts[:, columns], test_counts[:, columns]
    tfidf = TfidfTransformer(sublinear_tf=True).fit(train)
    model = LogisticRegression(C=10.0, class_weight="balanced", max_iter=2000)
    model.fit(tfidf.transform(train), list(train_labels))
    return np.asarray(model.predict(tfidf.transform(test)), dtype=object)


@dataclasses.dataclass(frozen=True)
class TstrResult:
    """Accuracies on the real test texts and the fraction of the floor-to-ceiling gap closed."""

    accuracy_synthetic: Interval
    accuracy_ceiling: Interval
    accuracy_floor: Interval
    gap_closed: Interval | None
    gap_closed_note: str
    num_train_synthetic: int
    num_train_real: int
    num_test: int
    num_classes: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _check(name: str, texts, labels) -> None:
    if len(texts) != len(labels):
        raise ValueError(f"{name}: {len(texts)} texts but {len(labels)} labels")
    if not texts:
        raise ValueError(f"{name}: no labelled texts")


#: how a TSTR gap-closed fraction is flagged when the ceiling does not beat the floor significantly
NOT_INTERPRETABLE = "NOT INTERPRETABLE"


def _gap_closed(accuracy: dict[str, float], boot: dict[str, np.ndarray], confidence: float, how: str):
    """The fraction of the floor-to-ceiling gap the synthetic classifier closes, with its bootstrap
    interval over the replicates where the ceiling beats the floor (``None`` and why, when it does not)."""
    denominator = accuracy["ceiling"] - accuracy["floor"]
    if denominator <= 0:
        return None, f"undefined: the ceiling ({accuracy['ceiling']:.3f}) does not beat the floor ({accuracy['floor']:.3f})"
    estimate = (accuracy["synthetic"] - accuracy["floor"]) / denominator
    spread = boot["ceiling"] - boot["floor"]
    usable = spread > 0
    replicates = (boot["synthetic"][usable] - boot["floor"][usable]) / spread[usable]
    dropped = int((~usable).sum())
    note = "(acc_syn - acc_floor) / (acc_ceiling - acc_floor)" + (
        f"; {dropped} replicates where the ceiling did not beat the floor were dropped" if dropped else ""
    )
    if dropped / spread.size > (1 - confidence) / 2:  # the ceiling does not beat the floor at this confidence
        note = (f"{NOT_INTERPRETABLE}: the ceiling beats the floor in only {usable.mean():.0%} of replicates, so the "
                f"fraction of the gap is a ratio of noise; " + note)
    return percentile_interval(estimate, replicates, confidence, method=how), note


def _accuracies(syn_counts, synthetic_labels, ceiling_counts, ceiling_labels, test, truth, syn_idx, ceiling_idx,
                test_idx) -> dict[str, float]:
    """The three accuracies on one (re)sample: the classifier trained on the synthetic texts ``syn_idx``, the
    ceiling trained on the real texts ``ceiling_idx``, both scored on the test texts ``test_idx``, and the
    stratified guess's expected accuracy."""
    syn_labels = [synthetic_labels[i] for i in syn_idx]
    predicted_syn = _fit_predict(syn_counts[syn_idx], syn_labels, test)
    predicted_ceiling = _fit_predict(ceiling_counts[ceiling_idx], [ceiling_labels[i] for i in ceiling_idx], test)
    # the stratified guess is right on text i with probability p_syn(label_i): its expected accuracy
    frequencies = Counter(syn_labels)
    floor = np.asarray([frequencies.get(t, 0) / len(syn_labels) for t in truth], dtype=np.float64)
    return {
        "synthetic": float((predicted_syn == truth)[test_idx].mean()),
        "ceiling": float((predicted_ceiling == truth)[test_idx].mean()),
        "floor": float(floor[test_idx].mean()),
    }


def train_on_synthetic_test_on_real(
    synthetic_texts: Sequence[str],
    synthetic_labels: Sequence[str],
    real_train_texts: Sequence[str],
    real_train_labels: Sequence[str],
    real_test_texts: Sequence[str],
    real_test_labels: Sequence[str],
    *,
    num_bootstrap: int = 50,
    confidence: float = DEFAULT_CONFIDENCE,
    rng: np.random.Generator | None = None,
) -> TstrResult:
    """TSTR with its ceiling and floor (module docstring). The ceiling is trained on
    ``min(len(synthetic), len(real_train))`` real texts (a seeded sample), so that it differs from the
    synthetic classifier in the texts' origin, not in their number."""
    _check("synthetic", synthetic_texts, synthetic_labels)
    _check("real train", real_train_texts, real_train_labels)
    _check("real test", real_test_texts, real_test_labels)
    rng = rng if rng is not None else np.random.default_rng(20253)
    n = min(len(synthetic_texts), len(real_train_texts))
    chosen = np.sort(rng.choice(len(real_train_texts), size=n, replace=False))
    ceiling_texts = [real_train_texts[i] for i in chosen]
    ceiling_labels = [real_train_labels[i] for i in chosen]
    truth = np.asarray(list(real_test_labels), dtype=object)
    accuracies = functools.partial(
        _accuracies, _hashed_counts(synthetic_texts), list(synthetic_labels), _hashed_counts(ceiling_texts), ceiling_labels,
        _hashed_counts(real_test_texts), truth,
    )
    m = len(truth)
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):  # small fits: BLAS threads only spin-wait on a shared machine
        accuracy = accuracies(np.arange(len(synthetic_texts)), np.arange(n), np.arange(m))
        replicas = [
            accuracies(
                rng.integers(0, len(synthetic_texts), size=len(synthetic_texts)),
                rng.integers(0, n, size=n),
                rng.integers(0, m, size=m),
            )
            for _ in range(num_bootstrap)
        ]
    boot = {k: np.asarray([r[k] for r in replicas]) for k in accuracy}
    how = "bootstrap over training and test texts (classifiers retrained)"
    intervals = {k: percentile_interval(accuracy[k], boot[k], confidence, method=how) for k in accuracy}
    gap, note = _gap_closed(accuracy, boot, confidence, how)
    return TstrResult(
        accuracy_synthetic=intervals["synthetic"],
        accuracy_ceiling=intervals["ceiling"],
        accuracy_floor=intervals["floor"],
        gap_closed=gap,
        gap_closed_note=note,
        num_train_synthetic=len(synthetic_texts),
        num_train_real=n,
        num_test=m,
        num_classes=len(set(real_test_labels) | set(synthetic_labels)),
    )
