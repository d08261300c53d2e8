"""Megatron's timers without synchronising: marks recorded in order, read on log iterations only.

megatron-core's ``Timer`` calls ``torch.cuda.synchronize()`` in every ``start`` and ``stop``: each timed
region (the step's ``forward-backward``, each encoder's forward, the optimizer) drains the GPU's queue
and the host stops running ahead of it. :class:`EventTimers` is ``Timers`` whose timers record a mark
instead: on a GPU a CUDA event on the current stream (so a span is GPU time), on the CPU the host clock
(CPU work runs in program order). The host waits for a GPU mark only when a time is read, which the
trainer does on log iterations.
"""
from __future__ import annotations

import time
from typing import List, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core.timers import Timer, Timers

Mark = Union[torch.cuda.Event, float]


class EventTimer(Timer):
    """A Megatron ``Timer`` measuring between marks (module docstring); ``cuda``: CUDA events, else the clock."""

    def __init__(self, name: str, cuda: bool):
        super().__init__(name)
        self._cuda = cuda
        self._spans: List[Tuple[Mark, Mark]] = []  # not read yet
        self._begin: Mark = 0.0

    def _mark(self, barrier: bool) -> Mark:
        if barrier:
            dist.barrier(group=self._barrier_group)
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, barrier=False):
        assert not self._started, "timer has already been started"
        self._begin = self._mark(barrier)
        self._started = True

    def stop(self, barrier=False):
        assert self._started, "timer is not started"
        self._spans.append((self._begin, self._mark(barrier)))
        self._started = False
        self._fold(wait=False)  # timers nobody reads (megatron-core's own) keep no growing list of events

    def _fold(self, wait: bool) -> None:
        """Add recorded spans to the elapsed time, oldest first: all of them when ``wait`` (on a GPU the
        host then waits for their end events: only when a time is read), else those already over (an
        event query does not block)."""
        while self._spans:
            begin, end = self._spans[0]
            if self._cuda:
                if wait:
                    end.synchronize()
                elif not end.query():
                    return
                seconds = begin.elapsed_time(end) / 1000.0
            else:
                seconds = end - begin
            self._elapsed += seconds
            self._active_time += seconds
            self._spans.pop(0)

    def reset(self):
        self._spans = []
        super().reset()

    def elapsed(self, reset=True, barrier=False):
        started = self._started
        if started:
            self.stop(barrier=barrier)
        self._fold(wait=True)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if started:
            self.start(barrier=barrier)
        return elapsed

    def active_time(self):
        self._fold(wait=True)
        return self._active_time


class EventTimers(Timers):
    """Megatron's ``Timers`` (levels, names, logging) whose timers are :class:`EventTimer`; ``cuda``: whether
    the timed work runs on this rank's GPU."""

    def __init__(self, log_level: int, log_option: str, *, cuda: bool):
        super().__init__(log_level, log_option)
        self._cuda = cuda

    def __call__(self, name, log_level=None):
        timer = super().__call__(name, log_level)
        if type(timer) is Timer:  # just created by Timers (a DummyTimer stays one)
            timer = self._timers[name] = EventTimer(name, self._cuda)
        return timer
