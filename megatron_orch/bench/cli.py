"""The command-line inputs both benchmarks share, and their output."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Optional

from megatron_orch.balance.model_config import DEFAULT_MODEL
from megatron_orch.balance.traces import DEFAULT_MIXTURE, parse_trace_spec


def parser_with_batch_args(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the inputs that draw and map a global batch (traces, DP, model, seed, JSON)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", nargs="+", metavar="CSV[:WEIGHT]",
                        help="trace CSVs (names in the traces folder, or paths) with optional weights; "
                             "default: the shipped mixture " + ", ".join(f"{n}:{w}" for n, w in DEFAULT_MIXTURE))
    parser.add_argument("--traces-dir", default=None,
                        help="folder of the trace CSVs (default: $MEGATRON_ORCH_TRACES or the gzipped copies "
                             "in <repo>/data/traces)")
    parser.add_argument("--dp", type=int, default=512, help="data-parallel size K (default 512)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank M (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="DP ranks per node G (default 8)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model config name or YAML (default {DEFAULT_MODEL})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    return parser


def trace_specs(args: argparse.Namespace) -> list:
    return [parse_trace_spec(s) for s in args.trace] if args.trace else list(DEFAULT_MIXTURE)


def report(result: dict, format_tables: Callable[[dict], str], json_path: Optional[str]) -> dict:
    """Print the tables; write the JSON if asked."""
    print(format_tables(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {json_path}", file=sys.stderr)
    return result
