"""A partitioner and a placement method registered from outside the package (examples/toy_partitioner.py, the
code of docs/integration.md's "Extending") are picked by name through OrchestratorConfig, the compact trainer's
``--orch-algorithm`` / ``--orch-placement`` and plan_step; unknown names are refused naming the registered
ones."""
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_orch.balance.partition import partition, partition_groups
from megatron_orch.balance.placement import BinTraffic, PlacementConfig, place_bins
from dist_utils import scaled
from megatron_orch.balance import registry
from megatron_orch.balance.registry import PARTITIONERS, PLACEMENTS, PLUGINS_ENV, load_plugins, partitioner_names
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import StepSizes
from megatron_orch.mllm.config import load_model_config
from megatron_orch.megatron.orch_arguments import flag_message
from megatron_orch.orchestrator.config import ConfigError, OrchestratorConfig
from megatron_orch.orchestrator.step_plan import plan_step
from megatron_orch.trainer import arguments
from megatron_orch.mllm.task import MLLM_TASK

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "toy_partitioner.py"
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "2",
          "--lr", "1e-3", "--distributed-backend", "gloo"]


def _unregister_toys():
    for registry, name in ((PARTITIONERS, "round_robin"), (PLACEMENTS, "reversed")):
        if name in registry.names():
            registry.unregister(name)


@pytest.fixture
def toy():
    """The example module run afresh (its decorators register both), both removed afterwards."""
    _unregister_toys()
    module = runpy.run_path(str(EXAMPLE))
    yield module
    _unregister_toys()


def test_the_registered_names_are_choices_of_config_and_flags(toy):
    assert partitioner_names() == ("auto", "lpt", "kk", "bs_ffd", "round_robin")
    assert PLACEMENTS.names() == ("identity", "greedy", "exact", "minmax", "reversed")
    entry = PARTITIONERS.get("round_robin")
    assert (entry.function, entry.doc, entry.builtin) == (
        toy["round_robin"], "Item i to bin i mod K, ignoring the costs (a toy: it balances counts, not work).", False)
    config = OrchestratorConfig(algorithm="round_robin", placement="reversed")
    assert (config.algorithm, config.placement) == ("round_robin", "reversed")
    args = arguments.parse_args(MLLM_TASK, COMMON + ["--orch-post-balancing", "--orch-algorithm", "round_robin",
                                          "--orch-placement", "reversed"], world_size=1)
    assert (args.orch_config.algorithm, args.orch_config.placement) == ("round_robin", "reversed")
    helped = arguments.build_parser(MLLM_TASK).format_help()
    assert "round_robin: Item i to bin i mod K" in " ".join(helped.split()), helped


def test_partition_and_place_bins_run_them(toy):
    costs = np.array([5.0, 1.0, 4.0, 2.0, 3.0])
    part = partition(costs, 2, method="round_robin")
    assert part.method == "round_robin" and part.bin_of_item.tolist() == [0, 1, 0, 1, 0]
    assert part.bin_costs.tolist() == [12.0, 3.0]
    # the packed micro-batches of every rank (not compiled: group by group)
    assert partition_groups(costs, np.array([1, 0, 1, 0, 1]), 2, method="round_robin").tolist() == [0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="partitioner 'round_robin': round robin exceeds the memory cap 2.0"):
        partition(costs, 2, method="round_robin", memory=[1.0] * 5, memory_cap=2.0)
    placed = place_bins(BinTraffic.from_matrix(np.eye(4, dtype=np.int64)), Topology.uniform(4, 2),
                        PlacementConfig(method="reversed"))
    assert placed.rank_of_bin.tolist() == [3, 2, 1, 0] and placed.solver == "reversed"
    assert placed.off_gpu_bytes == 4


def test_plan_step_balances_with_them(toy):
    """DP 4, 4 examples a rank, rank 0's all long: round robin puts one long example on every rank, the reversed
    placement bin b on rank 3 - b, and each rank's examples in its micro-batches by round robin too."""
    tokens = np.array([100] * 4 + [10] * 12)
    sizes = StepSizes(counts=np.full(4, 4), items={"vision": np.ones(16, dtype=np.int64),
                                                   "audio": np.zeros(16, dtype=np.int64)}, num_tokens=tokens)
    config = OrchestratorConfig(algorithm="round_robin", placement="reversed", background=False)
    plan = plan_step(sizes, load_model_config("tiny").phases(), config, Topology.uniform(4, 2), 1, 4)
    assert plan.stats["llm"].method == "round_robin"
    assert plan.examples_backbone.rank.tolist() == (3 - np.arange(16) % 4).tolist()
    assert plan.stats["llm"].max_after < plan.stats["llm"].max_before
    for rank in range(4):  # its 4 examples, by id, in micro-batches 0..3
        assert plan.microbatch_of_example[plan.examples_backbone.rank == rank].tolist() == [0, 1, 2, 3]
    assert plan.stats["vision"].method == "home"  # one item per example: round robin is no better than home
    auto = plan_step(sizes, load_model_config("tiny").phases(), OrchestratorConfig(background=False),
                     Topology.uniform(4, 2), 1, 4)
    assert "round_robin" not in auto.stats["llm"].method  # auto tries the built-in partitioners only


def test_unknown_names_are_refused_naming_the_registered_ones(toy):
    choices = "auto, lpt, kk, bs_ffd, round_robin"
    with pytest.raises(ConfigError, match=re.escape(f"OrchestratorConfig.algorithm: unknown partitioner 'zigzag'; "
                                                    f"choose one of {choices}")) as refused:
        OrchestratorConfig(algorithm="zigzag")
    assert flag_message(refused.value).startswith("--orch-algorithm: unknown partitioner 'zigzag'")
    with pytest.raises(ValueError, match=re.escape(f"unknown partitioner 'zigzag'; choose one of {choices}")):
        partition([1.0], 2, method="zigzag")
    with pytest.raises(ConfigError, match=re.escape("OrchestratorConfig.placement: unknown placement method 'far'; "
                                                    "choose one of identity, greedy, exact, minmax, reversed")):
        OrchestratorConfig(placement="far")
    with pytest.raises(ValueError, match="unknown placement method 'far'"):
        PlacementConfig(method="far")
    with pytest.raises(arguments.ArgumentError, match=r"argument --orch-algorithm: invalid choice: 'zigzag' "
                                                      r"\(choose from .*'round_robin'\)"):
        arguments.parse_args(MLLM_TASK, COMMON + ["--orch-post-balancing", "--orch-algorithm", "zigzag"], world_size=1)


def test_a_parser_built_before_the_registration_does_not_know_the_name():
    """argparse's choices are read when the parser is built: register first."""
    _unregister_toys()
    parser = arguments.build_parser(MLLM_TASK)
    runpy.run_path(str(EXAMPLE))
    try:
        with pytest.raises(arguments.ArgumentError, match="invalid choice: 'round_robin'"):
            parser.parse_args(COMMON + ["--orch-post-balancing", "--orch-algorithm", "round_robin"])
        arguments.build_parser(MLLM_TASK).parse_args(COMMON + ["--orch-post-balancing", "--orch-algorithm", "round_robin"])
    finally:
        _unregister_toys()


def test_names_are_checked_when_registered(toy):
    def noop(costs, num_bins, memory, memory_cap):
        return np.zeros(costs.size, dtype=np.int64)

    for taken in ("auto", "lpt", "round_robin", "home"):
        with pytest.raises(ValueError, match=f"partitioner '{taken}' is taken"):
            PARTITIONERS.register(taken, noop)
    for bad in ("", "-x", "a b", "lpt+refine", "auto:lpt"):
        with pytest.raises(ValueError, match="use letters, digits and _.-"):
            PARTITIONERS.register(bad, noop)
    with pytest.raises(ValueError, match="partitioner 'lpt' is built in: it cannot be removed"):
        PARTITIONERS.unregister("lpt")


def test_a_registered_partitioners_bad_result_is_named(toy):
    PARTITIONERS.register("out_of_range", lambda costs, num_bins, memory, memory_cap: np.full(costs.size, num_bins))
    try:
        with pytest.raises(ValueError, match=r"partitioner 'out_of_range''s result puts item 0 in bin 2, outside 0..1"):
            partition([1.0, 2.0], 2, method="out_of_range")
    finally:
        PARTITIONERS.unregister("out_of_range")


def test_the_plugins_variable_imports_a_users_module(monkeypatch):
    """MEGATRON_ORCH_PLUGINS: how the shipped launch scripts pick up a user's partitioner (no launch script)."""
    _unregister_toys()
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))
    monkeypatch.setenv(PLUGINS_ENV, " toy_partitioner ,")
    try:
        load_plugins()
        assert "round_robin" in partitioner_names() and "reversed" in PLACEMENTS.names()
    finally:
        sys.modules.pop("toy_partitioner", None)
        registry._plugins_loaded.discard("toy_partitioner")
        _unregister_toys()
    monkeypatch.setenv(PLUGINS_ENV, "no_such_plugin_module")
    with pytest.raises(ValueError, match=f"{PLUGINS_ENV}: cannot import 'no_such_plugin_module'"):
        load_plugins()


@pytest.mark.distributed
def test_the_docs_launch_command_finds_the_plugin():
    """The shipped launch script with MEGATRON_ORCH_PLUGINS (docs/integration.md's command, with --help: the
    command line checked and the choices listed, nothing trained) sees the registered names."""
    doc = (REPO / "docs" / "integration.md").read_text()
    block = re.findall(r"```bash\n(.*?)```", doc[doc.index("## Extending"):], re.S)[0]
    words = shlex.split(block.replace("\\\n", " "))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / env["PYTHONPATH"]), str(REPO)])  # this checkout's package
    env["MEGATRON_ORCH_SKIP_SETUP"] = "1"
    assert words[:2] == ["bash", "scripts/train_tiny_cpu.sh"] and env[PLUGINS_ENV] == "toy_partitioner", words
    proc = subprocess.run(words + ["--help"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    help_text = " ".join(proc.stdout.split())
    assert "round_robin: Item i to bin i mod K" in help_text and "reversed: Bin b on rank K-1-b" in help_text
