"""The pure-Python ``localize`` (balance/repair.py) the compiled kernel (balance/_kernels/repair.py) replaced: the
reference its plans are tested against, choice for choice."""
import bisect
from typing import List, Optional, Tuple

import numpy as np

from megatron_orch.balance.repair import _LOCALIZE_PASSES, _LOCALIZE_SCAN, _SETTLE_TRIES


def localize_reference(bin_of_item: np.ndarray, costs: np.ndarray, want_node: np.ndarray, node_of_rank: np.ndarray,
                       capacity: Optional[float] = None, *, swaps_only: bool,
                       item_bytes: Optional[np.ndarray] = None) -> Tuple[np.ndarray, int]:
    """:func:`megatron_orch.balance.repair.localize`, in Python: lists, bisect and numpy where the kernel has
    linked lists and sorted rows."""
    rank_array = np.array(bin_of_item, dtype=np.int64)
    costs_array = np.asarray(costs, dtype=np.float64)
    node_array = np.asarray(node_of_rank, dtype=np.int64)
    load_array = np.bincount(rank_array, weights=costs_array, minlength=node_array.size)
    if capacity is None:
        capacity = float(load_array.max(initial=0.0))
    num_nodes = int(node_array.max(initial=-1)) + 1
    want_array = np.asarray(want_node, dtype=np.int64)
    weight = (np.ones(rank_array.size) if item_bytes is None else np.asarray(item_bytes, dtype=np.float64)).tolist()
    rank, cost, want = rank_array.tolist(), costs_array.tolist(), want_array.tolist()
    node, load = node_array.tolist(), load_array.tolist()
    ranks_of_node = [np.flatnonzero(node_array == x).tolist() for x in range(num_nodes)]
    members: List[List[int]] = [[] for _ in range(node_array.size)]
    for e, r in enumerate(rank):
        members[r].append(e)
    # per node, every example on it, as sorted (cost, example) lists
    pools: List[List[Tuple[float, int]]] = [[] for _ in range(num_nodes)]
    for e in np.argsort(costs_array, kind="stable").tolist():
        pools[node[rank[e]]].append((cost[e], e))

    def exchange(e: int, f: int) -> None:
        """e and f trade ranks."""
        a, b = rank[e], rank[f]
        rank[e], rank[f] = b, a
        members[a].remove(e)
        members[b].remove(f)
        members[a].append(f)
        members[b].append(e)
        load[a] += cost[f] - cost[e]
        load[b] += cost[e] - cost[f]

    def relocate(e: int, to: int) -> None:
        a = rank[e]
        rank[e] = to
        members[a].remove(e)
        members[to].append(e)
        load[a] -= cost[e]
        load[to] += cost[e]

    def max_room(x: int) -> float:
        return capacity - min(load[q] for q in ranks_of_node[x])

    def settle(r: int, over: float) -> bool:
        """One exchange between rank r and another rank q of its node that takes between ``over`` and q's room
        off r, the least such (keeping the most room): applied, True; else False."""
        others = [q for q in ranks_of_node[node[r]] if q != r and capacity - load[q] >= over]
        if not others:
            return False
        theirs = [f for q in others for f in members[q]]
        mine = np.asarray(members[r], dtype=np.int64)
        of = np.asarray(theirs, dtype=np.int64)
        their_cost = costs_array[of]
        room_of = np.asarray([capacity - load[rank[f]] for f in theirs])
        if not swaps_only:  # a move: a partner of no cost on every other rank
            of = np.concatenate([of, -1 - np.asarray(others, dtype=np.int64)])
            their_cost = np.concatenate([their_cost, np.zeros(len(others))])
            room_of = np.concatenate([room_of, [capacity - load[q] for q in others]])
        diff = costs_array[mine][:, None] - their_cost[None, :]
        diff[(diff < over) | (diff > room_of[None, :])] = np.inf
        if not diff.size or not np.isfinite(diff.min()):
            return False
        i, j = np.unravel_index(int(np.argmin(diff)), diff.shape)
        g, h = int(mine[i]), int(of[j])
        if h >= 0:
            exchange(g, h)
        else:
            relocate(g, -1 - h)
        return True

    start = int((node_array[rank_array] == want_array).sum())
    for _ in range(_LOCALIZE_PASSES):  # the costliest first (fewest partners); again, as moves made room
        away = np.flatnonzero(node_array[np.asarray(rank)] != want_array)
        moved = 0
        for e in away[np.argsort(-costs_array[away], kind="stable")].tolist():
            a = rank[e]
            x, y = node[a], want[e]
            if x == y:
                continue
            c = cost[e]
            pool = pools[y]
            pick, pick_key, unsettled = -1, None, []
            if pool:
                # no partner further in cost can fit, even settled: a costlier one overfills a by the gap less
                # a's room, a cheaper one its own rank by the gap less that rank's room
                up = capacity - load[a] + max_room(x)
                down = 2 * max_room(y)
                at = bisect.bisect_left(pool, (c, -1))
                lo, hi = at - 1, at
                for _scan in range(2 * _LOCALIZE_SCAN):  # outward from c, nearest cost first
                    up_fits = hi < len(pool) and pool[hi][0] - c <= up
                    down_fits = lo >= 0 and c - pool[lo][0] <= down
                    if up_fits and (not down_fits or pool[hi][0] - c <= c - pool[lo][0]):
                        k, hi = hi, hi + 1
                    elif down_fits:
                        k, lo = lo, lo - 1
                    else:
                        break
                    cf, f = pool[k]
                    gap = abs(cf - c)
                    # bytes brought home by the swap: e's, plus f's if it wants x, less f's if it was home
                    gain = weight[e] + (weight[f] if want[f] == x else (-weight[f] if want[f] == y else 0.0))
                    if gain <= 0:
                        continue
                    key = (-gain, gap)
                    b = rank[f]
                    if load[a] - c + cf > capacity or load[b] - cf + c > capacity:
                        unsettled.append((key, f))
                        continue
                    if pick_key is None or key < pick_key:
                        pick, pick_key = k, key
            partner = None
            if pick >= 0:
                _, partner = pool.pop(pick)
                exchange(e, partner)
            else:  # the best swaps that overfill one rank, if its node can take the excess
                for _key, f in sorted(unsettled)[:_SETTLE_TRIES]:
                    b = rank[f]
                    exchange(e, f)
                    heavy = a if load[a] > capacity else b
                    if settle(heavy, load[heavy] - capacity):
                        _remove(pools[y], (cost[f], f))
                        partner = f
                        break
                    exchange(e, f)
            if partner is not None:
                _remove(pools[x], (c, e))
                bisect.insort(pools[y], (c, e))
                bisect.insort(pools[x], (cost[partner], partner))
                moved += 1
                continue
            if not swaps_only:
                b = min(ranks_of_node[y], key=load.__getitem__)
                if load[b] + c <= capacity:
                    relocate(e, b)
                    _remove(pools[x], (c, e))
                    bisect.insort(pools[y], (c, e))
                    moved += 1
        if not moved:
            break
    out = np.asarray(rank, dtype=np.int64)
    return out, int((node_array[out] == want_array).sum()) - start


def _remove(pool: List[Tuple[float, int]], entry: Tuple[float, int]) -> None:
    at = bisect.bisect_left(pool, entry)
    if at < len(pool) and pool[at] == entry:
        pool.pop(at)
