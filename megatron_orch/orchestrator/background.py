"""Plan step k+1 on a CPU thread while step k trains.

The partitioners' hot loops are numba kernels compiled with ``nogil=True`` and the rest is numpy, so
the planning thread mostly runs without the GIL and leaves the training loop's Python (kernel
launches, the schedule) alone. Only the *exposed* time (how long the training loop waits for a plan
that is not ready yet) costs step time; it is measured here and logged by the caller.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional


class BackgroundPlanner:
    """One planning thread; ``submit`` a plan function now, ``result`` it later.

    With ``enabled=False`` the plan is computed inside ``result`` (all of it exposed): the same code
    path, so turning background planning off changes timing only, never plans.
    """

    def __init__(self, enabled: bool = True):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orch-planner") if enabled else None
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

        if self._executor is None:
            self._deferred = timed
        else:
            self._pending = self._executor.submit(timed)

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
