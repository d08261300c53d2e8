"""The encoder layouts on one device: what the busiest encoder rank of each layout runs, measured.

The planner gives, for a global batch of the shipped mixture at DP x PP, every encoder phase's items per
rank with the encoders on the first pipeline stage (``first-stage``: each DP rank's first stage encodes its
plan's items) and on every stage (``all``: those items spread over the PP stages of their DP rank,
:func:`~megatron_orch.orchestrator.encoder_ranks.spread_over_stages`), and the plan's chunk size (items per
encoder call). On this device each encoder alone (``bench.mfu``'s modules, world of one) runs the busiest
rank's items of each layout chunk by chunk, forward and backward: the figures are the encoders' time per
step on that rank and one chunk's peak memory (weights, gradients and the call's activations; GPU only).
Expected: ``all``'s busiest rank encodes about 1/PP of ``first-stage``'s, at the same chunk memory.

What one device cannot show (it needs PP x DP GPUs): the all-to-all over the encoder group and the stages
running their encoders at the same time; the simulator models those (``python -m megatron_orch.sim
--encoder-ranks all``).

    python scripts/check_encoder_layout.py --model mllm_10b --layers 4,4,2 --dp 8 --pp 4 --json out.json  # GPU
    python scripts/check_encoder_layout.py --model tiny --device cpu --dp 4 --pp 2                         # CPU

The last line is PASSED when both layouts ran every chunk and ``all``'s busiest rank encodes fewer items
of every phase than ``first-stage``'s (exit status 0), else FAILED (1).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_orch.balance.topology import Topology  # noqa: E402
from megatron_orch.bench import mfu  # noqa: E402
from megatron_orch.bench.common import MIXTURES, draw_sizes, effective_layers, parse_layers, with_layers  # noqa: E402
from megatron_orch.mllm.config import load_model_config  # noqa: E402
from megatron_orch.mllm.model import ModelParallelSettings  # noqa: E402
from megatron_orch.orchestrator.config import OrchestratorConfig  # noqa: E402
from megatron_orch.orchestrator.encoder_ranks import spread_over_stages  # noqa: E402
from megatron_orch.orchestrator.step_plan import plan_step  # noqa: E402


def busiest_items(config, dp: int, pp: int, per_rank: int, seed: int) -> Dict[str, Dict[str, int]]:
    """Per layout and encoder phase: the busiest rank's items and the plan's chunk size (items per call)."""
    _, _, sizes = draw_sizes(MIXTURES["shipped"], dp, per_rank, config.name, seed)
    plan = plan_step(sizes, config.phases(), OrchestratorConfig(), Topology.uniform(dp, 8), 1, per_rank)
    group = spread_over_stages(plan, pp)
    out: Dict[str, Dict[str, int]] = {"first-stage": {}, "all": {}}
    for phase, encoder in plan.encoders.items():
        chunk = int(encoder.chunks.items)
        out["first-stage"][phase] = {"items": int(encoder.encode.counts().max(initial=0)), "chunk": chunk}
        out["all"][phase] = {"items": int(group.counts(phase).max(initial=0)), "chunk": chunk}
    return out


def measure_layout(phases: Dict[str, Dict[str, int]], modules, config, device, warmup: int,
                   repeats: int) -> Dict[str, dict]:
    """Each phase's busiest rank's items, chunk by chunk: time (ms, whole step's encoding) and a chunk's peak."""
    out = {}
    for phase, load in phases.items():
        items, chunk = load["items"], max(1, min(load["chunk"], load["items"]))
        figures = {"items": items, "chunk": chunk, "calls": 0, "ms": 0.0, "peak_memory_gib": None, "status": "ok"}
        sizes = [chunk] * (items // chunk) + ([items % chunk] if items % chunk else [])
        for n in sorted(set(sizes)):
            point = mfu.Point(phase, f"n={n}", 0, 1.0)
            mfu.measure(point, phase, modules[phase], config, n, device, warmup, repeats, None)
            if point.status != "ok":
                figures["status"] = point.status
                break
            calls = sizes.count(n)
            figures["calls"] += calls
            figures["ms"] += calls * point.ms
            if point.peak_memory_gib is not None:
                figures["peak_memory_gib"] = max(figures["peak_memory_gib"] or 0.0, point.peak_memory_gib)
        out[phase] = figures
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/check_encoder_layout.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B", help="layers of each phase (as bench.mfu)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dp", type=int, default=8, help="data-parallel size of the planned step (default 8)")
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages the encoders spread over (default 4)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the figures here")
    args = parser.parse_args(argv)
    if min(args.dp, args.pp, args.per_rank, args.repeats) < 1 or args.warmup < 0:
        parser.error("--dp, --pp, --per-rank and --repeats must be >= 1, --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no GPU is visible")
    config = with_layers(load_model_config(args.model), parse_layers(parser, args.layers))
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    layouts = busiest_items(config, args.dp, args.pp, args.per_rank, args.seed)
    print(f"planned: DP {args.dp} x PP {args.pp}, {args.per_rank} examples per DP rank, shipped mixture seed "
          f"{args.seed}; busiest rank's items (chunk): " + "; ".join(
              f"{layout} " + ", ".join(f"{p} {v['items']} ({v['chunk']})" for p, v in phases.items())
              for layout, phases in layouts.items()), flush=True)
    settings = ModelParallelSettings(bf16=cuda, use_cpu_initialization=not cuda)
    result = {"model": config.name, "layers": effective_layers(config), "dp": args.dp, "pp": args.pp,
              "per_rank": args.per_rank, "seed": args.seed,
              "device": torch.cuda.get_device_name(device) if cuda else "cpu", "layouts": {}}
    with mfu.world_of_one(device):
        modules = {phase: mfu.build_phase(phase, config, settings, device) for phase in config.encoders}
        for layout, phases in layouts.items():
            result["layouts"][layout] = measure_layout(phases, modules, config, device, args.warmup, args.repeats)
            for phase, f in result["layouts"][layout].items():
                memory = "" if f["peak_memory_gib"] is None else f", chunk peak {f['peak_memory_gib']:.2f} GiB"
                print(f"{layout:>11} {phase}: {f['items']} items in {f['calls']} calls of <= {f['chunk']}: "
                      f"{f['ms']:.1f} ms forward+backward{memory} ({f['status']})", flush=True)
    failures = [f"{layout} {phase}: {f['status']}" for layout, phases in result["layouts"].items()
                for phase, f in phases.items() if f["status"] != "ok"]
    failures += [f"{phase}: all's busiest rank has {layouts['all'][phase]['items']} items, first-stage's "
                 f"{layouts['first-stage'][phase]['items']}" for phase in layouts["all"]
                 if args.pp > 1 and layouts["first-stage"][phase]["items"] > 1
                 and not layouts["all"][phase]["items"] < layouts["first-stage"][phase]["items"]]
    result["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    speedup = {p: result["layouts"]["first-stage"][p]["ms"] / max(result["layouts"]["all"][p]["ms"], 1e-9)
               for p in layouts["all"]}
    print("encoder time on the busiest rank, first-stage / all: " + ", ".join(
        f"{p} {s:.2f}x" for p, s in speedup.items()))
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
