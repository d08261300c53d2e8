"""What exchanging alike examples between backbone bins (``OrchestratorConfig.exchange_alike``) does to the peers
per rank and what it costs the planner, A/B on the same batches in one process.

Plans each batch with the defaults (``orch``) through ``plan_step``, without and with the exchange, alternating
(A B A B ..., so both see the same machine load), and prints per DP size: the busiest and mean peers per rank in the
first step and over all steps (flat all-to-all), the bytes across nodes per step, whether each phase's balance and
the modeled step time are the plain plan's (the exchange moves no load, so they must be), and the planner's CPU time
per step (``time.process_time``, median over the steps, after one warm-up plan of each):

    python scripts/check_alike_exchange.py [--dp 512,2560] [--steps 10] [--per-rank 16] [--gpus-per-node 8]
"""
import argparse
import dataclasses
import time

import numpy as np

from megatron_orch.balance.plan import Connections
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import DEFAULT_METHOD, MIXTURES, PLAN_METHODS, draw_sizes, step_connections
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import plan_step

MODEL = "mllm_10b"
VARIANTS = {"plain": False, "exchange_alike": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", default="512,2560", help="comma-separated DP sizes (default 512,2560)")
    parser.add_argument("--steps", type=int, default=10, help="batches of seeds 0.. (default 10)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="DP ranks per node (default 8)")
    args = parser.parse_args()
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
        outcome = {name: [([s.max_after for s in plan.stats.values()], plan.step_time) for plan in plans[name]]
                   for name in VARIANTS}
        for name in VARIANTS:
            run, first, inter = Connections.none(dp), None, 0.0
            for sizes, plan in zip(batches, plans[name]):
                connected = step_connections(plan, phase_items(sizes, phases), topology.node_of_rank, "flat")
                first = connected if first is None else first
                run = run | connected
                inter += plan.report()["inter-node MB"] / 1e3
            step, whole = first.peers(topology.node_of_rank).total, run.peers(topology.node_of_rank).total
            same = "yes" if outcome[name] == outcome["plain"] else "no"
            print(f"| {dp} | {name} | {step.max()} / {step.mean():.1f} | {whole.max()} / {whole.mean():.1f} | "
                  f"{inter / args.steps:.1f} | {same} | {1e3 * np.median(seconds[name]):.1f} |")


if __name__ == "__main__":
    main()
