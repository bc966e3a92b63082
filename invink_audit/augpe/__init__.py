"""AugPE (Xie et al. 2024, arXiv:2403.01749): the InvisibleInk paper's API-access baseline (App. C, sec:augpe-expt).

* :func:`augpe_generate`, :class:`AugPEConfig`, :class:`AugPEResult` — the algorithm end to end (:mod:`.generator`);
* :func:`dp_nn_histogram`, :func:`nearest_neighbour_votes`, :func:`select_candidates`, :class:`Selection` — the
  DP nearest-neighbour histogram and the selection (numpy; :mod:`.histogram`);
* :class:`AugPEPrompts`, :data:`AUGPE_PRESETS` — the public generation and paraphrase prompts (:mod:`.prompts`);
* audits of the histogram's privacy claim, exact and black-box, live on the auditor's side:
  :mod:`invink_audit.audit.augpe` and :class:`invink_audit.audit.targets.HistogramTarget`.

The accounting (T Gaussian histograms, the sensitivity and the paper's convention) is torch-free:
:class:`accounting.AugPEEvent`, :func:`accounting.plan_augpe_noise_std`.
"""

from __future__ import annotations

from invink_audit import lazy_exports

_LAZY = {
    **dict.fromkeys(
        ("AugPEConfig", "AugPEResult", "AugPEStats", "SamplingSettings", "augpe_generate"),
        ".generator",
    ),
    **dict.fromkeys(
        ("Selection", "dp_nn_histogram", "nearest_neighbour_votes", "noisy_counts", "select_candidates", "vote_counts"),
        ".histogram",
    ),
    **dict.fromkeys(("AUGPE_PRESETS", "AugPEPrompts", "defaulted_augpe_fields", "get_augpe_prompts"), ".prompts"),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
