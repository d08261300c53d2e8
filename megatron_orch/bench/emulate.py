"""Emulated data parallelism on one device: every DP rank's phases timed in turn, upstream and balanced.

    python -m megatron_orch.bench.emulate --model mllm_10b --layers 12,8,4 --dp 512 --per-rank 16 \\
        --timing shape --llm-bucket 32 --repeats 2 --cost-profile h200_10b.yaml \\
        --json emulate.json --plot emulate.png                                                   # GPU
    python -m megatron_orch.bench.emulate --model tiny --dp 8 --per-rank 8 --device cpu \\
        --cost-profile tiny_cpu.yaml --json emulate.json --plot emulate.png                      # CPU

Draws a global batch of ``dp * per_rank`` examples from the traces (DP rank r loads the r-th block, as
upstream Megatron does), plans it upstream-style (``none``) and with ``plan_step`` under every method
of :data:`megatron_orch.bench.common.PLAN_METHODS` (``--methods``) and the cost profile if given (else
FLOPs), then runs, for every method and rank, that rank's work of each phase on the local device,
forward and backward, with the modules and inputs of :mod:`megatron_orch.bench.mfu`: every encoder
over the rank's items in one call, the backbone over each of the rank's examples in
turn (one sequence per call, as the cost model counts them; the trainer's micro-batches are not
emulated). There is no communication. Calls of all methods and ranks are interleaved, repeat after
repeat, so that load drifting on a shared machine hits every method alike; a rank's time is
the median over repeats. For large DP sizes ``--timing shape`` times each distinct call once (a rank's
time is then the sum of its calls') and ``--llm-bucket`` rounds backbone lengths up to fewer distinct
calls. ``--compare-flops`` (with a profile) also plans every method with FLOPs (``orch_flops``, ...),
timed in the same run, so the two costs are compared on the same measurements.

Figures per method and phase: measured and modeled (the plan's costs: profile seconds with the
per-call overhead, or FLOPs) max/mean over ranks. Per method: the step (upstream: the slowest rank's
whole step, its examples run end to end; balanced: the sum over phases of the slowest rank, since
an all-to-all separates phases), its speedup over upstream measured and modeled, and its distance to
perfect balance (step / sum over phases of the mean rank - 1).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from megatron_orch.balance.cost_profile import CostProfile, load_cost_profile, rank_seconds
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes, phase_items
from megatron_orch.bench import mfu
from megatron_orch.bench.calibrate import device_settings
from megatron_orch.bench.common import (PLAN_METHODS, add_trace_args, draw_sizes, effective_layers, model_phases,
                                        parse_layers, plan_method, report, trace_specs, with_layers)
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import StepPlan

EMULATED_METHODS = ("none",) + tuple(PLAN_METHODS)
FLOPS = "_flops"  # suffix of the methods planned (and modeled) with FLOPs under --compare-flops


def plan_all(sizes: StepSizes, model, costs: Dict[str, Optional[CostProfile]], gpus_per_node: int,
             methods=tuple(PLAN_METHODS)) -> Dict[str, StepPlan]:
    """Plans of upstream and ``methods`` under each cost (``costs``: name suffix -> profile, None = FLOPs)."""
    topology = Topology.uniform(int(np.asarray(sizes.counts).size), gpus_per_node)
    return {m + suffix: plan_method(m, sizes, model, topology, profile)
            for suffix, profile in costs.items() for m in ("none",) + tuple(methods)}


def _suffix(name: str) -> str:
    return FLOPS if name.endswith(FLOPS) else ""


def item_ranks(plan: StepPlan, phase: str) -> np.ndarray:
    return plan.encoders[phase].encode.rank if phase in plan.encoders else plan.examples_backbone.rank


def rank_shapes(encoder: bool, items: PhaseItems, rank: np.ndarray, dp: int, llm_bucket: int,
                max_tokens: int) -> List[list]:
    """The calls of every rank's work of one phase, by size: ``[n]`` items of an encoder in one call (none
    for a rank without items), ``(1, s)`` per backbone example with s rounded up to ``llm_bucket`` and
    cut at ``max_tokens`` (the position table: longer examples are reported, see :func:`main`)."""
    shapes = []
    for r in range(dp):
        mine = np.flatnonzero(rank == r)
        if encoder:
            shapes.append([int(mine.size)] if mine.size else [])
        else:
            bucketed = np.minimum(-(-items.tokens[mine] // llm_bucket) * llm_bucket, max_tokens)
            shapes.append([(1, int(s)) for s in bucketed])
    return shapes


def time_interleaved(calls: Dict[object, list], make_call: Callable[[object], Callable[[], None]],
                     device: torch.device, warmup: int, repeats: int) -> Dict[object, float]:
    """Median seconds of every key's calls run in turn, keys interleaved within each repeat.

    ``make_call(size)`` builds one call with its inputs, outside the timed region, right before the
    key runs: only one key's inputs are alive at a time (hundreds of encoder batches would not fit a
    GPU together).
    """
    cuda = device.type == "cuda"
    times = {key: [] for key in calls}
    for repeat in range(warmup + repeats):
        for key, sizes in calls.items():
            steps = [make_call(size) for size in sizes]
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for step in steps:
                step()
            if cuda:
                torch.cuda.synchronize(device)
            if repeat >= warmup:
                times[key].append(time.perf_counter() - start)
            del steps
    return {key: statistics.median(t) for key, t in times.items()}


def measure(plans: Dict[str, StepPlan], items: Dict[str, PhaseItems], config, device, settings, warmup: int,
            repeats: int, timing: str, llm_bucket: int) -> Dict[str, Dict[str, np.ndarray]]:
    """Measured seconds of every method's phases on every rank: ``[method][phase][rank]``.

    ``timing="rank"``: each rank's work is one timed run of its calls in turn. ``"shape"``: each distinct
    call is timed once and a rank's time is the sum of its calls' (for DP sizes where running every
    rank would take too long; calls of one rank do not overlap either way).
    """
    dp = plans["none"].examples_home.num_ranks
    timed_plans = {m: plan for m, plan in plans.items() if m != "none" + FLOPS}  # upstream is upstream
    measured = {m: {} for m in timed_plans}
    for phase in config.phases().names:
        module = mfu.build_phase(phase, config, settings, device)
        shapes = {(m, r): calls for m, plan in timed_plans.items() for r, calls in enumerate(rank_shapes(
            phase in config.encoders, items[phase], item_ranks(plan, phase), dp, llm_bucket, config.backbone.max_position_embeddings))}
        make_call = functools.partial(mfu.phase_call, phase, module, config, device=device)  # (size)
        if timing == "shape":
            distinct = sorted({size for calls in shapes.values() for size in calls}, key=str)
            table = time_interleaved({size: [size] for size in distinct}, make_call, device, warmup, repeats)
            seconds = {key: sum(table[size] for size in calls) for key, calls in shapes.items()}
            timed = f"{len(distinct)} distinct calls"
        else:
            runs = {key: calls for key, calls in shapes.items() if calls}
            seconds = time_interleaved(runs, make_call, device, warmup, repeats)
            timed = f"{len(runs)} rank runs"
        for m in timed_plans:
            measured[m][phase] = np.array([seconds.get((m, r), 0.0) for r in range(dp)])
        print(f"[emulate] phase {phase}: {timed} timed", file=sys.stderr, flush=True)
        del module, make_call  # the next phase's module is built without this one
    if "none" + FLOPS in plans:
        measured["none" + FLOPS] = measured["none"]
    return measured


def modeled(plans: Dict[str, StepPlan], items: Dict[str, Dict[str, PhaseItems]],
            costs: Dict[str, Optional[CostProfile]]) -> Dict[str, Dict[str, np.ndarray]]:
    """Each plan's own costs per rank: profile seconds (with per-call overhead) or FLOPs."""
    dp = plans["none"].examples_home.num_ranks
    out = {}
    for m, plan in plans.items():
        profile, own = costs[_suffix(m)], items[_suffix(m)]
        out[m] = {}
        for phase in own:
            rank = item_ranks(plan, phase)
            out[m][phase] = (np.bincount(rank, weights=own[phase].cost, minlength=dp) if profile is None
                             else rank_seconds(profile.phases[phase], own[phase].cost, rank, dp))
    return out


def step_figures(loads: Dict[str, Dict[str, np.ndarray]]) -> Dict[str, dict]:
    """Per method: step (upstream end to end, balanced sum of phase maxima), speedup, distance to perfect."""
    out = {}
    for m, phases in loads.items():
        upstream = m == "none" + _suffix(m)
        step = float(sum(phases.values()).max()) if upstream else float(sum(v.max() for v in phases.values()))
        perfect = float(sum(v.mean() for v in phases.values()))
        out[m] = {"step": step, "over_perfect_balance": step / perfect - 1.0 if perfect > 0 else 0.0,
                  "max_over_mean": {p: float(v.max() / v.mean()) if v.mean() > 0 else 1.0 for p, v in phases.items()}}
    for m in out:
        out[m]["speedup"] = out["none" + _suffix(m)]["step"] / out[m]["step"]
    return out


def run(config, sizes: StepSizes, profile: Optional[CostProfile], device, settings, gpus_per_node: int,
        warmup: int, repeats: int, timing: str = "rank", llm_bucket: int = 1,
        methods=tuple(PLAN_METHODS), compare_flops: bool = False) -> dict:
    costs = {"": profile, **({FLOPS: None} if compare_flops else {})}
    plans = plan_all(sizes, config, costs, gpus_per_node, methods)
    items = {suffix: phase_items(sizes, model_phases(config, cost)) for suffix, cost in costs.items()}
    with mfu.world_of_one(device):
        measured = measure(plans, items[""], config, device, settings, warmup, repeats, timing, llm_bucket)
    model = modeled(plans, items, costs)
    steps_measured, steps_modeled = step_figures(measured), step_figures(model)
    result = {"methods": {}}
    for m in plans:
        result["methods"][m] = {
            "phases": {p: {"measured_seconds": measured[m][p].tolist(), "modeled": model[m][p].tolist(),
                           "measured_max_over_mean": steps_measured[m]["max_over_mean"][p],
                           "modeled_max_over_mean": steps_modeled[m]["max_over_mean"][p],
                           "items_per_rank": np.bincount(item_ranks(plans[m], p), minlength=len(
                               measured[m][p])).tolist()}
                       for p in config.phases().names},
            "step": {"measured_seconds": steps_measured[m]["step"], "modeled": steps_modeled[m]["step"],
                     "measured_speedup": steps_measured[m]["speedup"], "modeled_speedup": steps_modeled[m]["speedup"],
                     "speedup_prediction_error": steps_modeled[m]["speedup"] / steps_measured[m]["speedup"] - 1.0,
                     "measured_over_perfect_balance": steps_measured[m]["over_perfect_balance"],
                     "modeled_over_perfect_balance": steps_modeled[m]["over_perfect_balance"]},
        }
    return result


def _phases(result: dict) -> List[str]:
    return list(result["methods"]["none"]["phases"])


def format_tables(result: dict) -> str:
    p, phases = result["params"], _phases(result)
    lines = [f"[emulate] {p['model']} layers {tuple(p['layers'])} on {p['device']} ({p['dtype']}), DP {p['dp']} x "
             f"{p['per_rank']} examples, seed {p['seed']}, costs: {p['costs']}, median of {p['repeats']}", "",
             "| method | " + " | ".join(f"{q} max/mean modeled / measured" for q in phases)
             + " | step s measured | speedup modeled / measured | over perfect balance modeled / measured |",
             "|---|" + "---:|" * (len(phases) + 3)]
    for m, f in result["methods"].items():
        cells = [f"{f['phases'][q]['modeled_max_over_mean']:.3f} / {f['phases'][q]['measured_max_over_mean']:.3f}"
                 for q in phases]
        s = f["step"]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {s['measured_seconds']:.4f} | "
                     f"{s['modeled_speedup']:.3f} / {s['measured_speedup']:.3f} | "
                     f"{100 * s['modeled_over_perfect_balance']:.1f}% / "
                     f"{100 * s['measured_over_perfect_balance']:.1f}% |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods, phases = list(result["methods"]), _phases(result)
    hatches = ("", "//", "..", "xx", "\\\\", "--")  # besides colour, for grey prints and colour blindness
    fig, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 3.8))
    for ax, phase in zip(axes, phases):
        dp = len(result["methods"]["none"]["phases"][phase]["measured_seconds"])
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            seconds = np.array(result["methods"][m]["phases"][phase]["measured_seconds"]) * 1e3
            ax.bar(np.arange(dp) + (i - (len(methods) - 1) / 2) * width, seconds, width, label=m,
                   hatch=hatches[i % len(hatches)], edgecolor="white", linewidth=0)
        ax.set_xticks(np.arange(dp))
        ax.set_xlabel("DP rank")
        ax.set_ylabel("measured ms (forward+backward)")
        ax.set_title(f"{phase}")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), title="method")  # beside the bars
    p = result["params"]
    fig.suptitle(f"emulated DP {p['dp']} on {p['device']}: per-rank time, upstream (none) vs balanced")
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.emulate", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B", help="cut the stacks (as bench.calibrate)")
    parser.add_argument("--dp", type=int, default=8, help="emulated DP ranks K (default 8)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per rank M (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="for locality and placement (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    add_trace_args(parser)
    parser.add_argument("--cost-profile", default=None, metavar="PROFILE.yaml",
                        help="plan and model with this profile's costs (default: FLOPs)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 on CPU)")
    parser.add_argument("--methods", default=",".join(PLAN_METHODS),
                        help=f"balancing methods to emulate besides upstream (default {','.join(PLAN_METHODS)})")
    parser.add_argument("--compare-flops", action="store_true",
                        help="with --cost-profile: also plan every method with FLOPs (methods *_flops), timed in "
                             "the same run")
    parser.add_argument("--timing", choices=["rank", "shape"], default="rank",
                        help="rank: time each rank's work as one run; shape: time each distinct call once and sum "
                             "(large DP)")
    parser.add_argument("--llm-bucket", type=int, default=1, metavar="TOKENS",
                        help="round backbone lengths up to a multiple of this (fewer distinct calls; default 1)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--plot", default=None, metavar="OUT.png")
    args = parser.parse_args(argv)
    layers = parse_layers(parser, args.layers)
    if min(args.dp, args.per_rank, args.gpus_per_node, args.repeats, args.llm_bucket) < 1 or args.warmup < 0:
        parser.error("--dp, --per-rank, --gpus-per-node, --repeats and --llm-bucket must be >= 1, --warmup >= 0")
    if args.compare_flops and args.cost_profile is None:
        parser.error("--compare-flops needs --cost-profile (FLOPs are the default costs)")
    methods = tuple(m for m in args.methods.split(",") if m)
    if not methods or not set(methods) <= set(PLAN_METHODS):
        parser.error(f"--methods takes a comma-separated subset of {','.join(PLAN_METHODS)}, got {args.methods!r}")
    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else None)
    try:
        device, settings, device_name = device_settings(args.device, threads)
        _, _, sizes = draw_sizes(trace_specs(args), args.dp, args.per_rank, args.model, args.seed, args.traces_dir,
                                 args.seq_length)
        config = with_layers(load_model_config(args.model), layers)
        profile = None if args.cost_profile is None else load_cost_profile(args.cost_profile, config.phases())
    except ValueError as err:
        parser.error(str(err))
    result = run(config, sizes, profile, device, settings, args.gpus_per_node, args.warmup, args.repeats,
                 args.timing, args.llm_bucket, methods, args.compare_flops)
    result["params"] = {
        "model": config.name, "layers": effective_layers(config), "device": device_name,
        "dtype": "bf16" if settings.bf16 else "fp32", "dp": args.dp, "per_rank": args.per_rank,
        "gpus_per_node": args.gpus_per_node, "seed": args.seed, "warmup": args.warmup, "repeats": args.repeats,
        "timing": args.timing, "llm_bucket": args.llm_bucket,
        "llm_examples_cut_at_max_positions": int((sizes.num_tokens > config.backbone.max_position_embeddings).sum()),
        "traces": [list(spec) for spec in trace_specs(args)],
        "costs": (f"profile {args.cost_profile} ({profile.device})" if profile else "training FLOPs")
        + ("; methods *_flops: training FLOPs" if args.compare_flops else ""),
        "notes": "backbone examples timed one per call (lengths rounded up to llm_bucket); no communication; "
                 "balanced step = sum over phases of the slowest rank, upstream = slowest rank's whole step"}
    if result["params"]["llm_examples_cut_at_max_positions"]:
        print(f"[emulate] {result['params']['llm_examples_cut_at_max_positions']} backbone example(s) longer than "
              f"the model's {config.backbone.max_position_embeddings} positions were timed at that length",
              flush=True)
    return report(result, format_tables, args.json, plot, args.plot)


if __name__ == "__main__":
    main()
