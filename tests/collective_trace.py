"""Each rank of a multi-rank test writes its collectives, in the order it issues them, to a file of its own; where
the run fails or hangs, :func:`part_ways` reads the files and says where the ranks' collectives parted: the first
collective of a process group that not every rank issued alike, or, where none, the last each rank issued.

A hang of ranks that issued different collectives (one gathers while its peers reduce) is a bug of the code under
test; one of ranks that issued the same ones is not an ordering bug. The trace tells which.

Traced: the collectives of the ``torch.distributed`` namespace (``dist.all_reduce(...)`` and
``torch.distributed.all_reduce(...)``, which megatron-core and this package call); a module that imported one by
name before the rank started is not seen. Collectives inside ``_coalescing_manager`` are traced one by one, as
called (they go out together when it closes).
"""
from __future__ import annotations

import os
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

# Not isend / irecv: P2POp takes them as its op and checks it is one of them (point-to-point ops in megatron-core's
# pipeline go through batch_isend_irecv, traced).
TRACED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
          "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather", "gather_object",
          "monitored_barrier", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
          "scatter_object_list", "send")
SITE_FRAMES = 4  # call-site frames kept per collective (outside torch.distributed)
_SKIPPED = (os.path.dirname(dist.__file__) + os.sep, __file__)


@dataclass(frozen=True)
class Collective:
    """One collective as a rank issued it: its place among that rank's collectives of ``group``."""

    index: int
    group: str      # the process group's name and ranks
    name: str
    shapes: str
    thread: str
    site: str

    def line(self) -> str:
        return "\t".join((str(self.index), self.group, self.name, self.shapes, self.thread, self.site)) + "\n"

    @classmethod
    def parse(cls, line: str) -> "Collective":
        index, group, name, shapes, thread, site = line.rstrip("\n").split("\t")
        return cls(int(index), group, name, shapes, thread, site)

    def describe(self) -> str:
        return f"{self.name} {self.shapes} (thread {self.thread}) at {self.site}"


def trace_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"collectives_rank{rank}.tsv")


def install(folder: str, rank: int) -> None:
    """Trace this process's collectives to :func:`trace_file` (line-buffered: what a hung rank issued is there)."""
    out = open(trace_file(folder, rank), "w", buffering=1)
    counts: Dict[str, int] = defaultdict(int)
    lock = threading.Lock()
    for name in TRACED:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, _traced(name, original, out, counts, lock))


def _traced(name, original, out, counts, lock):
    def call(*args, **kwargs):
        group = _group_label(kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None)))
        shapes = str([tuple(a.shape) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
        with lock:
            counts[group] += 1
            out.write(Collective(counts[group], group, name, shapes, threading.current_thread().name,
                                 _site()).line())
        return original(*args, **kwargs)

    call.__wrapped__ = original
    return call


def _group_label(group: Optional[dist.ProcessGroup]) -> str:
    if group is None:
        return "default"
    return f"{getattr(group, 'group_name', '?')} {dist.get_process_group_ranks(group)}"


def _site() -> str:
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < SITE_FRAMES:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIPPED[0]) and path != _SKIPPED[1]:
            frames.append(f"{os.path.basename(path)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(frames)


def read(folder: str, world_size: int) -> List[List[Collective]]:
    """Each rank's traced collectives (none for a rank that wrote no file)."""
    traces = []
    for rank in range(world_size):
        path = trace_file(folder, rank)
        if not os.path.exists(path):
            traces.append([])
            continue
        with open(path) as handle:
            traces.append([Collective.parse(line) for line in handle if line.count("\t") == 5])
    return traces


def _members(group: str, world_size: int) -> List[int]:
    if group == "default":
        return list(range(world_size))
    return [int(rank) for rank in group[group.index("[") + 1:group.rindex("]")].split(",") if rank.strip()]


def part_ways(traces: Sequence[Sequence[Collective]]) -> str:
    """Where the ranks' collectives parted: per process group, the first place where its ranks issued collectives
    of different kinds, or where some issued one and others none; where the ranks issued the same collectives in
    every group, each rank's last. Compared by kind only: sizes may differ by rank (an all-to-all's splits)."""
    by_group: Dict[str, Dict[int, List[Collective]]] = defaultdict(dict)
    for rank, trace in enumerate(traces):
        for collective in trace:
            members = by_group[collective.group]
            if not members:  # a rank of the group that issued none of its collectives is in the comparison too
                members.update((member, []) for member in _members(collective.group, len(traces)))
            members.setdefault(rank, []).append(collective)
    parted = []
    for group, ranks in by_group.items():
        longest = max(len(issued) for issued in ranks.values())
        for index in range(longest):
            kinds = {rank: issued[index].name if index < len(issued) else None for rank, issued in ranks.items()}
            if len(set(kinds.values())) > 1:
                lines = [f"  rank {rank}: " + (issued[index].describe() if index < len(issued)
                                               else f"none (its last of {len(issued)}: "
                                               f"{issued[-1].describe() if issued else '-'})")
                         for rank, issued in sorted(ranks.items())]
                parted.append(f"process group {group}, collective #{index + 1}:\n" + "\n".join(lines))
                break
    if parted:
        return "the ranks' collectives parted ways in " + "\n".join(parted)
    last = [f"  rank {rank}: " + (f"#{trace[-1].index} of group {trace[-1].group}: {trace[-1].describe()}"
                                  if trace else "none") for rank, trace in enumerate(traces)]
    return "every rank issued the same collectives in every process group; each rank's last:\n" + "\n".join(last)
