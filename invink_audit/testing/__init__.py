"""Property-based test kit for private-decoding mechanisms (hypothesis strategies, checkers, the contract, an exact
oracle; docs/guide/testing-kit.md). Importing it imports torch and hypothesis: a test-time dependency, never imported
by the library itself.
"""

from invink_audit.testing import checkers, contract, reference, strategies

# the public names are each submodule's own ``__all__``: the contract every mechanism passes by subclassing,
# the strategies, the checkers and the exact oracle
_MODULES = (contract, strategies, checkers, reference)
__all__ = [name for module in _MODULES for name in module.__all__]
globals().update({name: getattr(module, name) for module in _MODULES for name in module.__all__})
