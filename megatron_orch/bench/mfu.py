"""Forward+backward time and achieved TFLOP/s of each phase of the project's model, over a grid of shapes.

    python -m megatron_orch.bench.mfu --model mllm_10b --layers 12,8,4 --json mfu.json
    python -m megatron_orch.bench.mfu --model tiny --quick --device cpu

Each phase is built alone, so that a point's peak memory is that phase's, and run as training runs
it, followed by its backward: every encoder of the config over n items per call (a
:class:`VisionEncoder`: ViT, pixel shuffle, projector, over image tiles / video frames; an
:class:`AudioEncoder` over windows), the backbone (:meth:`MLLMModel.forward` with the per-token loss,
its encoders dropped) over b sequences of s text tokens. FLOPs are the planner's own (the cost model of :mod:`megatron_orch.balance.cost`
through the model config's item costs), so TFLOP/s is how fast the device runs the cost the
partitioners balance; that cost leaves out the patch embedding and the audio conv stem (a few % of
an encoder's work). MFU is against ``--peak-tflops``, an assumption (on a CPU none unless given: no
MFU). ``--layers V,A,B`` (one number per phase) cuts the stacks so that large widths fit one device. A point that runs out of memory is recorded as ``oom``
and the grid goes on; a backbone length over the config's position table is ``skipped``.
bf16 on a GPU (NCCL world of one), fp32 on the CPU (gloo world of one through the CPU harness).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
from datetime import timedelta
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import package_info, parallel_state, tensor_parallel

from megatron_orch.bench.common import effective_layers, parse_layers, with_layers
from megatron_orch.megatron.batch import BatchSpec, MicroBatch
from megatron_orch.mllm.config import BACKBONE_PHASE, BYTE_VOCAB_SIZE, MLLMConfig, load_model_config
from megatron_orch.mllm.model import ENCODER_MODULES, MLLMModel, ModelParallelSettings, transformer_engine_available
from megatron_orch.trainer import cpu_harness

# Grid points by encoder kind (items per call; every encoder of that kind) and for the backbone
# (sequences x tokens per call).
FULL_GRID = {"vit": [1, 2, 4, 8, 16, 32, 64, 128], "whisper": [1, 2, 4, 8, 16, 32],
             BACKBONE_PHASE: [(1, 256), (1, 512), (1, 1024), (1, 2048), (1, 4096), (1, 8192), (1, 16384),
                              (4, 2048), (2, 4096)]}
QUICK_GRID = {"vit": [1, 4], "whisper": [1, 2], BACKBONE_PHASE: [(1, 64), (2, 128)]}

DEFAULT_PEAK_TFLOPS = 790.0  # assumed reachable dense bf16 rate of one H200 (spec sheet: 989)


@dataclasses.dataclass
class Point:
    phase: str      # the planner's phase name (the config's encoders, then the backbone)
    shape: str      # "n=16" items, or "2x4096" sequences x tokens
    tokens: int     # tokens through the phase's transformer per call
    flops: float    # training FLOPs of the call (cost model)
    status: str = "ok"  # or "oom", "skipped"
    ms: Optional[float] = None  # median forward+backward time
    tflops: Optional[float] = None
    mfu: Optional[float] = None
    peak_memory_gib: Optional[float] = None  # GPU only: weights, grads and the call's activations


@contextlib.contextmanager
def world_of_one(device: torch.device) -> Iterator[None]:
    """A one-process world with megatron-core's model-parallel state (its layers need one), torn down after."""
    if dist.is_initialized():
        raise RuntimeError("the MFU benchmark sets up its own world of one, but torch.distributed is already "
                           "initialised in this process")
    cuda = device.type == "cuda"
    if not cuda:
        cpu_harness.install()
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))  # port 0: a free port, no clash with other runs
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            device_id=device if cuda else None)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_phase(phase: str, config: MLLMConfig, settings: ModelParallelSettings,
                device: torch.device) -> torch.nn.Module:
    """One phase's module alone, on ``device``, cast to bf16 as the trainer's Float16Module casts it."""
    if phase in config.encoders:
        encoder = config.encoders[phase]
        module = ENCODER_MODULES[type(encoder)](encoder, config.backbone.transformer, settings)
    else:
        module = MLLMModel(config, settings, config.backbone.max_position_embeddings,
                           pre_process=True, post_process=True)
        module.encoders = torch.nn.ModuleDict()  # the backbone's forward over text never uses them
    module = module.to(device)
    return module.bfloat16() if settings.bf16 else module


def grid_points(phase: str, config: MLLMConfig, grid: Dict[str, list]) -> Iterator[Tuple[Point, object]]:
    """(Point with its cost-model FLOPs, size) for every grid point of ``phase``."""
    if phase in config.encoders:
        encoder = config.encoders[phase]
        item_flops = float(config.encoder_cost(phase).item_cost(encoder.item_tokens))
        for n in grid[encoder.kind]:
            yield Point(phase, f"n={n}", n * encoder.item_tokens, n * item_flops), n
    else:
        backbone = config.backbone
        for b, s in grid[BACKBONE_PHASE]:
            point = Point(phase, f"{b}x{s}", b * s, b * float(backbone.transformer.train_flops(s)))
            if s > backbone.max_position_embeddings:
                point.status = "skipped"
            yield point, (b, s)


def text_batch(b: int, s: int, device: torch.device, spec: BatchSpec) -> MicroBatch:
    """``b`` rows of ``s`` random text tokens (no placeholders), every token in the loss."""
    tokens = torch.randint(0, BYTE_VOCAB_SIZE, (b, s), device=device)
    no_placeholders = {i.phase: torch.zeros((2, 0), dtype=torch.long, device=device) for i in spec.inputs}
    return MicroBatch(tokens=tokens, labels=tokens, loss_mask=torch.ones(b, s, device=device),
                      position_ids=torch.arange(s, device=device).expand(b, s), seq_lengths=torch.full((b,), s),
                      items={}, item_counts={}, sample_ids=torch.arange(b), placeholders=no_placeholders)


def phase_call(phase: str, module: torch.nn.Module, config: MLLMConfig, size,
               device: torch.device) -> Callable[[], None]:
    """Forward and backward of one grid point over inputs drawn once."""
    if phase in config.encoders:
        x = torch.randn(size, *config.encoders[phase].item_shape, device=device)
        return lambda: module(x).sum().backward()
    batch = text_batch(*size, device, module.spec)
    return lambda: module(batch, embeds={}).sum().backward()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(call: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(point: Point, phase: str, module: torch.nn.Module, config: MLLMConfig, size, device: torch.device,
            warmup: int, repeats: int, peak_tflops: Optional[float]) -> None:
    """Time one point into ``point`` (median ms, TFLOP/s, MFU unless ``peak_tflops`` is None, peak memory), or
    mark it ``oom``."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        seconds = median_seconds(phase_call(phase, module, config, size, device), device, warmup, repeats)
    except torch.cuda.OutOfMemoryError:
        point.status = "oom"
    if point.status == "oom":
        _release(device)  # out of the except block: its traceback no longer holds the call's tensors
        return
    point.ms = 1e3 * seconds
    point.tflops = point.flops / seconds / 1e12
    point.mfu = None if peak_tflops is None else point.tflops / peak_tflops
    if device.type == "cuda":
        point.peak_memory_gib = torch.cuda.max_memory_allocated(device) / 2 ** 30


def run(config: MLLMConfig, device: torch.device, settings: ModelParallelSettings, grid: Dict[str, list],
        warmup: int, repeats: int, peak_tflops: Optional[float], on_point: Callable[[Point], None]) -> List[Point]:
    """Every point of ``grid``, phase by phase (one module alive at a time); ``on_point`` after each."""
    points = []
    for phase in config.phases().names:
        module = build_phase(phase, config, settings, device)
        for point, size in grid_points(phase, config, grid):
            if point.status == "ok":
                measure(point, phase, module, config, size, device, warmup, repeats, peak_tflops)
            points.append(point)
            on_point(point)
        del module
        _release(device)
    return points


def format_header(result: dict) -> str:
    gpu = result["dtype"] == "bf16"
    return "\n".join([
        f"[mfu] {result['model']} layers per phase = {tuple(result['layers'])} | {result['device']} | "
        f"{result['dtype']} | --transformer-impl {result['transformer_impl']} | torch {result['torch']}, "
        f"megatron-core {result['megatron_core']} | median of {result['repeats']} after {result['warmup']} warm-up",
        (f"[mfu] MFU is against an ASSUMED peak of {result['peak_tflops']:g} TFLOP/s (--peak-tflops); "
         if result["peak_tflops"] is not None else
         "[mfu] MFU: '-', no peak is assumed for a CPU (give --peak-tflops to have one); ")
        + "FLOPs are the planner's cost model",
        f"{'phase':>9} {'shape':>9} {'tokens':>9} {'ms':>10} {'TFLOP/s':>9} {'MFU':>7}"
        + (f" {'peak GiB':>9}" if gpu else "")])


def format_point(p: Point) -> str:
    if p.status != "ok":
        return f"{p.phase:>9} {p.shape:>9} {p.tokens:>9} {p.status:>10}"
    memory = "" if p.peak_memory_gib is None else f" {p.peak_memory_gib:9.2f}"
    mfu = "-" if p.mfu is None else f"{100 * p.mfu:.1f}%"
    return f"{p.phase:>9} {p.shape:>9} {p.tokens:>9} {p.ms:10.2f} {p.tflops:9.3g} {mfu:>7}{memory}"


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.mfu", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B",
                        help="layers of each phase: the encoders in the config's order, then the backbone (the "
                             "shipped configs: vision, audio, backbone; default: the config's)")
    parser.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small grid (CPU, tests)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default 2; quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 5; quick 2)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help=f"the device's peak for MFU (default on a GPU {DEFAULT_PEAK_TFLOPS:g}: an assumption "
                             "for one H200 in bf16; on a CPU none: no MFU)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the result here (after every point)")
    args = parser.parse_args(argv)
    layers = parse_layers(parser, args.layers)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no GPU is visible")
    if args.transformer_impl == "transformer_engine" and (args.device == "cpu" or not transformer_engine_available()):
        parser.error("--transformer-impl transformer_engine needs --device cuda and an importable transformer_engine")
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    if warmup < 0 or repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    try:
        config = with_layers(load_model_config(args.model), layers)
    except ValueError as err:
        parser.error(str(err))
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    settings = ModelParallelSettings(bf16=cuda, use_cpu_initialization=not cuda,
                                     transformer_impl=args.transformer_impl)
    result = {"model": config.name, "layers": effective_layers(config),
              "device": torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)",
              "torch": torch.__version__, "megatron_core": package_info.__version__,
              "dtype": "bf16" if cuda else "fp32", "transformer_impl": args.transformer_impl,
              "peak_tflops": DEFAULT_PEAK_TFLOPS if cuda and args.peak_tflops is None else args.peak_tflops,
              "warmup": warmup, "repeats": repeats,
              "grid": "quick" if args.quick else "full", "points": []}

    def on_point(point: Point) -> None:
        print(format_point(point), flush=True)
        result["points"].append(dataclasses.asdict(point))
        if args.json:  # rewritten after every point: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    with world_of_one(device):
        print(format_header(result), flush=True)  # after megatron-core's own start-up lines
        run(config, device, settings, QUICK_GRID if args.quick else FULL_GRID, warmup, repeats,
            result["peak_tflops"], on_point)
    if args.json:
        print(f"[mfu] wrote {args.json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
