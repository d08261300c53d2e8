"""The iteration line round-trips through its parser (the comparison command reads logs with it), for the
configured phases: the project's three, or a model with a third encoder; the default line is the compact one
(``--orch-log-level 0``), the full one adds the loads, the phase times and post-balancing's moves and times."""
import pytest

from megatron_orch.mllm.config import load_model_config
from megatron_orch.trainer.training_log import (IterationRecord, load_fields, parse_iteration_line, phase_timers,
                                                 post_balancing_fields)

TINY = load_model_config("tiny").phases()


def record(post_balancing, phases=TINY):
    fields = load_fields(phases)
    return IterationRecord(
        iteration=7, consumed_samples=224, elapsed_ms=312.5, learning_rate=1e-3, global_batch_size=32,
        lm_loss=5.4321, grad_norm=1.5, loss_scale=1.0, skipped=0, nan=0, tokens_per_s=1234.5,
        load_max=dict(zip(fields, (12.0, 3.0, 9.0, 700.0)[-len(fields):])),
        load_mean=dict(zip(fields, (10.0, 2.5, 8.0, 650.0)[-len(fields):])),
        phase_ms_max={"vision-encoder-forward": 20.5, "forward-backward": 100.5},
        phase_ms_mean={"vision-encoder-forward": 10.0, "forward-backward": 99.0}, post_balancing=post_balancing)


@pytest.mark.parametrize("balanced", [None, 1.0, 0.0], ids=["upstream", "balanced", "shadow"])
def test_line_round_trips(balanced):
    figures = dict(zip(post_balancing_fields(TINY),
                       (1.8, 1.01, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 6.0, 2.5, 23.4, 12.5, 0.1, 3.5, balanced)))
    line = record(figures if balanced is not None else None).line(20, full=True)
    assert line.startswith(" iteration        7/      20 |")
    parsed = parse_iteration_line(line)
    assert parsed["iteration"] == 7 and parsed["lm_loss"] == pytest.approx(5.4321)
    assert parsed["elapsed_ms"] == pytest.approx(312.5)
    assert parsed["load"] == {"vision items": (3.0, 2.5), "audio items": (9.0, 8.0), "llm tokens": (700.0, 650.0)}
    assert parsed["time_ms"] == {"vision-encoder-forward": (20.5, 10.0), "forward-backward": (100.5, 99.0)}
    if balanced is not None:
        assert parsed["post_balancing"] == pytest.approx(figures)
        shadow = "post-balancing shadow (planned, not applied) cost max/mean" in line
        assert shadow == (not balanced) and ("would move MB" in line) == shadow, line
        assert "modeled step time saved: 23.4%" in line
    else:
        assert "post_balancing" not in parsed
    assert parse_iteration_line(" > model config tiny: 1 parameters") is None


@pytest.mark.parametrize("balanced", [None, 1.0], ids=["upstream", "balanced"])
def test_default_line_is_compact(balanced):
    """Megatron-LM's fields, tokens/s, each phase's load imbalance and the cost imbalance before->after: about
    500 characters with post-balancing (the full line: about 800 here, 1,100 in a run); bad examples and
    truncated answers only where the interval had some."""
    figures = dict(zip(post_balancing_fields(TINY),
                       (1.8, 1.01, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 6.0, 2.5, 23.4, 12.5, 0.1, 3.5, balanced)))
    logged = record(figures if balanced is not None else None)
    line = logged.line(20)
    assert len(line) <= 510 and len(logged.line(20, full=True)) > len(line) + 150, line
    assert line.endswith(" tokens/s: 1234.5 | load imbalance max/mean over DP: vision items 1.20, audio items 1.12, "
                         "llm tokens 1.08 |" + (" post-balancing cost max/mean over DP before->after: vision "
                                                "1.80->1.01, audio 2.00->1.10, llm 1.30->1.00 |" if balanced else ""))
    parsed = parse_iteration_line(line)
    assert (parsed["lm_loss"], parsed["load"], parsed["time_ms"]) == (pytest.approx(5.4321), {}, {})
    if balanced:
        assert parsed["post_balancing"] == pytest.approx({name: value for name, value in figures.items()
                                                          if name.endswith(("before", "after", "applied"))})
    assert "bad examples" not in line and "answers truncated" not in line
    bad = IterationRecord(**{**record(None).__dict__, "bad_examples": 2}).line(20)
    assert "| number of bad examples skipped:   2 |" in bad and parse_iteration_line(bad)["bad_examples"] == 2


def test_fields_follow_the_configured_phases():
    three = load_model_config("tiny_video").phases()
    assert load_fields(three) == ("vision items", "video items", "audio items", "llm tokens")
    assert phase_timers(three)[:3] == ("vision-encoder-forward", "video-encoder-forward", "audio-encoder-forward")
    fields = post_balancing_fields(three)
    assert fields[:8] == ("vision before", "vision after", "video before", "video after", "audio before",
                          "audio after", "llm before", "llm after")
    figures = dict(zip(fields, (1.8, 1.01, 1.6, 1.05, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 7.0, 3.0, 20.0, 12.5, 0.1, 3.5,
                                 1.0)))
    parsed = parse_iteration_line(record(figures, three).line(20, full=True))
    assert parsed["post_balancing"] == pytest.approx(figures)
    assert list(parsed["load"]) == list(load_fields(three))


def test_logged_bytes_count_every_transfer_as_the_simulator_does(tmp_path):
    """The trainer's post-balancing figures (LoadMeter, the iteration line, TensorBoard) count every transfer
    of the step: raw inputs, text, and the embeddings forward and their gradients back, the same bytes as the
    cluster simulator's for the same plan."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.bench.common import PLAN_METHODS, draw_sizes
    from megatron_orch.megatron.post_balancing import BalancedStep
    from megatron_orch.orchestrator.step_plan import plan_step
    from megatron_orch.sim.cluster import LinkModel, simulate_step
    from megatron_orch.trainer.training_log import LoadMeter, TensorBoardLog

    dp, per_rank, gpus = 16, 4, 4
    model = load_model_config("tiny")
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), dp, per_rank, "tiny", 1)
    plan = plan_step(sizes, model.phases(), PLAN_METHODS["equal_count"], Topology.uniform(dp, gpus), 1, per_rank)
    step = BalancedStep(microbatches=[], inputs={}, plan=plan, rank=0, num_tokens=np.asarray(sizes.num_tokens),
                        rows_per_item={}, comm_group=None, moves=None, timings={"plan": 0.01, "plan_exposed": 0.0, "dispatch": 0.002})
    meter = LoadMeter(iter([step]), model.phases())
    next(meter)
    figures = dict(zip(post_balancing_fields(model.phases()), meter.take_post_balancing().tolist()))
    simulated = simulate_step(sizes, model, LinkModel(gpus_per_node=gpus))["equal_count"]
    embeddings = sum(m["times"] * m["inter_node_bytes"] for name, m in simulated["comm"].items()
                     if "embeddings" in name)
    assert embeddings > 0  # the embeddings do cross nodes in this plan, so the count below includes them
    assert figures["inter-node MB"] * 1e6 == pytest.approx(simulated["inter_node_bytes"], rel=1e-12)
    assert figures["intra-node MB"] * 1e6 == pytest.approx(simulated["intra_node_bytes"], rel=1e-12)
    peers = simulated["peers"][PLAN_METHODS["equal_count"].all_to_all]  # as the plan's all-to-alls run
    assert (figures["peers intra-node"], figures["peers inter-node"]) == (peers["node"], peers["net"]) != (0, 0)

    line = record(figures).line(20, full=True)
    logged = parse_iteration_line(line)["post_balancing"]
    assert logged["inter-node MB"] == pytest.approx(figures["inter-node MB"], abs=0.005)
    assert logged["intra-node MB"] == pytest.approx(figures["intra-node MB"], abs=0.005)
    assert (logged["peers intra-node"], logged["peers inter-node"]) == (peers["node"], peers["net"])
    tensorboard = TensorBoardLog(str(tmp_path))
    tensorboard.write(record(figures))
    tensorboard.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for name in ("inter-node MB", "intra-node MB"):
        scalar = events.Scalars(f"post-balancing/{name.replace(' ', '-')}")[0].value
        assert scalar == pytest.approx(figures[name], rel=1e-6)


def test_the_logged_loads_are_the_loaders_in_shadow_mode_and_the_plans_when_balanced():
    """LoadMeter: in shadow mode nothing moves, so a rank's logged load is what its loader gave it (its own
    micro-batches); balanced, what the plan gives it. On a batch the plan rearranges, the two differ."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.bench.common import PLAN_METHODS, draw_sizes
    from megatron_orch.megatron.post_balancing import BalancedStep, ShadowStep
    from megatron_orch.orchestrator.step_plan import plan_step
    from megatron_orch.trainer.training_log import LoadMeter

    dp, per_rank = 4, 4
    model = load_model_config("tiny")
    phases = model.phases()
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), dp, per_rank, "tiny", 2)
    plan = plan_step(sizes, phases, PLAN_METHODS["orch"], Topology.uniform(dp, 2), 1, per_rank)
    timings = {"plan": 0.0, "plan_exposed": 0.0}
    for rank in range(dp):
        home = np.flatnonzero(plan.examples_home.rank == rank)
        microbatches = [SimpleNamespace(items={p: torch.zeros(int(sizes.items[p][e]), 1) for p in phases.encoder_names},
                                        seq_lengths=torch.tensor([int(sizes.num_tokens[e])])) for e in home]
        loaded = [*(float(sizes.items[p][home].sum()) for p in phases.encoder_names), float(sizes.num_tokens[home].sum())]
        backbone = plan.examples_backbone.rank == rank
        planned = [*(float(plan.encoders[p].encode.counts()[rank]) for p in phases.encoder_names),
                   float(sizes.num_tokens[backbone].sum())]
        shadow = LoadMeter(iter([ShadowStep(microbatches=microbatches, plan=plan, rank=rank,
                                            num_tokens=np.asarray(sizes.num_tokens), timings=timings)]), phases)
        balanced = LoadMeter(iter([BalancedStep(microbatches=[], inputs={}, plan=plan, rank=rank,
                                                num_tokens=np.asarray(sizes.num_tokens), rows_per_item={},
                                                comm_group=None, moves=None, timings=timings)]), phases)
        next(shadow), next(balanced)
        assert shadow.take().tolist() == loaded and balanced.take().tolist() == planned, rank
        assert shadow.take_post_balancing().tolist() == pytest.approx(balanced.take_post_balancing()[:-1].tolist()
                                                                      + [0.0])  # the plan's figures, not applied
    assert any(plan.examples_backbone.rank[e] != plan.examples_home.rank[e] for e in range(dp * per_rank))


def test_line_says_where_the_encoders_ran():
    """With balanced steps: the encoder layout and the items each rank encoded, min/max over the job's ranks in the
    compact line, every rank's in the full one (up to 16 ranks), still parsed."""
    figures = dict(zip(post_balancing_fields(TINY), (1.8, 1.01, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 6.0, 2.5, 23.4, 12.5,
                                                     0.1, 3.5, 1.0)))
    logged = IterationRecord(**{**record(figures).__dict__, "encoder_ranks": "all",
                                "items_encoded": {"vision": [3.0, 3.0, 2.0, 3.0], "audio": [1.0, 0.0, 1.0, 1.0]}})
    compact, full = logged.line(20), logged.line(20, full=True)
    assert compact.endswith(" encoders all, items per rank min/max: vision 2/3, audio 0/1 |")
    assert full.endswith(" encoders all, items per rank (each): vision [3 3 2 3], audio [1 0 1 1] |")
    assert len(compact) <= 580
    assert parse_iteration_line(full)["post_balancing"] == pytest.approx(figures)
    many = IterationRecord(**{**logged.__dict__, "items_encoded": {"vision": [1.0] * 17}})
    assert many.line(20, full=True).endswith(" items per rank min/max: vision 1/1 |")


def test_the_run_peers_are_the_union_of_the_steps_connections_logged_as_of_the_last_step(tmp_path):
    """A rank's peers over the run (what post-balancing's communicator keeps connected) are those of the union of
    the plans' connections, which are the pairs the byte accountant counts for the step's transfers: RunPeers, as
    the post-balancing iterator keeps them per rank, against that union for every rank. LoadMeter keeps the latest
    step's (a run-long figure is not averaged over the interval), the full line and TensorBoard report them (the
    busiest rank's: the max over the DP group), and the line round-trips."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_orch.balance.plan import Connections, RunPeers
    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.balance.workload import phase_items
    from megatron_orch.bench.common import PLAN_METHODS, draw_sizes, step_connections
    from megatron_orch.megatron.post_balancing import BalancedStep
    from megatron_orch.orchestrator.step_plan import plan_step
    from megatron_orch.trainer.training_log import RUN_PEER_FIELDS, IntervalStats, LoadMeter, TensorBoardLog

    dp, per_rank, model = 16, 4, load_model_config("tiny")
    topology = Topology.uniform(dp, 4)
    union, per_rank_run = Connections.none(dp), [RunPeers(rank, topology.node_of_rank) for rank in range(dp)]
    steps, busiest = [], []
    for seed in range(3):
        _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), dp, per_rank, "tiny", seed)
        plan = plan_step(sizes, model.phases(), PLAN_METHODS["orch"], topology, 1, per_rank)
        connected = step_connections(plan, phase_items(sizes, model.phases()), topology.node_of_rank, "flat")
        assert np.array_equal(plan.connections.pairs, connected.pairs)
        union = union | plan.connections
        reference = union.peers(topology.node_of_rank)
        run = [runs.add(plan.connections) for runs in per_rank_run]
        assert run == list(zip(reference.intra_node.tolist(), reference.inter_node.tolist()))
        busiest.append(reference.busiest()[1:])
        steps.append(BalancedStep(microbatches=[], inputs={}, plan=plan, rank=0, num_tokens=np.asarray(sizes.num_tokens),
                                  rows_per_item={}, comm_group=None, moves=None, run_peers=run[0],
                                  timings={"plan": 0.01, "plan_exposed": 0.0, "dispatch": 0.002}))
    assert busiest[-1] > busiest[0] >= tuple(steps[0].plan.peers.busiest()[1:])  # the run grows past a step's
    meter, stats = LoadMeter(iter(steps), model.phases()), IntervalStats()
    for step in meter:
        assert meter.run_peers == step.run_peers
        stats.add(1.0, meter.take(), False, 1.0, meter.take_post_balancing(), run_peers=meter.run_peers)
    assert stats.run_peers == steps[-1].run_peers  # the last step's, not a mean over the interval
    figures = dict(zip(post_balancing_fields(model.phases()), (stats.post_balancing / 3).tolist()))
    figures |= dict(zip(RUN_PEER_FIELDS, map(float, busiest[-1])))  # as the loop logs them: the max over DP
    line = record(figures).line(20, full=True)
    assert f"| run peers per rank max intra/inter node: {busiest[-1][0]}/{busiest[-1][1]} |" in line
    parsed = parse_iteration_line(line)["post_balancing"]
    assert [parsed[name] for name in RUN_PEER_FIELDS] == list(map(float, busiest[-1]))
    assert "run peers" not in record(figures).line(20)  # the compact line leaves the communication figures out
    tensorboard = TensorBoardLog(str(tmp_path))
    tensorboard.write(record(figures))
    tensorboard.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [events.Scalars(f"post-balancing/{name.replace(' ', '-')}")[0].value for name in RUN_PEER_FIELDS] == \
        list(map(float, busiest[-1]))
