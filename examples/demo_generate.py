"""Demo, generation part: private synthetic patient messages on the embedded SmolLM2-135M model.

The shipped dataset (``invink_audit/resources/demo_references.jsonl``) holds 24 short messages that
fictional patients sent to their family doctor: names, ages, conditions and addresses are invented,
but they are exactly the kind of text a practice must not leak. The demo

1. plans the clip norm for the budget with :func:`accounting.plan_clip_norm`,
2. creates a budget ledger for the dataset and charges the run to it before generating,
3. generates one text per disjoint batch of ``B`` messages with InvisibleInk (streamed to JSON Lines),
4. prints the texts and the a-priori guarantee.

Run it with ``python examples/demo_generate.py`` (a few minutes at most on 2 CPU cores; the first run
also converts the embedded GGUF model once, about 30 s). ``main()`` returns the
:class:`~invink_audit.generation.GenerationResult` so that a caller can audit the texts.
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
import time
from pathlib import Path

DESCRIPTION = "short messages that patients sent to their family doctor"


def main(
    *,
    epsilon: float = 8.0,
    delta: float = 1e-6,
    batch_size: int = 4,
    max_new_tokens: int = 48,
    num_texts: int = 3,
    temperature: float = 1.0,
    top_k: int = 100,
    output_dir: str | Path | None = None,
):
    from accounting import BudgetLedger, plan_clip_norm
    from invink_audit.bench import demo_references
    from invink_audit.generation import generate
    from invink_audit.models import load_model

    references = demo_references()
    plan = plan_clip_norm(
        epsilon=epsilon, delta=delta, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature
    )
    print("== Private synthetic text generation (InvisibleInk) ==")
    print(f"dataset: {len(references)} fictional patient messages, e.g.")
    print(textwrap.indent(textwrap.fill(references[0], 96), "    "))
    print(
        f"plan: ({plan.epsilon:g}, {plan.delta:g})-DP for texts of at most T = {max_new_tokens} tokens, "
        f"B = {batch_size} references per text, tau = {temperature:g}\n"
        f"      -> clip norm C = {plan.clip_norm:.4f}, epsilon0 = {plan.epsilon0:.4f} per token, "
        f"rho_sequence = {plan.rho_sequence:.4f} ({plan.accountant})"
    )

    directory = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="invink-demo-"))
    directory.mkdir(parents=True, exist_ok=True)
    ledger = BudgetLedger.create(directory / "ledger.json", epsilon=10.0, delta=delta, dataset="demo patient messages")
    print(f"ledger: total budget epsilon = 10 at delta = {delta:g} ({directory / 'ledger.json'})")

    started = time.perf_counter()
    model = load_model()
    print(f"model: {model.name} on {model.device} (loaded in {time.perf_counter() - started:.1f} s)")
    rows = num_texts * (batch_size + 1)
    print(f"generating {num_texts} texts ({num_texts} disjoint batches x (B+1) = {rows} rows per step) ...")
    result = generate(
        references,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        delta=delta,
        epsilon=epsilon,
        temperature=temperature,
        top_k=top_k,
        num_texts=num_texts,
        model=model,
        prompt="generic",
        prompt_fields={"description": DESCRIPTION},
        output=directory / "texts.jsonl",
        ledger=ledger,
    )
    for text in result.texts:
        print(
            f"\n-- text {text.batch_index + 1} (from references {text.batch_index * batch_size + 1}-"
            f"{(text.batch_index + 1) * batch_size}; {text.num_tokens} tokens, {text.finish_reason}; "
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
