"""The empirical privacy auditor (white-box, black-box, self-test, reports).

Submodules are imported lazily: ``invink_audit.audit.stats`` is torch-free.
"""

from __future__ import annotations

import importlib

# public name -> submodule that defines it
_LAZY: dict[str, str] = {
    "Verdict": "invink_audit.audit.stats",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'invink_audit.audit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(__all__)
