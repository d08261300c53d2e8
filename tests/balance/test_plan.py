"""Placement / Transfer algebra against a direct simulation of moving lists of items between ranks."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.plan import Placement, Transfer


def simulate(transfer: Transfer, src_lists):
    """Reference: each rank sends its items in wire order; receivers reorder into destination slots."""
    num_ranks = transfer.num_ranks
    outboxes = {}
    for r in range(num_ranks):
        ids = transfer.send_items(r)
        assert sorted(ids.tolist()) == sorted(src_lists[r])
        for d in range(num_ranks):
            outboxes[(r, d)] = [i for i in ids if transfer.dst.rank[i] == d]
    dst_lists = []
    for d in range(num_ranks):
        arrived = [i for s in range(num_ranks) for i in outboxes[(s, d)]]
        assert arrived == transfer.recv_items(d).tolist()
        dst_lists.append(sorted(arrived, key=lambda i: transfer.dst.slot[i]))
    return dst_lists


@st.composite
def placements(draw, num_items=None, num_ranks=None):
    num_ranks = num_ranks or draw(st.integers(1, 6))
    n = draw(st.integers(0, 30)) if num_items is None else num_items
    rank = draw(st.lists(st.integers(0, num_ranks - 1), min_size=n, max_size=n))
    key = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return Placement.from_ranks(np.array(rank, dtype=np.int64), num_ranks, key=np.array(key))


@st.composite
def transfer_chains(draw):
    num_ranks = draw(st.integers(1, 6))
    n = draw(st.integers(0, 30))
    a, b, c = (draw(placements(n, num_ranks)) for _ in range(3))
    return a, b, c


@settings(max_examples=150, deadline=None)
@given(transfer_chains())
def test_transfer_delivers_every_item_to_its_slot_once(chain):
    src, dst, _ = chain
    t = Transfer(src, dst)
    src_lists = [src.items_on(r).tolist() for r in range(src.num_ranks)]
    got = simulate(t, src_lists)
    assert got == [dst.items_on(r).tolist() for r in range(dst.num_ranks)]
    for r in range(t.num_ranks):
        assert t.send_counts(r).sum() == len(src_lists[r])
        assert np.array_equal(t.send_counts(r), t.traffic_matrix()[r])
        assert np.array_equal(t.recv_counts(r), t.traffic_matrix()[:, r])
    assert t.traffic_matrix().sum() == src.num_items


@settings(max_examples=100, deadline=None)
@given(transfer_chains())
def test_composition_equals_two_moves_and_inverse_returns(chain):
    a, b, c = chain
    first, second = Transfer(a, b), Transfer(b, c)
    lists_a = [a.items_on(r).tolist() for r in range(a.num_ranks)]
    two_hops = simulate(second, simulate(first, lists_a))
    assert two_hops == simulate(first.then(second), lists_a)
    assert simulate(first.inverse(), simulate(first, lists_a)) == lists_a


@settings(max_examples=100, deadline=None)
@given(placements(), st.data())
def test_expand_keeps_children_with_their_parent_in_parent_order(parents, data):
    n_children = data.draw(st.integers(0, 40))
    if parents.num_items == 0:
        n_children = 0
    parent = np.array(data.draw(st.lists(st.integers(0, max(parents.num_items - 1, 0)),
                                         min_size=n_children, max_size=n_children)), dtype=np.int64)
    children = parents.expand(parent)
    assert np.array_equal(children.rank, parents.rank[parent])
    for r in range(parents.num_ranks):
        order = children.items_on(r)
        keys = [(parents.slot[parent[j]], j) for j in order]
        assert keys == sorted(keys)


def test_from_counts_is_the_loader_layout():
    p = Placement.from_counts([2, 0, 3])
    assert p.rank.tolist() == [0, 0, 2, 2, 2]
    assert p.slot.tolist() == [0, 1, 0, 1, 2]
    assert p.counts().tolist() == [2, 0, 3]


def test_bad_placements_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="item 1 is placed on rank 3"):
        Placement.from_ranks([0, 3], num_ranks=2)
    with pytest.raises(ValueError, match="permutation"):
        Placement(rank=np.array([0, 0]), slot=np.array([0, 0]), num_ranks=1)
    with pytest.raises(ValueError, match="integers"):
        Placement.from_ranks(np.array([0.5]), num_ranks=1)
    with pytest.raises(ValueError, match="3 items but dst holds 2"):
        Transfer(Placement.from_counts([3]), Placement.from_counts([2]))
    with pytest.raises(ValueError, match="cannot compose"):
        a = Placement.from_counts([1, 1])
        b = Placement.from_ranks([1, 0], 2)
        Transfer(a, b).then(Transfer(a, b))
