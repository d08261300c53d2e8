"""The item all-to-all and the size gather on 2, 4 and 8 gloo processes, against gather-then-select
references: every rank builds the whole global batch from a seed and checks that it holds exactly the
items the plan puts there, in slot order; gradients come back to where the items came from."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megatron_orch.balance.plan import Placement, Transfer, checksum
from megatron_orch.comm.alltoall import (ItemLayout, Route, all_to_all_items, routes_for, start_all_to_all_hops,
                                        start_all_to_all_items, upload_routes)
from megatron_orch.comm.gather import GroupMismatchError, gather_item_sizes
from megatron_orch.comm.group_topology import group_topology

# Two float32 streams (one dtype group, different trailing shapes) and one int64 stream.
TRAILING = [(3,), (2, 2), ()]
DTYPES = [torch.float32, torch.float32, torch.int64]


def _random_placement(rng, num_items, world, only_rank=None):
    ranks = np.full(num_items, only_rank) if only_rank is not None else rng.integers(0, world, num_items)
    return Placement.from_ranks(ranks, world, key=rng.permutation(num_items))


def _layouts(rng, num_items, dtypes=DTYPES, trailing=TRAILING):
    return [ItemLayout(rng.integers(0, 4, num_items), shape, dtype) for shape, dtype in zip(trailing, dtypes)]


def _items(layout: ItemLayout, seed: int):
    """The global batch of one stream: a distinct tensor per item, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows in layout.rows:
        shape = (int(rows), *layout.trailing_shape)
        if layout.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen, dtype=layout.dtype))
        else:
            out.append(torch.randint(-1000, 1000, shape, generator=gen, dtype=layout.dtype))
    return out


def _packed(items, layout, placement, rank):
    """What ``rank`` holds under ``placement``: its items concatenated in slot order."""
    chosen = [items[i] for i in placement.items_on(rank)]
    return torch.cat(chosen) if chosen else torch.empty((0, *layout.trailing_shape), dtype=layout.dtype)


def _move_and_check(transfer, layouts, seed, rank, group=None):
    items = [_items(layout, seed + k) for k, layout in enumerate(layouts)]
    local = [_packed(it, lay, transfer.src, rank) for it, lay in zip(items, layouts)]
    moved = all_to_all_items(local, layouts, transfer, group)
    for k, (out, it, lay) in enumerate(zip(moved, items, layouts)):
        expected = _packed(it, lay, transfer.dst, rank)
        assert out.dtype == lay.dtype and out.shape == expected.shape, (k, out.shape, expected.shape)
        assert torch.equal(out, expected), f"rank {rank} stream {k} differs"
    return moved


def _check_moves(rank, world):
    rng = np.random.default_rng(1234)  # same draws on every rank
    cases = []
    for trial in range(4):
        n = int(rng.integers(0, 3 * world + 1)) if trial else 0  # first case: no items at all
        cases.append(Transfer(_random_placement(rng, n, world), _random_placement(rng, n, world)))
    n = 2 * world + 1
    cases.append(Transfer(_random_placement(rng, n, world, only_rank=0), _random_placement(rng, n, world)))
    cases.append(Transfer(_random_placement(rng, n, world), _random_placement(rng, n, world, world - 1)))
    same = _random_placement(rng, n, world)
    cases.append(Transfer(same, same))  # nothing moves: the no-copy paths
    for t, transfer in enumerate(cases):
        layouts = _layouts(rng, transfer.src.num_items)
        _move_and_check(transfer, layouts, seed=100 * t, rank=rank)

    # Composition: one move along first.then(second) lands where the two moves in a row land,
    # and the inverse brings everything back.
    a, b, c = (_random_placement(rng, n, world) for _ in range(3))
    first, second = Transfer(a, b), Transfer(b, c)
    layouts = _layouts(rng, n)
    once = _move_and_check(first, layouts, seed=7, rank=rank)
    twice = all_to_all_items(once, layouts, second)
    direct = _move_and_check(first.then(second), layouts, seed=7, rank=rank)
    back = all_to_all_items(direct, layouts, first.then(second).inverse())
    items = [_items(layout, 7 + k) for k, layout in enumerate(layouts)]
    for k in range(len(layouts)):
        assert torch.equal(twice[k], direct[k])
        assert torch.equal(back[k], _packed(items[k], layouts[k], a, rank))


def _check_strided_subgroups(rank, world):
    """Megatron-style DP groups of non-consecutive global ranks: {0, 2} and {1, 3}."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    assert group_topology(group, gpus_per_node=2).node_of_rank.tolist() == [0, 1]
    rng = np.random.default_rng(99 + rank % 2)  # each subgroup its own plan
    n = 5
    transfer = Transfer(_random_placement(rng, n, 2), _random_placement(rng, n, 2))
    _move_and_check(transfer, _layouts(rng, n), seed=3, rank=dist.get_rank(group), group=group)


def _check_inverse_moves_back(rank, world):
    """``transfer.inverse()`` brings every row back where it came from (what the schedule relies on to
    return embedding gradients: moving items is a permutation, its adjoint its inverse), with ranks
    that hold nothing before or after, and streams of several dtypes."""
    rng = np.random.default_rng(5)
    n = 3 * world
    src = Placement.from_ranks(rng.integers(1, world, n), world)  # rank 0 holds nothing
    dst = Placement.from_ranks(rng.integers(0, world - 1, n), world, key=rng.permutation(n))  # last rank: nothing
    transfer = Transfer(src, dst)
    layouts = _layouts(rng, n, dtypes=[torch.float64, torch.float32, torch.int64])
    local = [_packed(_items(layout, 10 + k), layout, src, rank) for k, layout in enumerate(layouts)]
    moved = all_to_all_items(local, layouts, transfer)
    back = all_to_all_items(list(moved), layouts, transfer.inverse())
    assert not any(out.requires_grad for out in moved)
    for k, (got, want) in enumerate(zip(back, local)):
        assert torch.equal(got, want), (rank, k)
    # Adjoint: <A x, w> summed over ranks equals <x, A^-1 w>, for the floating-point streams.
    weights = [_packed(_items(layout, 20 + k), layout, dst, rank) for k, layout in enumerate(layouts[:2])]
    pulled = all_to_all_items(weights + [moved[2]], layouts, transfer.inverse())
    forward = torch.tensor([float((m.double() * w.double()).sum()) for m, w in zip(moved, weights)])
    backward = torch.tensor([float((x.double() * p.double()).sum()) for x, p in zip(local[:2], pulled[:2])])
    dist.all_reduce(forward), dist.all_reduce(backward)
    torch.testing.assert_close(forward, backward)


def _check_bad_inputs(rank, world):
    """Every check here is local and raises before any collective (all ranks pass bad input)."""
    rng = np.random.default_rng(3)
    n = 4
    transfer = Transfer(_random_placement(rng, n, world), _random_placement(rng, n, world))
    layout = ItemLayout(np.array([1, 2, 0, 3]), (3,), torch.float32)
    rows = layout.local_rows(transfer.src, rank)
    good = torch.zeros(rows, 3)
    bad = [
        ([torch.zeros(rows, 4)], [layout], transfer, "tensor shape"),
        ([torch.zeros(rows, 3, dtype=torch.float64)], [layout], transfer, "dtype"),
        ([torch.zeros(rows + 1, 3)], [layout], transfer, f"has {rows + 1} rows"),
        ([good, good], [layout], transfer, "2 tensors for 1 layouts"),
        ([good], [ItemLayout(np.array([1, 2, 0]), (3,), torch.float32)], transfer, "rows for 3 items"),
        ([good], [layout], Transfer(Placement.from_counts([4, 0, 0]), Placement.from_counts([0, 4, 0])),
         "spans 3 ranks"),
    ]
    for tensors, layouts, plan, match in bad:
        with pytest.raises(ValueError, match=match):
            all_to_all_items(tensors, layouts, plan)
    # The group is still healthy afterwards.
    _move_and_check(transfer, [layout], seed=1, rank=rank)


def _check_size_gather(rank, world):
    rng = np.random.default_rng(21)
    counts = rng.integers(0, 4, world)
    counts[world - 1] = 0  # a rank without items
    everything = rng.integers(0, 10**6, (int(counts.sum()), 3))
    starts = np.concatenate(([0], np.cumsum(counts)))
    mine = everything[starts[rank]:starts[rank + 1]]
    for max_count in (None, int(counts.max()) + 2):
        gathered = gather_item_sizes(mine, max_count=max_count, checks={"check value": checksum(counts)})
        assert not gathered.failed
        assert np.array_equal(gathered.sizes, everything) and np.array_equal(gathered.counts, counts)
        assert np.array_equal(gathered.home_rank, np.repeat(np.arange(world), counts))
        assert gathered.placement().same_as(Placement.from_counts(counts))
    # Disagreements raise the same error on every rank, and the group stays usable.
    with pytest.raises(GroupMismatchError, match="disagree on the check value"):
        gather_item_sizes(mine, checks={"check value": rank})
    with pytest.raises(GroupMismatchError, match="rank 1 has negative sizes"):
        gather_item_sizes(-np.ones((1, 3), dtype=np.int64) if rank == 1 else mine)
    with pytest.raises(GroupMismatchError, match="more items than max_count"):
        gather_item_sizes(mine, max_count=int(counts.max()) - 1)
    with pytest.raises(GroupMismatchError, match="size fields"):
        gather_item_sizes(np.zeros((1, 2 + (rank == 0)), dtype=np.int64))
    # Hostnames gathered over the group: every process of this test runs on one node.
    assert group_topology(env={}).node_of_rank.tolist() == [0] * world
    assert np.array_equal(gather_item_sizes(mine).sizes, everything)


def _check_async_moves_with_routes_made_ahead(rank, world):
    """Routes built on the host ahead of time and uploaded once serve the all-to-alls of any row width;
    several exchanges in flight at once, waited for in any order, give what one exchange at a time gives."""
    rng = np.random.default_rng(77)
    transfers = [Transfer(_random_placement(rng, n, world), _random_placement(rng, n, world))
                 for n in (3 * world, 1, 0, 2 * world)]
    layouts = [_layouts(rng, t.src.num_items) for t in transfers]
    routes = [upload_routes(routes_for(t, rank, lay), torch.device("cpu")) for t, lay in zip(transfers, layouts)]
    items = [[_items(layout, 50 * j + k) for k, layout in enumerate(lay)] for j, lay in enumerate(layouts)]
    local = [[_packed(it, layout, t.src, rank) for it, layout in zip(its, lay)]
             for t, lay, its in zip(transfers, layouts, items)]
    pending = [start_all_to_all_items(x, lay, t, routes=r) for x, lay, t, r in zip(local, layouts, transfers, routes)]
    for j in reversed(range(len(transfers))):  # completion order is the caller's
        for k, (got, it, layout) in enumerate(zip(pending[j].wait(), items[j], layouts[j])):
            assert torch.equal(got, _packed(it, layout, transfers[j].dst, rank)), (rank, j, k)
    with pytest.raises(RuntimeError, match="already called"):
        pending[0].wait()
    # One route, rows of another width (embeddings of another hidden size use the route of the plan).
    transfer = transfers[0]
    rows = np.full(transfer.src.num_items, 2, dtype=np.int64)
    route = upload_routes([Route.build(transfer, rank, [rows])], torch.device("cpu"))
    for width in (3, 5):
        layout = ItemLayout(rows, (width,), torch.float32)
        data = _items(layout, 9 + width)
        moved, = all_to_all_items([_packed(data, layout, transfer.src, rank)], [layout], transfer, routes=route)
        assert torch.equal(moved, _packed(data, layout, transfer.dst, rank))
    # Routes of other streams are refused before the collective.
    with pytest.raises(ValueError, match="routes for"):
        all_to_all_items(local[0], layouts[0], transfers[0], routes=routes[0][:1])
    others = upload_routes(routes_for(transfers[0], (rank + 1) % world, layouts[0]), torch.device("cpu"))
    if [r.send.local_rows for r in others] != [r.send.local_rows for r in routes[0]]:
        with pytest.raises(ValueError, match="a route for local rows"):
            all_to_all_items(local[0], layouts[0], transfers[0], routes=others)
    with pytest.raises(ValueError, match="not uploaded"):
        all_to_all_items(local[0], layouts[0], transfers[0], routes=routes_for(transfers[0], rank, layouts[0]))


@pytest.mark.distributed
def test_async_moves_with_routes_made_ahead_three_ranks():
    run_distributed(_check_async_moves_with_routes_made_ahead, 3)


def _check_failures_and_peers_reach_every_rank(rank, world):
    """DP groups {0, 1}, {2, 3}; TP/PP peers {0, 2}, {1, 3}. A rank that failed, or peers that disagree,
    are known to every rank after the one size gather of its DP group (no world-wide collective)."""
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    peer_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp, peers = dp_groups[rank // 2], peer_groups[rank % 2]
    mine = np.full((rank % 2 + 1, 2), rank, dtype=np.int64)

    def gather(**kw):
        return gather_item_sizes(mine, dp, max_count=2, peer_group=peers, **kw)

    ok = gather(checks={"plan digest": 11, "step status": 0})
    assert not ok.failed and ok.counts.tolist() == [1, 2]
    assert ok.sizes.tolist() == [[rank // 2 * 2] * 2] + [[rank // 2 * 2 + 1] * 2] * 2
    for failing in range(world):
        assert gather(checks={"plan digest": 11}, failed=rank == failing).failed, failing
    with pytest.raises(GroupMismatchError, match=r"disagree on the plan digest \(TP/PP peers\)"):
        gather(checks={"plan digest": rank // 2, "step status": 0})
    with pytest.raises(GroupMismatchError, match=r"disagree on the step status: per rank \[0, 1\]"):
        gather(checks={"plan digest": 1, "step status": rank % 2})
    # Without max_count (two collectives) the peers' verdict travels in the header.
    assert gather_item_sizes(mine, dp, peer_group=peers, failed=rank == 3).failed
    assert gather_item_sizes(mine, dp, peer_group=peers).counts.tolist() == [1, 2]


@pytest.mark.distributed
def test_failures_and_peer_disagreements_reach_every_rank_four_ranks():
    run_distributed(_check_failures_and_peers_reach_every_rank, 4)


@pytest.mark.distributed
def test_size_gather_two_ranks():
    run_distributed(_check_size_gather, 2)


@pytest.mark.distributed
def test_moves_match_gather_reference_two_ranks():
    run_distributed(_check_moves, 2)


@pytest.mark.distributed
def test_moves_match_gather_reference_four_ranks_and_strided_groups():
    run_distributed(_check_moves, 4)
    run_distributed(_check_strided_subgroups, 4)


@pytest.mark.distributed
def test_inverse_transfer_moves_every_row_back_four_ranks():
    run_distributed(_check_inverse_moves_back, 4)


@pytest.mark.distributed
def test_bad_inputs_raise_before_the_collective():
    run_distributed(_check_bad_inputs, 2)


def _check_node_wise(rank, world):
    """Emulated nodes of 4 ranks (``gpus_per_node``): a node-wise transfer (``Transfer.node_wise``'s hops) gives
    what the flat one gives, bit for bit, and the gather reference, forward and back along the inverse (the
    gradients' way), and this rank exchanges only with ranks of its node and its rail peers."""
    node_of_rank = group_topology(gpus_per_node=4).node_of_rank
    rng = np.random.default_rng(38)
    for trial in range(3):
        n = int(rng.integers(1, 4 * world))
        transfer = Transfer(_random_placement(rng, n, world), _random_placement(rng, n, world))
        layouts = _layouts(rng, n)
        items = [_items(layout, 40 + trial * 5 + k) for k, layout in enumerate(layouts)]
        local = [_packed(it, lay, transfer.src, rank) for it, lay in zip(items, layouts)]
        hops = transfer.hops("node-wise", node_of_rank)
        node_wise = start_all_to_all_hops(local, layouts, hops).wait()
        flat = all_to_all_items(local, layouts, transfer)
        for k, (it, lay) in enumerate(zip(items, layouts)):
            assert torch.equal(node_wise[k], flat[k]), (rank, trial, k)
            assert torch.equal(node_wise[k], _packed(it, lay, transfer.dst, rank)), (rank, trial, k)
        grads = [_packed(_items(lay, 90 + k), lay, transfer.dst, rank) for k, lay in enumerate(layouts)]
        back = start_all_to_all_hops(grads, layouts, transfer.inverse().hops("node-wise", node_of_rank)).wait()
        for k, (got, want) in enumerate(zip(back, all_to_all_items(grads, layouts, transfer.inverse()))):
            assert torch.equal(got, want), (rank, trial, k)
        routes = routes_for(hops[0], rank, layouts) + (routes_for(hops[1], rank, layouts) if len(hops) > 1 else [])
        peers = {p for route in routes for side in (route.send, route.recv)
                 for p in np.flatnonzero(side.peer_rows.sum(axis=0))} - {rank}
        assert all(node_of_rank[p] == node_of_rank[rank] or p % 4 == rank % 4 for p in peers), (rank, peers)


def _check_eight(rank, world):
    _check_size_gather(rank, world)
    rng = np.random.default_rng(8)
    transfer = Transfer(_random_placement(rng, 12, world), _random_placement(rng, 12, world))
    _move_and_check(transfer, _layouts(rng, 12), seed=5, rank=rank)
    _check_inverse_moves_back(rank, world)
    _check_node_wise(rank, world)


@pytest.mark.distributed
def test_eight_ranks():
    run_distributed(_check_eight, 8, timeout_s=150)
