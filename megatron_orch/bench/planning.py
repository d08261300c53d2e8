"""Planning benchmark: the trainer's ``plan_step`` on global batches drawn from the traces, its CPU time,
and how long it stalls a training loop's Python while it runs in the background.

    python -m megatron_orch.bench.planning --dp 512 2560 --per-rank 16 --gpus-per-node 8 --seeds 0 1 2 --json out.json

For every (DP size, mixture, seed) it draws a global batch of ``dp * per_rank`` examples (DP rank r
loads the r-th consecutive block), builds the sizes the trainer gathers (:func:`step_sizes`) and calls
exactly what the trainer calls: ``plan_step(sizes, model, OrchestratorConfig(), topology, ...)`` with
the default flags (every phase, ``auto`` partitioner, ``equal_count`` micro-batches, ``exact``
placement), a uniform topology of ``--gpus-per-node`` ranks per node, ``--micro-batch-size`` examples
per micro-batch. Mixtures re-weight the shipped traces (``default``, ``audio-heavy``, ``image-heavy``,
``video-heavy``) or add a heavy tail of long examples to short ones (``heavy-tail``,
``heavy-tail-rare``: ``balance/traces.py``), or ``--trace`` gives one of your own.

Figures, per configuration:

* ``plan_cpu_ms``: CPU time of ``plan_step`` on its own (``time.process_time`` of the whole process,
  nothing else running), over ``--repeats`` runs after one untimed run; ``plan_wall_ms`` likewise;
  ``plan_sys_ms`` and ``page_faults``: the kernel's share of that CPU time, mostly page faults of
  freshly allocated arrays (``--retain-freed-memory`` keeps freed memory in the process instead).
* the stall: a main thread runs a probe loop of small Python work while :class:`BackgroundPlanner`
  plans the same step on its thread (as the trainer does while a step trains), and records the
  longest gap between two of its iterations. Two controls, side by side in the same run: the same
  loop, as long, with nothing planning (``idle``), and while the same plan runs in a forked process
  (``beside``: the same CPU contention, no shared GIL). What ``planning`` shows above ``beside`` is
  the GIL's share of the stall; the rest is the machine (preemption, a busy core). Two probes: ``sleep`` (``time.sleep(1 ms)``
  per iteration: a loop that waits on the GPU) and ``numpy`` (a tight loop of short numpy ops: a loop
  busy launching kernels). ``bg_plan_cpu_ms``/``bg_plan_wall_ms``: the background plan's thread CPU
  and wall time meanwhile. Each figure is the worst over the repeats.
* the plan digest (equal over repeats and between the foreground and background runs: deterministic).

On a small shared VM the idle loop alone sees gaps of several ms (preemption, steal time): read the
planning column against the idle one, and the median over repeats against the worst.
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import resource
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import DEFAULT_MIXTURE, HEAVY_TAILED_MIXTURES, Trace, load_mixture, parse_trace_spec
from megatron_orch.balance.workload import StepSizes
from megatron_orch.bench.common import report
from megatron_orch.mllm.config import DEFAULT_MODEL, MLLMConfig, load_model_config, sizes_from_trace
from megatron_orch.orchestrator.background import BackgroundPlanner
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import plan_step, warm_up

PROBES = ("sleep", "numpy")
TARGET_CPU_MS = 100.0   # issue 12: all phases at DP 2560 x 16 in < 100 ms CPU on one core
TARGET_STALL_MS = 5.0   # and the main thread's longest stall < 5 ms


def _reweighted(factors: Dict[str, float]) -> Tuple[Tuple[str, float], ...]:
    """The shipped mixture with the weight of every trace whose name contains a key multiplied."""
    return tuple((name, weight * next((f for key, f in factors.items() if key in name), 1.0))
                 for name, weight in DEFAULT_MIXTURE)


MIXTURES: Dict[str, Tuple[Tuple[str, float], ...]] = {
    "default": DEFAULT_MIXTURE,
    "audio-heavy": _reweighted({"asr": 4.0, "audio": 4.0, "music": 4.0}),
    "image-heavy": _reweighted({"omnibal": 4.0, "image": 4.0}),
    "video-heavy": _reweighted({"video": 4.0}),
    **HEAVY_TAILED_MIXTURES,  # short examples and a tail of long ones (balance/traces.py)
}


def retain_freed_memory() -> bool:
    """glibc only: keep freed arrays in the process (mmap threshold 64 MiB, trim threshold 256 MiB)
    instead of returning them to the OS and page-faulting them in again on the next step, as
    ``MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456`` would for a launched
    trainer. Returns whether it applied."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 64 << 20)) and bool(libc.mallopt(-1, 256 << 20))  # M_MMAP_, M_TRIM_
    except (OSError, AttributeError):
        return False


def step_sizes(rows: Trace, dp: int, per_rank: int, model: MLLMConfig) -> StepSizes:
    """The sizes the trainer gathers over the DP group for a global batch of trace rows, DP rank r
    holding rows ``[r * per_rank, (r + 1) * per_rank)``. (The one place that builds them here.)"""
    return sizes_from_trace(rows, np.full(dp, per_rank, dtype=np.int64), model)


def draw_step(trace_specs: Sequence[Tuple[str, float]], dp: int, per_rank: int, model: str, seed: int,
              traces_dir: Optional[str] = None) -> Tuple[MLLMConfig, StepSizes]:
    """A random global batch of a mixture, as the trainer sees it: (model config, sizes)."""
    config = load_model_config(model)
    rows = load_mixture(trace_specs, traces_dir).draw(dp * per_rank, seed)
    return config, step_sizes(rows, dp, per_rank, config)


# -------------------------------------------------------------------------------------------------
# The main thread's probe loops
# -------------------------------------------------------------------------------------------------

def _probe(kind: str, keep_going: Callable[[], bool]) -> np.ndarray:
    """Run the probe loop while ``keep_going()``; the times (s) between consecutive iterations."""
    stamps: List[float] = []
    clock = time.perf_counter
    if kind == "sleep":
        while keep_going():
            time.sleep(0.001)
            stamps.append(clock())
    elif kind == "numpy":
        x = np.arange(256, dtype=np.float64)
        out = np.empty_like(x)
        while keep_going():
            np.multiply(x, 1.0001, out=out)
            np.add(out, 1.0, out=out)
            float(out[7])
            stamps.append(clock())
    else:
        raise ValueError(f"unknown probe {kind!r}; choose from {PROBES}")
    return np.diff(np.asarray(stamps)) if len(stamps) > 1 else np.zeros(0)


def _gap_figures(gaps: np.ndarray) -> Dict[str, float]:
    if gaps.size == 0:
        return {"max_gap_ms": 0.0, "p99_gap_ms": 0.0, "iterations": 0}
    return {"max_gap_ms": 1e3 * float(gaps.max()), "p99_gap_ms": 1e3 * float(np.percentile(gaps, 99)),
            "iterations": int(gaps.size + 1)}


def _stall(kind: str, plan_fn: Callable[[], object]):
    """(figures with planning in the background, of the idle baseline as long, of planning in a forked
    process, plan digest)."""
    finished = threading.Event()
    cpu = [0.0]

    def timed_plan():
        start = time.thread_time()
        plan = plan_fn()
        cpu[0] = time.thread_time() - start
        finished.set()
        return plan

    planner = BackgroundPlanner(enabled=True)
    try:
        start = time.perf_counter()
        planner.submit(timed_plan)
        busy = _probe(kind, lambda: not finished.is_set())
        wall = time.perf_counter() - start
        plan = planner.result()
    finally:
        planner.shutdown()
    # Baseline: the same loop for as long (at least 50 ms), nothing planning.
    deadline = time.perf_counter() + max(wall, 0.05)
    idle = _probe(kind, lambda: time.perf_counter() < deadline)
    child = multiprocessing.get_context("fork").Process(target=plan_fn, name="orch-planner-beside")
    child.start()
    beside = _probe(kind, child.is_alive)
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"planning in a forked process failed (exit code {child.exitcode})")
    planning = dict(_gap_figures(busy), bg_plan_cpu_ms=1e3 * cpu[0], bg_plan_wall_ms=1e3 * wall)
    return planning, _gap_figures(idle), _gap_figures(beside), plan.digest


# -------------------------------------------------------------------------------------------------
# The benchmark
# -------------------------------------------------------------------------------------------------

def run_one(model: MLLMConfig, sizes: StepSizes, gpus_per_node: int, micro_batch_size: int,
            repeats: int = 3, probes: Sequence[str] = PROBES) -> dict:
    """Time ``plan_step`` on one global batch (foreground CPU/wall, background stalls)."""
    dp = int(np.asarray(sizes.counts).size)
    per_rank = int(np.asarray(sizes.counts)[0])
    if per_rank % micro_batch_size:
        raise ValueError(f"--per-rank {per_rank} is not a multiple of --micro-batch-size {micro_batch_size}")
    config = OrchestratorConfig()
    topology = Topology.uniform(dp, gpus_per_node)

    def plan():
        return plan_step(sizes, model.phases(), config, topology, micro_batch_size, per_rank // micro_batch_size)

    first = plan()  # untimed: first touches of memory at this size
    digests = {first.digest}
    cpu, wall, sys_cpu, faults = [], [], [], []
    for _ in range(repeats):
        start_usage = resource.getrusage(resource.RUSAGE_SELF)
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        digests.add(plan().digest)
        cpu.append(1e3 * (time.process_time() - start_cpu))
        wall.append(1e3 * (time.perf_counter() - start_wall))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        sys_cpu.append(1e3 * (usage.ru_stime - start_usage.ru_stime))
        faults.append(usage.ru_minflt - start_usage.ru_minflt)
    stalls = {}
    for kind in probes:
        runs = {"planning": [], "idle": [], "beside": []}
        for _ in range(repeats):
            busy, idle, beside, digest = _stall(kind, plan)
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
        "plan_cpu_ms": {"min": min(cpu), "median": statistics.median(cpu), "max": max(cpu), "all": cpu},
        "plan_wall_ms": {"min": min(wall), "median": statistics.median(wall), "max": max(wall), "all": wall},
        "plan_sys_ms": {"median": statistics.median(sys_cpu), "all": sys_cpu},  # kernel time: page faults
        "page_faults": {"median": statistics.median(faults), "all": faults},
        "stall": stalls,
        "digest": first.digest,
        "deterministic": len(digests) == 1,
    }


def run(dps: Sequence[int], per_rank: int, gpus_per_node: int, seeds: Sequence[int], mixtures: Dict[str, tuple],
        model: str = DEFAULT_MODEL, micro_batch_size: int = 1, repeats: int = 3,
        probes: Sequence[str] = PROBES, traces_dir: Optional[str] = None, log=None) -> dict:
    """Every (dp, mixture, seed); JSON-ready ``{"runs": [...], "params": {...}}``."""
    if min(dps) < 1 or per_rank < 1 or gpus_per_node < 1 or micro_batch_size < 1 or repeats < 1:
        raise ValueError("--dp, --per-rank, --gpus-per-node, --micro-batch-size and --repeats must be >= 1")
    config = load_model_config(model)
    warm_up(config.phases(), OrchestratorConfig())  # compile (or load) the kernels first, as the trainer does
    runs = []
    for dp in dps:
        for name, specs in mixtures.items():
            mixture = load_mixture(specs, traces_dir)
            for seed in seeds:
                sizes = step_sizes(mixture.draw(dp * per_rank, seed), dp, per_rank, config)
                result = dict(run_one(config, sizes, gpus_per_node, micro_batch_size, repeats, probes),
                              mixture=name, seed=seed)
                runs.append(result)
                if log is not None:
                    log(_row(result, probes))
    return {"runs": runs, "params": {
        "dp": list(dps), "per_rank": per_rank, "gpus_per_node": gpus_per_node, "seeds": list(seeds),
        "micro_batch_size": micro_batch_size, "model": config.name, "repeats": repeats,
        "mixtures": {name: [{"trace": t, "weight": w} for t, w in specs] for name, specs in mixtures.items()},
        "orchestrator_config": repr(OrchestratorConfig()),
        "targets": {"plan_cpu_ms": TARGET_CPU_MS, "max_stall_ms": TARGET_STALL_MS},
        "notes": {
            "plan_cpu_ms": "process CPU time of plan_step alone, after one untimed run",
            "stall": "longest gap between iterations of a main-thread probe loop while BackgroundPlanner "
                     "plans (planning), of the same loop with nothing planning (idle) and while the plan runs "
                     "in a forked process (beside: same CPU contention, no shared GIL), worst of the repeats",
        }}}


HEADER = (f"{'dp':>5} {'mixture':<12} {'seed':>4} {'vision':>7} {'audio':>6} {'llm':>6} "
          f"{'cpu ms':>7} {'(max)':>7} {'sys ms':>7} {'wall ms':>8}")


def _header(probes: Sequence[str]) -> str:
    return HEADER + "".join(f" {kind + ' max':>9} {'(med)':>6} {'idle':>8} {'beside':>8}" for kind in probes)


def _row(r: dict, probes: Sequence[str]) -> str:
    cells = (f"{r['dp']:>5} {r['mixture']:<12} {r['seed']:>4} {r['items']['vision']:>7} {r['items']['audio']:>6} "
             f"{r['items']['llm']:>6} {r['plan_cpu_ms']['median']:>7.1f} {r['plan_cpu_ms']['max']:>7.1f} "
             f"{r.get('plan_sys_ms', {}).get('median', float('nan')):>7.1f} {r['plan_wall_ms']['median']:>8.1f}")
    for kind in probes:
        s = r["stall"][kind]
        cells += (f" {s['planning']['max_gap_ms']:>9.2f} {s['planning']['median_max_gap_ms']:>6.2f}"
                  f" {s['idle']['max_gap_ms']:>8.2f} {s['beside']['max_gap_ms']:>8.2f}")
    return cells + ("" if r["deterministic"] else "  NOT DETERMINISTIC")


def _title(probes: Sequence[str]) -> List[str]:
    return ["plan_step CPU (median, max of repeats), its kernel (page fault) share and wall; main-thread longest "
            "gap (ms) while planning in the background (worst and median over repeats) vs idle and vs planning "
            "in a forked process (worst)", _header(probes)]


def _summary(result: dict) -> List[str]:
    """Each DP size's worst figures against the targets."""
    probes = list(result["runs"][0]["stall"]) if result["runs"] else []
    lines = []
    for dp in result["params"]["dp"]:
        mine = [r for r in result["runs"] if r["dp"] == dp]
        if not mine:
            continue
        worst_cpu = max(r["plan_cpu_ms"]["max"] for r in mine)
        worst_stall = max(r["stall"][k]["planning"]["max_gap_ms"] for r in mine for k in probes) if probes else 0.0
        lines.append(f"dp {dp}: worst plan CPU {worst_cpu:.1f} ms (target < {TARGET_CPU_MS:.0f}), worst main-thread "
                     f"gap while planning {worst_stall:.2f} ms (target < {TARGET_STALL_MS:.0f})")
    return lines


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
    parser.add_argument("--mixtures", nargs="+", choices=sorted(MIXTURES), default=list(MIXTURES),
                        help="re-weightings of the shipped traces (default: all)")
    parser.add_argument("--trace", nargs="+", metavar="CSV[:WEIGHT]",
                        help="a mixture of your own (trace CSVs with weights), run instead of --mixtures")
    parser.add_argument("--traces-dir", default=None, help="folder of the trace CSVs")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model config (default {DEFAULT_MODEL})")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (default 3)")
    parser.add_argument("--probes", nargs="+", choices=PROBES, default=list(PROBES))
    parser.add_argument("--retain-freed-memory", action="store_true",
                        help="glibc: keep freed memory in the process (mallopt), so the planner's arrays are "
                             "not page-faulted in anew every step; default: the allocator as it is")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    args = parser.parse_args(argv)
    retained = retain_freed_memory() if args.retain_freed_memory else False
    mixtures = ({"custom": tuple(parse_trace_spec(s) for s in args.trace)} if args.trace
                else {name: MIXTURES[name] for name in args.mixtures})
    print("\n".join(_title(args.probes)), flush=True)  # the table, a row as each configuration is done
    result = run(args.dp, args.per_rank, args.gpus_per_node, args.seeds, mixtures, args.model,
                 args.micro_batch_size, args.repeats, args.probes, args.traces_dir,
                 log=lambda line: print(line, flush=True))
    result["params"]["retain_freed_memory"] = retained
    return report(result, lambda r: "\n".join(_summary(r)), args.json)


if __name__ == "__main__":
    main()
