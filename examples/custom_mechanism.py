"""Plug your own mechanism into the engine and the auditor (the interface of ``invink_audit.mechanisms.base``).

A mechanism implements :class:`invink_audit.mechanisms.Mechanism`: given one step's private rows
(G, B, V) and public row (G, V) it returns the log-probabilities of what the step releases, and it
states its guarantee. Here: the exponential mechanism on difference-clipped logits over the whole
vocabulary (InvisibleInk with k = |V|, written from scratch), once accounted correctly and once with
a planted bug (the sampling temperature is half the accounted one). The engine generates with it and
the white-box auditor audits it on a model: PASS for the first, VIOLATION for the second.

    python examples/custom_mechanism.py            # the embedded SmolLM2 (about a minute on 2 CPU cores)
    python examples/custom_mechanism.py --tiny     # a tiny random model (seconds)
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch

from accounting import Adjacency, Clipping, linf_sensitivity
from invink_audit.mechanisms import GuaranteeKind, Mechanism, MechanismGuarantee, MechanismStep


class FullVocabularyDClip(Mechanism):
    """x_t ~ softmax((φ_pub + mean_i clip_C(φ_i − φ_pub)) / τ_sample); accounted at τ_account."""

    name = "full-vocabulary-dclip"
    num_modes = 1
    mode_names = ("private",)

    def __init__(self, *, clip_norm: float, batch_size: int, temperature: float, sample_temperature: float | None = None):
        self.clip_norm, self._batch_size, self.temperature = clip_norm, batch_size, temperature
        self.sample_temperature = temperature if sample_temperature is None else sample_temperature

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def _log_probs(self, private, public):
        public64 = public.double()
        diff = (private.double() - public64.unsqueeze(-2)).clamp(-self.clip_norm, self.clip_norm)
        return torch.log_softmax((public64 + diff.mean(dim=-2)) / self.sample_temperature, dim=-1)

    def step(self, private, public, state, aux, *, exact, neighbours):
        actual = self._log_probs(private, public)
        if not neighbours:
            return MechanismStep(actual)
        # replace-by-null neighbour R'_j: reference j's row becomes the public row
        b = private.shape[1]
        rows = [self._log_probs(torch.where(torch.arange(b).view(1, b, 1) == j, public.unsqueeze(1), private), public)
                for j in range(b)]
        return MechanismStep(actual, torch.stack(rows, dim=1))

    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        from accounting import composed_epsilon

        # ℓ∞ sensitivity of the aggregate under replace-by-null: C/B (paper Property 1); the exponential
        # mechanism at temperature τ is ε0 = 2Δ/τ bounded range and ε0²/8-zCDP (paper Theorem 2 (thm:accounting))
        sensitivity = linf_sensitivity(self.clip_norm, self.batch_size, Clipping.DIFFERENCE, Adjacency.REPLACE_BY_NULL)
        epsilon0 = 2.0 * sensitivity / self.temperature
        return MechanismGuarantee(
            kind=GuaranteeKind.A_PRIORI,
            mechanism=self.name,
            epsilon=composed_epsilon(delta, epsilon0, max_new_tokens, "br-adaptive"),
            delta=delta,
            max_new_tokens=max_new_tokens,
            composition="bounded-range",
            rho_sequence=max_new_tokens * epsilon0**2 / 8.0,
            step_epsilon0=epsilon0,
            step_rho=epsilon0**2 / 8.0,
            description=f"DClip exponential mechanism, eps0={epsilon0:.4g} per token",
        )


def main(tiny: bool = False, seed: int = 7) -> dict:
    from invink_audit import build_tiny_model, load_model, make_generator
    from invink_audit.audit import ModelAuditSettings, WhiteBoxConfig, audit_model
    from invink_audit.generation import PromptSpec, ReleaseConfig, generate
    from invink_audit.mechanism import SeededGeneratorWarning

    warnings.simplefilter("ignore", SeededGeneratorWarning)  # a fixed seed: reproducible, not private
    model = build_tiny_model(seed=1) if tiny else load_model(None)
    references = ["Great tacos and friendly staff.", "", "The soup was cold but the bread was fresh."]
    ours = FullVocabularyDClip(clip_norm=1.0, batch_size=3, temperature=1.0)
    # the same release pipeline as InvisibleInk's (partition, labels, resume, ledger charge, quick audit)
    run = generate(references, ReleaseConfig(ours, max_new_tokens=8, delta=1e-6), model=model,
                   prompt=PromptSpec("yelp", fields={"category": "Restaurants", "stars": "4.0"}), seed=seed)
    print("generated:", [t.text for t in run.texts], "|", run.guarantee.label())
    verdicts = {}
    for label, mech in (("correct", ours), ("sampled colder than accounted", FullVocabularyDClip(
            clip_norm=1.0, batch_size=3, temperature=1.0, sample_temperature=0.5))):
        report = audit_model(
            references, ModelAuditSettings(max_new_tokens=8, mechanism=mech),
            WhiteBoxConfig(alphas=(2.0, 8.0), num_samples=32, num_is_samples=8, min_samples=16),
            model=model, prompt="yelp", prompt_fields={"category": "Restaurants", "stars": "4.0"},
            generator=make_generator(seed),
        )
        verdicts[label] = report.verdict.value
        print(f"{label}: {report.verdict.value} ({report.reason}); max per-step loss range / eps0 = "
              f"{report.step_checks.max_loss_range / report.step_checks.epsilon0:.3f}")
    assert math.isfinite(run.guarantee.epsilon)
    return verdicts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model (seconds)")
    args = parser.parse_args()
    main(tiny=args.tiny)
