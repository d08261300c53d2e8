"""Packed rows: the dense block-diagonal mask (what packed rows attended with before varlen attention) against
variable-length attention over ``cu_seqlens`` (:func:`~megatron_orch.mllm.attention.packed_attention`).

For each row length T, one packed row of examples drawn from a trace mixture (the backbone lengths of
``--model``, first fit; what is left is a padding tail):

* host: building the dense ``[1, 1, T, T]`` mask (the removed ``MicroBatch.attention_mask()``, same ops:
  :func:`~megatron_orch.mllm.attention.dense_block_diagonal_mask`) against ``MicroBatch.packed_seq_params()``,
  median milliseconds and bytes;
* one core attention (:class:`~megatron_orch.mllm.attention.SDPAttention`) forward + backward at the
  given heads / query groups / head dim: the dense mask through SDPA against the packed row, median
  seconds (the two alternate, so drift hits both alike), the bytes it saves for backward
  (``saved_tensors_hooks``, each storage once) and its largest tensor;
* attended pairs: what the dense kernel computes (T^2: masked tiles are not skipped) against the sum of
  the examples' causal triangles, ``s(s+1)/2``, the backbone cost model the planner balances.

CPU by default (fp32; the dense mask goes through SDPA's CPU flash kernel with a float bias). With
``--device cuda`` (bf16) the packed row runs ``varlen_attn`` when dropout is 0; that needs a GPU.

    python -m megatron_orch.bench.packed_attention [--lengths 8192,16384] [--json OUT]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import torch
from megatron.core.transformer.enums import AttnMaskType
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_orch.balance.cost import TransformerShape
from megatron_orch.bench.common import MIXTURES, draw_sizes, report
from megatron_orch.megatron.batch import Example, MicroBatch, collate_packed
from megatron_orch.mllm.attention import SDPAttention, dense_block_diagonal_mask, uses_varlen_kernel
from megatron_orch.mllm.config import load_model_config
from megatron_orch.mllm.examples import batch_spec
from megatron_orch.mllm.model import ModelParallelSettings, transformer_config


def packed_row(lengths: np.ndarray, length: int, model: str) -> MicroBatch:
    """One packed row of ``length`` tokens: the drawn examples in order, each one that still fits (first
    fit); what is left is the padding tail."""
    chosen, used = [], 0
    for n in lengths.tolist():
        if used + n <= length:
            chosen.append(n)
            used += n
    if not chosen:
        raise ValueError(f"no drawn example fits a row of {length} tokens (the shortest has {lengths.min()})")
    examples = [Example(sample_index=i, tokens=torch.full((n,), 7), labels=torch.full((n,), 7),
                        loss_mask=torch.ones(n)) for i, n in enumerate(chosen)]
    return collate_packed(examples, batch_spec(load_model_config(model), length), pad_to=length)


def median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def saved_and_largest(call: Callable[[], object]) -> Dict[str, int]:
    """Bytes saved for backward (each storage once) and the bytes of the largest tensor an op returns."""
    storages: Dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    class Largest(TorchDispatchMode):
        nbytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.nbytes = max(self.nbytes, t.numel() * t.element_size())
            return out

    with Largest() as largest, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        call()
    return {"saved_bytes": sum(storages.values()), "largest_tensor_bytes": largest.nbytes}


def measure_row(batch: MicroBatch, heads: int, groups: int, head_dim: int, device: torch.device,
                dtype: torch.dtype, repeats: int) -> dict:
    length, bounds = batch.tokens.shape[1], batch.host_cu_seqlens
    lengths = np.diff(bounds)
    row = {"tokens": length, "examples": len(lengths), "example_lengths": lengths.tolist(),
           "padding_tail": length - bounds[-1],
           "mask_ms": median_ms(lambda: dense_block_diagonal_mask(bounds, length), repeats),
           "mask_bytes": length * length,
           "params_ms": median_ms(batch.packed_seq_params, repeats),
           "dense_pairs": length * length, "packed_pairs": int((lengths * (lengths + 1) // 2).sum())}

    shape = TransformerShape(num_layers=1, hidden_size=heads * head_dim, ffn_hidden_size=4 * heads * head_dim,
                             num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, causal=True)
    config = transformer_config(shape, ModelParallelSettings(bf16=dtype == torch.bfloat16), pipeline_split=False)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self").to(device)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(length, heads, head_dim, generator=g).to(device, dtype).requires_grad_()
    key, value = (torch.randn(length, groups, head_dim, generator=g).to(device, dtype).requires_grad_()
                  for _ in range(2))
    on_device = batch.to(device)
    params = on_device.packed_seq_params()
    row["packed_kernel"] = "varlen_attn" if uses_varlen_kernel(query, 0.0) else "sdpa_per_example"

    def dense():
        mask = dense_block_diagonal_mask(bounds, length).to(device)
        attention(query[:, None], key[:, None], value[:, None], mask).float().sum().backward()

    def packed():
        attention(query, key, value, None, packed_seq_params=params).float().sum().backward()

    def synced(call):
        def run():
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    for name, call in (("dense", dense), ("packed", packed)):
        row.update({f"{name}_{k}": v for k, v in saved_and_largest(call).items()})
        synced(call)()  # warm-up
    times = {"dense": [], "packed": []}
    for _ in range(repeats):
        for name, call in (("dense", dense), ("packed", packed)):
            times[name].append(median_ms(synced(call), 1) / 1e3)
    row["dense_s"], row["packed_s"] = (statistics.median(times[k]) for k in ("dense", "packed"))
    return row


def format_tables(result: dict) -> str:
    lines = [f"packed rows: dense mask vs variable-length attention ({result['device']}, {result['dtype']}, "
             f"{result['heads']} heads / {result['groups']} groups x {result['head_dim']}, median of "
             f"{result['repeats']})",
             "    T  ex  tail | mask build ms  MiB | params ms | attention fwd+bwd s dense / packed (x) | "
             "saved MiB dense / packed | largest MiB dense / packed | pairs packed/dense | packed kernel"]
    mib = 2 ** 20
    for r in result["rows"]:
        lines.append(
            f"{r['tokens']:>6} {r['examples']:>3} {r['padding_tail']:>5} | {r['mask_ms']:>13.1f} {r['mask_bytes'] / mib:>4.0f}"
            f" | {r['params_ms']:>9.3f} | {r['dense_s']:>8.2f} / {r['packed_s']:.2f} ({r['dense_s'] / r['packed_s']:.1f}x)"
            f"{'':>12} | {r['dense_saved_bytes'] / mib:>9.0f} / {r['packed_saved_bytes'] / mib:<6.1f} | "
            f"{r['dense_largest_tensor_bytes'] / mib:>11.0f} / {r['packed_largest_tensor_bytes'] / mib:<7.1f} | "
            f"{r['packed_pairs'] / r['dense_pairs']:>18.3f} | {r['packed_kernel']}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.packed_attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384", help="packed row lengths T (default 8192,16384)")
    parser.add_argument("--model", default="mllm_10b", help="model whose backbone lengths fill the rows")
    parser.add_argument("--mixture", choices=sorted(MIXTURES), default="shipped")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heads", type=int, default=2, help="query heads of the measured attention (default 2)")
    parser.add_argument("--groups", type=int, default=2, help="key/value heads (default 2)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints, got {args.lengths!r}")
    if min(lengths) < 1 or args.repeats < 1 or args.heads % args.groups:
        parser.error("--lengths and --repeats must be >= 1 and --groups must divide --heads")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but no GPU is visible")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    _, _, sizes = draw_sizes(list(MIXTURES[args.mixture]), 1, 256, args.model, args.seed)
    drawn = np.asarray(sizes.num_tokens, dtype=np.int64)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
              f"cpu ({torch.get_num_threads()} threads)", "dtype": str(dtype).replace("torch.", ""),
              "torch": torch.__version__, "model": args.model, "mixture": args.mixture, "heads": args.heads,
              "groups": args.groups, "head_dim": args.head_dim, "repeats": args.repeats, "rows": []}
    for length in lengths:
        result["rows"].append(measure_row(packed_row(drawn, length, args.model), args.heads, args.groups,
                                          args.head_dim, device, dtype, args.repeats))
    return report(result, format_tables, args.json)


if __name__ == "__main__":
    main()
