"""Forward+backward time and achieved TFLOP/s of each phase of the project's model, over a grid of shapes.

    python -m megatron_orch.bench.mfu --model mllm_10b --layers 12,8,4 --json mfu.json
    python -m megatron_orch.bench.mfu --model tiny --quick --device cpu

Each phase runs as training runs it: :meth:`MLLMModel.encode_vision` over n image tiles,
:meth:`MLLMModel.encode_audio` over n audio windows, :meth:`MLLMModel.backbone_forward` (with the loss)
over b sequences of s tokens, each followed by its backward. FLOPs are the planner's own
(:mod:`megatron_orch.balance.cost` through the model config), so TFLOP/s here is how fast the GPU runs
the cost the partitioners balance; MFU is against ``--peak-tflops`` (an assumption: 790 is a large
bf16 matmul measured on one H200). ``--layers V,A,B`` shrinks the stacks so that large widths fit one
device; a point that runs out of memory is recorded as ``oom``. bf16 on a GPU, fp32 on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_orch.balance.model_config import MLLMConfig, load_model_config

FULL_GRID = {"vision": [1, 2, 4, 8, 16, 32, 64, 128], "audio": [1, 2, 4, 8, 16, 32],
             "backbone": [(1, 256), (1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (1, 16384),
                          (4, 2048), (2, 4096)]}
QUICK_GRID = {"vision": [1, 4], "audio": [1, 2], "backbone": [(1, 64), (2, 128)]}


@dataclasses.dataclass
class Point:
    phase: str
    shape: str      # "n=16" items, or "2x4096" sequences x tokens
    tokens: int     # tokens through the phase's transformer
    flops: float    # training FLOPs of the call (cost model)
    status: str = "ok"
    ms: Optional[float] = None
    tflops: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_gib: Optional[float] = None


def with_layers(config: MLLMConfig, layers: Optional[Tuple[int, int, int]]) -> MLLMConfig:
    """``config`` with the vision, audio and backbone stacks cut to ``layers``."""
    if layers is None:
        return config
    def cut(component, n):
        return dataclasses.replace(component, transformer=dataclasses.replace(component.transformer, num_layers=n))
    return dataclasses.replace(config, vision=cut(config.vision, layers[0]), audio=cut(config.audio, layers[1]),
                               backbone=cut(config.backbone, layers[2]))


def _init_world(device: torch.device) -> None:
    """A world of one process with megatron-core's model-parallel state, as the trainer sets it up."""
    from megatron.core import parallel_state, tensor_parallel

    if device.type == "cpu":
        from megatron_orch.trainer import cpu_harness
        cpu_harness.install()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                device_id=device if device.type == "cuda" else None)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def build_model(config: MLLMConfig, device: torch.device, transformer_impl: str):
    from megatron_orch.mllm.model import MLLMModel, ModelParallelSettings

    settings = ModelParallelSettings(bf16=device.type == "cuda", use_cpu_initialization=device.type == "cpu",
                                     transformer_impl=transformer_impl)
    max_seq = max(s for _, s in FULL_GRID["backbone"])
    model = MLLMModel(config, settings, min(max_seq, config.backbone.max_position_embeddings))
    model = model.to(device)
    return model.bfloat16() if settings.bf16 else model


def phase_calls(model, config: MLLMConfig, device: torch.device, grid: Dict[str, list]):
    """(Point, make_inputs, step) for every grid point; ``step(inputs)`` runs forward and backward."""
    vision, audio = config.vision, config.audio
    patches = (vision.tile_px // vision.patch_px) ** 2
    patch_dim = vision.channels * vision.patch_px ** 2
    for n in grid["vision"]:
        yield (Point("vision", f"n={n}", n * vision.tile_seq_len, n * config.vision_item_train_flops()),
               lambda n=n: torch.randn(n, patches, patch_dim, device=device),
               lambda x: model.encode_vision(x).float().sum().backward())
    for n in grid["audio"]:
        yield (Point("audio", f"n={n}", n * audio.window_tokens, n * config.audio_window_train_flops()),
               lambda n=n: torch.randn(n, audio.window_frames, audio.num_mel_bins, device=device),
               lambda x: model.encode_audio(x).float().sum().backward())
    backbone = config.backbone
    for b, s in grid["backbone"]:
        if s > backbone.max_position_embeddings:
            continue
        yield (Point("backbone", f"{b}x{s}", b * s, b * float(backbone.transformer.train_flops(s))),
               lambda b=b, s=s: (torch.randint(0, 256, (b, s), device=device),
                                 torch.arange(s, device=device).expand(b, s)),
               lambda x: model.backbone_forward(x[0], x[1], None, labels=x[0]).float().sum().backward())


def _time(step: Callable, inputs, model, device: torch.device, warmup: int, repeats: int) -> List[float]:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = []
    for i in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        step(inputs)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def run(config: MLLMConfig, device: torch.device, transformer_impl: str, grid: Dict[str, list], warmup: int,
        repeats: int, peak_tflops: float, log: Callable[[str], None] = print) -> List[Point]:
    model = build_model(config, device, transformer_impl)
    points = []
    for point, make_inputs, step in phase_calls(model, config, device, grid):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            times = _time(step, make_inputs(), model, device, warmup, repeats)
        except torch.cuda.OutOfMemoryError:
            point.status = "oom"
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        else:
            seconds = statistics.median(times)
            point.ms = 1e3 * seconds
            point.tflops = point.flops / seconds / 1e12
            point.mfu = point.tflops / peak_tflops
            if device.type == "cuda":
                point.peak_memory_gib = torch.cuda.max_memory_allocated() / 2 ** 30
        points.append(point)
        log(format_point(point))
    return points


def format_point(p: Point) -> str:
    if p.status != "ok":
        return f"{p.phase:>9} {p.shape:>9} {p.tokens:>9} {p.status:>10}"
    memory = "" if p.peak_memory_gib is None else f" {p.peak_memory_gib:9.2f}"
    return f"{p.phase:>9} {p.shape:>9} {p.tokens:>9} {p.ms:10.2f} {p.tflops:9.3g} {100 * p.mfu:6.1f}%{memory}"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.mfu", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B",
                        help="layers of the vision encoder, audio encoder and backbone (default: the config's)")
    parser.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small grid (CPU, tests)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default 2; quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 5; quick 2)")
    parser.add_argument("--peak-tflops", type=float, default=790.0,
                        help="the device's peak for MFU (default 790: a large bf16 matmul on one H200)")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    layers = None
    if args.layers:
        try:
            layers = tuple(int(x) for x in args.layers.split(","))
        except ValueError:
            parser.error(f"--layers takes three integers V,A,B, got {args.layers!r}")
        if len(layers) != 3 or min(layers) < 1:
            parser.error(f"--layers takes three positive integers V,A,B, got {args.layers!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no GPU is visible")
    if args.transformer_impl == "transformer_engine":
        from megatron_orch.trainer.arguments import transformer_engine_available
        if not transformer_engine_available():
            parser.error("--transformer-impl transformer_engine, but transformer_engine does not import")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    config = with_layers(load_model_config(args.model), layers)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _init_world(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[mfu] {config.name} layers (vision, audio, backbone) = "
          f"{(config.vision.transformer.num_layers, config.audio.transformer.num_layers, config.backbone.transformer.num_layers)}"
          f" | {name} | {'bf16' if device.type == 'cuda' else 'fp32'} | --transformer-impl {args.transformer_impl} | "
          f"MFU against an assumed peak of {args.peak_tflops:.0f} TFLOP/s | median of {repeats} after {warmup} warm-up")
    print(f"{'phase':>9} {'shape':>9} {'tokens':>9} {'ms':>10} {'TFLOP/s':>9} {'MFU':>7}"
          + (f" {'peak GiB':>9}" if device.type == "cuda" else ""))
    points = run(config, device, args.transformer_impl, QUICK_GRID if args.quick else FULL_GRID, warmup, repeats,
                 args.peak_tflops)
    result = {"model": config.name, "layers": layers, "device": name, "torch": torch.__version__,
              "dtype": "bf16" if device.type == "cuda" else "fp32", "transformer_impl": args.transformer_impl,
              "peak_tflops": args.peak_tflops, "warmup": warmup, "repeats": repeats,
              "points": [dataclasses.asdict(p) for p in points]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[mfu] wrote {args.json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
