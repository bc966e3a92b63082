"""The figures of docs/results/outside-generators.md: the three outside generators audited through their shipped code
with the adapters of docs/guide/outside-generators.md, in the configurations of tests/test_outside_generators.py
(whose adapters, references and pinned requirements it reuses), printed as Markdown lines.

Run from the repository root (installs the packages from the registry into a temporary folder)::

    PYTHONPATH=$PWD HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python -m benchmarks.outside_generators
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]


def _install(folder: Path, *requirements: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), *requirements],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    sys.path.append(str(folder))


def _row(name: str, audit, claim) -> str:
    """verdict, worst per-step Rényi excess over the claim (nats) and its ratio, tolerance, dtypes, draws, the ε the
    generator reports against the ε its claim composes to by our accountant (``audit.certified_epsilon``)."""
    step = np.maximum(audit.renyi_forward, audit.renyi_reverse)
    bound = np.array([claim.step.renyi_bound(a) for a in audit.alphas])
    finite = np.isfinite(bound)
    worst = "–" if not finite.any() else (
        f"{float((step - bound)[..., finite].max()):+.4g} nats ({float((step / bound)[..., finite].max()):.3g}x)")
    return (f"| {name} | {audit.verdict.value} | {worst} | max per-step D_a {float(step.max()):.4g} | "
            f"{audit.tolerance:.3g} ({', '.join(audit.dtypes)}) | {len(audit.calls)} draws | {_reported(claim, audit)} | "
            f"{audit.reason} |")


def _reported(claim, audit) -> str:
    if claim.reported_epsilon is None:
        return "reports no ε"
    return (f"reports ε = {claim.reported_epsilon:.4g} at δ = {claim.reported_delta:g}; its claim composes to "
            f"{audit.certified_epsilon:.4g}")


def _invink(t, tiny_dir) -> list[str]:
    from invink_audit.audit import InterceptionError, audit_generator, blackbox_audit
    from invink_audit.audit.targets import ReferencePackageTarget

    import invink

    lines = []
    for label, options, refs in (("honest (topk=5)", {"topk": 5}, t.INVINK_REFS),
                                 ("drop_empty=True (its default)", {"drop_empty": True}, [*t.INVINK_REFS, "the pasta was cold"])):  # fmt: skip
        generate, claim = t.invink_adapter(invink, tiny_dir, **options)
        lines.append(_row(f"invink {label}", audit_generator(generate, refs, claim), claim))
    generate, claim = t.invink_adapter(invink, tiny_dir, max_toks="auto")
    try:
        audit_generator(generate, t.INVINK_REFS, claim)
    except InterceptionError as err:
        lines.append(f"| invink max_toks=\"auto\" (its default) | InterceptionError | {err} |")
    target = ReferencePackageTarget(str(tiny_dir), batch_size=2, dataset_desc="short restaurant reviews", epsilon=2.0,
                                    delta=1e-6, max_toks=4, drop_empty=False, dtype="float32", device_map=-1,
                                    allow_download=False, random_seed=None)  # fmt: skip
    report = blackbox_audit(target, t.INVINK_REFS, t.CANARY, claimed_epsilon=2.0, claimed_delta=1e-6, num_trials=10)
    lines.append(f"| invink black box (10 trials) | {report.verdict.value} | ε ≥ {report.epsilon_lower_bound:.3g} vs 2 |")
    return lines


def _pack_reports(llm, sizes=(4, 8, 10)) -> str:
    """The pack's own ``sigma_to_eps(1, GAUSSIAN, 1, 3)`` (one text of 3 tokens, δ = 1/N) on N examples, raw."""
    from llama_index.core.llama_dataset.base import CreatedBy, CreatedByType
    from llama_index.core.llama_dataset.simple import LabelledSimpleDataExample, LabelledSimpleDataset

    import llama_index.packs.diff_private_simple_dataset.base as pack

    example = LabelledSimpleDataExample(reference_label="r", text="x", text_by=CreatedBy(type=CreatedByType.HUMAN))
    bundle, out = pack.PromptBundle(instruction="i", text_heading="t", label_heading="l"), []
    for n in sizes:
        dp_pack = pack.DiffPrivateSimpleDatasetPack(llm, None, bundle, LabelledSimpleDataset(examples=[example] * n))
        try:
            out.append(f"N = {n}: {dp_pack.sigma_to_eps(1.0, pack.PrivacyMechanism.GAUSSIAN, 1, 3):.4g}")
        except RuntimeError as err:
            out.append(f"N = {n}: RuntimeError: {err}")
    return f"| pack: its sigma_to_eps(1, GAUSSIAN, 1, 3) at δ = 1/N | {'; '.join(out)} |"


def _pack(t, llm) -> list[str]:
    from invink_audit.audit import audit_generator, blackbox_audit
    from invink_audit.audit.targets import CallableTarget

    generate, claim = t.pack_adapter(None, llm)
    left_out = dataclasses.replace(claim, adjacency="add-remove")
    n = len(t.PACK_REFS)
    lines = [_pack_reports(llm), f"| pack: dp-accounting PLD, {claim.steps} Gaussians σ = 1 (no sampling) at δ = 1/{n} | ε = "
             f"{t._pld_epsilon(1.0, 1.0, claim.steps, 1 / n):.4g}; at its rate 1/{n}: "
             f"{t._pld_epsilon(1 / n, 1.0, claim.steps, 1 / n):.4g} |"]
    for seed in range(6):
        random.seed(seed)
        lines.append(_row(f"pack replace-by-empty, shuffle seed {seed}", audit_generator(generate, t.PACK_REFS, claim), claim))
        random.seed(seed)
        lines.append(_row(f"pack left out, shuffle seed {seed}", audit_generator(generate, t.PACK_REFS, left_out), left_out))
    random.seed(0)
    report = blackbox_audit(CallableTarget(generate), t.PACK_REFS, t.CANARY, claimed_epsilon=2.0, claimed_delta=1e-6,
                            num_trials=16)  # fmt: skip
    lines.append(f"| pack black box (16 trials) | {report.verdict.value} | ε ≥ {report.epsilon_lower_bound:.3g} vs 2 |")
    return lines


def _dp_fusion(t, tiny, smol) -> list[str]:
    from invink_audit.audit import audit_generator, blackbox_audit
    from invink_audit.audit.targets import CallableTarget

    import dp_fusion_lib
    from test_audit_intercept import _dp_fusion_audit

    lines = []
    for model, name in ((tiny, "tiny"), (smol, "SmolLM2-135M float32")):
        for alpha, beta, aligned in ((2.0, 0.5, True), (2.0, 0.1, True), (8.0, 0.5, True), (2.0, 0.5, False)):
            audit = _dp_fusion_audit(dp_fusion_lib, model, alpha=alpha, beta=beta, aligned=aligned, steps=16)
            recorded = np.asarray(audit.output["divergences"]["PRIVATE"], dtype=float)
            path = "token path" if aligned else "text path"
            lines.append(_row(f"dp-fusion {name} {path} α={alpha:g} β={beta:g} (αβ = {alpha * beta:g}; recorded "
                              f"{recorded.size} divergences, {int(np.isnan(recorded).sum())} NaN)", audit, audit.claim))
    generate, claim = t.dp_fusion_adapter(dp_fusion_lib, tiny)
    epsilon = claim.reported_epsilon
    torch.manual_seed(0)
    lines.append(_row("dp-fusion guide adapter (text path, T = 4)", audit_generator(generate, [t.DPF_PRIVATE], claim),
                      claim))
    report = blackbox_audit(CallableTarget(generate), [t.DPF_PRIVATE], t.CANARY, claimed_epsilon=epsilon,
                            claimed_delta=1e-5, num_trials=16)  # fmt: skip
    lines.append(f"| dp-fusion black box, text path (16 trials) | {report.verdict.value} | ε ≥ "
                 f"{report.epsilon_lower_bound:.3g} vs {epsilon:.4g} |")
    return lines


def main() -> None:
    warnings.simplefilter("ignore")
    sys.path.insert(0, str(ROOT / "tests"))
    import test_outside_generators as t

    from invink_audit.models import EMBEDDED_MODEL, build_tiny_model, load_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        _install(tmp / "invink", "invink==0.1.0")
        if sys.version_info < (3, 12):  # the one-print fix the tests apply (tests/test_outside_generators.py)
            path = tmp / "invink" / "invink" / "utils.py"
            path.write_text(path.read_text().replace('{"all devices" if device_map == "auto" else device_map}',
                                                     "{'all devices' if device_map == 'auto' else device_map}"))
        _install(tmp / "pack", *t.PACK_REQUIREMENTS)
        _install(tmp / "dpf", "dp-fusion-lib==0.1.0")
        tiny = build_tiny_model(seed=5)
        tiny.model.save_pretrained(tmp / "tiny")
        tiny.tokenizer.save_pretrained(tmp / "tiny")
        llm = t.guide_function("stand_in_llm")(tiny.model, tiny.tokenizer, t.TOP_LOGPROBS)
        smol = load_model(EMBEDDED_MODEL, dtype="float32")
        torch.manual_seed(0)
        for line in [*_invink(t, tmp / "tiny"), *_pack(t, llm), *_dp_fusion(t, tiny, smol)]:
            print(line)


if __name__ == "__main__":
    main()
