"""python -m megatron_orch.sim: simulated step time and speedup vs upstream of every method, per DP size.

    python -m megatron_orch.sim --model mllm_10b --dp 64,512,2560 --json sim.json --plot sim.png
    python -m megatron_orch.sim --model tiny --dp 8,64 --profile tiny_cpu.yaml --per-rank 8

The model and its assumptions: :mod:`megatron_orch.sim.cluster`. It also checks the direction of
published results (per-phase balancing >= backbone-only at every DP, speedup growing with DP,
locality winning when inter-node bandwidth is scarce) and prints the figures each one rests on (the
JSON's ``checks`` also say whether the direction held).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import List, Optional

from megatron_orch.balance.cost_profile import load_cost_profile
from megatron_orch.balance.step_model import ENCODER_RANKS
from megatron_orch.balance.comm_memory import CommunicatorMemory
from megatron_orch.bench.balance import peer_table
from megatron_orch.bench.common import (DEFAULT_METHOD, add_trace_args, draw_sizes, effective_layers, model_phases,
                                        parse_layers, peers_over_steps, plan_method, report, trace_specs, with_layers)
from megatron_orch.mllm.config import load_model_config
from megatron_orch.sim.cluster import (DEFAULT_TFLOPS, PEAK_TFLOPS, SIM_METHODS, LinkModel, StepModel,
                                       model_state_bytes, simulate_step, topology_of, warm_up_planner)

PER_PHASE = ("orch", "equal_count", "locality", "equal_locality")
# each locality-aware method and its plain counterpart (equal-count micro-batches can be slower than packed ones
# by their own bound: equal_locality against orch is reported beside)
LOCALITY_PAIRS = (("locality", "orch"), ("equal_locality", "equal_count"))
# Published step speedups over Megatron-LM, set beside the paper configuration's simulated one.
PUBLISHED = (("OrchMLLM (arXiv 2503.23830)", "84B MLLM, three modalities, 2560 H100 GPUs", 3.1, "41.6%"),
             ("DistTrain (arXiv 2408.04275)", "72B multimodal LLM, 1172 GPUs", 2.2, ""))
AUTO = "auto"
PAPER = {"model": "mllm_84b", "dp": "80", "tensor_parallel": 8, "pipeline_stages": 4, "per_rank": 16}


def _numbers(parser, text: str, kind, what: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        parser.error(f"{what} takes a comma-separated list of positive numbers, got {text!r}")
    return values


def mean_over_runs(runs: List[dict]):
    """The figures of several simulated batches, averaged leaf by leaf (text: the distinct values, joined)."""
    if isinstance(runs[0], dict):
        return {key: mean_over_runs([run[key] for run in runs]) for key in runs[0]}
    if isinstance(runs[0], str):
        return " | ".join(dict.fromkeys(runs))
    return sum(runs) / len(runs)


def checks(result: dict) -> dict:
    """The direction of published results, and that locality-aware plans are never slower than their plain
    counterparts, each with the figures it rests on."""
    dps = sorted(result["dp"], key=int)
    speedups = {dp: {m: result["dp"][dp][m]["speedup"] for m in SIM_METHODS} for dp in dps}
    per_phase = {dp: max(speedups[dp][m] for m in PER_PHASE) for dp in dps}
    orch = [speedups[dp]["orch"] for dp in dps]
    slower, equal_vs_orch = [], []  # (dp, seed, NIC Gb/s, method, its step, the other's): every batch, bandwidth
    for dp in dps:
        for seed, run in zip(result["params"]["seeds"], result["per_seed"][dp]):
            for gbits, steps in run["nic_sweep"].items():
                for near, plain in LOCALITY_PAIRS:
                    if steps[near] > steps[plain] * (1 + 1e-9):
                        slower.append([dp, seed, float(gbits), near, steps[near], steps[plain]])
                if steps["equal_locality"] > steps["orch"] * (1 + 1e-9):
                    equal_vs_orch.append([dp, seed, float(gbits), "equal_locality", steps["equal_locality"],
                                          steps["orch"]])
    lowest = min((float(g) for g in result["dp"][dps[0]]["nic_sweep"]), default=None)
    scarce = {dp: result["dp"][dp]["nic_sweep"][str(lowest)] for dp in dps} if lowest is not None else {}
    behind = [[dp, seed, run["orch"]["step_seconds"], run["orch"]["sum_balanced_step_seconds"]]
              for dp in dps for seed, run in zip(result["params"]["seeds"], result["per_seed"][dp])
              if "sum_balanced_step_seconds" in run["orch"]
              and run["orch"]["step_seconds"] > run["orch"]["sum_balanced_step_seconds"] * (1 + 1e-9)]
    pipelined = any("sum_balanced_step_seconds" in run["orch"] for dp in dps for run in result["per_seed"][dp])
    return {
        "pipeline_aware_never_slower": {
            "held": not behind, "pipelined": pipelined, "slower": behind,
            "orch_step_seconds": {dp: result["dp"][dp]["orch"]["step_seconds"] for dp in dps},
            "sum_balanced_step_seconds": {dp: result["dp"][dp]["orch"].get("sum_balanced_step_seconds") for dp in dps}},
        "per_phase_at_least_backbone_only": {
            "held": all(per_phase[dp] >= speedups[dp]["backbone_only"] for dp in dps),
            "best_per_phase_speedup": per_phase,
            "backbone_only_speedup": {dp: speedups[dp]["backbone_only"] for dp in dps}},
        "speedup_grows_with_dp": {"held": all(b >= a for a, b in zip(orch, orch[1:])),
                                  "orch_speedup": dict(zip(dps, orch))},
        "locality_never_slower": {
            "held": not slower, "slower": slower, "pairs": [list(p) for p in LOCALITY_PAIRS],
            "equal_locality_slower_than_orch": equal_vs_orch,
            "nic_gbits_per_s": lowest, "step_seconds": scarce},
    }


def format_tables(result: dict) -> str:
    p = result["params"]
    link, layout = p["link"], p["step_model"]
    first = result["dp"][sorted(result["dp"], key=int)[0]]
    phases = list(first[SIM_METHODS[0]]["phase_seconds"])
    lines = [f"[sim] model {p['model']} (layers {tuple(p['layers'])}), {p['per_rank']} examples per DP rank, "
             f"mean over seeds {p['seeds']}, costs: {p['costs']}; a DP rank is TP {layout['tensor_parallel']} x PP "
             f"{layout['pipeline_stages']} (virtual {layout['virtual_stages']}) GPUs, the balanced methods' encoders "
             f"on {_encoder_layout(p)}; links: {link['gpus_per_node']} "
             f"GPUs/node, NVLink {link['nvlink_gbytes_per_s']:g} GB/s, NIC {link['nic_gbits_per_s']:g} Gb/s per GPU; "
             f"transfers {'overlapped as the schedule overlaps them' if layout['overlap'] else 'all exposed'}"
             + (", FSDP" if layout["fsdp"] else ""), "",
             "| DP | GPUs | method | " + " | ".join(f"{q} s" for q in phases) + " | compute s | exposed comm s | "
             "bubble s | grad reduce s | step s | speedup | MFU | " + " / ".join(phases) + " speedup |",
             "|---:|---:|---|" + "---:|" * len(phases) + "---:|---:|---:|---:|---:|---:|---:|---|"]
    for dp in sorted(result["dp"], key=int):
        for m in SIM_METHODS:
            f = result["dp"][dp][m]
            ph = f["phase_seconds"]
            lines.append(f"| {dp} | {f['gpus']:g} | {m} | "
                         + " | ".join(f"{ph[q]:.4g}" for q in phases) + " | "
                         f"{f['compute_seconds']:.4g} | {f['exposed_comm_seconds']:.3g} | "
                         f"{f['pipeline_bubble_seconds']:.3g} | {f['grad_reduce_seconds']:.3g} | "
                         f"{f['step_seconds']:.4g} | {f['speedup']:.3f} | {100 * f['mfu']:.1f}% | "
                         + " / ".join(f"{f['phase_speedup'][q]:.2f}" for q in phases) + " |")
    lines += ["", "flat vs node-wise all-to-all (--orch-all-to-all): step s, and the busiest rank's peers in one "
              "step (on its node + across nodes)", "",
              "| DP | method | flat step s | node-wise step s | node-wise/flat | flat peers | node-wise peers |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for dp in sorted(result["dp"], key=int):
        for m in PER_PHASE:
            f = result["dp"][dp][m]
            flat, node_wise = f["peers"]["flat"], f["peers"]["node-wise"]
            lines.append(f"| {dp} | {m} | {f['step_seconds']:.4g} | {f['node_wise_step_seconds']:.4g} | "
                         f"{f['node_wise_step_seconds'] / f['step_seconds']:.4f} | {flat['all']:.0f} "
                         f"({flat['node']:.0f}+{flat['net']:.0f}) | {node_wise['all']:.0f} "
                         f"({node_wise['node']:.0f}+{node_wise['net']:.0f}) |")
    peers = {f"{dp}, {DEFAULT_METHOD}": figures for dp, figures in result["peers"].items()}
    lines += ["", *peer_table(peers, "DP, method")]
    sweep = [g for g in result["dp"][sorted(result["dp"], key=int)[0]]["nic_sweep"]]
    if sweep:
        lines += ["", "step s of orch / locality (equal_count / equal_locality) at NIC Gb/s per GPU:", "",
                  "| DP | " + " | ".join(f"{g} Gb/s" for g in sweep) + " |", "|---:|" + "---:|" * len(sweep)]
        for dp in sorted(result["dp"], key=int):
            s = result["dp"][dp]["nic_sweep"]
            lines.append(f"| {dp} | " + " | ".join(
                f"{s[g]['orch']:.4g} / {s[g]['locality']:.4g} "
                f"({s[g]['equal_count']:.4g} / {s[g]['equal_locality']:.4g})" for g in sweep) + " |")
    if p.get("paper"):
        lines += ["", "paper configuration, step speedup over upstream Megatron and MFU (modeled here: training FLOPs "
                  f"over step x GPUs x {p['peak_tflops']:g} TFLOP/s):", "",
                  "| system | configuration | step speedup | MFU |", "|---|---|---:|---:|"]
        for dp in sorted(result["dp"], key=int):
            gpus = p["gpus"][dp] if dp in p["gpus"] else p["gpus"][int(dp)]
            orch = result["dp"][dp]["orch"]
            own = f" + {orch['gpus'] - gpus:g} encoder GPUs" if orch["gpus"] > gpus else ""
            lines.append(f"| this simulator, orch (defaults), encoders on {_encoder_layout(p, dp)} | {p['model']}, "
                         f"{gpus} GPUs (DP {dp} x TP {layout['tensor_parallel']} x PP {layout['pipeline_stages']})"
                         f"{own} | {orch['speedup']:.2f}x | {100 * orch['mfu']:.1f}% |")
            lines.append(f"| this simulator, the bound of any per-phase plan (compute alone, "
                         f"`step_lower_bound`) | same | {result['dp'][dp]['none']['speedup_bound']:.2f}x | |")
        lines += [f"| {name} (published) | {what} | {speedup:.1f}x | {mfu} |"
                  for name, what, speedup, mfu in p["published"]]
        for dp, state in p["model_state_gib"].items():
            lines.append(f"\nmodel state per GPU at DP {dp} (bf16 parameters, fp32 gradients, distributed Adam; no "
                         f"activations): first stage {state['first_stage']:.1f} GiB, other stages "
                         f"{state['other_stages']:.1f} GiB"
                         + (f", encoder GPUs {state['encoder_gpus']:.1f} GiB" if "encoder_gpus" in state else ""))
            lines.append(step_shares(result["dp"][str(dp)]["orch"]))
    return "\n".join(lines + [""] + findings(result["checks"]))


def _encoder_layout(params: dict, dp=None) -> str:
    """Where the balanced methods' encoders run (at ``dp``: the encoder GPUs chosen there)."""
    layout = params["step_model"]
    etp = layout["encoder_tensor_parallel"] or layout["tensor_parallel"]
    if params.get("encoder_gpus"):
        count = params["encoder_gpus"] if params["encoder_gpus"] != AUTO else (
            "the best count of" if dp is None else params["chosen"][str(dp)])
        return f"{count} GPUs of their own (encoder TP {etp}, overlapping the backbone)"
    if layout["encoder_ranks"] == "first-stage":
        return "the first pipeline stage"
    return f"every GPU (encoder TP {etp})"


def step_shares(figures: dict) -> str:
    """What share of the defaults' step is what (the parts of :meth:`StepModel.step`)."""
    parts, step = figures["parts"], figures["step_seconds"]
    if "encoder_gpus_seconds" in parts:
        return (f"orch's step {step:.3f} s: the encoder GPUs busy {parts['encoder_gpus_seconds']:.3f} s "
                f"({100 * parts['encoder_gpus_seconds'] / step:.0f}%), the replicas "
                f"{parts['backbone_gpus_seconds']:.3f} s "
                f"({100 * parts['backbone_gpus_seconds'] / step:.0f}%: backbone {parts['backbone']:.3f} s, of which "
                f"pipeline bubble {parts['pipeline_bubble']:.3f} s), embeddings and their gradients "
                f"{parts['exposed_moves']:.3f} s ({100 * parts['exposed_moves'] / step:.0f}%)")
    encoders = parts["encoders_forward"] + parts["encoders_backward"]
    backbone = parts["backbone"] - parts["pipeline_bubble"]
    return (f"orch's step {step:.3f} s: encoders {100 * encoders / step:.0f}% (forward and backward with their "
            f"exposed transfers), backbone {100 * backbone / step:.0f}%, pipeline bubble "
            f"{100 * parts['pipeline_bubble'] / step:.0f}%, gradient reduction "
            f"{100 * parts['grad_reduce'] / step:.0f}%, "
            f"raw inputs and text {100 * parts['exposed_prefetch'] / step:.0f}%")


def _change(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f}%"


def findings(checks: dict) -> List[str]:
    """The checks as what the figures show, beside the direction published results report."""
    c = checks["per_phase_at_least_backbone_only"]
    best, verl = c["best_per_phase_speedup"], c["backbone_only_speedup"]
    lines = ["[sim] step speedup over upstream, best per-phase method vs backbone-only (verl-style KK), published: "
             "per-phase >= backbone-only: " + ", ".join(f"DP {dp} {best[dp]:.4g} vs {verl[dp]:.4g} "
                                                        f"({_change(best[dp], verl[dp])})" for dp in best)]
    orch = checks["speedup_grows_with_dp"]["orch_speedup"]
    dps = list(orch)
    lines.append("[sim] step speedup of orch by DP size, published: grows with DP: " + ", ".join(
        f"DP {dp} {orch[dp]:.4g}" + (f" ({_change(orch[dp], orch[dps[i - 1]])})" if i else "")
        for i, dp in enumerate(dps)))
    c = checks["pipeline_aware_never_slower"]
    if c["pipelined"]:
        lines.append("[sim] orch's pipeline-aware backbone vs the same defaults planned by sums, both through the "
                     "exact schedule: " + ", ".join(
                         f"DP {dp} {c['orch_step_seconds'][dp]:.4g} s vs {c['sum_balanced_step_seconds'][dp]:.4g} s"
                         for dp in c["orch_step_seconds"])
                     + ("; never slower on any batch" if c["held"] else f"; slower on {len(c['slower'])} batches"))
    c = checks["locality_never_slower"]
    scarce = ", ".join(f"DP {dp} {s['locality']:.4g} vs {s['orch']:.4g} ({_change(s['locality'], s['orch'])})"
                       for dp, s in c["step_seconds"].items())
    lines.append(f"[sim] step s of locality vs orch at the lowest NIC bandwidth swept ({c['nic_gbits_per_s']:g} Gb/s "
                 f"per GPU): {scarce}")
    worse = "; ".join(f"DP {dp} seed {seed} at {g:g} Gb/s: {near} {a:.4g} s vs {b:.4g} s"
                      for dp, seed, g, near, a, b in c["slower"][:6])
    lines.append("[sim] locality-aware plans vs their plain counterparts (" + ", ".join(
        f"{near} vs {plain}" for near, plain in c["pairs"]) + ") on every batch and swept bandwidth: " +
        ("never slower" if not c["slower"] else f"slower in {len(c['slower'])} cases: {worse}"))
    lines.append(f"[sim] equal_locality vs orch: slower in {len(c['equal_locality_slower_than_orch'])} of the batch "
                 "x bandwidth cases (equal-count micro-batches: a long example can lift their bound above a packed "
                 "plan's)")
    return lines


MARKERS = ("o", "s", "^", "v", "D", "X", "P")
LINESTYLES = ("-", "--", "-.", ":")


def _plain_log_axis(axis, values) -> None:
    """A log axis with ticks at ``values``, labelled as plain numbers (not 2x10^1)."""
    from matplotlib.ticker import FixedLocator, NullLocator, FuncFormatter
    axis.set_major_locator(FixedLocator(values))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(NullLocator())


def plot(result: dict, path: str) -> None:
    """Left: each balancing method's step speedup over upstream by DP size (methods offset sideways, each its
    own marker and line, so that equal values stay visible); right: locality's step over orch's by inter-node
    bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dps = sorted(result["dp"], key=int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.4))
    methods = [m for m in SIM_METHODS if m != "none"]  # upstream is 1 by definition: the axis spans the others
    for i, m in enumerate(methods):
        offset = 1 + 0.05 * (i - (len(methods) - 1) / 2)  # multiplicative: the x axis is logarithmic
        left.plot([int(d) * offset for d in dps], [result["dp"][d][m]["speedup"] for d in dps],
                  marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)], label=m)
    left.set_xscale("log")
    _plain_log_axis(left.xaxis, [int(d) for d in dps])
    left.set_xlabel("DP size (GPUs; methods drawn side by side)")
    left.set_ylabel("step speedup vs upstream (none = 1)")
    left.set_title(f"{result['params']['model']}: simulated step speedup")
    left.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), title="method")
    gbits = []
    for i, d in enumerate(dps):
        sweep = result["dp"][d]["nic_sweep"]
        gbits = sorted(sweep, key=float)
        right.plot([float(g) for g in gbits], [sweep[g]["locality"] / sweep[g]["orch"] for g in gbits],
                   marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)], label=f"DP {d}")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set_xscale("log")
    if gbits:
        _plain_log_axis(right.xaxis, [float(g) for g in gbits])
    right.set_xlabel("inter-node bandwidth per GPU (Gb/s)")
    right.set_ylabel("step(locality) / step(orch)")
    right.set_title("below 1: locality is faster")
    right.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def step_model_of(model, link: LinkModel, args: argparse.Namespace) -> StepModel:
    """The simulated cluster's step model: the layout flags, and the bf16 gradients one GPU reduces (the
    backbone's over its tensor- and pipeline-parallel GPUs, the encoders' over the first stage's TP group)."""
    params = model.num_parameters()
    encoders = sum(params[name] for name in model.encoders)
    tp, pp = args.tensor_parallel, args.pipeline_stages
    etp = args.encoder_tensor_parallel or tp  # the encoders' share of a GPU: their parameters over their TP
    encoder_grads = 0.0 if args.no_grad_reduce else 2.0 * encoders / etp
    grads = 0.0 if args.no_grad_reduce else 2.0 * params[model.phases().backbone.name] / (tp * pp) + encoder_grads
    return StepModel(link=link, tflops=args.tflops, tensor_parallel=tp, pipeline_stages=pp,
                     virtual_stages=args.virtual_stages, grad_bytes=grads, encoder_grad_bytes=encoder_grads,
                     fsdp=args.fsdp, overlap=not args.no_overlap, encoder_ranks=args.encoder_ranks,
                     encoder_tensor_parallel=args.encoder_tensor_parallel,
                     encoder_gpus=0 if args.encoder_gpus == AUTO else args.encoder_gpus)


def encoder_gpu_choices(cluster: StepModel, dp: int) -> List[int]:
    """The encoder-GPU counts ``--encoder-gpus auto`` chooses from: whole nodes, from one up to as many GPUs as
    the replicas hold."""
    node = cluster.link.gpus_per_node
    return list(range(node, dp * cluster.tensor_parallel * cluster.pipeline_stages + 1, node))


def _encoder_gpus(text: str):
    if text == AUTO:
        return text
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"takes a number of GPUs >= 0 or {AUTO!r}, got {text!r}")
    return count


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.sim", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B",
                        help="cut the stacks as bench.calibrate did (a profile fits its measured shape only)")
    parser.add_argument("--dp", default="64,512,2560", help="comma-separated DP sizes (default 64,512,2560)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank (default 16)")
    parser.add_argument("--seeds", default="0,1,2",
                        help="global batches drawn per DP size (default 0,1,2); tables show their mean")
    add_trace_args(parser)
    parser.add_argument("--profile", default=None, metavar="PROFILE.yaml",
                        help="item costs in seconds from bench.calibrate (default: FLOPs at --tflops)")
    parser.add_argument("--tflops", type=float, default=DEFAULT_TFLOPS,
                        help=f"assumed achieved TFLOP/s per GPU without a profile (default {DEFAULT_TFLOPS:g})")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS,
                        help=f"peak TFLOP/s per GPU that modeled MFU divides by (default {PEAK_TFLOPS:g}: dense bf16 "
                             "of one H100 or H200)")
    defaults = LinkModel()
    parser.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    parser.add_argument("--nvlink-gbytes-per-s", type=float, default=defaults.nvlink_gbytes_per_s,
                        help="NVLink bandwidth per GPU and direction, GB/s (default: NVLink 4)")
    parser.add_argument("--nic-gbits-per-s", type=float, default=defaults.nic_gbits_per_s,
                        help="inter-node bandwidth per GPU, Gb/s (default: one 400 Gb/s NIC per GPU)")
    parser.add_argument("--nvlink-latency-us", type=float, default=defaults.nvlink_latency_us)
    parser.add_argument("--nic-latency-us", type=float, default=defaults.nic_latency_us)
    parser.add_argument("--nic-sweep", default="400,100,25,10,5,1",
                        help="NIC Gb/s per GPU at which every method is also simulated (locality vs plain)")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs of a replica's tensor-parallel group")
    parser.add_argument("--pipeline-stages", type=int, default=1, help="pipeline stages of a replica (1F1B)")
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per stage (interleaved 1F1B)")
    parser.add_argument("--encoder-ranks", choices=ENCODER_RANKS, default="first-stage",
                        help="where the balanced methods run the encoders: each replica's first pipeline stage "
                             "(default), or every GPU of the job, balanced over all of them (upstream keeps "
                             "Megatron's layout)")
    parser.add_argument("--encoder-tensor-parallel", type=int, default=None,
                        help="the encoders' TP size with --encoder-ranks all (default --tensor-parallel)")
    parser.add_argument("--encoder-gpus", type=_encoder_gpus, default=0, metavar="N|auto",
                        help="the balanced methods' encoders on N GPUs of their own beside the replicas' (whole "
                             "nodes; they encode the next batch while the replicas train this one); auto: the count "
                             "of whole nodes of the defaults' highest modeled MFU on the first seed's batch, then "
                             "kept for every seed; 0 (default): on the replicas' GPUs (--encoder-ranks)")
    parser.add_argument("--fsdp", action="store_true", help="parameters gathered per layer (Megatron-FSDP / FSDP2)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="every transfer and the gradient reduction exposed (no overlap with compute)")
    parser.add_argument("--no-grad-reduce", action="store_true", help="leave the gradient reduction out")
    parser.add_argument("--paper", action="store_true",
                        help="the OrchMLLM paper's configuration: mllm_84b (three modalities) on 2560 GPUs, assumed "
                             "TP 8 x PP 4 (DP 80), 16 examples per DP rank; printed beside the published speedups")
    parser.add_argument("--peer-steps", type=int, default=100,
                        help="steps the defaults' (orch) peers are counted over at each DP (cumulative: what the "
                             "communicator keeps connected), batches of seeds first seed, + 1, ... (default 100)")
    parser.add_argument("--json", default=None, metavar="OUT")
    parser.add_argument("--plot", default=None, metavar="OUT.png")
    args = parser.parse_args(argv)
    if args.paper:
        for key, value in PAPER.items():
            given = getattr(args, key)
            if given != parser.get_default(key) and given != value:  # a flag of one's own: never overridden silently
                flag = "--" + key.replace("_", "-")
                parser.error(f"--paper sets {flag} {value}, got {flag} {given}: leave out --paper and give the "
                             "configuration's flags (--model, --dp, --tensor-parallel, --pipeline-stages, --per-rank)")
            setattr(args, key, value)
    dps = _numbers(parser, args.dp, int, "--dp")
    sweep = _numbers(parser, args.nic_sweep, float, "--nic-sweep")
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds.replace(",", "").isdigit() else []
    if not seeds:
        parser.error(f"--seeds takes a comma-separated list of integers >= 0, got {args.seeds!r}")
    if args.per_rank < 1 or args.peer_steps < 1 or args.tflops <= 0 or args.peak_tflops <= 0:
        parser.error("--per-rank and --peer-steps must be >= 1, --tflops and --peak-tflops > 0")
    try:
        link = LinkModel(args.gpus_per_node, args.nvlink_gbytes_per_s, args.nic_gbits_per_s,
                         args.nvlink_latency_us, args.nic_latency_us)
        model = with_layers(load_model_config(args.model), parse_layers(parser, args.layers))
        profile = None if args.profile is None else load_cost_profile(args.profile, model.phases())
        cluster = step_model_of(model, link, args)
    except ValueError as err:
        parser.error(str(err))
    warm_up_planner(model, announce=lambda line: print(f"[sim] {line}", file=sys.stderr, flush=True))
    result = {"params": {
        "model": model.name, "layers": effective_layers(model), "dp": dps, "per_rank": args.per_rank, "seeds": seeds,
        "traces": [list(spec) for spec in trace_specs(args)], "link": vars(link) | {},
        "step_model": {f.name: getattr(cluster, f.name) for f in dataclasses.fields(cluster) if f.name != "link"},
        "gpus": {dp: dp * cluster.tensor_parallel * cluster.pipeline_stages for dp in dps},
        "paper": args.paper, "encoder_gpus": args.encoder_gpus, "chosen": {},
        "published": [list(p) for p in PUBLISHED], "peak_tflops": args.peak_tflops,
        "model_state_gib": {},
        "costs": (f"profile {args.profile} ({profile.device}, {profile.dtype})" if profile
                  else f"training FLOPs at an assumed {args.tflops:g} TFLOP/s per GPU"),
        "nic_sweep_gbits_per_s": sweep, "peer_steps": args.peer_steps,
        "communicator_memory": dataclasses.asdict(CommunicatorMemory())}, "dp": {}, "per_seed": {}, "peers": {},
        "encoder_gpu_choice": {}}
    for dp in dps:
        runs = []

        def draw(seed: int):
            try:
                return draw_sizes(trace_specs(args), dp, args.per_rank, args.model, seed, args.traces_dir,
                                  args.seq_length)[2]
            except ValueError as err:  # an example longer than --seq-length: refused, as training refuses it
                parser.error(str(err))

        at = cluster
        for seed in seeds:
            choices = encoder_gpu_choices(cluster, dp) if args.encoder_gpus == AUTO and at is cluster else ()
            runs.append(simulate_step(draw(seed), model, link, profile, args.tflops, sweep, at, args.peak_tflops,
                                      choices))
            if choices:  # chosen on the first seed's batch, kept for the others (a job's GPUs do not change)
                result["encoder_gpu_choice"][str(dp)] = runs[-1].pop("encoder_gpu_choice")
                result["params"]["chosen"][str(dp)] = runs[-1]["encoder_gpus"]
                at = dataclasses.replace(cluster, encoder_gpus=runs[-1]["encoder_gpus"])
        result["dp"][str(dp)], result["per_seed"][str(dp)] = mean_over_runs(runs), runs
        result["params"]["model_state_gib"][dp] = {k: v / 2**30 for k, v in model_state_bytes(model, at, dp).items()}
        topology = topology_of(dp, cluster)
        result["peers"][str(dp)] = peers_over_steps(
            lambda sizes: plan_method(DEFAULT_METHOD, sizes, model, topology, profile, cluster),
            lambda k: draw(seeds[0] + k), model_phases(model, profile), topology, args.peer_steps)
        print(f"[sim] DP {dp} done", file=sys.stderr, flush=True)
    result["checks"] = checks(result)
    return report(result, format_tables, args.json, plot, args.plot)


if __name__ == "__main__":
    main()
