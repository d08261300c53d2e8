"""Plan step k+1 on a CPU thread while step k trains.

The planner's hot loops (partitioning, placement, slots) are numba kernels compiled with
``nogil=True`` and the rest is numpy, so the planning thread mostly runs without the GIL and leaves
the training loop's Python (kernel launches, the schedule) alone. Where it does hold the GIL (its
Python glue, numpy calls that keep it), the training thread would wait for it up to the
interpreter's switch interval (5 ms by default) before CPython makes the planner hand it over; while
a plan is computed the interval is lowered to ``switch_interval_s`` (0.5 ms), so the training loop
waits at most about that plus the planner's current numpy call (``python -m
megatron_orch.bench.planning`` measures it). On a machine whose cores are all busy the training thread
can also wait for a core while the planning thread runs on it (no GIL involved: a plan in a forked process
does the same); on Linux the planning thread therefore runs ``nice_increment`` (10) below the process's
priority, so the kernel gives the core to the training thread first. Only the *exposed* time (how long the
training loop waits for a plan that is not ready yet) costs step time; it is measured here and logged by the
caller. A plan allocates its arrays afresh every step (hundreds of MB at DP 10240); glibc returns freed arrays
above its mmap threshold to the OS, and the next plan page-faults them in again: :func:`retain_freed_memory`
keeps them in the process instead.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

SWITCH_INTERVAL_S = 0.0005
NICE_INCREMENT = 10  # the planning thread's priority below the process's (Linux: nice is per thread)
# glibc's thresholds while post-balancing plans: freed blocks below 64 MiB stay in the process, and up to 256 MiB
# of free memory before it is given back (as MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456)
MMAP_THRESHOLD_BYTES = 64 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_switch_lock = threading.Lock()
_switch_users = 0  # plans running with the lowered interval (any planner of the process)
_switch_saved = 0.005


def _lower_switch_interval(interval_s: float) -> None:
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, interval_s))
        _switch_users += 1


def _restore_switch_interval() -> None:
    global _switch_users
    with _switch_lock:
        _switch_users -= 1
        if _switch_users == 0:
            sys.setswitchinterval(_switch_saved)


def retain_freed_memory() -> Optional[str]:
    """Keep freed memory in the process (glibc's ``mallopt``: mmap threshold :data:`MMAP_THRESHOLD_BYTES`, trim
    threshold :data:`TRIM_THRESHOLD_BYTES`), so that every plan does not page-fault its arrays in anew (measured
    at DP 10240: a third of a plan's CPU). Process-wide, at most 256 MiB of free memory more kept. Returns the
    line that says what was done, or None where nothing was: not glibc, or the job set ``MALLOC_MMAP_THRESHOLD_``
    / ``MALLOC_TRIM_THRESHOLD_`` itself (its own settings are kept)."""
    if any(name in os.environ for name in MALLOC_ENV):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        applied = libc.mallopt(-3, MMAP_THRESHOLD_BYTES) and libc.mallopt(-1, TRIM_THRESHOLD_BYTES)  # M_MMAP_, M_TRIM_
    except (OSError, AttributeError):
        return None
    if not applied:
        return None
    return (f"post-balancing: glibc keeps freed memory below {MMAP_THRESHOLD_BYTES >> 20} MiB in the process (up to "
            f"{TRIM_THRESHOLD_BYTES >> 20} MiB free), so plans do not page-fault their arrays in every step; "
            f"{' / '.join(MALLOC_ENV)} set in the environment keep the job's own")


def _lower_priority(increment: int) -> None:
    """Raise the calling thread's nice value by ``increment`` (Linux only, where it is per thread; elsewhere
    ``PRIO_PROCESS`` would take the whole process down)."""
    if increment <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
    except OSError:  # e.g. a sandbox without setpriority: the thread keeps the process's priority
        pass


class BackgroundPlanner:
    """One planning thread; ``submit`` a plan function now, ``result`` it later.

    With ``enabled=False`` the plan is computed inside ``result`` (all of it exposed): the same code
    path, so turning background planning off changes timing only, never plans.
    """

    def __init__(self, enabled: bool = True, switch_interval_s: Optional[float] = SWITCH_INTERVAL_S,
                 nice_increment: int = NICE_INCREMENT):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orch-planner",
                                            initializer=_lower_priority,
                                            initargs=(nice_increment,)) if enabled else None
        self._switch_interval_s = switch_interval_s  # None: leave the interpreter's switch interval alone
        self._pending: Optional[Future] = None
        self._deferred: Optional[Callable] = None
        self.last_exposed_s = 0.0   # time the last result() waited
        self.last_plan_s = 0.0      # time the last plan took to compute

    def submit(self, plan_fn: Callable[[], object]) -> None:
        if self._pending is not None or self._deferred is not None:
            raise RuntimeError("a plan is already pending: result() must be called before the next submit()")

        def timed():
            start = time.perf_counter()
            plan = plan_fn()
            return plan, time.perf_counter() - start

        def in_background():
            if self._switch_interval_s is None:
                return timed()
            _lower_switch_interval(self._switch_interval_s)
            try:
                return timed()
            finally:
                _restore_switch_interval()

        if self._executor is None:
            self._deferred = timed
        else:
            self._pending = self._executor.submit(in_background)

    def result(self):
        start = time.perf_counter()
        if self._deferred is not None:
            plan, self.last_plan_s = self._deferred()
            self._deferred = None
        elif self._pending is not None:
            plan, self.last_plan_s = self._pending.result()  # re-raises the planner's exception here
            self._pending = None
        else:
            raise RuntimeError("no plan was submitted")
        self.last_exposed_s = time.perf_counter() - start
        return plan

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
