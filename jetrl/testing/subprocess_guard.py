"""One guard for the subprocesses the tests start: against a hung child, never a speed limit.

Tests must not depend on the machine's speed: an interpreter run that takes 2 minutes on an idle
2-core box took over 5 on a loaded one and failed a fixed 300 s timeout (issue 21). Every test that
runs a subprocess passes ``timeout=HANG_GUARD_S``: an hour, long past any slow-but-working run, short
enough that a deadlocked child still ends inside CI's 90 minutes with its output shown.
"""

from __future__ import annotations

__all__ = ["HANG_GUARD_S"]

HANG_GUARD_S = 3600.0
"""Seconds after which a test's subprocess is taken to be hung (not slow): the one timeout tests use."""
