"""The pure-Python ``repair_locality`` (balance/repair.py) the compiled kernel (balance/_kernels/repair.py's
``repair_locality``) replaced: the reference its plans are tested against, action for action."""
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance import _kernels
from megatron_orch.balance.repair import (_CANDIDATES, _MAX_ROUNDS, _PARTNERS, _SPREAD, _State, _TARGET_NODES, _TOL,
                                          _WORST, _repair_start)


class State(_State):
    """The repair's state with the reference's two steps: the source ranks of an example's entries, an example
    moved."""

    def touched(self, e: int) -> np.ndarray:
        return np.concatenate([m.src[m.start[e]:m.start[e + 1]] for m in self.moves])

    def put(self, e: int, to: int) -> None:
        _kernels.shift_example(self.links, self.node, self.src, self.nbytes, self.offset, self.rank, self.load,
                               self.costs, e, to)


def repair_locality_reference(bin_of_item: np.ndarray, reference: np.ndarray, costs: np.ndarray,
                              sources: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]], node_of_rank: np.ndarray,
                              nvlink_over_nic: float, *, swaps_only: bool, capacity: Optional[float] = None,
                              max_rounds: int = _MAX_ROUNDS) -> Tuple[np.ndarray, int]:
    """:func:`megatron_orch.balance.repair.repair_locality`, in Python: numpy sorts and masks where the kernel has
    linked lists and partial selections."""
    moves, node, state, capacity, limits = _repair_start(bin_of_item, reference, costs, sources, node_of_rank,
                                                         nvlink_over_nic, capacity, state_class=State)
    costs, num_ranks = state.costs, node.size
    nic_limit, nvl_limit, nic_scale, nvl_scale = limits.T
    cap_scale = max(capacity, 1e-300)

    def worst():
        """(kind, move, rank) furthest over its limit, or None."""
        nic = (np.maximum(state.links[:, 2], state.links[:, 3]) - nic_limit[:, None]) / nic_scale[:, None]
        nvl = (np.maximum(state.links[:, 0], state.links[:, 1]) - nvl_limit[:, None]) / nvl_scale[:, None]
        comp = (state.load - capacity) / cap_scale
        found = []
        for kind, values in (("nic", nic), ("nvl", nvl), ("compute", comp[None, :])):
            flat = values.reshape(-1)
            top = np.flatnonzero(flat > _TOL)
            top = top[np.argsort(-flat[top], kind="stable")][:_WORST]
            for k in top:
                m, r = np.unravel_index(int(k), values.shape)
                found.append((float(flat[k]), kind, int(m) if kind != "compute" else -1, int(r)))
        found.sort(reverse=True)
        return found

    def candidates(kind: str, m: int, r: int) -> List[int]:
        """Examples whose move off their rank (or onto another) can lower rank r's excess."""
        if kind == "compute":
            mine = np.flatnonzero(state.rank == r)
            return mine[np.argsort(-costs[mine], kind="stable")][:_CANDIDATES].tolist()
        move = moves[m]
        links = state.links[m]
        across = kind == "nic"
        receiving = (links[3, r] >= links[2, r]) if across else (links[1, r] >= links[0, r])
        if receiving:  # examples on r whose entries of move m arrive over that link
            mine = np.flatnonzero(state.rank == r)
            weight = np.zeros(mine.size)
            for k, e in enumerate(mine):
                s, b = move.src[move.start[e]:move.start[e + 1]], move.nbytes[move.start[e]:move.start[e + 1]]
                on = (node[s] != node[r]) if across else ((node[s] == node[r]) & (s != r))
                weight[k] = b[on].sum()
        else:  # examples that rank r sends entries of move m to, over that link
            mine = np.unique(move.by_src_example[move.by_src_start[r]:move.by_src_start[r + 1]])
            dst = state.rank[mine]
            on = (node[dst] != node[r]) if across else ((node[dst] == node[r]) & (dst != r))
            mine = mine[on]
            weight = np.zeros(mine.size)
            for k, e in enumerate(mine):
                s, b = move.src[move.start[e]:move.start[e + 1]], move.nbytes[move.start[e]:move.start[e + 1]]
                weight[k] = b[s == r].sum()
        keep = weight > 0
        mine, weight = mine[keep], weight[keep]
        return mine[np.argsort(-weight, kind="stable")][:_CANDIDATES].tolist()

    def targets(e: int, r: int, kind: str, m: int) -> np.ndarray:
        """Ranks to try example e on: those of the nodes its bytes come from most (and rank r's node, when r
        sends it), then the ranks with the least on the over-limit link of move m (to spread what r has)."""
        s = state.touched(e)
        b = np.concatenate([mv.nbytes[mv.start[e]:mv.start[e + 1]] for mv in moves])
        per_node = np.bincount(node[s], weights=b, minlength=int(node.max()) + 1) if s.size else np.zeros(1)
        nodes = [int(x) for x in np.argsort(-per_node, kind="stable")[:_TARGET_NODES] if per_node[x] > 0]
        if kind != "compute" and state.rank[e] != r:
            nodes.insert(0, int(node[r]))
        if not nodes:
            nodes = [int(node[state.rank[e]])]
        ranks = [np.flatnonzero(np.isin(node, nodes))]
        if kind in ("nic", "nvl"):  # ranks holding examples whose bytes of move m come from r's node: swap partners
            move = moves[m]
            mine = np.flatnonzero(node == node[r])
            examples = np.concatenate([move.by_src_example[move.by_src_start[q]:move.by_src_start[q + 1]]
                                       for q in mine])
            held = state.rank[examples]
            held = held[node[held] != node[r]] if kind == "nic" else held[held != r]
            if held.size:
                count = np.bincount(held, minlength=num_ranks)
                ranks.append(np.argsort(-count, kind="stable")[:min(_SPREAD, int((count > 0).sum()))])
        if kind == "nic":
            links = state.links[m]
            ranks.append(np.argsort(np.maximum(links[2], links[3]), kind="stable")[:_SPREAD])
        elif kind == "nvl":
            links = state.links[m]
            ranks.append(np.argsort(np.maximum(links[0], links[1]), kind="stable")[:_SPREAD])
        else:
            ranks.append(np.argsort(state.load, kind="stable")[:_SPREAD])
        ranks = np.concatenate(ranks)
        _, first = np.unique(ranks, return_index=True)
        ranks = ranks[np.sort(first)]
        return ranks[ranks != state.rank[e]]

    by_rank: dict = {}

    def on_rank(s: int) -> np.ndarray:
        if s not in by_rank:
            by_rank[s] = np.flatnonzero(state.rank == s)
        return by_rank[s]

    def try_action(e: int, to: int, partners: Sequence[int]):
        """(excess change, inter-node bytes change) of moving e to ``to`` and ``partners`` to e's rank; undone
        (compiled: :func:`_kernels.try_exchange`, the sums of ``excess`` as numpy takes them)."""
        return _kernels.try_exchange(state.links, node, state.src, state.nbytes, state.offset, state.rank,
                                     state.load, costs, e, to, np.array(partners, dtype=np.int64), limits,
                                     float(capacity), cap_scale)

    def options(e: int, a: int, to: int, kind: str) -> List[Tuple[int, ...]]:
        """Partner sets for moving e from a to ``to`` that keep both ranks within the capacity: none (a move),
        one example of ``to`` (a swap), or (packed) several whose costs add up to what fits."""
        c = costs[e]
        found: List[Tuple[int, ...]] = []
        low = state.load[to] + c - capacity      # what must leave ``to``
        high = capacity - state.load[a] + c      # what ``a`` can take
        if kind == "compute":
            high = min(high, c * (1 - 1e-12)) if state.load[a] <= capacity else c * (1 - 1e-12)
        if not swaps_only and low <= 0:
            found.append(())
        others = on_rank(to)
        if not others.size or high <= 0:
            return found
        oc = costs[others]
        fit = others[(oc >= low) & (oc <= high)]
        if fit.size:  # the closest in cost, those with most bytes on a's node first (they land near home)
            fit = fit[np.argsort(np.abs(costs[fit] - c), kind="stable")][:4 * _PARTNERS]
            near_a = _kernels.bytes_on_node(state.src, state.nbytes, state.offset, node, fit, node[a])
            found += [(int(f),) for f in fit[np.argsort(-near_a, kind="stable")][:_PARTNERS]]
        if not swaps_only and low > 0:  # several of to's examples, largest first, while they fit
            chosen, total = [], 0.0
            for f in others[np.argsort(-oc, kind="stable")]:
                if total + costs[f] <= high:
                    chosen.append(int(f))
                    total += costs[f]
                    if total >= low:
                        break
            if total >= low and len(chosen) > 1:
                found.append(tuple(chosen))
        return found

    actions = 0
    stuck = set()
    while actions < max_rounds:
        over = [w for w in worst() if (w[1], w[2], w[3]) not in stuck]
        if not over:
            break
        _, kind, m, r = over[0]
        best = None
        for e in candidates(kind, m, r):
            a = int(state.rank[e])
            for to in targets(e, r, kind, m):
                for partners in options(e, a, int(to), kind):
                    gain, moved = try_action(e, int(to), partners)
                    if gain < -_TOL and (best is None or (gain, moved) < best[0]):
                        best = ((gain, moved), e, int(to), partners)
            if best is not None:  # the first example (most bytes on the link) that can go: taken
                break
        if best is None:
            stuck.add((kind, m, r))
            continue
        _, e, to, partners = best
        a = int(state.rank[e])
        state.put(e, to)
        for f in partners:
            state.put(f, a)
        for s in (a, to):
            by_rank.pop(s, None)
        stuck.clear()
        actions += 1
    return state.rank, actions
