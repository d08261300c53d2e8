"""Post-balancing's own communicator beside the DP group's, over gloo.

Four ranks, DP groups {0, 1} and {2, 3}: every rank asks for its DP group's dedicated group (after a
group the ranks of a DP group hold differently), the dedicated group holds the same ranks on another
communicator (collectives issued on the two in opposite orders on the two ranks do not get matched with
each other, as they would on one communicator), the schedule refuses a step whose data moves over other
ranks than its DP group, and DP groups that overlap are refused on every rank.

What the dedicated communicator gains on a GPU (an all-to-all that does not queue behind DDP's bucket
reductions under --overlap-grad-reduce) needs NCCL on GPUs to measure; not here.

In one process (fast): the DP replicas (the peers a plan is agreed with) are megatron-core's TP x CP x PP
groups, and post_balance agrees with them under CP.
"""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megatron_orch.comm.communicator import dedicated_group
from megatron_orch.megatron.post_balancing import BalancedStep
from megatron_orch.megatron.schedule import ModalityAwareSchedule


def _check_dedicated_groups(rank, world):
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = dp_groups[rank // 2]
    # A group the DP group's ranks made before and only one of them has let go (as ranks hold after a job
    # re-initialized its model-parallel groups): a group made by the members alone
    # (use_local_synchronization) would now be named differently on the two ranks, which would wait for
    # each other until the store timed out.
    earlier = dist.new_group(dist.get_process_group_ranks(dp), use_local_synchronization=True)
    if rank % 2:
        dist.destroy_process_group(earlier)
    comm = dedicated_group(dp)
    assert comm is not dp
    assert dist.get_process_group_ranks(comm) == dist.get_process_group_ranks(dp) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_backend(comm) == dist.get_backend(dp) == "gloo"

    # Opposite orders on the two ranks of a DP group: a reduction on the DP group (DDP's) and an
    # all-to-all on the dedicated group (post-balancing's). On one communicator the first collective of
    # each rank would be matched with the other rank's first one; on two, each meets its own.
    local = rank % 2
    grads = torch.full((3,), 10.0 * (rank + 1))
    sent = torch.tensor([100.0 * rank, 100.0 * rank + 1])
    received = torch.empty(2)
    if local == 0:
        reduction = dist.all_reduce(grads, group=dp, async_op=True)
        dist.all_to_all_single(received, sent, group=comm)
        reduction.wait()
    else:
        moving = dist.all_to_all_single(received, sent, group=comm, async_op=True)
        dist.all_reduce(grads, group=dp)
        moving.wait()
    first = rank // 2 * 2
    assert torch.equal(grads, torch.full((3,), 10.0 * (first + 1) + 10.0 * (first + 2)))
    assert torch.equal(received, torch.tensor([100.0 * first + local, 100.0 * (first + 1) + local]))

    # The schedule refuses a step whose moves use other ranks than its DP group, before any collective.
    step = BalancedStep(microbatches=[], inputs={}, plan=None, rank=local, num_tokens=np.zeros(0, dtype=np.int64),
                        rows_per_item={}, comm_group=dist.group.WORLD,
                        moves=None)
    with pytest.raises(ValueError, match="over a group of other ranks than this schedule's DP group"):
        ModalityAwareSchedule(lambda **kw: [], dp_group=dp)._start_move(step, "vision", torch.zeros(1, 2))

    # DP groups that overlap are refused on every rank, before any group is made.
    first_three, last_two = dist.new_group([0, 1, 2]), dist.new_group([2, 3])
    with pytest.raises(ValueError, match=r"disjoint DP groups, one per rank; the ranks gave \[\(0, 1, 2\), \(2, 3\)\]"):
        dedicated_group(first_three if rank < 3 else last_two)


@pytest.mark.distributed
def test_each_dp_group_moves_data_on_a_communicator_of_its_own_four_ranks():
    run_distributed(_check_dedicated_groups, 4)


def _iterator_on_its_own_communicator(rank, world):
    """A post-balancing iterator given only the DP group moves its data on a group of its own."""
    import warnings
    warnings.filterwarnings("ignore")
    from megatron_orch.balance.topology import Topology
    from megatron_orch.megatron.post_balancing import ParallelGroups, PostBalancingDataIterator, StepShape
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.data import build_train_iterator
    from megatron_orch.mllm.data_config import DataConfig
    from megatron_orch.orchestrator.config import OrchestratorConfig

    dp = dist.new_group([0, 1])
    config = DataConfig(load_model_config("tiny"), seq_length=192, micro_batch_size=1, num_samples=4)
    source = build_train_iterator(config, consumed_samples=0, data_parallel_rank=rank, data_parallel_size=world)
    iterator = PostBalancingDataIterator(source, config.layout.spec, OrchestratorConfig(background=False),
                                         StepShape(1, 1), ParallelGroups(dp, Topology.uniform(world, 1)),
                                         compute_device=torch.device("cpu"))
    step = next(iterator)
    assert iterator.comm_group is not dp and step.comm_group is iterator.comm_group
    assert dist.get_process_group_ranks(step.comm_group) == dist.get_process_group_ranks(dp) == [0, 1]
    assert step.plan.num_microbatches == 1


@pytest.mark.distributed
def test_the_iterator_moves_its_data_on_a_communicator_of_its_own():
    run_distributed(_iterator_on_its_own_communicator, 2)


@pytest.mark.parametrize("tp, cp, pp, dp", [(1, 2, 1, 2), (2, 2, 2, 2), (2, 1, 2, 2), (1, 4, 1, 2), (2, 2, 1, 1)])
def test_a_dp_replica_is_megatrons_tp_cp_pp_peers(tp, cp, pp, dp):
    """The DP replicas found from megatron-core's DP groups are its TP x CP x PP groups: the peers that read the
    same examples, with which a rank's plan must agree (a CP rank that fails must reach its CP peers)."""
    from megatron.core.parallel_state import RankGenerator

    from megatron_orch.comm.communicator import dp_replicas

    ranks = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    want = sorted(tuple(sorted(g)) for g in ranks.get_ranks("tp-cp-pp"))
    assert dp_replicas(ranks.get_ranks("dp")) == want
    assert {len(r) for r in want} == {tp * cp * pp}


@pytest.fixture(scope="module")
def harness():
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()


@pytest.mark.parametrize("cp", [1, 2])
def test_post_balance_checks_its_plan_with_the_cp_peers_too(cp, harness, world_of_one, monkeypatch):
    """post_balance's peers (the group over which a failed read or another plan reaches every rank): megatron-core's
    model-parallel group (TP x PP) without CP, the DP replica (TP x CP x PP) with it."""
    from megatron.core import parallel_state

    import example_modules  # noqa: F401 -- examples/ on the path
    import own_model
    from megatron_orch.megatron import StepShape, any_loop, post_balance

    replicas = []

    def replica_group(group, timeout=None):
        replicas.append(dist.get_process_group_ranks(group))
        return "the DP replica's group"

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: cp)
    monkeypatch.setattr(any_loop, "replica_group", replica_group)
    _, iterator = post_balance(None, iter(()), own_model.batch_spec(), StepShape(2, 2))
    if cp == 1:
        assert iterator.groups.peer_group is parallel_state.get_model_parallel_group() and not replicas
    else:
        assert iterator.groups.peer_group == "the DP replica's group"
        assert replicas == [dist.get_process_group_ranks(parallel_state.get_data_parallel_group())]
