"""Demo, generation part: private synthetic restaurant reviews on the default generator (Gemma-3-270M).

The shipped dataset (``invink_audit/resources/demo_reviews.jsonl``) holds 24 short restaurant reviews,
8 each at 1, 3 and 5 stars, with Yelp-style label columns: names and places are invented, but reviews
are exactly the kind of user text a platform must not leak. The demo

1. plans the clip norm for the budget with :func:`accounting.plan_clip_norm`,
2. creates a budget ledger for the dataset and charges the run to it before generating,
3. generates one review per star rating, each from a disjoint batch of ``B`` reviews of that rating
   (label-conditioned: the rating is a public field of the prompt), with InvisibleInk and the ``yelp``
   preset, which a base model is prompted with as its completion twin ``yelp-completion`` (a quoted review to
   continue, ending at the closing quote: ``docs/results/templates.md``), streamed to JSON Lines,
4. prints the texts and the a-priori guarantee.

Run it with ``python examples/demo_generate.py`` (a few minutes at most on 2 CPU cores; the first run
also converts the GGUF model once, about a minute). ``main()`` returns the
:class:`~invink_audit.generation.GenerationResult` so that a caller can audit the texts.
"""

from __future__ import annotations

import importlib.resources
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

LABELS = ("label1", "label2")


def main(
    *,
    epsilon: float = 8.0,
    delta: float = 1e-6,
    batch_size: int = 4,
    max_new_tokens: int = 48,
    temperature: float = 1.0,
    top_k: int = 100,
    output_dir: str | Path | None = None,
):
    from accounting import BudgetLedger, plan_clip_norm
    from invink_audit.data import ReferencesFile
    from invink_audit.generation import GenerationConfig, generate
    from invink_audit.models import DEFAULT_GENERATOR, load_model

    directory = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="invink-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    references = directory / "reviews.jsonl"  # a copy of the shipped file (its path may be inside a wheel)
    shipped = importlib.resources.files("invink_audit") / "resources" / "demo_reviews.jsonl"
    references.write_text(shipped.read_text("utf-8"), encoding="utf-8")
    records = [json.loads(line) for line in references.read_text("utf-8").splitlines() if line.strip()]
    plan = plan_clip_norm(
        epsilon=epsilon, delta=delta, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature
    )
    print("== Private synthetic text generation (InvisibleInk) ==")
    print(f"dataset: {len(records)} fictional restaurant reviews (1, 3 and 5 stars), e.g.")
    print(textwrap.indent(textwrap.fill(f"[{records[0]['label2']}] {records[0]['text']}", 96), "    "))
    print(
        f"plan: ({plan.epsilon:g}, {plan.delta:g})-DP for texts of at most T = {max_new_tokens} tokens, "
        f"B = {batch_size} references per text, tau = {temperature:g}\n"
        f"      -> clip norm C = {plan.clip_norm:.4f}, epsilon0 = {plan.epsilon0:.4f} per token, "
        f"rho_sequence = {plan.rho_sequence:.4f} ({plan.accountant})"
    )
    ledger = BudgetLedger.create(directory / "ledger.json", epsilon=10.0, delta=delta, dataset="demo restaurant reviews")
    print(f"ledger: total budget epsilon = 10 at delta = {delta:g} ({directory / 'ledger.json'})")

    started = time.perf_counter()
    model = load_model(DEFAULT_GENERATOR)
    print(f"model: {model.name} on {model.device} (loaded in {time.perf_counter() - started:.1f} s)")
    print(f"generating one review per star rating (3 disjoint batches x (B+1) = {3 * (batch_size + 1)} rows per step) ...")
    config = GenerationConfig(batch_size=batch_size, max_new_tokens=max_new_tokens, delta=delta, epsilon=epsilon,
                              temperature=temperature, top_k=top_k, num_texts_per_group=1)
    result = generate(ReferencesFile(references, label_columns=LABELS), config, model=model, prompt="yelp",
                      output=directory / "texts.jsonl", ledger=ledger)
    for text in result.texts:
        stars = text.labels["label2"].removeprefix("Review Stars: ") if text.labels else "?"
        print(
            f"\n-- text {text.batch_index + 1}: a {stars}-star review ({text.num_tokens} tokens, {text.finish_reason}; "
            f"|V_k+| = {text.topk_plus_size_mean:.0f} ± {text.topk_plus_size_std:.0f}, "
            f"{text.expansion_tokens} from the expansion set)"
        )
        print(textwrap.indent(textwrap.fill(text.text or "(empty)", 96), "    "))
    g = result.guarantee
    status = ledger.status()
    print(
        f"\nguarantee: ({g.epsilon:g}, {g.delta:g})-DP (replace-by-null adjacency) for every text of at most "
        f"T = {g.max_new_tokens} tokens, whatever its realised length; the {result.num_batches} texts come from "
        f"disjoint batches, so together they cost one sequence (paper Corollary 11)."
    )
    print(
        f"ledger: spent epsilon = {status.epsilon_spent:.4g} of {status.epsilon_budget:g}; "
        f"{result.num_unused_references} references unused; {result.tokens_generated} tokens in "
        f"{result.seconds:.1f} s ({result.tokens_per_second:.1f} tokens/s)"
    )
    print(f"texts written to {result.output}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
