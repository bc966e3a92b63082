"""`make demo`: plan a privacy budget, generate private synthetic text, and audit it.

Three steps, each a part of the toolkit:

1. **plan** (``accounting``): the demo's own clip norm C for its budget, and what each token costs
   (B+1 forward rows);
2. **generate** (``invink_audit.generation``): InvisibleInk on the default generator (Gemma-3-270M,
   prompted with the completion twin of the ``yelp`` preset) from a small dataset of fictional restaurant
   reviews, one review per star rating, charged to a budget ledger first (``examples/demo_generate.py``),
   then each text read back with the off-genre rule;
3. **audit** (``invink_audit.audit``): teacher-forced exact per-step checks of the released texts for
   every replace-by-null neighbour and a short sampled audit, ending in a verdict.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from invink_audit.cpu import configure_cpu_threads  # noqa: E402

CPU_THREADS = configure_cpu_threads()  # before torch is imported: no more threads than free cores

EPSILON, DELTA, T, B, TAU = 8.0, 1e-6, 48, 4, 1.0


def plan_section() -> None:
    from accounting import plan_clip_norm
    from invink_audit.cli._plan import format_plan

    print("== 1. Plan: the demo's own budget ==")
    demo = plan_clip_norm(epsilon=EPSILON, delta=DELTA, max_new_tokens=T, batch_size=B, temperature=TAU)
    print(format_plan(demo, headline=f"({EPSILON:g}, {DELTA:g})-DP, texts of at most T = {T} tokens, B = {B} references each"))
    print(f"Each token costs B+1 = {B + 1} forward rows. To plan your own deployment: `invink-audit plan`, "
          "`invink-audit table` (C against epsilon and B) and `invink-audit profile` (utility by teacher forcing).\n")


def read_back(result) -> None:
    """Each text read back with the off-genre rule (a chatbot talking about the task, a refusal, a list...)."""
    from invink_audit.evaluation.genre import off_genre

    print("\n== Read back: does each text read as a review? (the off-genre rule) ==")
    flagged = 0
    for text in result.texts:
        stars = text.labels["label2"].removeprefix("Review Stars: ") if text.labels else "?"
        why = off_genre(text.text)
        flagged += why is not None
        print(f"  {stars}-star text: {'reads as a review' if why is None else f'off-genre ({why})'}")
    print(f"  {len(result.texts) - flagged} of {len(result.texts)} read as reviews by the rule (it cannot tell whether a "
          "review matches its star rating: read them above)")


def main() -> int:
    started = time.perf_counter()
    print(f"CPU: {CPU_THREADS.threads} torch thread(s) ({CPU_THREADS.reason})\n")
    plan_section()
    print("== 2. Generate: InvisibleInk on the default generator, Gemma-3-270M ==")
    import demo_generate

    result = demo_generate.main(epsilon=EPSILON, delta=DELTA, batch_size=B, max_new_tokens=T, temperature=TAU)
    read_back(result)
    print("\n== 3. Audit: does the claimed guarantee hold on these texts? ==")
    from invink_audit.audit.quick import quick_audit
    from invink_audit.cli import phase_progress

    # a short audit for the demo: 16 sampled texts (the fewest for which a sampled audit can PASS),
    # 4 importance-sampled texts per alpha and neighbour (audits/ holds the full-size specs); the
    # release's plan, prompt, labels and batches come from the result itself. One progress bar per
    # phase on stderr (exact checks, then the sampled audit): quick_audit reports, the demo draws.
    progress, close = phase_progress()
    try:
        report = quick_audit(result, num_samples=16, num_is_samples=4, progress=progress)
    finally:
        close()
    print(report.summary())
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return 0 if report.verdict.value != "VIOLATION" else 1


if __name__ == "__main__":
    sys.exit(main())
