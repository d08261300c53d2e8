"""all_to_all_items over the whole world, compared exactly against an all_gather reference.

Every rank draws only its own items (bf16, fp32 and int64 streams, some items of zero rows; gloo's
``all_to_all_single`` refuses bf16, so on gloo the default is fp32 and int64), moves them
with :func:`megatron_orch.comm.alltoall.all_to_all_items` along a transfer, and checks, bit for bit,
that it holds exactly the items the destination placement puts there, in slot order, against a
reference built by all-gathering every rank's packed tensors; then the inverse transfer must bring
every rank's own items back. Cases: random moves, a rank that sends nothing, a rank that receives
nothing, a phase with no items at all, nothing moving, and one large move. Every case runs flat and
node-wise (``Transfer.hops``, nodes of ``--gpus-per-node`` ranks, default torchrun's processes per node), each
all-to-all on a communicator of its own, whose memory is measured around its exchanges (on a GPU: the
device's used bytes, the caching allocator's reserved bytes and their difference, NCCL's own buffers) beside
this rank's peers and :class:`~megatron_orch.balance.comm_memory.CommunicatorMemory`'s modeled MiB. One GPU
is a world of 1: no peers, nothing to connect; the per-peer memory needs >= 2 GPUs, node-wise's saving across
nodes several nodes. NCCL on a GPU, gloo on CPU (e.g. 2 ranks). Writes JSON (``--json``); the last line is
PASSED or FAILED (exit status 1). Launch it as the trainer is launched::

    python -m megatron_orch.trainer.launch --standalone --nproc-per-node 2 scripts/check_alltoall.py --json a2a.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROG = "check_alltoall.py"
DTYPES = {"bf16": "bfloat16", "fp32": "float32", "int64": "int64"}  # --dtypes names -> torch dtypes
TRAILING = {"bf16": (8,), "fp32": (2, 3), "int64": ()}  # trailing shapes (bf16 rows x 128 on a GPU)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                     epilog="Launch: python -m megatron_orch.trainer.launch --standalone "
                                            "--nproc-per-node N scripts/check_alltoall.py [--json PATH]")
    parser.add_argument("--json", type=Path, default=None, help="write the cases and their results here (rank 0)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="default: nccl where CUDA is available, else gloo")
    parser.add_argument("--dtypes", default=None, metavar="D,D,...",
                        help=f"stream dtypes, of {','.join(DTYPES)} (default: all on nccl; fp32,int64 on gloo, "
                             "whose all_to_all_single refuses bf16: 'Invalid scalar type')")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="ranks per (emulated) node of the node-wise all-to-all (default: torchrun's "
                             "LOCAL_WORLD_SIZE)")
    return parser.parse_args(argv)


def _cases(rng, world: int, large_rows: int, streams: int):
    """(name, src ranks, dst ranks, rows per item (one array per stream)) of every case, the same on all ranks."""
    import numpy as np

    def rows(n, most=4):
        return [rng.integers(0, most + 1, n) for _ in range(streams)]  # zero-row items included

    n = 3 * world + 1
    yield "random", rng.integers(0, world, n), rng.integers(0, world, n), rows(n)
    yield "one rank sends nothing", np.full(n, 0) if world == 1 else rng.integers(1, world, n), \
        rng.integers(0, world, n), rows(n)
    yield "one rank receives nothing", rng.integers(0, world, n), np.full(n, world - 1) if world == 1 else \
        rng.integers(0, world - 1, n), rows(n)
    yield "a phase with no items", np.zeros(0, int), np.zeros(0, int), rows(0)
    yield "only zero-row items", rng.integers(0, world, n), rng.integers(0, world, n), [np.zeros(n, int)] * streams
    same = rng.integers(0, world, n)
    yield "nothing moves", same, same, rows(n)
    big = 64 * world
    yield "large", rng.integers(0, world, big), rng.integers(0, world, big), rows(big, large_rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np
    import torch
    import torch.distributed as dist

    from megatron_orch.balance.comm_memory import CommunicatorMemory
    from megatron_orch.balance.plan import ALL_TO_ALL, Connections, Placement, Transfer
    from megatron_orch.comm.alltoall import ItemLayout
    from megatron_orch.comm.device import communication_device
    from megatron_orch.comm.group_topology import group_topology
    from megatron_orch.trainer import launch

    if "RANK" not in os.environ:
        launch.report_failure(PROG, "not started by torchrun ($RANK is not set): python -m "
                                    "megatron_orch.trainer.launch --standalone --nproc-per-node N "
                                    "scripts/check_alltoall.py")
        return 2
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = communication_device()
    names = (args.dtypes or ("fp32,int64" if backend == "gloo" else "bf16,fp32,int64")).split(",")
    unknown = sorted(set(names) - set(DTYPES))
    if unknown or not names:
        launch.report_failure(PROG, f"--dtypes: unknown {unknown}; choose from {','.join(DTYPES)}", show=rank == 0)
        return 2
    dtypes = tuple(getattr(torch, DTYPES[n]) for n in names)
    scale = 1 if backend == "gloo" else 128
    trailing = tuple((TRAILING[n][0] * scale,) if n == "bf16" else TRAILING[n] for n in names)
    node_of_rank = group_topology(gpus_per_node=args.gpus_per_node).node_of_rank
    dist.all_gather(list(torch.zeros(world, device=device).chunk(world)), torch.zeros(1, device=device))  # warm
    results, memory = [], {}
    for mode in ALL_TO_ALL:
        group = dist.new_group(list(range(world)))  # a communicator of its own: its memory is this mode's
        rng = np.random.default_rng(args.seed)  # the same draws on every rank, and for every mode
        connected, before = Connections.none(world), _device_memory(device)
        for c, (name, src, dst, rows) in enumerate(_cases(rng, world, 4 if backend == "gloo" else 256,
                                                          len(dtypes))):
            layouts = [ItemLayout(r, shape, dtype) for r, shape, dtype in zip(rows, trailing, dtypes)]
            transfer = Transfer(Placement.from_ranks(src, world, key=rng.permutation(len(src))),
                                Placement.from_ranks(dst, world, key=rng.permutation(len(dst))))
            item_bytes = sum(layout.rows * layout.row_numel for layout in layouts)
            connected = connected | transfer.moved_bytes(item_bytes, node_of_rank, mode).connections
            results.append(_case(f"{mode}: {name}", c, transfer, layouts, mode, node_of_rank, group, rank, world,
                                 device, args.seed))
        after = _device_memory(device)
        peers = connected.peers(node_of_rank)
        memory[mode] = {"peers_on_node": int(peers.intra_node[rank]),
                        "peers_across_nodes": int(peers.inter_node[rank]),
                        "modeled_mib": float(CommunicatorMemory().per_rank_mib(peers)[rank]),
                        **{k: after[k] - before[k] for k in after}}
    gathered = [None] * world
    dist.all_gather_object(gathered, (results, memory))
    dist.destroy_process_group()
    memories = [m for _, m in gathered]
    cases = [{"case": per_rank[0]["case"], "items": per_rank[0]["items"],
              "elements_sent_per_rank": [r["elements_sent"] for r in per_rank],
              "max_seconds": max(r["seconds"] for r in per_rank),
              "problems": {r["rank"]: r["problems"] for r in per_rank if r["problems"]}}
             for per_rank in zip(*(g[0] for g in gathered))]
    failed = [c["case"] for c in cases if c["problems"]]
    summary = (f"{len(cases)} cases on {world} rank(s) over {backend} ({device.type}), streams "
               f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    if rank == 0:
        print(f"[alltoall] {'case':<36} {'items':>6} {'elements sent per rank':>24} {'max s':>8}  result")
        for c in cases:
            print(f"[alltoall] {c['case']:<36} {c['items']:>6} {str(c['elements_sent_per_rank']):>24} "
                  f"{c['max_seconds']:8.4f}  {'ok' if not c['problems'] else c['problems']}")
        for mode in ALL_TO_ALL:
            for r, m in enumerate(memories):
                used, reserved = m[mode]["device_mib"], m[mode]["allocator_mib"]
                measured = (f"device +{used:.1f} MiB, allocator +{reserved:.1f} MiB, outside it (NCCL) "
                            f"+{used - reserved:.1f} MiB" if device.type == "cuda" else "not measured on CPU")
                print(f"[alltoall] {mode} communicator, rank {r}: {m[mode]['peers_on_node']} peers on its node + "
                      f"{m[mode]['peers_across_nodes']} across nodes, modeled {m[mode]['modeled_mib']:.0f} MiB; "
                      f"{measured}")
        if world == 1:
            print("[alltoall] one rank: no peers to connect; the communicator's memory per peer needs >= 2 GPUs, "
                  "the node-wise all-to-all's saving across nodes several nodes")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"world": world, "backend": backend, "device": str(device),
                                             "cases": cases, "communicator_memory": memories,
                                             "passed": not failed}, indent=1))
    if failed:
        launch.report_failure(PROG, f"[alltoall] FAILED: {', '.join(failed)} of {summary}",
                              show=rank == 0)
        return 1
    if rank == 0:
        print(f"[alltoall] PASSED: {summary}, flat and node-wise: every rank holds exactly the all_gather "
              "reference's items, and the inverse brings them back")
    return 0


def _device_memory(device) -> dict:
    """MiB the device has in use (``mem_get_info``: every allocation, NCCL's included) and the caching allocator
    has reserved (zeros on CPU)."""
    import torch
    if device.type != "cuda":
        return {"device_mib": 0.0, "allocator_mib": 0.0}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"device_mib": (total - free) / 2**20, "allocator_mib": torch.cuda.memory_reserved() / 2**20}


def _case(name, c, transfer, layouts, mode, node_of_rank, group, rank, world, device, seed) -> dict:
    """One case: this rank's items moved along ``transfer`` run ``mode`` over ``group``, checked against the
    all_gather reference, then brought back by the inverse."""
    import torch

    from megatron_orch.comm.alltoall import start_all_to_all_hops
    from megatron_orch.trainer import launch
    gen = torch.Generator().manual_seed(seed + 1000 * c + rank)  # this rank's own items only
    local = []
    for layout in layouts:
        shape = (layout.local_rows(transfer.src, rank), *layout.trailing_shape)
        local.append((torch.randn(shape, generator=gen).to(layout.dtype) if layout.dtype.is_floating_point
                      else torch.randint(-2**40, 2**40, shape, generator=gen, dtype=layout.dtype)).to(device))
    problems, start = [], time.perf_counter()
    try:
        moved = start_all_to_all_hops(local, layouts, transfer.hops(mode, node_of_rank), group).wait()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        back = start_all_to_all_hops(list(moved), layouts, transfer.inverse().hops(mode, node_of_rank), group).wait()
        for k, layout in enumerate(layouts):
            expected = _reference(local[k], layout, transfer, rank, world, device)
            if moved[k].shape != expected.shape or not torch.equal(_bits(moved[k]), _bits(expected)):
                problems.append(f"{layout.dtype} stream differs from the all_gather reference "
                                f"(shape {tuple(moved[k].shape)}, expected {tuple(expected.shape)})")
            if not torch.equal(_bits(back[k]), _bits(local[k])):
                problems.append(f"{layout.dtype} stream: the inverse transfer did not bring the items back")
    except Exception as err:  # noqa: BLE001 -- a case that raises is a failed case, the others still run
        seconds, problems = time.perf_counter() - start, [launch.one_line(err)]
    sent = sum(int(layout.rows[transfer.send_items(rank)].sum()) * layout.row_numel for layout in layouts)
    return {"case": name, "items": int(transfer.src.num_items), "rank": rank, "elements_sent": sent,
            "seconds": seconds, "problems": problems}


def _bits(tensor):
    """The tensor's bits as integers: an exact comparison (-0.0 vs 0.0, NaN included)."""
    import torch
    return tensor.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(tensor.dtype, tensor.dtype))


def _reference(local, layout, transfer, rank: int, world: int, device):
    """What ``rank`` must hold after the move, from every rank's packed tensor gathered (padded to the
    longest; the bits sent as integers, so every backend takes every dtype)."""
    import torch
    import torch.distributed as dist
    rows = [layout.local_rows(transfer.src, r) for r in range(world)]
    longest = max(rows + [0])
    padded = torch.zeros((longest, *layout.trailing_shape), dtype=local.dtype, device=device)
    padded[:local.shape[0]] = local
    flat = _bits(padded)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    items = {}
    for r in range(world):
        offset = 0
        for i in transfer.src.items_on(r):
            n = int(layout.rows[i])
            items[int(i)] = gathered[r][offset:offset + n]
            offset += n
    mine = [items[int(i)] for i in transfer.dst.items_on(rank)]
    out = torch.cat(mine) if mine else flat.new_empty((0, *layout.trailing_shape))
    return out.view(local.dtype) if local.dtype != out.dtype else out


if __name__ == "__main__":
    sys.exit(main())
