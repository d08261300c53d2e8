"""The test harness's timeouts scale with $ORCH_TEST_TIMEOUT_FACTOR, so a loaded machine passes and a hang still fails;
its ranks, forked from a fork server, see what a spawned rank would."""
import os
import sys
import time

import pytest

from dist_utils import DEFAULT_TIMEOUT_FACTOR, TIMEOUT_FACTOR_ENV, run_distributed, scaled, timeout_factor

CALLERS_VARIABLE = "ORCH_TEST_CALLERS_VARIABLE"
IMPORTED_WITH = os.environ.get(CALLERS_VARIABLE)  # in a rank: the caller's, read when the rank imports this module


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
def test_run_distributed_times_out_after_the_scaled_timeout(monkeypatch, capfd):
    """A rank that never finishes: the run ends after 100 s x 0.05, not after 100 s, and the rank wrote where it
    was stuck."""
    monkeypatch.setenv(TIMEOUT_FACTOR_ENV, "0.05")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 5 s"):
        run_distributed(_sleep, 1, 600.0, timeout_s=100.0)
    assert time.monotonic() - start < 60
    assert "in _sleep" in capfd.readouterr().err


def _fail_or_sleep(rank, world_size):
    if rank == 0:
        raise ValueError("rank 0 fails")
    time.sleep(600.0)


@pytest.mark.distributed
def test_a_rank_stopped_after_a_peer_failed_writes_where_it_was(capfd):
    """Rank 0 fails while rank 1 is busy elsewhere (as a rank that never reaches the collective its peers wait in):
    the failure is raised and rank 1's stack, stopped from outside, is in the test's output."""
    with pytest.raises(RuntimeError, match="rank 0 fails"):
        run_distributed(_fail_or_sleep, 2, timeout_s=60.0)
    err = capfd.readouterr().err
    assert "in _fail_or_sleep" in err and "in _worker" in err, err


def _report(rank, world_size, name, path):
    with open(path, "w") as handle:
        handle.write(f"{os.environ.get(name)}\n{IMPORTED_WITH}\n{os.getcwd()}\n{sys.path[0]}")
    print(f"rank {rank} says so on stdout", flush=True)
    print(f"rank {rank} says so on stderr", file=sys.stderr, flush=True)


@pytest.mark.distributed
def test_a_rank_sees_the_callers_environment_folder_path_and_output(monkeypatch, tmp_path, capfd):
    """The fork server started with another environment and output: each rank still gets the environment of the
    call (also while it imports the test's module), its working folder and sys.path, and writes to its stdout and
    stderr (pytest's capture here)."""
    with capfd.disabled():
        run_distributed(_sleep, 1, 0.0, timeout_s=30.0)  # the server runs (started here if not before)
    monkeypatch.setenv(CALLERS_VARIABLE, str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "first"))
    run_distributed(_report, 2, CALLERS_VARIABLE, str(tmp_path / "seen"), timeout_s=30.0)
    assert (tmp_path / "seen").read_text().splitlines() == [str(tmp_path)] * 3 + [str(tmp_path / "first")]
    out, err = capfd.readouterr()
    assert "rank 0 says so on stdout" in out and "rank 1 says so on stdout" in out, out
    assert "rank 0 says so on stderr" in err and "rank 1 says so on stderr" in err, err
