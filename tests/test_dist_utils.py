"""The test harness's timeouts scale with $ORCH_TEST_TIMEOUT_FACTOR, so a loaded machine passes and a hang still fails."""
import time

import pytest

from dist_utils import DEFAULT_TIMEOUT_FACTOR, TIMEOUT_FACTOR_ENV, run_distributed, scaled, timeout_factor


def test_factor_from_the_environment(monkeypatch):
    monkeypatch.delenv(TIMEOUT_FACTOR_ENV, raising=False)
    assert timeout_factor() == DEFAULT_TIMEOUT_FACTOR > 1
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, "0.5")
    assert scaled(150) == 75.0
    for bad in ("0", "-2", "nan", "inf", "fast"):
        monkeypatch.setenv(TIMEOUT_FACTOR_ENV, bad)
        with pytest.raises(ValueError, match=TIMEOUT_FACTOR_ENV):
            timeout_factor()


def _sleep(rank, world_size, seconds):
    time.sleep(seconds)


@pytest.mark.distributed
def test_run_distributed_times_out_after_the_scaled_timeout(monkeypatch):
    """A rank that never finishes: the run ends after 100 s x 0.05, not after 100 s."""
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, "0.05")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 5 s"):
        run_distributed(_sleep, 1, 600.0, timeout_s=100.0)
    assert time.monotonic() - start < 60
