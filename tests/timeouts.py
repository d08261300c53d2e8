"""Every timeout a test states is the time its work takes on an idle 2-core machine with room to spare;
:func:`scaled` multiplies it by ``$ORCH_TEST_TIMEOUT_FACTOR`` (default 3: a machine shared with other CPU-heavy
processes runs the tests several times slower; a hang still fails, only later). Torch-free, so the planning layers'
tests time their subprocesses with it too (``dist_utils`` re-exports it)."""
import math
import os

TIMEOUT_FACTOR_ENV = "ORCH_TEST_TIMEOUT_FACTOR"
DEFAULT_TIMEOUT_FACTOR = 3.0


def timeout_factor() -> float:
    """``$ORCH_TEST_TIMEOUT_FACTOR`` (a finite number > 0), default :data:`DEFAULT_TIMEOUT_FACTOR`."""
    raw = os.environ.get(TIMEOUT_FACTOR_ENV, "")
    try:
        factor = float(raw) if raw else DEFAULT_TIMEOUT_FACTOR
    except ValueError:
        factor = math.nan
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{TIMEOUT_FACTOR_ENV}={raw!r}: expected a finite number > 0")
    return factor


def scaled(seconds: float) -> float:
    """A test's timeout for this machine: ``seconds`` (enough on an idle 2-core machine) x :func:`timeout_factor`."""
    return seconds * timeout_factor()
