"""Pinned seeded releases: the tokens a few fixed-seed releases draw, so that a refactor of the generation
pipeline can show it changed nothing (the design step's "seeded releases stay token-identical").

Each case runs a public entry point on the tiny test model (``build_tiny_model``) with a fixed seed and
records every text's token ids, finish reason and released text, and the quick audit's realised losses
for one of them. ``--write FILE`` records them with the machine they were drawn on (torch version, CPU
flags that change float arithmetic, thread count); ``--check FILE`` draws them again and compares;
``tests/test_pinned_releases.py`` does the same where the machine matches (elsewhere floating-point
reductions may legitimately differ, and the test skips, saying why).

Seeded texts are reproducible and therefore carry no privacy: these are regression fixtures, not releases.

    python examples/pin_releases.py --write tests/data/pinned_releases.json
    python examples/pin_releases.py --check tests/data/pinned_releases.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

REFERENCES = ["Anna liked the soup.", "", "Bo found the waiter rude.", "Cy came back twice.",
              "Dee ordered noodles.", "Eli waited an hour.", "Fay loved the cake.", "Gus paid too much."]  # fmt: skip
LABELLED = [("Soup was cold.", "1.0"), ("Great tacos!", "5.0"), ("Rude staff.", "1.0"), ("Lovely view.", "5.0"),
            ("", "1.0"), ("Best pho in town.", "5.0")]  # fmt: skip


def machine() -> dict:
    """What seeded float arithmetic depends on: torch's version, its thread count, and the CPU's vector flags."""
    import torch

    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4")))
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_flags": vector}


def _texts(texts) -> list[dict]:
    return [{"tokens": list(t.token_ids), "finish": t.finish_reason, "text": t.text} for t in texts]


def draw() -> dict:
    """Every case, drawn now."""
    from invink_audit.audit.quick import quick_audit
    from invink_audit.data import ReferencesFile
    from invink_audit.generation import GenerationConfig, PromptSpec, ReleaseConfig, generate
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism
    from invink_audit.models import build_tiny_model

    tiny = build_tiny_model(seed=5)
    common = dict(batch_size=2, max_new_tokens=6, delta=1e-6)
    cases = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seeded: deliberately reproducible
        topk = generate(REFERENCES, GenerationConfig(epsilon=5.0, top_k=8, **common), model=tiny, prompt="generic", seed=11)
        cases["invisibleink-topk-generic"] = _texts(topk.texts)
        full = generate(REFERENCES, GenerationConfig(epsilon=5.0, top_k=None, **common), model=tiny,
                        prompt=PromptSpec("yelp-paper", fields={"category": "Restaurants", "stars": "3.0"}), seed=12)
        cases["invisibleink-full-vocabulary-yelp-paper"] = _texts(full.texts)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "labelled.csv"
            path.write_text("text,stars\n" + "".join(f'"{t}",{s}\n' for t, s in LABELLED), encoding="utf-8")
            labelled = generate(ReferencesFile(path, label_columns=["stars"]), GenerationConfig(epsilon=8.0, top_k=8, **common),
                                model=tiny, prompt=PromptSpec("yelp", fields={"category": "Restaurants"}), seed=13)
        cases["invisibleink-labelled-yelp"] = _texts(labelled.texts)
        amin = AminMechanism(AminConfig(clip_norm=2.0, batch_size=2))
        amin = generate(REFERENCES, ReleaseConfig(amin, max_new_tokens=6, delta=1e-6), model=tiny, seed=14)
        cases["amin"] = _texts(amin.texts)
        adap = AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=2, epsilon=50.0))
        adap = generate(REFERENCES, ReleaseConfig(adap, max_new_tokens=6, delta=1e-6), model=tiny, seed=15)
        cases["adapmixed"] = _texts(adap.texts)
        report = quick_audit(topk, model=tiny, sampled_batch=None)
    cases["quick-audit-of-invisibleink-topk-generic"] = {
        "step_checks": report.step_checks, "failures": sum(report.step_failures.values()),
        "realised_loss_max": round(report.realised_loss_max, 9), "realised_loss_mean": round(report.realised_loss_mean, 9),
    }  # fmt: skip
    return cases


def differences(recorded: dict, drawn: dict) -> list[str]:
    """The cases whose drawn value differs from the recorded one (by name), and cases missing on either side."""
    out = [f"{name}: missing now" for name in recorded if name not in drawn]
    out += [f"{name}: not recorded" for name in drawn if name not in recorded]
    out += [f"{name}: differs" for name in recorded if name in drawn and recorded[name] != drawn[name]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="FILE")
    action.add_argument("--check", metavar="FILE")
    args = parser.parse_args(argv)
    if args.write:
        Path(args.write).write_text(json.dumps({"machine": machine(), "cases": draw()}, indent=1) + "\n")
        print(f"wrote {args.write}")
        return 0
    recorded = json.loads(Path(args.check).read_text())
    if recorded["machine"] != machine():
        print(f"note: recorded on {recorded['machine']}, drawn on {machine()}: differences may be arithmetic")
    found = differences(recorded["cases"], draw())
    print("\n".join(found) if found else f"all {len(recorded['cases'])} cases identical")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
