"""The multi-rank harness's collective trace: where the ranks' collectives parted, from each rank's trace."""
import time

import pytest
import torch
import torch.distributed as dist

from collective_trace import Collective, part_ways
from dist_utils import run_distributed

GROUP = "5 [0, 1, 2]"
PAIR = "7 [0, 1]"


def _issued(*calls):
    """A rank's trace from (group, name, shapes) calls, numbered per group as install() numbers them."""
    counts, trace = {}, []
    for group, name, shapes in calls:
        counts[group] = counts.get(group, 0) + 1
        trace.append(Collective(counts[group], group, name, shapes, "MainThread", f"model.py:{10 * counts[group]} f"))
    return trace


def test_the_first_collective_of_another_kind_is_named_with_every_ranks_own():
    gathers = [(GROUP, "all_gather_into_tensor", "[(8,), (2,)]")] * 2
    traces = [_issued(*gathers, (GROUP, "reduce_scatter_tensor", "[(2,), (8,)]")),
              _issued(*gathers, (GROUP, "all_gather_into_tensor", "[(8,), (2,)]"), (GROUP, "reduce_scatter_tensor",
                                                                                      "[(2,), (8,)]")),
              _issued(*gathers, (GROUP, "reduce_scatter_tensor", "[(2,), (8,)]"))]
    report = part_ways(traces)
    assert report.startswith("the ranks' collectives parted ways in process group 5 [0, 1, 2], collective #3:")
    assert "rank 0: reduce_scatter_tensor [(2,), (8,)] (thread MainThread) at model.py:30 f" in report
    assert "rank 1: all_gather_into_tensor [(8,), (2,)] (thread MainThread) at model.py:30 f" in report


def test_a_rank_that_issued_fewer_or_none_is_named_with_its_last():
    traces = [_issued((PAIR, "all_reduce", "[(4,)]"), (PAIR, "broadcast", "[(4,)]")),
              _issued((PAIR, "all_reduce", "[(4,)]")),
              _issued()]
    report = part_ways(traces)
    assert "process group 7 [0, 1], collective #2:" in report
    assert "rank 1: none (its last of 1: all_reduce [(4,)]" in report
    assert "rank 2" not in report  # not a member of the pair
    member_silent = part_ways([_issued((PAIR, "all_reduce", "[(4,)]")), _issued(), _issued()])
    assert "collective #1:" in member_silent and "rank 1: none (its last of 0: -)" in member_silent


def test_sizes_may_differ_by_rank_and_alike_traces_name_each_ranks_last():
    """An all-to-all's splits differ by rank: not a parting. Alike traces: every rank's last collective."""
    traces = [_issued((GROUP, "all_to_all_single", f"[({4 + rank},), (3,)]"), ("default", "barrier", "[]"))
              for rank in range(3)]
    report = part_ways(traces)
    assert report.startswith("every rank issued the same collectives in every process group; each rank's last:")
    assert "rank 2: #1 of group default: barrier []" in report


def _reduce_but_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(0.5)  # rank 0 reaches its all-reduce first
        raise ValueError("rank 1 stops before the all-reduce")
    dist.all_reduce(torch.ones(3))


@pytest.mark.distributed
def test_a_failed_run_notes_where_the_ranks_collectives_parted():
    """Rank 1 fails before the all-reduce rank 0 waits in: the failure's note names both, with rank 0's call site."""
    with pytest.raises(RuntimeError, match="rank 1 stops before the all-reduce") as failure:
        run_distributed(_reduce_but_rank_1, 2, timeout_s=60.0)
    note = "\n".join(failure.value.__notes__)
    assert "the ranks' collectives parted ways in process group default, collective #1:" in note, note
    assert "rank 0: all_reduce [(3,)] (thread MainThread) at test_collective_trace.py:" in note, note
    assert "_reduce_but_rank_1" in note and "rank 1: none (its last of 0: -)" in note, note
