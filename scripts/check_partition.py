"""Quick quality/speed check of the partitioners on synthetic heavy-tailed costs.

Prints, per instance and method, max/lower-bound and the warm plan time (best of a few runs, one
thread). The trace-driven benchmark is ``python -m megatron_orch.bench.balance``; this is only a
fast check of the algorithms on shapes that stress them:

    python scripts/check_partition.py [--bins 512 2560] [--per-bin 16] [--large-items 200000]
"""
import argparse
import time

import numpy as np

from megatron_orch.balance.partition import partition, partition_equal_count, partition_locality


def synthetic_costs(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Item costs of a few realistic shapes (linear + quadratic attention cost of a token count).

    Tails are clipped as a context length or resolution limit would, so the lower bound is mostly
    the mean (the hard case) rather than the largest item.
    """
    if kind == "llm":          # example lengths, log-normal, clipped to an 8k context
        s = np.clip(rng.lognormal(6.8, 0.9, n), 16, 8192).round()
        return 24576.0 * s + s * s
    if kind == "mixture":      # many small items plus a heavy Pareto tail
        small = rng.uniform(1, 10, n)
        huge = np.minimum(50.0 * (1 + rng.pareto(1.5, n)), 400.0)
        return np.where(rng.random(n) < 0.85, small, huge)
    if kind == "vision":       # few fixed sizes: 256-patch tiles, 1024-patch frames, 4096 images
        s = rng.choice([256.0, 1024.0, 4096.0], size=n, p=[0.8, 0.17, 0.03])
        return 4096.0 * s + s * s
    if kind == "quadratic":    # attention-dominated: cost ~ s^2 with heavy-tailed s
        s = np.clip(rng.pareto(2.0, n) * 600 + 50, 50, 4096).round()
        return s * s
    raise ValueError(kind)


def timed(fn, repeats=5):
    """Result and best-of-``repeats`` CPU time of this thread in ms (robust on a shared machine)."""
    best, out = np.inf, None
    for _ in range(repeats):
        t = time.thread_time()
        out = fn()
        best = min(best, time.thread_time() - t)
    return out, 1e3 * best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bins", type=int, nargs="+", default=[512, 2560])
    ap.add_argument("--per-bin", type=int, default=16)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--large-items", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t = time.perf_counter()
    partition(np.arange(40.0), 4)
    partition_equal_count(np.arange(40.0), 4)
    partition_locality(np.arange(40.0), np.arange(40) % 4, 4, 2, item_bytes=np.ones(40))
    print(f"first call (compile or load from cache): {time.perf_counter() - t:.2f} s")

    rng = np.random.default_rng(args.seed)
    print(f"{'kind':10s} {'K':>5s} {'n':>7s} {'lb/mean':>7s} {'method':28s} {'max/lb':>8s} {'ms':>8s} "
          f"{'inter-node':>10s}")
    cases = [(kind, k, k * args.per_bin) for k in args.bins
             for kind in ("llm", "mixture", "vision", "quadratic")]
    cases += [(kind, args.bins[-1], args.large_items) for kind in ("mixture", "vision")]
    for kind, k, n in cases:
        costs = synthetic_costs(kind, n, rng)
        home = np.repeat(np.arange(k), -(-n // k))[:n]            # loader: consecutive items per rank
        nbytes = costs ** 0.5
        runs = {m: (lambda m=m: partition(costs, k, method=m)) for m in ("lpt", "kk", "bs_ffd", "auto")}
        runs["equal_count"] = lambda: partition_equal_count(costs[: n - n % k], k)
        runs["locality"] = lambda: partition_locality(costs, home, k, args.gpus_per_node, item_bytes=nbytes)
        for name, fn in runs.items():
            p, ms = timed(fn)
            frac = f"{p.inter_node_bytes_frac:10.3f}" if name == "locality" else ""
            lb_over_mean = p.lower_bound / (costs.sum() / k)
            print(f"{kind:10s} {k:5d} {n:7d} {lb_over_mean:7.3f} {p.method:28s} {p.max_over_lb:8.4f} {ms:8.1f} {frac}")


if __name__ == "__main__":
    main()
