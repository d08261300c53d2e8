"""Run ``python -m megatron_orch.bench.balance`` on every mixture, DP size and seed, and summarise per batch: the
default's step speedup against the best method's, and how the locality-aware rows planned the backbone.

    python scripts/bench_balance_sweep.py --dp 64 512 2560 --seeds 0 1 2 --json sweep.json

Each batch is the benchmark's own run (``bench.balance.run``, the same JSON per batch under ``runs``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_orch.bench import balance  # noqa: E402
from megatron_orch.bench.common import MIXTURES  # noqa: E402

LOCALITY = ("orch_locality", "orch_equal_locality")


def summary_row(run: dict) -> dict:
    p, step = run["params"], run["step"]
    row = {"mixture": p["mixture"], "dp": p["dp"], "seed": p["seed"], "default": p["default"],
           "default_speedup": run["default"]["speedup"], "best": run["default"]["best"],
           "best_speedup": run["default"]["best_speedup"], "default_below_best": 1 - run["default"]["within"]}
    for method in ("orch", "orch_equal_count") + LOCALITY:
        row[method] = {"speedup": step[method]["speedup"],
                       "inter_node_bytes_frac": step[method]["inter_node_bytes_frac"],
                       "backbone_method": step[method]["backbone_method"],
                       "kept": "placed (" not in step[method]["backbone_method"]}
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mixtures", nargs="+", choices=list(MIXTURES), default=list(MIXTURES))
    parser.add_argument("--dp", type=int, nargs="+", default=[64, 512, 2560])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--per-rank", type=int, default=16)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--model", default="mllm_84b")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    runs, rows = [], []
    print("| mixture | DP | seed | default speedup | best (method) | default below best | orch_locality "
          "(backbone, bytes across nodes) | orch_equal_locality (backbone, bytes across nodes) |", flush=True)
    print("|---|---:|---:|---:|---|---:|---|---|", flush=True)
    for mixture in args.mixtures:
        for dp in args.dp:
            for seed in args.seeds:
                run = balance.run(list(MIXTURES[mixture]), dp, args.per_rank, args.gpus_per_node, args.model, seed,
                                  args.repeats)
                run["params"]["mixture"] = mixture
                runs.append(run)
                row = summary_row(run)
                rows.append(row)
                cells = [f"{row[m]['speedup']:.4f} {'kept' if row[m]['kept'] else 'PLAIN PLAN'}, "
                         f"{100 * row[m]['inter_node_bytes_frac']:.1f}%" for m in LOCALITY]
                print(f"| {mixture} | {dp} | {seed} | {row['default_speedup']:.4f} | {row['best_speedup']:.4f} "
                      f"({row['best']}) | {100 * row['default_below_best']:.2f}% | " + " | ".join(cells) + " |",
                      flush=True)
    worst = max(rows, key=lambda r: r["default_below_best"])
    kept = {m: sum(r[m]["kept"] for r in rows) for m in LOCALITY}
    bytes_max = {m: max(r[m]["inter_node_bytes_frac"] for r in rows if r[m]["kept"]) if kept[m] else None
                 for m in LOCALITY}
    summary = {"batches": len(rows), "default_worst_below_best": worst["default_below_best"],
               "default_worst_batch": [worst["mixture"], worst["dp"], worst["seed"], worst["best"]],
               "locality_kept": kept, "locality_max_inter_node_bytes_frac_when_kept": bytes_max}
    print(f"\n{len(rows)} batches: the default's step speedup at most {100 * worst['default_below_best']:.2f}% below "
          f"the best method's ({worst['mixture']} DP {worst['dp']} seed {worst['seed']}: {worst['best']}); "
          + "; ".join(f"{m} kept on {kept[m]} of {len(rows)}" +
                      (f", at most {100 * bytes_max[m]:.1f}% of the bytes across nodes" if kept[m] else "")
                      for m in LOCALITY))
    out = {"summary": summary, "rows": rows, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
