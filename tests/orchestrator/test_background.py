"""The background planner: same plans as in the foreground, errors re-raised, the switch interval
lowered only while a plan runs."""
import sys

import numpy as np
import pytest

from megatron_orch.mllm.config import load_model_config
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import StepSizes
from megatron_orch.orchestrator.background import NICE_INCREMENT, SWITCH_INTERVAL_S, BackgroundPlanner
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import plan_step


def test_background_plan_equals_foreground_plan():
    rng = np.random.default_rng(0)
    sizes = StepSizes(counts=np.full(8, 4), items={"vision": rng.integers(0, 6, 32), "audio": rng.integers(0, 3, 32)},
                      num_tokens=rng.integers(1, 300, 32))
    model, config, topology = load_model_config("tiny").phases(), OrchestratorConfig(), Topology.uniform(8, 4)
    foreground = plan_step(sizes, model, config, topology, 2, 2)
    planner = BackgroundPlanner(enabled=True)
    try:
        planner.submit(lambda: plan_step(sizes, model, config, topology, 2, 2))
        background = planner.result()
    finally:
        planner.shutdown()
    assert background.digest == foreground.digest
    assert np.array_equal(background.examples_backbone.rank, foreground.examples_backbone.rank)


@pytest.mark.parametrize("interval", [SWITCH_INTERVAL_S, None])
def test_switch_interval_lowered_while_planning_and_restored(interval):
    before = sys.getswitchinterval()
    planner = BackgroundPlanner(enabled=True, switch_interval_s=interval)
    try:
        planner.submit(sys.getswitchinterval)
        during = planner.result()
        planner.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            planner.result()
    finally:
        planner.shutdown()
    assert during == (min(before, SWITCH_INTERVAL_S) if interval else before)
    assert sys.getswitchinterval() == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
@pytest.mark.parametrize("increment", [NICE_INCREMENT, 0])
def test_the_planning_thread_runs_below_the_training_thread(increment):
    """Only the planning thread's nice value goes up (the kernel gives a busy core to the training thread
    first); the process's stays."""
    import os
    import threading
    process = os.getpriority(os.PRIO_PROCESS, 0)
    planner = BackgroundPlanner(enabled=True, nice_increment=increment)
    try:
        planner.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        thread = planner.result()
    finally:
        planner.shutdown()
    assert thread == min(19, process + increment)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == process


def test_freed_memory_stays_in_the_process_unless_the_job_set_its_own(monkeypatch):
    """After retain_freed_memory an array freed and allocated again reuses the process's pages (no page faults: a
    plan's arrays are not faulted in anew every step); MALLOC_* set by the job are left alone (nothing applied)."""
    import resource

    from megatron_orch.orchestrator import background
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert background.retain_freed_memory() is None
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    line = background.retain_freed_memory()
    if line is None:
        pytest.skip("not glibc: mallopt is not there")  # (the project's machines and CI are glibc)
    assert "64 MiB" in line and "256 MiB" in line
    # a plan's working set: arrays of a few MiB (on the heap, below the mmap threshold), 144 MiB in all, freed
    # together at its end; glibc's own thresholds give the heap's top back (trimmed) and fault it in again next time
    pages = (144 << 20) // resource.getpagesize()
    for attempt in range(2):  # the first round grows the heap; the second reuses what the first freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [np.empty(12 << 17) for _ in range(12)]  # 12 arrays of 12 MiB, every page written
        for block in blocks:
            block.fill(1.0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del blocks, block
    assert faults < pages // 50, f"{faults} page faults for {pages} pages allocated the second time"
