"""What the compact trainer does so that a failure on one rank ends the job on every rank, saying where.

* :class:`StepReader` (training without post-balancing): the loader's micro-batches of a step are read
  before the step's first collective and every rank learns whether any rank failed to read
  (:func:`~megatron_orch.comm.status.raise_if_any_rank_failed`), so a loader error raises on every rank
  with the failing rank's message instead of leaving the others in the pipeline or gradient collectives.
  (With post-balancing the data iterator does the same.)
* :func:`diagnose_collective_failure`: when a collective times out or loses a peer, the error torch
  gives (gloo: "Timed out waiting 60000ms for recv operation") names neither the collective nor the
  rank that is missing. Each rank whose collective failed writes where it was waiting to the job's
  rendezvous store and waits a grace period (a quarter of the timeout, at most a minute) for the others; the
  ranks that never report are the ones stuck outside any collective (in a forward, a loader, a
  deadlock), and the error names them. Nothing is written to the store until a collective has failed.

The store is the default process group's (torchrun's or the test harness's TCPStore), reached through
``torch.distributed.distributed_c10d._get_default_store``. On NCCL a timeout may end the process in the
watchdog before Python sees an error; there ``TORCH_NCCL_DESYNC_DEBUG=1`` makes torch name the ranks
that did not join (not run here: no GPU).
"""
from __future__ import annotations

import contextlib
import itertools
import time
import traceback
from collections import defaultdict
from typing import Callable, Iterator

import torch.distributed as dist

from megatron_orch.comm.status import PeerFailedError, describe, raise_if_any_rank_failed
from megatron_orch.trainer.launch import rank_ranges

_LOST_COLLECTIVE = ("timed out", "timeout", "connection closed", "connection reset", "pair closure",
                    "broken pipe")
_MAX_GRACE_S = 60.0
_POLL_S = 0.2


class StepReader:
    """Iterator of the loader's micro-batches, filled one step at a time by :meth:`read_step`."""

    def __init__(self, source: Iterator, num_microbatches: int):
        self.source, self.num_microbatches = source, num_microbatches
        self._step: Iterator = iter(())

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._step)

    def read_step(self) -> None:
        """Read the next step's micro-batches; every rank raises if any rank could not (call on all ranks)."""
        batches, error = [], None
        try:
            batches = list(itertools.islice(self.source, self.num_microbatches))
            if len(batches) != self.num_microbatches:
                raise ValueError(f"the training data ended inside a step ({len(batches)} of "
                                 f"{self.num_microbatches} micro-batches)")
        except Exception as err:  # noqa: BLE001 -- any loader failure must reach the other ranks
            error = err
        raise_if_any_rank_failed(error, what="reading the step's input")
        self._step = iter(batches)


class CollectiveFailureError(RuntimeError):
    """A collective timed out or lost a peer; the message says which ranks never reached one."""


def lost_collective(error: BaseException) -> bool:
    """Whether ``error`` is a collective that timed out or lost its peer (not a report made of one)."""
    if isinstance(error, (PeerFailedError, CollectiveFailureError)) or not isinstance(error, RuntimeError):
        return False
    text = str(error).lower()
    return any(marker in text for marker in _LOST_COLLECTIVE)


def _waiting_site(error: BaseException) -> str:
    """The torch.distributed call that failed and the project / megatron-core frames that called it; for an
    asynchronous collective (its error surfaces in the wait), the project's wait and its callers outside the
    communication layer (a node-wise exchange waits on its hops' waits)."""
    frames = traceback.extract_tb(error.__traceback__)
    collective = next((i for i, f in enumerate(frames) if "torch/distributed/distributed_c10d" in f.filename), None)
    if collective is not None:
        site, callers = f"torch.distributed.{frames[collective].name}", frames[:collective]
    else:
        waits = [i for i, f in enumerate(frames) if "megatron_orch/comm/" in f.filename and f.name == "wait"]
        if not waits:
            return "an unknown place (no torch.distributed frame in the traceback)"
        wait = frames[waits[-1]]
        site = f"the wait for an asynchronous collective at {_short(wait.filename)}:{wait.lineno}"
        callers = [f for f in frames[:waits[-1]] if "megatron_orch/comm/" not in f.filename]  # (a wait of waits)
    callers = [f for f in callers if "megatron_orch/" in f.filename or "megatron/core/" in f.filename]
    chain = " <- ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(callers[-3:]))
    return site + (f" called from {chain}" if chain else "")


def _short(filename: str) -> str:
    for root in ("megatron_orch/", "megatron/core/"):
        if root in filename:
            return root + filename.split(root, 1)[1]
    return filename


@contextlib.contextmanager
def naming_lost_collectives(stage: Callable[[], str], timeout_minutes: float):
    """Turn a collective that times out or loses a peer inside the block into a
    :class:`CollectiveFailureError` that names the silent ranks; ``stage()`` says where training was
    (e.g. "iteration 3"), the same on every rank that gets there."""
    try:
        yield
    except RuntimeError as err:
        if not lost_collective(err):
            raise
        raise diagnose_collective_failure(err, stage(), timeout_minutes) from err


def diagnose_collective_failure(error: BaseException, stage: str, timeout_minutes: float) -> CollectiveFailureError:
    """Report where this rank waited, wait for the other ranks' reports, and name the silent ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    where = _waiting_site(error)
    grace_s = min(timeout_minutes * 60.0 / 4, _MAX_GRACE_S)
    prefix = f"megatron_orch/lost_collective/{stage.replace(' ', '_')}/"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(prefix + str(rank), where)
        reported, deadline = store.add(prefix + "reported", 1), time.monotonic() + grace_s
        while reported < world and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            reported = store.add(prefix + "reported", 0)
        reports = {r: store.get(prefix + str(r)).decode() for r in range(world) if store.check([prefix + str(r)])}
    except Exception as store_error:  # noqa: BLE001 -- the diagnosis must not hide the failure itself
        return CollectiveFailureError(
            f"{stage}: a collective failed on rank {rank} ({describe(error)}) in {where}; "
            f"could not ask the other ranks where they are ({describe(store_error)})")
    silent = [r for r in range(world) if r not in reports]
    by_site = defaultdict(list)
    for r, site in sorted(reports.items()):
        by_site[site].append(r)
    sites = "; ".join(f"ranks {rank_ranges(ranks)} in {site}" for site, ranks in list(by_site.items())[:4])
    if silent:
        verdict = (f"rank(s) {rank_ranges(silent)} did not reach a collective (no report within {grace_s:.0f} s of "
                   f"this rank's failure): stuck, gone or far slower outside communication -- look there first. ")
    else:
        verdict = "every rank reported a failed collective (none is stuck outside one). "
    return CollectiveFailureError(
        f"{stage}: a collective failed on rank {rank} after waiting up to "
        f"--distributed-timeout-minutes {timeout_minutes:g} ({describe(error)}). {verdict}"
        f"Where the ranks that reported were waiting: {sites}.")
