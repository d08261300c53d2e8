"""How much the choice of bin -> rank placement changes the peers per rank, on the same partition.

Plans each batch with the defaults (``orch``) through ``plan_step``, once per placement (the registered
``identity``, ``greedy``, ``exact`` and a random permutation registered here), and prints per DP size and
placement: the busiest and mean peers per rank in the first step and over all steps (flat all-to-all), the
bytes across nodes per step, and whether each phase's balance and the modeled step time are the default
placement's (placement moves no load, so they should be):

    python scripts/check_placement_peers.py [--dp 512,2560] [--steps 10] [--per-rank 16] [--gpus-per-node 8]
"""
import dataclasses

import numpy as np

from megatron_orch.balance.registry import PLACEMENTS
from megatron_orch.balance.topology import Topology
from megatron_orch.bench.common import (DEFAULT_METHOD, MIXTURES, PLAN_METHODS, draw_sizes, flat_peers,
                                        peer_check_args)
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import plan_step

MODEL = "mllm_10b"
PLACEMENT_METHODS = ("identity", "greedy", "exact", "random")


@PLACEMENTS.register("random")
def _random_placement(traffic, topology, config):
    """A random permutation of the bins (seeded by the instance: the same plan on every call)."""
    return np.random.default_rng([traffic.num_bins, int(traffic.nbytes.sum())]).permutation(traffic.num_bins)


def main() -> None:
    args = peer_check_args(__doc__.splitlines()[0])
    phases = load_model_config(MODEL).phases()
    print(f"| DP | placement | step peers max / mean | run peers ({args.steps} steps) max / mean | inter-node GB per "
          "step | balance and step time as exact's |")
    print("|---:|---|---:|---:|---:|---|")
    for dp in (int(text) for text in args.dp.split(",")):
        topology = Topology.uniform(dp, args.gpus_per_node)
        batches = [draw_sizes(list(MIXTURES["shipped"]), dp, args.per_rank, MODEL, seed)[2]
                   for seed in range(args.steps)]
        figures = {}
        for placement in PLACEMENT_METHODS:
            config = dataclasses.replace(PLAN_METHODS[DEFAULT_METHOD], placement=placement)
            figures[placement] = flat_peers([plan_step(sizes, phases, config, topology, 1, args.per_rank)
                                             for sizes in batches], batches, phases, topology)
        for placement, peers in figures.items():
            same = "yes" if peers.outcome == figures["exact"].outcome else "no"
            print(f"| {dp} | {placement} | {' | '.join(peers.cells())} | {same} |")


if __name__ == "__main__":
    main()
