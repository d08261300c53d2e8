"""The planning benchmark runs the trainer's plan_step and reports CPU time and main-thread stalls."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_orch.bench.planning import MIXTURES, PROBES, _run_queue_wait, draw_step, format_tables, run
from megatron_orch.balance.traces import HEAVY_TAILED_MIXTURES, SHIPPED_MIXTURE


@pytest.mark.distributed
def test_planning_benchmark_reports_every_configuration():
    result = run([16], per_rank=2, gpus_per_node=4, seeds=[0, 1], mixtures={"shipped": MIXTURES["shipped"],
                                                                         "audio-heavy": MIXTURES["audio-heavy"]},
                 repeats=1)
    json.dumps(result)
    assert len(result["runs"]) == 4
    for r in result["runs"]:
        assert r["deterministic"]
        assert r["plan_cpu_ms"]["min"] > 0 and r["plan_wall_ms"]["min"] > 0
        assert set(r["stall"]) == set(PROBES)
        for probe in r["stall"].values():  # the background plan and both controls, once per repeat
            assert set(probe) == {"planning", "idle", "beside"}
            assert all(len(probe[name]["max_gap_ms_each"]) == 1 for name in probe)
        for name, figures in r["stall"]["sleep"].items():  # the sleep probe splits off its wait for a core
            assert 0.0 <= figures["run_queue_in_worst_gap_ms"] <= figures["max_gap_ms"], (name, figures)
        assert all("run_queue_in_worst_gap_ms" not in f for k in ("spin", "numpy") for f in r["stall"][k].values())
        assert set(r["items"]) == {"vision", "audio", "llm"} and r["items"]["llm"] == 32
    assert "dp 16: plan CPU median" in format_tables(result) and "load average" in format_tables(result)
    assert all(r["reference_cpu_ms"]["min"] > 0 for r in result["runs"])


@pytest.mark.distributed
@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="needs Linux's per-thread schedstat")
def test_the_run_queue_wait_counts_time_without_a_core():
    """A busy loop pinned to one core beside three CPU-bound processes on that core: the loop never sleeps, so
    its wall time is its time on the core plus the probe's figure, its wait for the core; and with three others
    taking turns it waits longer than it runs. Both hold on a loaded host, where other work only adds wait."""
    core = min(os.sched_getaffinity(0))
    saved = os.sched_getaffinity(0)
    spin = ("import os, sys, time; os.sched_setaffinity(0, {%d}); print('ready', flush=True); "
            "end = time.perf_counter() + 120\nwhile time.perf_counter() < end: pass" % core)
    children = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        assert all(child.stdout.readline().strip() == "ready" for child in children)
        os.sched_setaffinity(0, {core})
        start_wait, start_cpu, start = _run_queue_wait(), time.thread_time(), time.perf_counter()
        while time.perf_counter() - start < 0.4:
            pass
        waited, on_core, wall = (_run_queue_wait() - start_wait, time.thread_time() - start_cpu,
                                 time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, saved)
        for child in children:
            child.kill()
            child.wait(timeout=30)
    assert abs(on_core + waited - wall) < 0.05 * wall + 0.01, (on_core, waited, wall)
    assert waited > on_core, (on_core, waited, wall)


def test_mixtures_reweight_the_shipped_traces():
    names = [name for name, _ in SHIPPED_MIXTURE]
    for mixture, specs in MIXTURES.items():
        if mixture not in HEAVY_TAILED_MIXTURES:
            assert [name for name, _ in specs] == names
    audio = dict(MIXTURES["audio-heavy"])
    assert audio["asr_librispeech_commonvoice.csv"] == 4 * dict(SHIPPED_MIXTURE)["asr_librispeech_commonvoice.csv"]
    _, sizes = draw_step(list(MIXTURES["audio-heavy"]), dp=8, per_rank=4, model="mllm_84b", seed=0)
    assert np.asarray(sizes.counts).tolist() == [4] * 8


@pytest.mark.distributed
def test_the_table_is_printed_once(capsys):
    """A row per configuration as it is done, then the targets (old code: the rows again, as a table)."""
    from megatron_orch.bench.planning import main
    main(["--dp", "16", "--per-rank", "2", "--gpus-per-node", "4", "--seeds", "0", "--mixtures", "shipped",
          "--repeats", "1", "--probes", "sleep"])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert text.count("plan_step CPU (median, max of repeats)") == 1, text
    assert sum(line.startswith("   16 shipped ") for line in text.splitlines()) == 1, text
    assert captured.out.rstrip().splitlines()[-1].startswith("dp 16: plan CPU median"), text


def test_the_summary_names_a_target_only_where_the_dp_size_has_one():
    from megatron_orch.bench.planning import TARGET_MEDIAN_CPU_MS, TARGET_WORST_CPU_MS, _target
    assert _target(TARGET_MEDIAN_CPU_MS, 2560) == " (target < 50)" and _target(TARGET_WORST_CPU_MS, 2560) == " (target < 70)"
    assert _target(TARGET_MEDIAN_CPU_MS, 10240) == " (target < 150)" and _target(TARGET_WORST_CPU_MS, 10240) == ""
    assert _target(TARGET_MEDIAN_CPU_MS, 512) == ""
