"""The compiled placement helpers against their numpy definitions; the line said while numba compiles."""
import itertools
import re
import zlib

import numba
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance import _plan_kernels
from megatron_orch.balance import _jit
from megatron_orch.balance._jit import announcing_compilation
from megatron_orch.balance.plan import Placement, checksum, moved_bytes


def reference_slots(rank, num_ranks, key):
    """Slot on its rank when a rank's items are ordered by key, ties by item id (the definition)."""
    order = np.lexsort((np.arange(rank.size), key, rank))
    counts = np.bincount(rank, minlength=num_ranks)
    slot = np.empty(rank.size, dtype=np.int64)
    slot[order] = np.arange(rank.size) - np.repeat(np.cumsum(counts) - counts, counts)
    return slot


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 7), st.integers(0, 60), st.integers(0, 80), st.integers(0, 2**31 - 1),
       st.sampled_from([3, 10**6, 2**40]))
def test_slots_and_expand_match_their_definitions(num_ranks, num_items, num_children, seed, key_span):
    rng = np.random.default_rng(seed)
    rank = rng.integers(0, num_ranks, num_items)
    key = rng.integers(-key_span, key_span, num_items)
    placement = Placement.from_ranks(rank, num_ranks, key=key)
    assert np.array_equal(placement.slot, reference_slots(rank, num_ranks, key))
    assert np.array_equal(Placement.from_ranks(rank, num_ranks).slot, reference_slots(rank, num_ranks, np.arange(num_items)))
    floats = Placement.from_ranks(rank, num_ranks, key=key.astype(np.float64) / 7)
    assert np.array_equal(floats.slot, reference_slots(rank, num_ranks, key.astype(np.float64) / 7))
    if num_items:
        parent = rng.integers(0, num_items, num_children)
        # children in any order, and listed by parent (an example's items: the kernel's run-by-run fill)
        for parent in (parent, np.sort(parent)):
            child = placement.expand(parent)
            assert np.array_equal(child.rank, rank[parent])
            assert np.array_equal(child.slot, reference_slots(rank[parent], num_ranks, placement.slot[parent]))
            Placement(rank=child.rank, slot=child.slot, num_ranks=num_ranks)  # valid


def test_expand_gathers_the_ranks_and_computes_the_slots_when_first_read():
    """A transfer's bytes are counted from its ranks alone (plan_step counts a step's embeddings, ~800k items at
    DP 10240, without their slots): expand gathers the ranks, and the slots (the definition's) are computed when
    first read, then kept."""
    rank, key = np.array([1, 0, 1, 1]), np.array([3, 0, 1, 2])
    parent = np.array([2, 0, 0, 3, 1])
    child = Placement.from_ranks(rank, 2, key=key).expand(parent)
    assert "slot" not in vars(child) and np.array_equal(child.rank, rank[parent])
    expected = reference_slots(rank[parent], 2, Placement.from_ranks(rank, 2, key=key).slot[parent])
    assert np.array_equal(child.slot, expected) and vars(child)["slot"] is child.slot
    with pytest.raises(AttributeError, match="no attribute 'slots'"):
        child.slots


def test_a_rank_or_parent_out_of_range_is_refused_naming_the_first():
    """The slot and expand kernels check the ranks and parents in their own passes: the first one outside is
    named, wherever it lies."""
    for bad in (0, 5, 9):
        rank = np.zeros(10, dtype=np.int64)
        rank[bad + 1:] = -1  # (later ones outside too)
        rank[bad] = 4
        with pytest.raises(ValueError, match=f"item {bad} is placed on rank 4, outside 0..3"):
            Placement.from_ranks(rank, 4)
        with pytest.raises(ValueError, match=f"item {bad} is placed on rank 4, outside 0..3"):
            Placement.from_ranks(rank, 4, key=np.arange(10))
        parent = np.zeros(10, dtype=np.int64)
        parent[bad] = 3
        with pytest.raises(ValueError, match=r"parent ids must lie in 0..2"):
            Placement.from_ranks([0, 1, 1], 2).expand(parent)
    with pytest.raises(ValueError, match=r"parent ids must lie in 0..2"):
        Placement.from_ranks([0, 1, 1], 2).expand([0, -1])
    with pytest.raises(ValueError, match="num_ranks must be >= 1, got 0"):
        Placement.from_ranks([], 0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(0, 60), st.integers(0, 2**31 - 1))
def test_stably_by_is_a_stable_sort_of_the_given_items(key_bound, num_items, seed):
    """The one counting sort (slots by key, distinct rank pairs, the alike exchange's classes): ``items`` in any
    order, a subset too, come back ordered by key with ties in their given order, as numpy's stable argsort."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, key_bound, num_items)
    for items in (rng.permutation(num_items), rng.choice(num_items, num_items // 2, replace=False)):
        items = items.astype(np.int64)
        expected = items[np.argsort(keys[items], kind="stable")]
        assert np.array_equal(_plan_kernels.stably_by(keys, items, key_bound), expected)


def test_moved_bytes_and_microbatches_match_numpy():
    rng = np.random.default_rng(3)
    node = np.repeat(np.arange(4), 3)
    home, rank = rng.integers(0, 12, 500), rng.integers(0, 12, 500)
    nbytes = rng.random(500)
    moved = moved_bytes(home, rank, nbytes, node)
    cross = node[home] != node[rank]
    local = (home != rank) & ~cross
    assert np.isclose(moved.inter_node, nbytes[cross].sum()) and np.isclose(moved.intra_node, nbytes[local].sum())
    assert np.isclose(moved.total, nbytes.sum()) and moved.off_gpu == moved.intra_node + moved.inter_node
    for per_rank, ranks, mask in ((moved.sent_intra, home, local), (moved.received_intra, rank, local),
                                  (moved.sent_inter, home, cross), (moved.received_inter, rank, cross)):
        np.testing.assert_allclose(per_rank, np.bincount(ranks[mask], weights=nbytes[mask], minlength=12))
    assert moved.times(2).inter_node == 2 * moved.inter_node
    # lengths in a narrow span (ordered by counting) and in one wider than the counted span (by merge sort)
    for tokens in (rng.integers(1, 50, 500), rng.integers(1, 4 * _plan_kernels._COUNTED_SPAN, 500)):
        micro = _plan_kernels.longest_first_microbatches(rank, tokens, 12, 3)
        for r in range(12):
            ids = np.flatnonzero(rank == r)
            order = ids[np.lexsort((ids, -tokens[ids]))]
            assert np.array_equal(micro[order], np.arange(order.size) // 3)
    assert _plan_kernels.longest_first_microbatches(rank[:0], tokens[:0], 12, 3).size == 0


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(0, 300), st.integers(0, 2**31 - 1))
def test_loads_before_after_are_numpys_sums_bit_for_bit(num_ranks, num_items, seed):
    """Keys at random, and in runs (a rank's items in a row, summed in a register): numpy's sums (and counts)
    either way."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0, 3, num_items)
    for before, after in ((rng.integers(0, num_ranks, num_items), rng.integers(0, num_ranks, num_items)),
                          (runs_of(rng, num_ranks, num_items), runs_of(rng, num_ranks, num_items))):
        loads, most = _plan_kernels.loads_before_after(before, after, weights, num_ranks)
        assert loads.tobytes() == np.bincount(before, weights=weights, minlength=num_ranks).tobytes()
        assert most == np.bincount(after, weights=weights, minlength=num_ranks).max()
        assert _plan_kernels.rank_loads_max(after, weights, num_ranks) == most
        assert np.array_equal(_plan_kernels.counts(before, num_ranks), np.bincount(before, minlength=num_ranks))


def runs_of(rng, bound, size):
    """``size`` keys below ``bound`` in runs of 1-6 equal keys (a key may come back in a later run)."""
    return np.repeat(rng.integers(0, bound, size), rng.integers(1, 7, size))[:size]


def _pull_ranks_numpy(home, example, source, nbytes, num_ranks):
    """The pull ranks as numpy finds them (the definition the kernel replaced): the (example, rank) pairs' sums, the
    pair of most bytes per example last after a lexsort (home first on ties, then the lower rank)."""
    keys, inverse = np.unique(example * num_ranks + source, return_inverse=True)
    total = np.bincount(inverse.reshape(-1), weights=nbytes, minlength=keys.size)
    pair_example, pair_rank = keys // num_ranks, keys % num_ranks
    at_home = pair_rank == home[pair_example]
    order = np.lexsort((-pair_rank, at_home, total, pair_example))
    last = np.flatnonzero(np.diff(np.append(pair_example[order], -1)) != 0)
    pull = home.copy()
    pull[pair_example[order[last]]] = pair_rank[order[last]]
    return pull


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9), st.integers(1, 30), st.integers(0, 120), st.sampled_from([3, 2**40]),
       st.integers(0, 2**31 - 1))
def test_pull_ranks_are_numpys(num_ranks, num_examples, num_entries, largest, seed):
    """Small byte counts (ties: home first, then the lower rank) and large ones, examples without entries."""
    rng = np.random.default_rng(seed)
    home = rng.integers(0, num_ranks, num_examples)
    example = rng.integers(0, num_examples, num_entries)
    source = np.where(rng.random(num_entries) < 0.3, home[example], rng.integers(0, num_ranks, num_entries))
    nbytes = rng.integers(0, largest + 1, num_entries)
    got = _plan_kernels.pull_ranks(home, example, source, nbytes, num_ranks)
    assert np.array_equal(got, _pull_ranks_numpy(home, example, source, nbytes, num_ranks))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(0, 300), st.integers(0, 2**31 - 1))
def test_sums_by_parent_and_padded_sums_are_numpys_bit_for_bit(num_keys, num_parents, num_items, seed):
    rng = np.random.default_rng(seed)
    parent_key, parent = rng.integers(0, num_keys, num_parents), rng.integers(0, num_parents, num_items)
    weights = rng.lognormal(0, 3, num_items) * (rng.random(num_items) < 0.8)  # some zeros
    for parent in (parent, runs_of(rng, num_parents, num_items)):  # (a parent's children in a row: a register)
        assert (_plan_kernels.sums_by_parent(parent_key, parent, weights, num_keys).tobytes()
                == np.bincount(parent_key[parent], weights=weights, minlength=num_keys).tobytes())
    key = parent_key[parent]
    longest = np.zeros(num_keys)
    np.maximum.at(longest, key, weights)
    assert (_plan_kernels.padded_sums(key, weights, num_keys).tobytes()
            == (np.bincount(key, minlength=num_keys) * longest).tobytes())


def test_a_compile_is_announced_before_it_runs_and_timed_after_and_a_compiled_kernel_says_nothing(monkeypatch):
    lines = []

    @numba.njit
    def twice(x):
        return 2 * x

    @numba.njit
    def thrice(x):
        return 3 * x

    with announcing_compilation(lines.append):
        assert twice(3) == 6
    assert len(lines) == 2 and lines[0].startswith("compiling the planning kernels (numba; first use"), lines
    assert re.fullmatch(r"planning kernels compiled in \d+ s", lines[1]), lines
    lines.clear()
    with announcing_compilation(lines.append):
        assert twice(4) == 8
    assert lines == []
    monkeypatch.setattr(_jit, "PROGRESS_EVERY_S", 0.0)  # a long compile: how far it got, between the two lines
    with announcing_compilation(lines.append):
        assert thrice(2) == 6
    assert len(lines) == 3 and re.fullmatch(r"  \.\.\. kernels compiled: 1, \d+ s", lines[1]), lines


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 80), st.integers(0, 2**31 - 1))
def test_sources_by_example_and_all_equal_match_their_definitions(num_ranks, num_examples, seed):
    rng = np.random.default_rng(seed)
    home = rng.integers(0, num_ranks, num_examples)
    example = np.repeat(np.arange(num_examples), rng.integers(0, 4, num_examples))
    item_rank = np.where(rng.random(example.size) < 0.5, home[example], rng.integers(0, num_ranks, example.size))
    item_bytes = rng.integers(1, 1000, example.size)
    at_home = rng.integers(0, 1000, num_examples)
    expected_at_home = at_home + np.bincount(example, weights=item_bytes * (item_rank == home[example]),
                                             minlength=num_examples).astype(np.int64)
    away = item_rank != home[example]
    out = _plan_kernels.sources_by_example(home, at_home, example, item_rank, item_bytes)
    assert np.array_equal(at_home, expected_at_home)
    for got, expected in zip(out, (example[away], item_rank[away], item_bytes[away])):
        assert np.array_equal(got, expected)
    for values in (item_bytes, np.full(example.size, 7), np.full(example.size, 2.5), item_bytes / 3):
        assert _plan_kernels.all_equal(values) == (values.size == 0 or values.min() == values.max())


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(0, 60), st.integers(0, 2**31 - 1))
def test_runs_merge_an_examples_consecutive_items_of_one_rank_and_send_what_they_send(num_ranks, num_examples, seed):
    """Against itertools.groupby (the definition), with how many items each run stands for, and moved anywhere the
    runs count the items' bytes exactly."""
    rng = np.random.default_rng(seed)
    example = np.repeat(np.arange(num_examples), rng.integers(0, 5, num_examples))
    example[rng.random(example.size) < 0.1] = 0  # an example's items need not come in one stretch
    rank = runs_of(rng, num_ranks, example.size)
    nbytes = rng.integers(0, 2**40, example.size)
    got = _plan_kernels.runs(example, rank, nbytes)
    groups = [(key, [int(nbytes[j]) for j in members]) for key, members in
              itertools.groupby(range(example.size), key=lambda j: (example[j], rank[j]))]
    assert ([(int(e), int(r), int(b), int(c)) for e, r, b, c in zip(*got)]
            == [(e, r, sum(b), len(b)) for (e, r), b in groups])
    node = np.arange(num_ranks) // 2
    backbone = rng.integers(0, num_ranks, max(num_examples, 1))
    per_item = moved_bytes(rank, backbone[example], nbytes, node)
    per_run = moved_bytes(got[1], backbone[got[0]], got[2], node)
    for field in ("total", "intra_node", "inter_node", "sent_intra", "received_intra", "sent_inter", "received_inter"):
        assert np.array_equal(getattr(per_run, field), getattr(per_item, field)), field
    assert np.array_equal(per_run.connections.pairs, per_item.connections.pairs)


def reference_fingerprint(values) -> int:
    """The plan digest's fingerprint, word by word in plain Python (its definition)."""
    mask, h = 2**64 - 1, 0xCBF29CE484222325
    for value in values:
        x = (int(value) % 2**64) * 0x9E3779B97F4A7C15 & mask
        x ^= x >> 29
        h = ((h ^ x) * 0x100000001B3) & mask
    return h


def reference_checksum(*arrays) -> int:
    value = 0
    for array in arrays:
        array = np.asarray(array, dtype=np.int64)
        value = zlib.crc32(np.asarray(array.shape, dtype=np.int64).tobytes(), value)
        value = zlib.crc32(np.uint64(reference_fingerprint(array.reshape(-1))).tobytes(), value)
    return value


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(-2**63, 2**63 - 1), max_size=12), max_size=5))
def test_fingerprints_and_the_checksum_match_their_definition(lists):
    """Fingerprints one at a time and two side by side (of arrays of any sizes), and the checksum that pairs
    them by size, against the word-by-word definition."""
    arrays = [np.array(values, dtype=np.int64) for values in lists]
    for a in arrays:
        assert _plan_kernels.fingerprint(a) == reference_fingerprint(a)
        for b in arrays:
            assert _plan_kernels.fingerprint_pair(a, b) == (reference_fingerprint(a), reference_fingerprint(b))
    assert checksum(*arrays) == reference_checksum(*arrays)
    assert checksum(*arrays, np.zeros((2, 3), dtype=np.int64)) == reference_checksum(*arrays, np.zeros((2, 3)))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 6), st.integers(1, 5), st.integers(0, 2**31 - 1), st.booleans())
def test_row_max_is_numpys(rows, columns, seed, with_nan):
    rng = np.random.default_rng(seed)
    values = rng.lognormal(0, 3, (rows, columns)) * (rng.random((rows, columns)) < 0.7)
    if with_nan and values.size:
        values[rng.integers(0, rows), rng.integers(0, columns)] = np.nan
    assert _plan_kernels.row_max(values).tobytes() == values.max(axis=1).tobytes()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40), st.integers(0, 2**31 - 1))
def test_repeat_parents_is_numpys_repeat(counts, seed):
    """Parents without children, with one and with several: numpy's repeats of the parent ids and of their values."""
    counts = np.array(counts, dtype=np.int64)
    values = np.random.default_rng(seed).integers(-9, 2**40, counts.size)
    parent, value = _plan_kernels.repeat_parents(counts, values)
    assert np.array_equal(parent, np.repeat(np.arange(counts.size), counts))
    assert np.array_equal(value, np.repeat(values, counts)) and parent.dtype == value.dtype == np.int64
