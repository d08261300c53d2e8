"""Context parallelism on one device, in one process, one CP shard at a time, against the unsharded attention.

For CP 2 and 4, a padded row (one sequence) and a packed row (sequences padded to multiples of 2 x CP, the
padding tail one more sequence, as ``megatron_orch.megatron.sequence_layout`` lays a packed row out), causal
attention with grouped-query heads:

1. ``partition``: every CP rank's positions (``SequenceLayout.local_positions``: chunks r and 2C-1-r of each
   sequence) against Transformer Engine's ``thd_get_partitioned_indices`` (what megatron-core's THD batches are
   cut with; GPU and Transformer Engine only);
2. ``te``: Transformer Engine's attention of each CP shard against TE's attention of the whole row: each of the
   shard's chunks attends, as its own query block, to the keys up to its end (``causal_bottom_right``); bf16
   (GPU and Transformer Engine only);
3. ``cpu_path``: the CPU path's shard attention (``attend_context_parallel_shard``, given the whole keys and values
   that its all-gather collects) against the unsharded SDPA attention, on the device this runs on (fp32 on CPU).

NOT RUN here, because they need more than one GPU: Transformer Engine's context-parallel attention across real
CP ranks (its p2p / a2a exchange of keys and values inside ``TEDotProductAttention``), CP and sequence parallelism
over NCCL, and the training invariance of CP 2 x DP 2 (padded and packed rows), TP 2 + SP x DP 2 and
TP 2 + SP x CP 2 x DP 2 on GPUs (on CPU over gloo: ``tests/megatron/test_parallel_layouts.py``).

Prints one line per case, then PASSED or FAILED (exit status 1); ``--json`` writes the cases.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROG = "check_context_parallel.py"
HEADS, GROUPS, HEAD_DIM, BATCH = 8, 2, 64, 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda where available")
    parser.add_argument("--cp", default="2,4", help="context-parallel sizes (default 2,4)")
    parser.add_argument("--length", type=int, default=1024, help="tokens of the padded row (default 1024)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=7)
    return parser.parse_args(argv)


def _rows(cp: int, length: int, rng):
    """(name, sequences (start, end) of the whole row, batch): one padded row of ``length`` tokens, one packed row
    of random examples each padded to 2 x CP, with a padding tail."""
    import numpy as np

    multiple = 2 * cp
    lengths = rng.integers(1, length // 4, 5)
    padded = -(-lengths // multiple) * multiple
    bounds = np.concatenate(([0], np.cumsum(padded), [int(padded.sum()) + 2 * multiple]))
    return [("padded", ((0, length),), BATCH), ("packed", tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist())), 1)]


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    import torch.nn.functional as F

    from megatron_orch.megatron.sequence_layout import SequenceLayout
    from megatron_orch.mllm.attention import attend_context_parallel_shard

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    te = tex = None
    te_missing = "needs a GPU" if device.type != "cuda" else None
    if device.type == "cuda":
        try:
            import transformer_engine.pytorch as te
            import transformer_engine_torch as tex
        except (ImportError, OSError) as err:
            te_missing = f"Transformer Engine does not import ({type(err).__name__}: {err})"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    rng, cases, failed = np.random.default_rng(args.seed), [], 0
    scale = HEAD_DIM ** -0.5
    torch.manual_seed(args.seed)

    def record(name, ok, detail):
        nonlocal failed
        failed += ok is False
        cases.append({"case": name, "ok": ok, "detail": detail})
        print(f"{name}: {'ok' if ok else 'NOT RUN' if ok is None else 'FAILED'} ({detail})", flush=True)

    if te is not None:
        whole_te = te.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                          qkv_format="sbhd", attn_mask_type="causal", softmax_scale=scale)
        block_te = te.DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                          qkv_format="sbhd", attn_mask_type="causal_bottom_right", softmax_scale=scale)
    for cp in (int(c) for c in args.cp.split(",")):
        for row, sequences, batch in _rows(cp, args.length, rng):
            total = sequences[-1][1]
            q = torch.randn(total, batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
            k, v = (torch.randn(total, batch, GROUPS, HEAD_DIM, device=device, dtype=dtype) for _ in range(2))
            reference = torch.cat([
                F.scaled_dot_product_attention(*(t[s:e].permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                               scale=scale, enable_gqa=True).permute(2, 0, 1, 3)
                for s, e in sequences])
            whole = None
            if te is not None:
                whole = torch.cat([whole_te(q[s:e], k[s:e], v[s:e]) for s, e in sequences])  # [total, b, h * d]
            for rank in range(cp):
                case = f"CP {cp} rank {rank} {row} row ({len(sequences)} sequence(s), {total} tokens)"
                positions = SequenceLayout(cp, rank).local_positions(sequences)
                if tex is not None:
                    cu = torch.tensor([s for s, _ in sequences] + [total], dtype=torch.int32, device=device)
                    index = tex.thd_get_partitioned_indices(cu, total, cp, rank).cpu().numpy()
                    record(f"partition {case}", bool(np.array_equal(index, positions)),
                           "SequenceLayout against tex.thd_get_partitioned_indices")
                else:
                    record(f"partition {case}", None, te_missing)
                mine = torch.from_numpy(positions).to(device)
                shard = attend_context_parallel_shard(q[mine], k, v, cp, rank, sequences, scale=scale)
                error = float((shard.float() - reference[mine].float()).abs().max())
                record(f"cpu_path {case}", error <= tolerance * 4, f"max |difference| {error:.2e}, tolerance "
                       f"{tolerance * 4:.0e}, {dtype}")
                if te is None:
                    record(f"te {case}", None, te_missing)
                    continue
                blocks = []
                for start, end in sequences:  # each chunk of the shard: its queries against the keys up to its end
                    chunk = (end - start) // (2 * cp)
                    for c in (rank, 2 * cp - 1 - rank):
                        first, last = start + c * chunk, start + (c + 1) * chunk
                        blocks.append(block_te(q[first:last], k[start:last], v[start:last]))
                error = float((torch.cat(blocks).float() - whole[mine].float()).abs().max())
                record(f"te {case}", error <= tolerance, f"TE per shard against TE on the whole row: max |difference| "
                       f"{error:.2e}, tolerance {tolerance:.0e}, {dtype}")
    print("not run (more than one GPU): Transformer Engine's context-parallel exchange across CP ranks, CP and SP "
          "over NCCL, the CP / SP training invariance on GPUs (CPU over gloo: tests/megatron/test_parallel_layouts.py)")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(device), "dtype": str(dtype), "cases": cases}, indent=1))
    print("FAILED" if failed else "PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
