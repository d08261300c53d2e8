"""Rank -> node maps: explicit, torchrun environment, hostnames, and Megatron-style strided DP groups."""
import numpy as np
import pytest

from megatron_orch.balance.topology import Topology, gpus_per_node_from_env


def test_uniform_fills_nodes_in_rank_order():
    topo = Topology.uniform(10, 4)
    assert topo.node_of_rank.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert topo.num_nodes == 3 and topo.num_ranks == 10
    assert topo.ranks_per_node().tolist() == [4, 4, 2]
    assert topo.ranks_on(1).tolist() == [4, 5, 6, 7]


def test_strided_data_parallel_group_maps_through_global_ranks():
    # Megatron order tp-dp-pp with TP=2, PP=2, 16 GPUs on 4 nodes of 4: the DP group of TP rank 1 on
    # pipeline stage 0 is global ranks 1, 3, 5, 7, which live on nodes 0, 0, 1, 1.
    topo = Topology.from_global_ranks([1, 3, 5, 7], gpus_per_node=4)
    assert topo.node_of_rank.tolist() == [0, 0, 1, 1]
    assert topo.ranks_per_node().tolist() == [2, 2]


def test_nodes_are_numbered_by_first_appearance():
    assert Topology(np.array([7, 7, 3, 9, 3])).node_of_rank.tolist() == [0, 0, 1, 2, 1]
    assert Topology.from_hostnames(["b", "a", "b", "c"]).node_of_rank.tolist() == [0, 1, 0, 2]


@pytest.mark.parametrize("env, expected", [
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32", "GROUP_WORLD_SIZE": "4"}, 8),
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32"}, 8),
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "30"}, None),            # uneven nodes: gather hostnames
    ({"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "32", "GROUP_WORLD_SIZE": "3"}, None),
    ({"WORLD_SIZE": "32"}, None),
    ({}, None),
])
def test_gpus_per_node_from_torchrun_environment(env, expected):
    assert gpus_per_node_from_env(env) == expected


@pytest.mark.parametrize("bad, match", [
    (np.array([], dtype=np.int64), "non-empty"),
    (np.array([[0, 1]]), "1-D"),
    (np.array([0, -1]), "non-negative"),
    (np.array([0.0, 1.0]), "integers"),
])
def test_bad_node_maps_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        Topology(bad)


def test_bad_global_ranks_are_rejected():
    with pytest.raises(ValueError, match="distinct"):
        Topology.from_global_ranks([0, 1, 1], 2)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Topology.from_global_ranks([0, 1], 0)
