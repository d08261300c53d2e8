"""Calibrate a cost profile: time every phase's forward+backward on the local device and fit item costs.

    python -m megatron_orch.bench.calibrate --model mllm_10b --layers 12,8,4 --out h200_10b.yaml   # GPU
    python -m megatron_orch.bench.calibrate --model tiny --device cpu --out tiny_cpu.yaml           # CPU

Each phase is built alone and timed as :mod:`megatron_orch.bench.mfu` times it (same modules, inputs
and median of ``--repeats`` after ``--warmup`` calls), over a grid of shapes: every encoder
over calls of n items, the backbone over calls of b sequences of s tokens. Per phase it fits
(:func:`megatron_orch.balance.cost_profile.fit_phase`, non-negative least squares on relative error)

    call seconds = [encoders: call_overhead] + n * (c0 + c1*s + c2*s^2)

and writes the fit, its relative residuals, every measured point with its fitted value, the device
and the phases it was measured on. The profile is rewritten after every measured point, with the phases
that can be fit so far and a ``notes`` field saying that it is partial (the phases still missing, the
points measured): a run stopped midway (a time limit) leaves what it measured, which
:func:`~megatron_orch.balance.cost_profile.load_cost_profile` refuses, naming a missing phase, until
the final write drops the note. ``--orch-cost-profile`` (training), ``bench.emulate
--cost-profile`` and ``megatron_orch.sim --profile`` read it. CPU timings are noisy on a shared
machine; ``--threads`` (default 1 on CPU) pins torch's intra-op threads so that calibration and
emulation run alike.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import yaml

from megatron_orch.balance.cost_profile import PhaseFit, fit_phase, profile_dict
from megatron_orch.bench import mfu
from megatron_orch.bench.common import effective_layers, parse_layers, with_layers
from megatron_orch.mllm.config import BACKBONE_PHASE, MLLMConfig, load_model_config
from megatron_orch.mllm.model import ModelParallelSettings

GPU_GRID = mfu.FULL_GRID
# CPU: the tiny model's range (tens of items per rank, examples of 25-400 tokens), one example per call
# as bench.emulate runs them.
CPU_GRID = {"vit": [1, 2, 4, 8, 16, 32, 64], "whisper": [1, 2, 4, 8, 16, 32, 64],
            BACKBONE_PHASE: [(1, s) for s in (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)]}


def device_settings(device_name: str, threads: Optional[int]) -> tuple:
    """(device, model settings, device description) as the benchmarks run a phase: bf16 on a GPU, fp32
    on the CPU with ``threads`` intra-op threads."""
    cuda = device_name == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no GPU is visible")
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    settings = ModelParallelSettings(bf16=cuda, use_cpu_initialization=not cuda, transformer_impl="local")
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    return device, settings, name


def measure(config: MLLMConfig, device: torch.device, settings: ModelParallelSettings, grid: Dict[str, list],
            warmup: int, repeats: int,
            on_point: Callable[[Dict[str, List[dict]]], None] = lambda points: None) -> Dict[str, List[dict]]:
    """Measured points of every phase: ``{"items", "seq_len", "seconds"}`` per call that ran;
    ``on_point(points so far)`` after each call that ran."""
    phases = config.phases().names
    sizes = {phase: [size for _, size in mfu.grid_points(phase, config, grid)] for phase in phases}
    points: Dict[str, List[dict]] = {phase: [] for phase in phases}
    item_tokens = {name: encoder.item_tokens for name, encoder in config.encoders.items()}
    peak = mfu.DEFAULT_PEAK_TFLOPS if device.type == "cuda" else None  # a CPU has no assumed peak: no MFU

    def add(point: mfu.Point) -> None:
        print(mfu.format_point(point), flush=True)
        size = sizes[point.phase].pop(0)
        if point.status != "ok":
            return
        items, seq_len = (size, item_tokens[point.phase]) if point.phase in item_tokens else size
        points[point.phase].append({"items": int(items), "seq_len": int(seq_len), "seconds": point.ms / 1e3})
        on_point(points)

    mfu.run(config, device, settings, grid, warmup, repeats, peak, add)
    return points


def fit_points(points: Dict[str, List[dict]], backbone: str) -> Dict[str, PhaseFit]:
    """Every phase's fit; encoder phases (all but ``backbone``) have a call overhead."""
    fits = {}
    for phase, rows in points.items():
        if not rows:
            raise ValueError(f"no measurement of phase {phase} succeeded: nothing to fit")
        fits[phase] = fit_phase([r["items"] for r in rows], [r["seq_len"] for r in rows],
                                [r["seconds"] for r in rows], call_overhead=phase != backbone)
        for row in rows:
            row["fitted_seconds"] = float(fits[phase].call_overhead
                                          + row["items"] * fits[phase].item_seconds(row["seq_len"]))
    return fits


def partial_fits(points: Dict[str, List[dict]], backbone: str) -> tuple:
    """(fits of the phases whose points can be fit so far, their points with fitted values, the phases
    that cannot be fit yet); ``points`` is left as it is."""
    fits, fitted, missing = {}, {}, []
    for phase, rows in points.items():
        rows = copy.deepcopy(rows)
        try:
            fits.update(fit_points({phase: rows}, backbone))
            fitted[phase] = rows
        except ValueError:  # no point yet, or fewer points than coefficients
            missing.append(phase)
    return fits, fitted, missing


def partial_note(points: Dict[str, List[dict]], missing: List[str]) -> str:
    measured = ", ".join(f"{phase} {len(rows)}" for phase, rows in points.items())
    return (f"PARTIAL profile, written while calibrating: no fit yet of phase(s) {', '.join(missing)}; points "
            f"measured so far: {measured}. A finished run rewrites it without this note.")


def format_fits(fits: Dict[str, PhaseFit], points: Dict[str, List[dict]]) -> str:
    lines = ["| phase | c0 (ms/item) | c1 (us/token) | c2 (ns/token^2) | call overhead (ms) | rel. residual rms / max |"
             " points |", "|---|---:|---:|---:|---:|---:|---:|"]
    for phase, fit in fits.items():
        lines.append(f"| {phase} | {fit.c0 * 1e3:.4f} | {fit.c1 * 1e6:.4f} | {fit.c2 * 1e9:.5f} | "
                     f"{fit.call_overhead * 1e3:.3f} | {fit.residual_rms:.3f} / {fit.residual_max:.3f} | "
                     f"{fit.num_points} |")
    lines += ["", "| phase | items | seq len | measured ms | fitted ms |", "|---|---:|---:|---:|---:|"]
    for phase, rows in points.items():
        lines += [f"| {phase} | {r['items']} | {r['seq_len']} | {r['seconds'] * 1e3:.3f} | "
                  f"{r['fitted_seconds'] * 1e3:.3f} |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.calibrate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B",
                        help="layers of each phase: the encoders in the config's order, then the backbone (the "
                             "shipped configs: vision, audio, backbone; default: the config's); the profile is "
                             "valid for this shape only")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grid", choices=["gpu", "cpu"], default=None,
                        help="shapes to time (default: gpu on cuda, cpu on the CPU)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 on CPU)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True, metavar="PROFILE.yaml")
    args = parser.parse_args(argv)
    layers = parse_layers(parser, args.layers)
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else None)
    try:
        device, settings, device_name = device_settings(args.device, threads)
        config = with_layers(load_model_config(args.model), layers)
    except ValueError as err:
        parser.error(str(err))
    grid = {"gpu": GPU_GRID, "cpu": CPU_GRID}[args.grid or ("gpu" if args.device == "cuda" else "cpu")]
    command = "python -m megatron_orch.bench.calibrate " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(fits, points, **notes) -> dict:
        document = profile_dict(device_name, "bf16" if settings.bf16 else "fp32", config.name, config.phases(),
                                fits, points, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                command=command, **notes)
        with open(args.out, "w") as f:
            yaml.safe_dump(document, f, sort_keys=False)
        return document

    def write_partial(points) -> None:
        fits, fitted, missing = partial_fits(points, BACKBONE_PHASE)
        if missing:  # the last point of a full run is written once, below, without a note
            write(fits, fitted, notes=partial_note(points, missing))

    with mfu.world_of_one(device):
        points = measure(config, device, settings, grid, args.warmup, args.repeats, write_partial)
    fits = fit_points(points, BACKBONE_PHASE)
    document = write(fits, points)
    print(f"[calibrate] {config.name} layers {effective_layers(config)} on {device_name}")
    print(format_fits(fits, points))
    print(f"[calibrate] wrote {args.out}", file=sys.stderr)
    return document


if __name__ == "__main__":
    main()
