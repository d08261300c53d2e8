"""What exchanging alike examples between backbone bins (``OrchestratorConfig.exchange_alike``) does to the peers
per rank and what it costs the planner, A/B on the same batches in one process.

Plans each batch with the defaults (``orch``) through ``plan_step``, without and with the exchange, alternating
(A B A B ..., so both see the same machine load), and prints per DP size: the busiest and mean peers per rank in the
first step and over all steps (flat all-to-all), the bytes across nodes per step, whether each phase's balance and
the modeled step time are the plain plan's (the exchange moves no load, so they must be), and the planner's CPU time
per step (``time.process_time``, median over the steps, after one warm-up plan of each):

    python scripts/check_alike_exchange.py [--dp 512,2560] [--steps 10] [--per-rank 16] [--gpus-per-node 8]
"""
import dataclasses
import time

import numpy as np

from megatron_orch.balance.topology import Topology
from megatron_orch.bench.common import (DEFAULT_METHOD, MIXTURES, PLAN_METHODS, draw_sizes, flat_peers,
                                        peer_check_args)
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import plan_step

MODEL = "mllm_10b"
VARIANTS = {"plain": False, "exchange_alike": True}


def main() -> None:
    args = peer_check_args(__doc__.splitlines()[0])
    phases = load_model_config(MODEL).phases()
    print(f"| DP | plan | step peers max / mean | run peers ({args.steps} steps) max / mean | inter-node GB per step "
          "| balance and step time as plain | plan CPU ms (median) |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for dp in (int(text) for text in args.dp.split(",")):
        topology = Topology.uniform(dp, args.gpus_per_node)
        batches = [draw_sizes(list(MIXTURES["shipped"]), dp, args.per_rank, MODEL, seed)[2]
                   for seed in range(args.steps)]
        configs = {name: dataclasses.replace(PLAN_METHODS[DEFAULT_METHOD], exchange_alike=on)
                   for name, on in VARIANTS.items()}
        for config in configs.values():  # compiled and cached before the clock runs
            plan_step(batches[0], phases, config, topology, 1, args.per_rank)
        plans = {name: [] for name in VARIANTS}
        seconds = {name: [] for name in VARIANTS}
        for sizes in batches:
            for name, config in configs.items():
                start = time.process_time()
                plans[name].append(plan_step(sizes, phases, config, topology, 1, args.per_rank))
                seconds[name].append(time.process_time() - start)
        figures = {name: flat_peers(plans[name], batches, phases, topology) for name in VARIANTS}
        for name, peers in figures.items():
            same = "yes" if peers.outcome == figures["plain"].outcome else "no"
            print(f"| {dp} | {name} | {' | '.join(peers.cells())} | {same} | {1e3 * np.median(seconds[name]):.1f} |")


if __name__ == "__main__":
    main()
