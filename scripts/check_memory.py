"""Peak CUDA memory of the training step: upstream, post-balancing (encoders in chunks under the default
memory cap), post-balancing with every encoder activation kept (no cap).

Trains the same model on the same data three times (scripts/compare_baseline.py's launch): ``baseline``
(post-balancing off: encoders per micro-batch, as upstream), ``balanced`` (``--orch-post-balancing``: the
encoders in the plan's chunks, capped by default at upstream's modeled peak) and ``uncapped`` (balanced
with ``--orch-encoder-memory-cap inf``: every chunk kept, as before the chunks), and reads each run's
Megatron-LM memory report (``[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated:
...``, which the compact trainer prints on CUDA after the first logged iterations). Reports each run's max allocated and its ratio to the
baseline's; the check fails when the balanced run needs more than ``--max-ratio`` (default 1.1) times the
baseline's. On a GPU: mllm_10b widths at reduced depth (``--layers``; the YAML is written into
``--out``), one rank's load of a DP-64 step at global batch 512 (8 examples of 4096 tokens, 8
micro-batches). On CPU there are no CUDA memory figures: the runs only show that the three settings
train (the tiny model). Writes ``memory.json`` in ``--out``; the last line is PASSED or FAILED
(exit status 1).

    python scripts/check_memory.py --model mllm_10b --layers 2,2,2 --nproc 1 --out runs/memory -- \\
        --distributed-backend nccl --bf16
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_baseline  # noqa: E402  (scripts/: its run() launches and parses a training run)

MEMORY_LINE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                         r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")
# One rank's share of a DP-64 step at global batch 512 on a GPU; the tiny model's own shapes on CPU.
GPU_FLAGS = ["--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8"]
CPU_FLAGS = ["--global-batch-size", "8"]


def parse_memory_reports(lines) -> list:
    """Every memory report line's figures: rank, iteration and the four MB figures."""
    reports = []
    for match in filter(None, map(MEMORY_LINE.search, lines)):
        rank, iteration, *mb = match.groups()
        reports.append({"rank": int(rank), "iteration": int(iteration),
                        **dict(zip(("allocated", "max_allocated", "reserved", "max_reserved"), map(float, mb)))})
    return reports


def reduced_depth_config(model: str, layers: str, out: Path) -> Path:
    """``configs/<model>.yaml`` (or a YAML path) with each stack cut to ``layers`` (V,A,B: the encoders in
    the config's order, then the backbone), written into ``out``."""
    path = Path(model) if model.endswith(".yaml") else REPO / "configs" / f"{model}.yaml"
    data = yaml.safe_load(path.read_text())
    numbers = [int(x) for x in layers.split(",")]
    stacks = [encoder["transformer"] for encoder in data["encoders"].values()] + [data["backbone"]["transformer"]]
    if len(numbers) != len(stacks) or min(numbers) < 1:
        raise SystemExit(f"check_memory.py: error: --layers {layers}: {len(stacks)} positive numbers wanted "
                         f"(the encoders {', '.join(data['encoders'])}, then the backbone)")
    for stack, n in zip(stacks, numbers):
        stack["num_layers"] = n
    data["name"] = f"{data['name']}_layers_{'_'.join(map(str, numbers))}"
    out.mkdir(parents=True, exist_ok=True)
    written = out / f"{data['name']}.yaml"
    written.write_text(f"# {path.name} at reduced depth ({layers}), written by scripts/check_memory.py\n"
                       + yaml.safe_dump(data, sort_keys=False))
    return written


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="model config name or YAML (default tiny)")
    parser.add_argument("--layers", default=None, metavar="V,A,B", help="cut every stack to these depths")
    parser.add_argument("--nproc", type=int, default=2, help="processes (DP size); default 2")
    parser.add_argument("--iters", type=int, default=2, help="iterations per run (default 2: the memory "
                                                             "report follows iterations 1 and 2)")
    parser.add_argument("--max-ratio", type=float, default=1.1,
                        help="largest balanced / baseline max allocated accepted (default 1.1)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "memory", help="logs, YAML, memory.json")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="extra pretrain_mllm.py flags after --")
    args = parser.parse_args(argv)
    extra = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if "--distributed-backend" in extra[:-1]:  # the device the runs train on follows their backend (gloo: CPU)
        gpu = extra[extra.index("--distributed-backend") + 1] == "nccl"
    else:  # the trainer's default: nccl when a GPU is visible
        import torch
        gpu = torch.cuda.is_available()
    model = reduced_depth_config(args.model, args.layers, args.out) if args.layers else args.model
    common = (compare_baseline.DEFAULT_FLAGS + ["--lr-warmup-iters", "1"] + (GPU_FLAGS if gpu else CPU_FLAGS) + extra
              + ["--model-config", str(model), "--train-iters", str(args.iters), "--log-interval", "1"])
    runs = {"baseline": common, "balanced": common + ["--orch-post-balancing"],
            "uncapped": common + ["--orch-post-balancing", "--orch-encoder-memory-cap", "inf"]}
    args.out.mkdir(parents=True, exist_ok=True)
    results, failures = {}, []
    for name, flags in runs.items():
        try:
            compare_baseline.check_flags(args.nproc, flags)
            records = compare_baseline.run(name, args.nproc, flags, args.out)
        except SystemExit as stop:  # the run's error is printed; the next run still runs
            failures.append(f"the {name} run failed (exit {stop.code})")
            results[name] = {"trained": False}
            continue
        reports = parse_memory_reports((args.out / f"{name}.log").read_text().splitlines())
        peak = max((r["max_allocated"] for r in reports), default=None)
        results[name] = {"trained": True, "iterations": len(records), "reports": reports,
                         "max_allocated_mb": peak}
    base = results["baseline"].get("max_allocated_mb")
    print(f"[memory] {'run':<9} {'max allocated MB':>17} {'x baseline':>10}  flags beyond the baseline's")
    for name, flags in runs.items():
        peak = results[name].get("max_allocated_mb")
        ratio = peak / base if peak and base else None
        results[name]["ratio_to_baseline"] = ratio
        print(f"[memory] {name:<9} {'-' if peak is None else f'{peak:.1f}':>17} "
              f"{'-' if ratio is None else f'{ratio:.2f}':>10}  {' '.join(flags[len(common):]) or '(none)'}")
    (args.out / "memory.json").write_text(json.dumps({"model": str(model), "nproc": args.nproc, "flags": common,
                                                      "runs": results}, indent=1))
    figures = ", ".join(f"{n} {r['max_allocated_mb']:.0f} MB" for n, r in results.items()
                        if r.get("max_allocated_mb") is not None)
    if not failures and not gpu:
        print("[memory] PASSED: the three runs trained; no CUDA memory figures exist on CPU (the memory report "
              "is CUDA's), so no peak is compared")
        return
    balanced = results["balanced"].get("ratio_to_baseline")
    if not failures and (balanced is None or base is None):
        failures.append("a run printed no memory report line")
    elif not failures and balanced > args.max_ratio:
        failures.append(f"the balanced run needs {balanced:.2f}x the baseline's max allocated (> {args.max_ratio:g})")
    if failures:
        raise SystemExit(f"[memory] FAILED: {'; '.join(failures)}" + (f" ({figures})" if figures else ""))
    print(f"[memory] PASSED: max allocated {figures}; balanced / baseline {balanced:.2f} <= {args.max_ratio:g}")


if __name__ == "__main__":
    main()
