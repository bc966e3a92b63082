"""Markdown report and plots of an evaluation (``report.md``, ``report.json``, ``*.png``): NOT PRIVATE,
so written owner-only and marked (:mod:`invink_audit.not_private`)."""

from __future__ import annotations

from pathlib import Path

from invink_audit.evaluation.evaluator import EvaluationResult
from invink_audit.evaluation.stats import Interval
from invink_audit.not_private import agg_pyplot, md_table, save_not_private_figure, write_not_private_json, write_not_private_text

__all__ = ["evaluation_markdown", "write_evaluation_report"]


def _fmt(value: Interval | None, digits: int = 3, scale: float = 1.0) -> str:
    return "n/a" if value is None else value.format(digits, scale)


def _dtype_note(dtype: str | None, choice=None) -> str:
    """`` (bfloat16: reason)``: the dtype a model of the evaluation ran in, and why where it was chosen."""
    if not dtype:
        return ""
    reason = choice.get("reason") if choice else None
    return f" ({dtype}: {reason.rstrip('.')})" if reason else f" ({dtype})"


def evaluation_markdown(result: EvaluationResult, *, title: str = "Utility evaluation") -> str:
    """The evaluation as a Markdown document (a table of every figure with its interval)."""
    conf = int(round(result.mauve.interval.confidence * 100))
    lines = [
        f"# {title}",
        "",
        "**NOT PRIVATE**: computed from the real texts in the clear; keep this report with the data.",
        "",
        f"{result.num_synthetic} synthetic texts against {result.num_real} real texts; embeddings "
        f"`{result.embedding_model}`{_dtype_note(result.embedding_dtype)}; perplexity scorer: {result.scorer or 'none'}"
        f"{_dtype_note(result.scorer_dtype and result.scorer_dtype.get('dtype'), result.scorer_dtype)}. "
        f"Intervals: {conf}%.",
        "",
    ]
    if result.warnings:  # before the figures: they are to be read with it in mind
        lines += ["**Small samples** (figures reported below, but read them with this in mind):", ""]
        lines += [f"- {w}" for w in result.warnings] + [""]
    lines += [
        *md_table("metric | estimate [interval] | how"),
        f"| MAUVE (paper: {result.mauve.num_buckets} buckets = n/20, c = 0.9) | {_fmt(result.mauve.interval)} | "
        f"mean of {len(result.mauve.seed_scores)} k-means seeds; {result.mauve.interval.method} |",
        f"| MAUVE (library default: {result.mauve_c5.num_buckets} buckets = n/10, c = 5) | "
        f"{_fmt(result.mauve_c5.interval)} | {result.mauve_c5.interval.method} |",
        f"| ΔPPL | {_fmt(result.delta_ppl, 2)} | \\|mean PPL(synthetic) − mean PPL(real)\\| |",
        f"| PPL synthetic | {_fmt(result.perplexity_synthetic, 2)} | Wald, log scale (never negative) |",
        f"| PPL real | {_fmt(result.perplexity_real, 2)} | Wald, log scale (never negative) |",
        f"| length, synthetic (scorer tokens) | {_fmt(result.length_synthetic, 1)} | Wald |",
        f"| length, real (scorer tokens) | {_fmt(result.length_real, 1)} | Wald |",
    ]
    if result.generated_tokens is not None:
        lines.append(f"| generated tokens per text | {_fmt(result.generated_tokens, 1)} | Wald |")
    if result.eos_share is not None:
        lines.append(f"| texts ending in EOS | {result.eos_share:.1%} | share |")
    if result.tstr is not None:
        t = result.tstr
        lines += [
            f"| TSTR accuracy, trained on synthetic | {_fmt(t.accuracy_synthetic)} | {t.num_test} real test texts, "
            f"{t.num_classes} classes |",
            f"| TSTR ceiling (trained on {t.num_train_real} real texts) | {_fmt(t.accuracy_ceiling)} | |",
            f"| TSTR floor (chance: labels alone) | {_fmt(t.accuracy_floor)} | |",
            f"| TSTR fraction of the gap closed | {_fmt(t.gap_closed)} | {t.gap_closed_note} |",
        ]
    lines += [*_off_genre_rows(result), ""]
    if result.num_empty_synthetic:
        lines += [
            f"**Warning**: {result.num_empty_synthetic} of {result.num_synthetic} synthetic texts are empty; they are "
            "evaluated as empty texts.",
            "",
        ]
    lines += [
        f"MAUVE per seed (paper setting): {', '.join(f'{s:.3f}' for s in result.mauve.seed_scores)}.",
        f"Texts without a perplexity (empty): {result.ppl_unscored_synthetic}; texts truncated for scoring: "
        f"{result.ppl_truncated}.",
        "Time: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items()) + ".",
        "",
    ]
    return "\n".join(lines)


def _off_genre_rows(result: EvaluationResult) -> list[str]:
    """The off-genre shares' table rows (none for a result without them)."""
    if result.off_genre_synthetic is None:
        return []
    return [
        f"| off-genre texts, synthetic | {_fmt(result.off_genre_synthetic, scale=100, digits=0)} % | the off-genre "
        "rule (a chatbot about the task, refusal, list, url, under 6 words); Wilson |",
        f"| off-genre texts, real | {_fmt(result.off_genre_real, scale=100, digits=0)} % | the same rule on the "
        "real texts sampled |",
    ]


def _plots(result: EvaluationResult, directory: Path) -> list[str]:
    plt = agg_pyplot()
    written = []
    fig, ax = plt.subplots(figsize=(4.5, 2.6), dpi=90)
    for y, (name, res) in enumerate((("paper (c=0.9)", result.mauve), ("library (c=5)", result.mauve_c5))):
        iv = res.interval
        ax.errorbar(iv.estimate, y, xerr=[[iv.estimate - iv.lower], [iv.upper - iv.estimate]], fmt="o", capsize=4)
        ax.scatter(res.seed_scores, [y + 0.15] * len(res.seed_scores), s=8, color="grey")
    ax.set_yticks([0, 1], ["paper (c=0.9)", "library (c=5)"])
    ax.set_xlim(0, 1.02)
    ax.set_xlabel("MAUVE (grey: per k-means seed)")
    fig.tight_layout()
    save_not_private_figure(fig, directory / "mauve.png")
    plt.close(fig)
    written.append("mauve.png")
    if result.synthetic_perplexities and result.real_perplexities:
        import numpy as np

        fig, ax = plt.subplots(figsize=(4.5, 2.6), dpi=90)
        values = np.log10(np.concatenate([result.synthetic_perplexities, result.real_perplexities]))
        bins = np.linspace(values.min(), values.max() + 1e-9, 25)
        ax.hist(np.log10(result.synthetic_perplexities), bins=bins, alpha=0.6, label="synthetic")
        ax.hist(np.log10(result.real_perplexities), bins=bins, alpha=0.6, label="real")
        ax.set_xlabel("log10 perplexity")
        ax.legend()
        fig.tight_layout()
        save_not_private_figure(fig, directory / "perplexity.png")
        plt.close(fig)
        written.append("perplexity.png")
    return written


def write_evaluation_report(result: EvaluationResult, directory: str | Path, *, title: str = "Utility evaluation") -> Path:
    """Write ``report.md``, ``report.json`` and the plots into ``directory`` (created); returns it.

    Every file is owner-only (0600) and never written through a symbolic link; the JSON is marked
    ``"not_private": true`` and the Markdown opens with the NOT PRIVATE banner.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)  # a new one: owner-only, like its files
    write_not_private_json(directory / "report.json", result.to_json(), indent=1)
    plots = _plots(result, directory)
    markdown = evaluation_markdown(result, title=title) + "\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n"
    write_not_private_text(directory / "report.md", markdown, markdown=True)
    return directory
