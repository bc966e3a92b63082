"""The empirical privacy auditor (white-box, black-box, self-test, reports).

* :func:`audit_model` — white-box audit of a model and one batch of references (exact per-step
  checks for every neighbour, sequence-level Rényi divergences by Monte Carlo and importance
  sampling, δ(ε), comparison with every accountant, canaries);
* :func:`quick_audit` — audit of the texts a ``generate`` call just produced (``make demo``);
* :func:`audit_generator` — white-box audit of your own generator's loop, unmodified (its sampling calls
  intercepted, every neighbour replayed with the same tokens);
* :func:`blackbox_audit` — canary audit of any :class:`BlackBoxTarget` (our engine for any mechanism, the
  reference package, AugPE's histogram, a callable);
* :func:`run_selftest` — the auditor against the correct mechanism and four planted bugs;
* :func:`load_spec` / :func:`run_spec` — TOML audit specs (``audits/``), :func:`write_report`.

Submodules are imported lazily: :mod:`invink_audit.audit.stats` is torch-free.
"""

from __future__ import annotations

from invink_audit import lazy_exports

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    **dict.fromkeys(("Verdict",), "invink_audit.audit.stats"),
    **dict.fromkeys(("Claim", "Direction", "WhiteBoxConfig"), "invink_audit.audit.whitebox"),
    **dict.fromkeys(
        ("WhiteBoxReport", "BlackBoxReport", "ReportedClaim", "WorstNeighbour", "LossHistogram", "AuditTimings",
         "report_from_dict"),
        "invink_audit.audit.records",
    ),
    **dict.fromkeys(("write_report",), "invink_audit.audit.report"),
    **dict.fromkeys(("ModelAuditSettings", "audit_model"), "invink_audit.audit.model_audit"),
    **dict.fromkeys(("AuditedRelease", "QuickAuditReport", "quick_audit"), "invink_audit.audit.quick"),
    **dict.fromkeys(("blackbox_audit",), "invink_audit.audit.blackbox"),
    **dict.fromkeys(
        ("GeneratorAudit", "InterceptionError", "SamplingCall", "SequenceCheck", "audit_generator"), "invink_audit.audit.intercept"
    ),
    **dict.fromkeys(
        ("BlackBoxTarget", "CallableTarget", "EngineTarget", "HistogramTarget", "ReferencePackageTarget"),
        "invink_audit.audit.targets",
    ),
    **dict.fromkeys(("SelfTestResult", "SelfTestSettings", "run_selftest"), "invink_audit.audit.selftest"),
    **dict.fromkeys(("AuditSpec", "SpecResult", "load_spec", "run_spec"), "invink_audit.audit.spec"),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
