"""EventTimers: Megatron's timers without a device synchronisation in start/stop (read on log iterations).

The GPU path (CUDA events) is checked with stand-in events that record who waits for them: no GPU here.
What the timers save in wall-clock time on a GPU is not measured here.
"""
import time

import pytest
import torch
from megatron.core.timers import DummyTimer

from megatron_orch.trainer import timers as timers_module
from megatron_orch.trainer.timers import EventTimer, EventTimers


@pytest.fixture()
def no_synchronize(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize called by a timer")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_cpu_timers_measure_the_clock_without_synchronising(no_synchronize):
    timers = EventTimers(log_level=1, log_option="minmax", cuda=False)
    timer = timers("region", log_level=0)
    assert isinstance(timer, EventTimer) and timers("region") is timer
    assert isinstance(timers("detail", log_level=2), DummyTimer)  # above the log level, as Megatron's
    for _ in range(3):
        timer.start()
        time.sleep(0.01)
        timer.stop()
    assert timer._spans == []  # on the CPU every span is folded at its stop
    assert 0.03 <= timer.elapsed(reset=True) < 1.0
    assert timer.elapsed() == 0.0
    timer.start()
    with pytest.raises(AssertionError, match="already been started"):
        timer.start()


class _StandInEvent:
    """A CUDA event: a time when recorded, done when the test says so; counts the host's waits."""

    clock, waits = [0.0], [0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.done = False

    def record(self):
        _StandInEvent.clock[0] += 0.5
        self.at = _StandInEvent.clock[0]

    def query(self):
        return self.done

    def synchronize(self):
        _StandInEvent.waits[0] += 1
        self.done = True

    def elapsed_time(self, end):
        assert self.done or end.done, "elapsed_time of events not yet over"
        return (end.at - self.at) * 1000.0


def test_cuda_timers_record_events_and_wait_only_when_read(monkeypatch, no_synchronize):
    monkeypatch.setattr(timers_module.torch.cuda, "Event", _StandInEvent)
    _StandInEvent.waits[0] = 0
    timer = EventTimers(log_level=1, log_option="minmax", cuda=True)("forward-backward", log_level=1)
    ends = []
    for _ in range(4):
        timer.start()
        timer.stop()
        ends.append(timer._spans[-1][1] if timer._spans else None)
    assert _StandInEvent.waits[0] == 0 and len(timer._spans) == 4  # nothing over yet: nothing waited for
    ends[0].done = ends[1].done = True
    timer.start()
    timer.stop()  # folds the spans already over (an event query), keeps the rest
    assert _StandInEvent.waits[0] == 0 and len(timer._spans) == 3
    assert timer.elapsed(reset=True) == pytest.approx(5 * 0.5)
    assert _StandInEvent.waits[0] == 3 and timer._spans == []  # the read waits for the three not over
    assert timer.active_time() == pytest.approx(5 * 0.5)
