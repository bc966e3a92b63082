"""How many examples a hypothesis test draws, by the active profile (registered in tests/conftest.py;
chosen with ``HYPOTHESIS_PROFILE``): a test names the count it needs in ``ci`` (``make test``) and
:func:`examples` scales it, so that a pinned count never overrides the quick loop's profile.

* ``ci`` (default): the count the test names;
* ``dev`` (``make check``, the quick loop): at most :data:`DEV_EXAMPLES`;
* ``thorough`` (``make test-thorough``): four times the count, at least 2,000.
"""

from __future__ import annotations

import os

DEV_EXAMPLES = 20


def profile() -> str:
    return os.environ.get("HYPOTHESIS_PROFILE", "ci")


def examples(count: int) -> int:
    """``count`` scaled for the active profile (module docstring)."""
    name = profile()
    if name == "dev":
        return min(count, DEV_EXAMPLES)
    if name == "thorough":
        return max(4 * count, 2000)
    return count
