"""Peer accounting (``MovedBytes.connections``, ``Connections.peers``), the node-wise all-to-all's hops and the
communicator-memory model, against brute-force sets of rank pairs."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.comm_memory import CommunicatorMemory
from megatron_orch.balance.plan import Connections, Placement, Transfer, exchanged_bytes, moved_bytes
from megatron_orch.balance.topology import Topology


def brute_peers(moves, node_of_rank):
    """Per rank, the ranks it sent bytes to or received bytes from in any of ``moves`` ((src, dst, bytes) lists),
    split into those on its node and the others."""
    peers = [set() for _ in node_of_rank]
    for src, dst, nbytes in moves:
        for s, d, b in zip(src, dst, nbytes):
            if s != d and b > 0:
                peers[s].add(d)
                peers[d].add(s)
    intra = [sum(node_of_rank[p] == node_of_rank[r] for p in mine) for r, mine in enumerate(peers)]
    return np.array(intra), np.array([len(mine) for mine in peers]) - np.array(intra)


@st.composite
def runs(draw):
    """A topology and a few moves over it (a run's steps)."""
    gpus_per_node = draw(st.integers(1, 4))
    num_ranks = gpus_per_node * draw(st.integers(1, 4))
    moves = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 25))
        ranks = st.lists(st.integers(0, num_ranks - 1), min_size=n, max_size=n)
        moves.append((draw(ranks), draw(ranks), draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))))
    return Topology.uniform(num_ranks, gpus_per_node).node_of_rank, moves


@settings(max_examples=150, deadline=None)
@given(runs())
def test_peers_of_a_step_and_of_a_run_match_brute_force(run):
    node_of_rank, moves = run
    connections = [moved_bytes(src, dst, nbytes, node_of_rank).connections for src, dst, nbytes in moves]
    for move, connected in zip(moves, connections):  # each move alone
        intra, inter = brute_peers([move], node_of_rank)
        peers = connected.peers(node_of_rank)
        assert peers.intra_node.tolist() == intra.tolist() and peers.inter_node.tolist() == inter.tolist()
    run_connections = Connections.none(node_of_rank.size)
    for connected in connections:  # the union: cumulative over the run
        run_connections = run_connections | connected
    intra, inter = brute_peers(moves, node_of_rank)
    peers = run_connections.peers(node_of_rank)
    assert peers.intra_node.tolist() == intra.tolist() and peers.inter_node.tolist() == inter.tolist()
    assert peers.busiest() == (int((intra + inter).max()), int(intra.max()), int(inter.max()))



@settings(max_examples=100, deadline=None)
@given(runs(), st.sampled_from(["flat", "node-wise"]))
def test_bytes_counted_without_their_connections_are_the_same_bytes(run, all_to_all):
    """What the planner reads of a candidate (``exchanged_bytes(..., connections=False)``): every byte figure as
    counted with the connections (and as :func:`moved_bytes` counts a flat move), none of the connections."""
    node_of_rank, moves = run
    for src, dst, nbytes in moves:
        full = exchanged_bytes(src, dst, nbytes, node_of_rank, all_to_all)
        bare = exchanged_bytes(src, dst, nbytes, node_of_rank, all_to_all, connections=False)
        for name in ("total", "intra_node", "inter_node", "node_wise"):
            assert getattr(bare, name) == getattr(full, name)
        for name in ("sent_intra", "received_intra", "sent_inter", "received_inter"):
            assert np.array_equal(getattr(bare, name), getattr(full, name))
        assert bare.connections.pairs.size == 0 and bare.connections.num_ranks == node_of_rank.size
        if all_to_all == "flat":
            counted = moved_bytes(src, dst, nbytes, node_of_rank)
            assert np.array_equal(full.connections.pairs, counted.connections.pairs)

@st.composite
def node_wise_cases(draw):
    gpus_per_node = draw(st.integers(1, 4))
    num_ranks = gpus_per_node * draw(st.integers(1, 4))
    n = draw(st.integers(0, 30))
    ranks = st.lists(st.integers(0, num_ranks - 1), min_size=n, max_size=n)
    keys = st.lists(st.integers(0, 5), min_size=n, max_size=n)
    src = Placement.from_ranks(np.array(draw(ranks), dtype=np.int64), num_ranks, key=np.array(draw(keys)))
    dst = Placement.from_ranks(np.array(draw(ranks), dtype=np.int64), num_ranks, key=np.array(draw(keys)))
    nbytes = np.array(draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)), dtype=np.float64)
    return gpus_per_node, Transfer(src, dst), nbytes


@settings(max_examples=200, deadline=None)
@given(node_wise_cases())
def test_node_wise_hops_compose_to_the_transfer_and_bound_peers(case):
    gpus_per_node, transfer, nbytes = case
    node_of_rank = Topology.uniform(transfer.num_ranks, gpus_per_node).node_of_rank
    hops = transfer.node_wise(node_of_rank)
    assert 1 <= len(hops) <= 2
    composed = hops[0] if len(hops) == 1 else hops[0].then(hops[1])
    assert composed.src.same_as(transfer.src) and composed.dst.same_as(transfer.dst)
    local = np.arange(transfer.num_ranks) % gpus_per_node
    for hop in hops:  # on a node, or between rail peers (the same local index)
        moving = hop.src.rank != hop.dst.rank
        on_node = node_of_rank[hop.src.rank] == node_of_rank[hop.dst.rank]
        rail = local[hop.src.rank] == local[hop.dst.rank]
        assert np.all(~moving | on_node | rail)
    if len(hops) == 2:
        assert np.all(node_of_rank[hops[0].src.rank] == node_of_rank[hops[0].dst.rank])
        assert np.all(local[hops[1].src.rank] == local[hops[1].dst.rank])
    flat = transfer.moved_bytes(nbytes, node_of_rank)
    node_wise = transfer.moved_bytes(nbytes, node_of_rank, "node-wise")
    assert node_wise.node_wise and not flat.node_wise
    assert node_wise.total == flat.total and node_wise.inter_node == flat.inter_node  # crosses nodes once
    assert node_wise.intra_node >= flat.intra_node
    nodes = transfer.num_ranks // gpus_per_node
    peers = node_wise.connections.peers(node_of_rank)
    assert peers.intra_node.max(initial=0) <= gpus_per_node - 1 and peers.inter_node.max(initial=0) <= nodes - 1


def test_node_wise_at_dp_2560_connects_at_most_326_peers():
    """The first node's ranks send to every rank and receive from every rank (their flat worst case, 2559
    peers): node-wise, 7 on the node and 319 rail peers."""
    num_ranks, gpus_per_node = 2560, 8
    first_node, every = np.arange(gpus_per_node), np.arange(num_ranks)
    src = np.concatenate((np.repeat(first_node, num_ranks), np.tile(every, gpus_per_node)))
    dst = np.concatenate((np.tile(every, gpus_per_node), np.repeat(first_node, num_ranks)))
    transfer = Transfer(Placement.from_ranks(src, num_ranks), Placement.from_ranks(dst, num_ranks))
    node_of_rank = Topology.uniform(num_ranks, gpus_per_node).node_of_rank
    nbytes = np.ones(src.size)
    assert transfer.moved_bytes(nbytes, node_of_rank).connections.peers(node_of_rank).busiest() == (2559, 7, 2552)
    assert transfer.moved_bytes(nbytes, node_of_rank, "node-wise").connections.peers(node_of_rank).busiest() == \
        (326, 7, 319)


def test_node_wise_refuses_unequal_nodes_and_unknown_modes():
    transfer = Transfer(Placement.from_ranks([0, 1, 2], 3), Placement.from_ranks([2, 0, 1], 3))
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        transfer.node_wise(np.array([0, 0, 1]))
    with pytest.raises(ValueError, match="unknown all-to-all 'ring'"):
        transfer.hops("ring", np.array([0, 1, 2]))


def test_communicator_memory_counts_each_kind_of_peer():
    model = CommunicatorMemory()
    assert model.nvlink_peer_bytes == 2 * 2 * 8 * (512 << 10)  # connections x channels x steps x chunk: 16 MiB
    assert model.net_peer_bytes == 2 * 2 * 8 * (128 << 10)  # 4 MiB
    connected = moved_bytes([0, 0, 0], [1, 2, 3], [1, 1, 1], [0, 0, 1, 1]).connections
    mib = model.per_rank_mib(connected.peers([0, 0, 1, 1]))
    assert mib.tolist() == [16 + 2 * 4, 16, 4, 4]
    with pytest.raises(ValueError, match="CommunicatorMemory.steps must be >= 1"):
        CommunicatorMemory(steps=0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9).flatmap(lambda ranks: st.tuples(st.just(ranks), st.lists(
    st.tuples(st.integers(0, ranks - 1), st.integers(0, ranks - 1)), max_size=40))))
def test_distinct_pairs_is_np_unique(case):
    """The linear-time dedupe of the accountant's rank pairs (repeats, any order, empty) equals np.unique."""
    from megatron_orch.balance._plan_kernels import distinct_pairs
    ranks, links = case
    lows = np.array([min(a, b) for a, b in links], dtype=np.int64)
    highs = np.array([max(a, b) for a, b in links], dtype=np.int64)
    assert np.array_equal(distinct_pairs(lows, highs, ranks), np.unique(lows * ranks + highs))


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 60)), st.sets(st.integers(0, 60)))
def test_sorted_union_is_np_union1d(a, b):
    """The merge that joins connections (disjoint, overlapping, equal, empty sets) equals np.union1d."""
    from megatron_orch.balance._plan_kernels import sorted_union
    a, b = np.array(sorted(a), dtype=np.int64), np.array(sorted(b), dtype=np.int64)
    assert np.array_equal(sorted_union(a, b), np.union1d(a, b))


def test_byte_accountant_refuses_mismatched_inputs():
    """Bytes per item, ranks and the node map are checked once, where they enter the accountant."""
    transfer = Transfer(Placement.from_counts([2, 1]), Placement.from_ranks([1, 0, 0], 2))
    assert transfer.moved_bytes(np.array([1, 2, 3]), [0, 1]).inter_node == 4.0  # items 0 and 2 cross; int64 kept
    assert transfer.moved_bytes([1.0, 2.0, 3.0], [0, 1]).inter_node == 4.0
    with pytest.raises(ValueError, match=r"item_bytes has shape \(2,\), expected \(3,\)"):
        transfer.moved_bytes([1, 2], [0, 1])
    with pytest.raises(ValueError, match="node_of_rank has 3 ranks, the transfer spans 2"):
        transfer.moved_bytes([1, 2, 3], [0, 0, 1])
    with pytest.raises(ValueError, match="dst_rank holds ranks outside 0..1"):
        moved_bytes([0], [2], [1], [0, 1])
    with pytest.raises(ValueError, match="src_rank and dst_rank differ in shape"):
        moved_bytes([0, 1], [1], [1, 1], [0, 1])


def test_run_peers_of_one_rank_are_the_union_of_its_steps_and_refuse_other_groups():
    """RunPeers (one rank's peers over a run, kept per rank by the post-balancing iterator) equals the union of the
    steps' connections at that rank, on its node and across nodes; a rank or a step of another group is refused."""
    from megatron_orch.balance.plan import RunPeers

    node = np.repeat(np.arange(3), 4)
    rng = np.random.default_rng(5)
    union, runs = Connections.none(12), [RunPeers(rank, node) for rank in range(12)]
    for _ in range(4):
        low = rng.integers(0, 11, 6)
        high = low + 1 + rng.integers(0, 11 - low)
        step = Connections(12, np.unique(low * 12 + high))
        union = union | step
        peers = union.peers(node)
        assert [run.add(step) for run in runs] == list(zip(peers.intra_node.tolist(), peers.inter_node.tolist()))
    with pytest.raises(ValueError, match="rank 12 is outside 0..11"):
        RunPeers(12, node)
    with pytest.raises(ValueError, match="connections of 8 ranks, the run's 12"):
        runs[0].add(Connections.none(8))
