"""Run a test function on every rank of a fresh gloo process group of CPU processes.

    from dist_utils import run_distributed
    def _check(rank, world_size, x): ...          # module level, so spawn can pickle it
    def test_something(): run_distributed(_check, 4, x)

The rendezvous store lives in the calling process on a port the OS picks (no port races between
tests running at the same time), and every collective and the whole run have timeouts, so a bug
fails the test instead of hanging it. A failure on any rank is re-raised with that rank's traceback.

Ranks are forked from a fork server (multiprocessing's ``forkserver``) that imported :data:`PRELOADED` once per
pytest session: a spawned rank spent ~6 s of CPU importing torch and megatron-core, most of a small test's time.
The server is a fresh interpreter (not a fork of pytest) that imports modules and runs nothing, so each rank starts
from the state a spawned rank reaches after its imports; it gets the caller's environment, working folder,
``sys.path`` and stdout/stderr (pytest's capture of the calling test) as a spawned rank does, and imports the
test's module within that environment. (What the preloaded modules read from the environment at import, they read
from that of the session's first multi-rank test.)

Every timeout is scaled for the machine (:func:`scaled`, from ``tests/timeouts.py``); fixed timeouts elsewhere in the
tests (subprocesses, stores) go through it too.
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import collective_trace
from timeouts import DEFAULT_TIMEOUT_FACTOR, TIMEOUT_FACTOR_ENV, scaled, timeout_factor  # (torch-free, re-exported)

HOST = "127.0.0.1"
# Absolute tolerance for parameters after a few Adam steps, balanced against upstream (or another wrapper).
# Another placement sums a gradient in another order; where the terms nearly cancel, Adam's
# g / (sqrt(v) + eps) turns that rounding into a step difference. On an AMD EPYC host 3-8 elements of a tensor
# differ by more than 1e-7 after 3 steps, the largest by 1.1e-6 (the hosts these tests passed on before stayed
# under 1e-6). A lost or doubled example moves many parameters by up to a step (the learning rate, 2e-3 to
# 1e-2 in these tests), and the losses are compared at 1e-5 relative as well.
TRAINED_PARAMS_ATOL = 5e-6
# What the fork server imports before its first fork: what every rank of the tests imports (the trainer imports the
# package's layers, megatron-core's parallel state, optimizer and schedules; the model its transformer blocks).
PRELOADED = ("torch.distributed", "megatron.core", "megatron_orch.trainer.loop", "megatron_orch.mllm.model")


def run_distributed(fn, world_size: int, *args, timeout_s: float = 90.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; raise on any failure.
    ``timeout_s`` (idle machine) is :func:`scaled` for the run and for every collective. Each rank traces its
    collectives (:mod:`collective_trace`); a failure carries a note of where the ranks' collectives parted."""
    timeout_s = scaled(timeout_s)
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    _start_fork_server()
    traces = tempfile.mkdtemp(prefix="collectives_")
    caller = _Caller(dict(os.environ), (_InheritedFd(1), _InheritedFd(2)))
    try:
        _run(fn, world_size, args, store, timeout_s, caller, traces)
    except BaseException as failure:
        failure.add_note(collective_trace.part_ways(collective_trace.read(traces, world_size)))
        raise
    finally:
        shutil.rmtree(traces, ignore_errors=True)


def _run(fn, world_size: int, args: tuple, store, timeout_s: float, caller, traces: str) -> None:
    context = mp.start_processes(_worker, args=(world_size, store.port, timeout_s, caller, traces,
                                                _Deferred((fn, args))),
                                 nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    name = getattr(fn, "__name__", repr(fn))
    try:
        while not context.join(timeout=max(0.05, min(1.0, deadline - time.monotonic())), grace_period=5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} on {world_size} ranks did not finish within {timeout_s:.0f} s")
    except mp.ProcessRaisedException:
        # Report every failed rank: the first one noticed is often a peer of the one that broke.
        raise RuntimeError(f"{name} failed on {world_size} ranks:" + "".join(
            f"\n\n-- rank {rank}:\n{trace}" for rank, trace in _errors(context))) from None
    finally:
        alive = [process for process in context.processes if process.is_alive()]
        for process in alive:  # SIGTERM first: each writes its stacks (see _worker)
            process.terminate()
        for process in alive:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()


def _errors(context):
    for rank, path in enumerate(context.error_files):
        if os.access(path, os.R_OK):
            with open(path, "rb") as handle:
                yield rank, pickle.load(handle)


def _start_fork_server() -> None:
    """Start the session's fork server (once) with this process's ``sys.path``, so it imports the same files."""
    multiprocessing.set_forkserver_preload(list(PRELOADED))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(path or os.getcwd() for path in sys.path)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


class _InheritedFd:
    """A file descriptor of the caller, passed to the forked rank (pickled only while a process starts)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _identity, (multiprocessing.reduction.DupFd(self.fd),)


def _identity(value):
    return value


class _Caller:
    """What a spawned rank inherits from the caller and a forked one does not (multiprocessing gives it the caller's
    ``sys.path`` and working folder): the environment, stdout and stderr."""

    def __init__(self, environ: dict, std_fds: tuple):
        self.environ, self.std_fds = environ, std_fds

    def enter(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        sys.stdout.flush()
        sys.stderr.flush()
        for target, inherited in zip((1, 2), self.std_fds):
            fd = inherited.detach()
            os.dup2(fd, target)
            os.close(fd)


class _Deferred:
    """A value the rank unpickles once it entered the caller's environment: the test module that defines ``fn``
    is imported then, and may read that environment at import (as it did in a spawned rank)."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):  # called while the rank starts, so file descriptors within are passed to it too
        return _Deferred._pickled, (bytes(multiprocessing.reduction.ForkingPickler.dumps(self.value)),)

    @classmethod
    def _pickled(cls, data: bytes) -> "_Deferred":
        deferred = cls(None)
        deferred.data = data
        return deferred

    def load(self):
        return pickle.loads(self.data)


def _worker(rank: int, world_size: int, port: int, timeout_s: float, caller: _Caller, traces: str,
            deferred: _Deferred) -> None:
    caller.enter()
    # A rank stopped from outside (a peer failed or the run timed out) first writes every thread's Python stack to
    # stderr, then dies as it would have: a rank that never reached a collective shows where it was.
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
    fn, args = deferred.load()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    collective_trace.install(traces, rank)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # On success, skip interpreter finalization: C++ teardown there (gloo and store threads) sometimes
    # aborts a rank after every check passed ("terminate called without an active exception"). A
    # raising fn still reaches torch.multiprocessing's error file above. Skipped finalization would leave the
    # rank's own child processes waiting forever (megatron-core's checkpoint writer starts a multiprocessing
    # Manager): they are stopped first.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=10)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
