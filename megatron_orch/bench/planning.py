"""Planning benchmark: the trainer's ``plan_step`` on global batches drawn from the traces, its CPU time,
and how long it stalls a training loop's Python while it runs in the background.

    python -m megatron_orch.bench.planning --dp 512 2560 --per-rank 16 --gpus-per-node 8 --seeds 0 1 2 --json out.json

For every (DP size, mixture, seed) it draws a global batch of ``dp * per_rank`` examples (DP rank r
loads the r-th consecutive block), builds the sizes the trainer gathers (``bench.common.batch_sizes``,
which refuses an example training would refuse) and calls exactly what the trainer calls:
``plan_step(sizes, model, OrchestratorConfig(), topology, ...)`` with the default flags (every phase,
``auto`` partitioner, packed micro-batches, ``exact`` placement), a uniform topology of
``--gpus-per-node`` ranks per node, ``--micro-batch-size`` examples per micro-batch. Mixtures: the
benchmarks' own (``bench.common.MIXTURES``: the shipped one and re-weightings of it, the heavy-tailed
ones of ``balance/traces.py``), or ``--trace`` gives one of your own.

Figures, per configuration:

* ``plan_cpu_ms``: CPU time of ``plan_step`` on its own (``time.process_time`` of the whole process,
  nothing else running), over ``--repeats`` runs after one untimed run, median and worst against the
  targets; ``plan_wall_ms`` likewise; ``plan_sys_ms`` and ``page_faults``: the kernel's share of that CPU
  time, mostly page faults of freshly allocated arrays (freed memory is kept in the process, as the trainer
  keeps it; ``--return-freed-memory`` leaves glibc's allocator as it is).
* ``reference_cpu_ms``: a fixed piece of numpy work (:func:`reference_workload`) timed right after each
  plan: how much a loaded machine inflates CPU times in this run (its min over the run against its
  median), and the load average (``os.getloadavg``) before and after each configuration.
* the stall: a main thread runs a probe loop of small Python work while :class:`BackgroundPlanner`
  plans the same step on its thread (as the trainer does while a step trains), and records the
  longest gap between two of its iterations. Two controls, side by side in the same run: the same
  loop, as long, with nothing planning (``idle``), and while the same plan runs in a forked process
  (``beside``: the same CPU contention, no shared GIL). What ``planning`` shows above ``beside`` is
  the GIL's share of the stall; the rest is the machine (preemption, a busy core). Three probes:
  ``spin`` (pure Python), ``sleep`` (``time.sleep(1 ms)`` per iteration: a loop that waits on the GPU)
  and ``numpy`` (a tight loop of short numpy ops: a loop busy launching kernels). The sleep probe also
  reads, on Linux, how long its thread was runnable without a core within its worst gap
  (``run_queue_in_worst_gap_ms``: a wait for a CPU, not for the GIL). ``bg_plan_cpu_ms``/``bg_plan_wall_ms``:
  the background plan's thread CPU and wall time meanwhile. Each figure is the worst over the repeats.
* the plan digest (equal over repeats and between the foreground and background runs: deterministic).

On a small shared VM the idle loop alone sees gaps of several ms (preemption, steal time): read the
planning column against the idle one, and the median over repeats against the worst.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import resource
import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import load_mixture, parse_trace_spec
from megatron_orch.balance.workload import StepSizes
from megatron_orch.bench.common import MIXTURES, add_seq_length_arg, batch_sizes, draw_sizes, report
from megatron_orch.mllm.config import DEFAULT_MODEL, MLLMConfig, load_model_config, sizes_from_trace
from megatron_orch.orchestrator.background import (NICE_INCREMENT, SWITCH_INTERVAL_S, BackgroundPlanner, _lower_priority,
                                                   retain_freed_memory)
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import plan_step, warm_up

PROBES = ("spin", "sleep", "numpy")
# the default plan_step at DP size x 16 examples: median CPU on one core of an idle machine, and its worst repeat
TARGET_MEDIAN_CPU_MS = {2560: 50.0, 10240: 150.0}
TARGET_WORST_CPU_MS = {2560: 70.0}
TARGET_STALL_MS = 5.0        # the main thread's longest stall while it plans in the background


def draw_step(trace_specs: Sequence[Tuple[str, float]], dp: int, per_rank: int, model: str, seed: int,
              traces_dir: Optional[str] = None, seq_length: Optional[int] = None) -> Tuple[MLLMConfig, StepSizes]:
    """A random global batch of a mixture, as the trainer sees it: (model config, sizes)."""
    config, _, sizes = draw_sizes(trace_specs, dp, per_rank, model, seed, traces_dir, seq_length)
    return config, sizes


def reference_workload() -> float:
    """CPU seconds of a fixed piece of numpy work (sorting, gathers and sums over 2^16 float64, the planner's
    kind of work, ~10 ms): timed beside every plan, so a loaded machine's inflation is measured in the same
    run."""
    rng = np.random.default_rng(0)
    values = rng.random(1 << 16)
    start = time.process_time()
    for _ in range(2):
        order = np.argsort(values, kind="stable")
        np.bincount(order % 2560, weights=values[order], minlength=2560).max()
    return time.process_time() - start


# -------------------------------------------------------------------------------------------------
# The main thread's probe loops
# -------------------------------------------------------------------------------------------------

def _run_queue_wait() -> float:
    """The calling thread's time (s) so far runnable but without a core (Linux schedstat; 0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return 1e-9 * int(stat.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0


def _probe(kind: str, keep_going: Callable[[], bool], other_thread: Optional[int] = None):
    """Run the probe loop while ``keep_going()``. Returns the times (s) between consecutive iterations,
    with ``other_thread`` (a ``threading.get_ident()``) that thread's CPU time (s) within each of them, and
    for the ``sleep`` probe (whose loop makes syscalls anyway) the time it waited for a core within each."""
    stamps: List[float] = []
    cpu_stamps: List[float] = []
    wait_stamps: List[float] = []
    clock = time.perf_counter
    if other_thread is not None:
        other_clock = time.pthread_getcpuclockid(other_thread)
        cpu = functools.partial(time.clock_gettime, other_clock)
    else:
        cpu = _zero
    if kind == "spin":  # pure Python: it holds the GIL but while another thread takes it
        while keep_going():
            stamps.append(clock())
            cpu_stamps.append(cpu())
    elif kind == "sleep":
        while keep_going():
            time.sleep(0.001)
            stamps.append(clock())
            cpu_stamps.append(cpu())
            wait_stamps.append(_run_queue_wait())
    elif kind == "numpy":
        x = np.arange(256, dtype=np.float64)
        out = np.empty_like(x)
        while keep_going():
            np.multiply(x, 1.0001, out=out)
            np.add(out, 1.0, out=out)
            float(out[7])
            stamps.append(clock())
            cpu_stamps.append(cpu())
    else:
        raise ValueError(f"unknown probe {kind!r}; choose from {PROBES}")
    waited = np.diff(np.asarray(wait_stamps)) if kind == "sleep" else None  # (fewer than 2 stamps: empty)
    return np.diff(np.asarray(stamps)), np.diff(np.asarray(cpu_stamps)), waited


def _zero() -> float:
    return 0.0


def _gap_figures(gaps: np.ndarray, other_cpu: Optional[np.ndarray] = None,
                 waited: Optional[np.ndarray] = None) -> Dict[str, float]:
    if gaps.size == 0:
        figures = {"max_gap_ms": 0.0, "p99_gap_ms": 0.0, "iterations": 0}
    else:
        figures = {"max_gap_ms": 1e3 * float(gaps.max()), "p99_gap_ms": 1e3 * float(np.percentile(gaps, 99)),
                   "iterations": int(gaps.size + 1)}
    worst = int(gaps.argmax()) if gaps.size else -1
    if waited is not None:  # the probe thread waiting for a core (the machine or CPU contention, not the GIL)
        figures["run_queue_in_worst_gap_ms"] = 1e3 * float(waited[worst]) if gaps.size else 0.0
    if other_cpu is not None:  # the planning thread's CPU time within the probe's gaps: an upper bound of the
        # time it held the GIL in them (it may also have run a nogil kernel while the probe waited for a CPU)
        figures["planner_cpu_in_worst_gap_ms"] = 1e3 * float(other_cpu[worst]) if gaps.size else 0.0
        figures["max_planner_cpu_in_gap_ms"] = 1e3 * float(other_cpu.max(initial=0.0))
    return figures


def _niced(plan_fn: Callable[[], object], nice_increment: int) -> None:
    """The forked control: the plan at the planning thread's priority."""
    _lower_priority(nice_increment)
    plan_fn()


def _stall(kind: str, plan_fn: Callable[[], object], switch_interval_s: Optional[float] = SWITCH_INTERVAL_S,
           nice_increment: int = NICE_INCREMENT):
    """(figures with planning in the background, of the idle baseline as long, of planning in a forked
    process, plan digest)."""
    started, finished = threading.Event(), threading.Event()
    cpu = [0.0]
    planner_thread = [0]

    def timed_plan():
        planner_thread[0] = threading.get_ident()
        started.set()
        start = time.thread_time()
        plan = plan_fn()
        cpu[0] = time.thread_time() - start
        finished.set()
        return plan

    planner = BackgroundPlanner(enabled=True, switch_interval_s=switch_interval_s, nice_increment=nice_increment)
    try:
        start = time.perf_counter()
        planner.submit(timed_plan)
        started.wait()
        busy, planner_cpu, busy_waited = _probe(kind, lambda: not finished.is_set(), planner_thread[0])
        wall = time.perf_counter() - start
        plan = planner.result()
    finally:
        planner.shutdown()
    # Baseline: the same loop for as long (at least 50 ms), nothing planning.
    deadline = time.perf_counter() + max(wall, 0.05)
    idle, _, idle_waited = _probe(kind, lambda: time.perf_counter() < deadline)
    child = multiprocessing.get_context("fork").Process(target=_niced, args=(plan_fn, nice_increment),
                                                        name="orch-planner-beside")
    child.start()
    beside, _, beside_waited = _probe(kind, child.is_alive)
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"planning in a forked process failed (exit code {child.exitcode})")
    planning = dict(_gap_figures(busy, planner_cpu, busy_waited), bg_plan_cpu_ms=1e3 * cpu[0],
                    bg_plan_wall_ms=1e3 * wall)
    return planning, _gap_figures(idle, waited=idle_waited), _gap_figures(beside, waited=beside_waited), plan.digest


# -------------------------------------------------------------------------------------------------
# The benchmark
# -------------------------------------------------------------------------------------------------

def run_one(model: MLLMConfig, sizes: StepSizes, gpus_per_node: int, micro_batch_size: int,
            repeats: int = 3, probes: Sequence[str] = PROBES,
            switch_interval_s: Optional[float] = SWITCH_INTERVAL_S, nice_increment: int = NICE_INCREMENT) -> dict:
    """Time ``plan_step`` on one global batch (foreground CPU/wall beside the reference workload, background
    stalls)."""
    dp = int(np.asarray(sizes.counts).size)
    per_rank = int(np.asarray(sizes.counts)[0])
    if per_rank % micro_batch_size:
        raise ValueError(f"--per-rank {per_rank} is not a multiple of --micro-batch-size {micro_batch_size}")
    config = OrchestratorConfig()
    topology = Topology.uniform(dp, gpus_per_node)

    def plan():
        return plan_step(sizes, model.phases(), config, topology, micro_batch_size, per_rank // micro_batch_size)

    load_before = os.getloadavg()[0]
    first = plan()  # untimed: first touches of memory at this size
    digests = {first.digest}
    cpu, wall, sys_cpu, faults, reference = [], [], [], [], []
    for _ in range(repeats):
        start_usage = resource.getrusage(resource.RUSAGE_SELF)
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        digests.add(plan().digest)
        cpu.append(1e3 * (time.process_time() - start_cpu))
        wall.append(1e3 * (time.perf_counter() - start_wall))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        sys_cpu.append(1e3 * (usage.ru_stime - start_usage.ru_stime))
        faults.append(usage.ru_minflt - start_usage.ru_minflt)
        reference.append(1e3 * reference_workload())
    stalls = {}
    for kind in probes:
        runs = {"planning": [], "idle": [], "beside": []}
        for _ in range(repeats):
            busy, idle, beside, digest = _stall(kind, plan, switch_interval_s, nice_increment)
            digests.add(digest)
            for name, figures in (("planning", busy), ("idle", idle), ("beside", beside)):
                runs[name].append(figures)
        stalls[kind] = {name: dict(max(figures, key=lambda f: f["max_gap_ms"]),
                                   median_max_gap_ms=statistics.median(f["max_gap_ms"] for f in figures),
                                   max_gap_ms_each=[f["max_gap_ms"] for f in figures])
                        for name, figures in runs.items()}
    return {
        "dp": dp, "per_rank": per_rank,
        "items": {phase: stats.items for phase, stats in first.stats.items()},
        "methods": {phase: stats.method for phase, stats in first.stats.items()},
        "plan_cpu_ms": _spread(cpu),
        "plan_wall_ms": _spread(wall),
        "plan_sys_ms": {"median": statistics.median(sys_cpu), "all": sys_cpu},  # kernel time: page faults
        "page_faults": {"median": statistics.median(faults), "all": faults},
        "reference_cpu_ms": _spread(reference),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "stall": stalls,
        "digest": first.digest,
        "deterministic": len(digests) == 1,
    }


def _spread(values: List[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "all": values}


def run(dps: Sequence[int], per_rank: int, gpus_per_node: int, seeds: Sequence[int], mixtures: Dict[str, tuple],
        model: str = DEFAULT_MODEL, micro_batch_size: int = 1, repeats: int = 3,
        probes: Sequence[str] = PROBES, traces_dir: Optional[str] = None, log=None,
        switch_interval_s: Optional[float] = SWITCH_INTERVAL_S, nice_increment: int = NICE_INCREMENT,
        seq_length: Optional[int] = None) -> dict:
    """Every (dp, mixture, seed); JSON-ready ``{"runs": [...], "params": {...}}``. ``seq_length``: the
    backbone's sequence length (default: the model's positions); a longer example is refused."""
    if min(dps) < 1 or per_rank < 1 or gpus_per_node < 1 or micro_batch_size < 1 or repeats < 1:
        raise ValueError("--dp, --per-rank, --gpus-per-node, --micro-batch-size and --repeats must be >= 1")
    config = load_model_config(model)
    warm_up(config.phases(), OrchestratorConfig(), announce=log)  # compile (or load) the kernels, as the trainer does
    runs = []
    for dp in dps:
        for name, specs in mixtures.items():
            mixture = load_mixture(specs, traces_dir)
            for seed in seeds:
                sizes = batch_sizes(mixture.draw(dp * per_rank, seed), dp, per_rank, config, seq_length)
                result = dict(run_one(config, sizes, gpus_per_node, micro_batch_size, repeats, probes,
                                      switch_interval_s, nice_increment),
                              mixture=name, seed=seed)
                runs.append(result)
                if log is not None:
                    log(_row(result, probes))
    return {"runs": runs, "params": {
        "dp": list(dps), "per_rank": per_rank, "gpus_per_node": gpus_per_node, "seeds": list(seeds),
        "micro_batch_size": micro_batch_size, "model": config.name, "seq_length": seq_length, "repeats": repeats,
        "mixtures": {name: [{"trace": t, "weight": w} for t, w in specs] for name, specs in mixtures.items()},
        "orchestrator_config": repr(OrchestratorConfig()),
        "cpus": os.cpu_count(),
        "switch_interval_s": {"planning": switch_interval_s, "interpreter": sys.getswitchinterval()},
        "planner_nice_increment": nice_increment,
        "targets": {"median_plan_cpu_ms_by_dp": {str(dp): ms for dp, ms in TARGET_MEDIAN_CPU_MS.items()},
                    "worst_plan_cpu_ms_by_dp": {str(dp): ms for dp, ms in TARGET_WORST_CPU_MS.items()},
                    "max_stall_ms": TARGET_STALL_MS},
        "notes": {
            "plan_cpu_ms": "process CPU time of plan_step alone, after one untimed run",
            "reference_cpu_ms": "a fixed numpy workload timed after each plan: its median over its min is the "
                                "inflation the machine's load caused in this run",
            "stall": "longest gap between iterations of a main-thread probe loop while BackgroundPlanner "
                     "plans (planning), of the same loop with nothing planning (idle) and while the plan runs "
                     "in a forked process (beside: same CPU contention, no shared GIL), worst of the repeats; "
                     "planner_cpu_in_worst_gap_ms / max_planner_cpu_in_gap_ms: the planning thread's CPU time "
                     "within the probe's gaps while planning (an upper bound of the time it held the GIL there); "
                     "run_queue_in_worst_gap_ms (sleep probe, Linux): of the worst gap, the time the probe's "
                     "thread was runnable but had no core (the machine or CPU contention, not the GIL)",
            "switch_interval_s": "the interpreter's switch interval while the background planner plans "
                                 "(BackgroundPlanner's switch_interval_s; None: left at the interpreter's)",
        }}}


HEADER = (f"{'dp':>5} {'mixture':<16} {'seed':>4} {'vision':>7} {'audio':>6} {'llm':>6} "
          f"{'cpu ms':>7} {'(max)':>7} {'ref ms':>7} {'sys ms':>7} {'wall ms':>8} {'load':>5}")


def _header(probes: Sequence[str]) -> str:
    return HEADER + "".join(f" {kind + ' max':>9} {'(med)':>6} {'cpu':>5} {'idle':>8} {'beside':>8}" for kind in probes)


def _row(r: dict, probes: Sequence[str]) -> str:
    cells = (f"{r['dp']:>5} {r['mixture']:<16} {r['seed']:>4} {r['items']['vision']:>7} {r['items']['audio']:>6} "
             f"{r['items']['llm']:>6} {r['plan_cpu_ms']['median']:>7.1f} {r['plan_cpu_ms']['max']:>7.1f} "
             f"{r['reference_cpu_ms']['median']:>7.1f} {r['plan_sys_ms']['median']:>7.1f} "
             f"{r['plan_wall_ms']['median']:>8.1f} {r['load_average']['after']:>5.1f}")
    for kind in probes:
        s = r["stall"][kind]
        cells += (f" {s['planning']['max_gap_ms']:>9.2f} {s['planning']['median_max_gap_ms']:>6.2f}"
                  f" {s['planning']['max_planner_cpu_in_gap_ms']:>5.2f}"
                  f" {s['idle']['max_gap_ms']:>8.2f} {s['beside']['max_gap_ms']:>8.2f}")
    return cells + ("" if r["deterministic"] else "  NOT DETERMINISTIC")


def _title(probes: Sequence[str]) -> List[str]:
    return ["plan_step CPU (median, max of repeats), the reference workload's CPU beside it, the plan's kernel (page "
            "fault) share and wall, the 1-minute load average; per probe, the main thread's longest gap (ms) while planning "
            "in the background (worst and median over repeats), the planning thread's most CPU time within one of "
            "those gaps (cpu: what it can have held the GIL for), and the same probe's longest gap with nothing "
            "planning (idle) and beside a plan in a forked process (beside), measured side by side",
            _header(probes)]


def _summary(result: dict) -> List[str]:
    """Each DP size's figures against the targets, and the load they were measured under."""
    probes = list(result["runs"][0]["stall"]) if result["runs"] else []
    lines = []
    for dp in result["params"]["dp"]:
        mine = [r for r in result["runs"] if r["dp"] == dp]
        if not mine:
            continue
        worst_median = max(r["plan_cpu_ms"]["median"] for r in mine)
        worst_cpu = max(r["plan_cpu_ms"]["max"] for r in mine)
        stalls = "; ".join(
            f"{k} probe {max(r['stall'][k]['planning']['max_gap_ms'] for r in mine):.2f} ms while planning"
            f"{_run_queue_note(mine, k)} (idle {max(r['stall'][k]['idle']['max_gap_ms'] for r in mine):.2f}, beside "
            f"{max(r['stall'][k]['beside']['max_gap_ms'] for r in mine):.2f}; planner CPU within one gap "
            f"{max(r['stall'][k]['planning']['max_planner_cpu_in_gap_ms'] for r in mine):.2f})" for k in probes)
        reference = [x for r in mine for x in r["reference_cpu_ms"]["all"]]
        loads = [x for r in mine for x in r["load_average"].values()]
        inflation = statistics.median(reference) / min(reference)
        lines.append(f"dp {dp}: plan CPU median {worst_median:.1f} ms at most{_target(TARGET_MEDIAN_CPU_MS, dp)}, "
                     f"worst {worst_cpu:.1f} ms{_target(TARGET_WORST_CPU_MS, dp)}; worst main-thread gap (target < "
                     f"{TARGET_STALL_MS:.0f}): {stalls}; measured under a load average "
                     f"of {min(loads):.1f}-{max(loads):.1f} on {result['params']['cpus']} CPUs, the reference "
                     f"workload's median {inflation:.2f}x its fastest run")
    return lines


def _target(targets: Dict[int, float], dp: int) -> str:
    """`` (target < N)`` where the DP size has a target, else nothing."""
    return f" (target < {targets[dp]:.0f})" if dp in targets else ""


def _run_queue_note(runs: List[dict], kind: str) -> str:
    worst = max((r["stall"][kind]["planning"] for r in runs), key=lambda f: f["max_gap_ms"])
    if "run_queue_in_worst_gap_ms" not in worst:
        return ""
    return f", {worst['run_queue_in_worst_gap_ms']:.2f} ms of it waiting for a core"


def format_tables(result: dict) -> str:
    probes = list(result["runs"][0]["stall"]) if result["runs"] else []
    return "\n".join(_title(probes) + [_row(r, probes) for r in result["runs"]] + _summary(result))


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.planning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[512, 2560], help="DP sizes (default 512 2560)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="DP ranks per node (default 8)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="examples per micro-batch (default 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--mixtures", nargs="+", choices=list(MIXTURES), default=list(MIXTURES),
                        help="the benchmarks' mixtures (bench.common.MIXTURES; default: all)")
    parser.add_argument("--trace", nargs="+", metavar="CSV[:WEIGHT]",
                        help="a mixture of your own (trace CSVs with weights), run instead of --mixtures")
    parser.add_argument("--traces-dir", default=None, help="folder of the trace CSVs")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model config (default {DEFAULT_MODEL})")
    add_seq_length_arg(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (default 3)")
    parser.add_argument("--probes", nargs="+", choices=PROBES, default=list(PROBES))
    parser.add_argument("--switch-interval-ms", type=float, default=1e3 * SWITCH_INTERVAL_S,
                        help="the interpreter's switch interval while the background planner plans (default "
                             f"{1e3 * SWITCH_INTERVAL_S:g}, the trainer's; 0: leave it at the interpreter's, "
                             f"{1e3 * sys.getswitchinterval():g})")
    parser.add_argument("--planner-nice", type=int, default=NICE_INCREMENT,
                        help=f"the planning thread's nice value above the process's (default {NICE_INCREMENT}, the "
                             "trainer's; 0: the same priority as the training thread)")
    parser.add_argument("--return-freed-memory", action="store_true",
                        help="leave glibc's allocator as it is (freed arrays go back to the OS and are page-faulted "
                             "in anew every plan); default: freed memory kept in the process, as the trainer keeps it "
                             "(orchestrator.background.retain_freed_memory)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    args = parser.parse_args(argv)
    retained = False if args.return_freed_memory else retain_freed_memory() is not None
    mixtures = ({"custom": tuple(parse_trace_spec(s) for s in args.trace)} if args.trace
                else {name: MIXTURES[name] for name in args.mixtures})
    print("\n".join(_title(args.probes)), flush=True)  # the table, a row as each configuration is done
    try:
        result = run(args.dp, args.per_rank, args.gpus_per_node, args.seeds, mixtures, args.model,
                     args.micro_batch_size, args.repeats, args.probes, args.traces_dir,
                     log=lambda line: print(line, flush=True),
                     switch_interval_s=1e-3 * args.switch_interval_ms if args.switch_interval_ms > 0 else None,
                     nice_increment=args.planner_nice, seq_length=args.seq_length)
    except ValueError as err:  # e.g. an example longer than the model's positions: refused, as training does
        parser.error(str(err))
    result["params"]["retain_freed_memory"] = retained
    return report(result, lambda r: "\n".join(_summary(r)), args.json)


if __name__ == "__main__":
    main()
