"""Consequence invariance end to end: training with post-balancing gives the losses of every step and
the parameters after every step of the upstream run (balancing off), on CPU over gloo.

The data is a scripted stream whose steps are the edge cases of DESIGN.md section 4: a step with no
images anywhere, audio on one rank only, one example far longer than a fair share, all heavy examples
on one rank, then an ordinary mixed step. Layouts: DP 4, TP 2 x DP 2, PP 2 x DP 2 (1F1B), DP 1; modes:
equal-count micro-batches, packed micro-batches (the default where rows are not of a fixed length) with
encoder recompute and locality-aware balancing; and
the three-encoder config (``tiny_video``: video frames as their own encoder phase) at DP 4.
"""
import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import TRAINED_PARAMS_ATOL, run_distributed
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

ITERS = 5
MBS, NUM_MB = 2, 2
COMMON = ["--model-config", "tiny", "--seq-length", "192", "--micro-batch-size", str(MBS),
          "--train-iters", str(ITERS), "--lr", "1e-2", "--lr-warmup-iters", "0", "--log-interval", "1",
          "--seed", "5", "--distributed-backend", "gloo", "--optimizer", "sgd",
          "--hidden-dropout", "0", "--attention-dropout", "0"]  # dropout masks follow the computing rank
BALANCED = ["--orch-post-balancing", "--orch-gpus-per-node", "2"]
TIMEOUT_S = 300.0
SCENARIOS = ("no_images", "audio_on_one_rank", "one_long_example", "heavy_on_one_rank", "mixed")


def scripted_example(step: int, dp_rank: int, position: int, spec, sample_index: int):
    """Example ``position`` of ``dp_rank`` in ``step``: sizes from the step's scenario, content random. A
    model with a video phase (tiny_video) gets video frames too: a long clip on one rank in the heavy step."""
    from megatron_orch.mllm.examples import assemble_example

    scenario = SCENARIOS[step % len(SCENARIOS)]
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + position)
    vision = int(torch.randint(0, 4, (1,), generator=g))
    audio = int(torch.randint(0, 3, (1,), generator=g))
    answer = int(torch.randint(4, 24, (1,), generator=g))
    video = int(torch.randint(0, 3, (1,), generator=g)) if "video" in spec.phases.encoder_names else 0
    if scenario == "no_images":
        vision = 0
    elif scenario == "audio_on_one_rank":
        audio = audio + 1 if dp_rank == 0 else 0
    elif scenario == "one_long_example" and dp_rank == 0 and position == 0:
        vision, audio, answer = 12, 4, 60
    elif scenario == "heavy_on_one_rank":
        vision, audio, answer, video = (8, 3, 40, 4) if dp_rank == 0 else (0, 0, 4, 0)
    prompt = torch.randint(0, 256, (4,), generator=g).tolist()
    counts = {"vision": vision, "audio": audio, "video": video}
    answer_ids = torch.randint(0, 256, (answer,), generator=g).tolist()
    items = {i.phase: torch.randn(counts[i.phase], *i.item_shape, generator=g) for i in spec.inputs}
    return assemble_example(sample_index, prompt, answer_ids, items, spec)


def scripted_iterator(args, consumed_samples, dp_rank, dp_size):
    """Micro-batches of the scripted stream for one DP rank (same on its TP/PP peers)."""
    from megatron_orch.mllm import providers
    from megatron_orch.megatron.batch import collate

    data = providers.data_config(args)
    spec = data.layout.spec
    per_rank = MBS * args.num_microbatches
    for step in range(consumed_samples // args.global_batch_size, args.train_iters):
        for m in range(args.num_microbatches):
            examples = [scripted_example(step, dp_rank, m * MBS + j, spec,
                                         step * args.global_batch_size + dp_rank * per_rank + m * MBS + j)
                        for j in range(MBS)]
            yield collate(examples, spec, pad_to=data.seq_length if data.pad_to_seq_length else None)


def _train(rank, world_size, argv, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments, loop as trainer

    providers.build_train_data_iterator = scripted_iterator
    built = []

    def model_provider(args, pre_process, post_process):
        built.append(providers.build_model(args, pre_process, post_process))
        return built[-1]

    args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
    lines = []
    try:
        task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
        records = trainer.pretrain(args, task, print_fn=lines.append)
    finally:
        parallel_state.destroy_model_parallel()
    state = {name: p.detach().clone() for name, p in built[0].named_parameters()}
    torch.save(state, Path(out_dir) / f"params_rank{rank}.pt")
    if records:
        torch.save({"losses": {r.iteration: r.lm_loss for r in records},
                    "post_balancing": [r.post_balancing for r in records], "lines": lines},
                   Path(out_dir) / "log.pt")


def train(tmp_path: Path, name: str, world_size: int, *flags: str) -> dict:
    out_dir = tmp_path / name
    out_dir.mkdir()
    global_batch = ["--global-batch-size", str(MBS * NUM_MB * world_size // _model_parallel(flags))]
    run_distributed(_train, world_size, COMMON + global_batch + list(flags), str(out_dir), timeout_s=TIMEOUT_S)
    log = torch.load(out_dir / "log.pt")
    log["params"] = [torch.load(out_dir / f"params_rank{r}.pt") for r in range(world_size)]
    return log


def _model_parallel(flags) -> int:
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if flag in flags:
            size *= int(flags[list(flags).index(flag) + 1])
    return size


def assert_invariant(balanced: dict, baseline: dict, rtol: float = 1e-5):
    assert sorted(balanced["losses"]) == list(range(1, ITERS + 1))
    for iteration, loss in baseline["losses"].items():
        assert balanced["losses"][iteration] == pytest.approx(loss, rel=rtol), (iteration, balanced["losses"],
                                                                                 baseline["losses"])
    for rank, (got, want) in enumerate(zip(balanced["params"], baseline["params"])):
        # the encoders on every pipeline stage (--orch-encoder-ranks auto: all) add their copies off the first
        assert want.keys() <= got.keys() and all(name.startswith("encoders.") for name in got.keys() - want.keys())
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m: f"rank {rank} parameter {name}: {m}")


def assert_plan_balances(balanced: dict, phases=("vision", "audio", "llm")):
    """The step with every heavy example on DP rank 0: the plan moved data off it and lowered each phase's
    modeled cost max/mean over DP (a plan that kept the loader's assignment would pass the invariance
    checks alone)."""
    heavy = balanced["post_balancing"][SCENARIOS.index("heavy_on_one_rank")]
    assert heavy["intra-node MB"] + heavy["inter-node MB"] > 0, heavy
    for phase in phases:
        assert heavy[f"{phase} before"] > 1.3, heavy
        assert heavy[f"{phase} after"] < heavy[f"{phase} before"], heavy


@pytest.fixture(scope="module")
def dp4_baseline(tmp_path_factory):
    return train(tmp_path_factory.mktemp("dp4"), "baseline", 4)


@pytest.mark.distributed
def test_dp4_equal_count_is_invariant_and_balances(dp4_baseline, tmp_path):
    balanced = train(tmp_path, "balanced", 4, *BALANCED, "--orch-microbatching", "equal_count")
    assert_invariant(balanced, dp4_baseline)
    # Loss decreases over the run, so the comparison is not between two idle models.
    assert dp4_baseline["losses"][ITERS] < dp4_baseline["losses"][1]
    assert_plan_balances(balanced)
    heavy = balanced["post_balancing"][SCENARIOS.index("heavy_on_one_rank")]
    assert min(heavy[f"{phase} before"] for phase in ("vision", "audio", "llm")) > 1.5, heavy
    assert heavy["llm after"] <= 1.15, heavy
    assert "post-balancing cost max/mean over DP before->after" in balanced["lines"][-1]
    # the run's peers (logged every step): the first step's at first, then never fewer, each step's within them
    run = [(s["run peers intra-node"], s["run peers inter-node"]) for s in balanced["post_balancing"]]
    step = [(s["peers intra-node"], s["peers inter-node"]) for s in balanced["post_balancing"]]
    assert run[0] == step[0] and run[-1] > (0, 0), (run, step)
    assert all(a <= b for before, after in zip(run, run[1:]) for a, b in zip(before, after)), run
    assert all(s <= r for each_step, each_run in zip(step, run) for s, r in zip(each_step, each_run)), (run, step)


@pytest.mark.distributed
def test_dp4_packed_recompute_locality_is_invariant(dp4_baseline, tmp_path):
    balanced = train(tmp_path, "packed", 4, *BALANCED, "--orch-microbatching", "packed",
                     "--orch-encoder-recompute", "--orch-locality", "--orch-no-background-planning")
    assert_invariant(balanced, dp4_baseline)
    assert_plan_balances(balanced)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [("--tensor-model-parallel-size", "2"),
                                    ("--pipeline-model-parallel-size", "2")], ids=["tp2_dp2", "pp2_dp2"])
def test_model_parallel_layouts_are_invariant(layout, tmp_path):
    """The defaults: packed rows under TP 2, equal-count ones under PP 2 (fixed-length rows); the encoders on the
    first stage under TP 2 and on every rank under PP 2 (``--orch-encoder-ranks auto``), as the iteration lines
    say."""
    baseline = train(tmp_path, "baseline", 4, *layout)
    balanced = train(tmp_path, "balanced", 4, *layout, *BALANCED, "--orch-placement", "minmax")
    assert_invariant(balanced, baseline)
    assert_plan_balances(balanced)
    layouts = {re.search(r" encoders ([\w-]+), items per rank", line).group(1) for line in balanced["lines"]
               if " items per rank " in line}
    assert layouts == {"all" if "--pipeline-model-parallel-size" in layout else "first-stage"}, balanced["lines"]


@pytest.mark.distributed
def test_three_encoder_config_is_invariant_and_balances(tmp_path):
    """tiny_video (vision tiles, video frames and audio windows, each its own encoder phase): DP 4 on 2 nodes of
    2, upstream against post-balancing, equal-count and (the default) packed with encoder recompute, the latter's
    transfers node-wise (within a node, then between rail peers: the same outputs as the flat exchange)."""
    three = ["--model-config", "tiny_video"]
    baseline = train(tmp_path, "baseline", 4, *three)
    for name, flags in (("equal_count", ("--orch-microbatching", "equal_count")),
                        ("packed", ("--orch-encoder-recompute", "--orch-all-to-all", "node-wise",
                                    "--orch-log-level", "1"))):  # the full line
        balanced = train(tmp_path, name, 4, *three, *BALANCED, *flags)
        assert_invariant(balanced, baseline)
        assert_plan_balances(balanced, phases=("vision", "video", "audio", "llm"))
    assert baseline["losses"][ITERS] < baseline["losses"][1]
    line = balanced["lines"][-1]
    assert "video items" in line and "video-encoder-forward" in line, line
    assert re.search(r"before->after: vision [\d.]+->[\d.]+, video [\d.]+->[\d.]+, audio", line), line


@pytest.mark.distributed
def test_dp1_is_invariant(tmp_path):
    balanced = train(tmp_path, "balanced", 1, "--orch-post-balancing", "--orch-gpus-per-node", "1")
    assert_invariant(balanced, train(tmp_path, "baseline", 1))
    # One DP rank: nothing to move, every phase already at max/mean 1.
    for step in balanced["post_balancing"]:
        assert step["intra-node MB"] == step["inter-node MB"] == 0, step
        assert all(step[f"{phase} {when}"] == pytest.approx(1.0) for phase in ("vision", "audio", "llm")
                   for when in ("before", "after")), step


def test_orch_flags_without_the_switch_are_rejected():
    from megatron_orch.trainer import arguments

    with pytest.raises(arguments.ArgumentError, match="--orch-locality given without --orch-post-balancing"):
        arguments.parse_args(MLLM_TASK, COMMON + ["--orch-locality"], world_size=1)
    exchanging = arguments.parse_args(MLLM_TASK, COMMON + ["--orch-post-balancing", "--orch-exchange-alike"],
                                      world_size=1)
    assert exchanging.orch_config.exchange_alike
    plain = arguments.parse_args(MLLM_TASK, COMMON + ["--orch-post-balancing"], world_size=1)
    assert not plain.orch_config.exchange_alike  # off by default
    with pytest.raises(arguments.ArgumentError, match="packed with --pipeline-model-parallel-size"):
        arguments.parse_args(MLLM_TASK, COMMON + ["--pipeline-model-parallel-size", "2", "--orch-post-balancing",
                                       "--orch-microbatching", "packed"], world_size=2)


def _disagreeing_ranks(rank, world_size):
    """Ranks configured differently plan differently: every rank must raise, none may hang."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_orch.balance.topology import Topology
    from megatron_orch.comm.gather import GroupMismatchError
    from megatron_orch.megatron.batch import collate
    from megatron_orch.megatron.post_balancing import ParallelGroups, PostBalancingDataIterator, StepShape
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.examples import batch_spec
    from megatron_orch.orchestrator.config import OrchestratorConfig

    spec = batch_spec(load_model_config("tiny"), 192)
    step = SCENARIOS.index("heavy_on_one_rank")
    source = iter([collate([scripted_example(step, rank, m * MBS + j, spec, 100 * rank + m * MBS + j)
                            for j in range(MBS)], spec) for m in range(NUM_MB)])
    config = OrchestratorConfig(background=False) if rank == 0 else \
        OrchestratorConfig(background=False, phases=("vision", "llm"))
    iterator = PostBalancingDataIterator(source, spec, config, StepShape(MBS, NUM_MB),
                                         ParallelGroups(dist.group.WORLD, Topology.uniform(world_size, 1)),
                                         compute_device=torch.device("cpu"))
    with pytest.raises(GroupMismatchError, match="plan digest"):
        next(iterator)


@pytest.mark.distributed
def test_ranks_with_different_plans_fail_loudly_instead_of_hanging():
    run_distributed(_disagreeing_ranks, 2, timeout_s=120.0)


def _bad_input_on_one_rank(rank, world_size):
    """Rank 1 loads an example whose image placeholders do not match its tiles, then (next iterator) its
    loader raises: each time rank 1 raises its own error and rank 0 an error quoting it; neither waits
    in a collective."""
    warnings.filterwarnings("ignore")
    import dataclasses

    import torch.distributed as dist

    from megatron_orch.balance.topology import Topology
    from megatron_orch.comm.status import PeerFailedError
    from megatron_orch.megatron.batch import collate
    from megatron_orch.megatron.post_balancing import ParallelGroups, PostBalancingDataIterator, StepShape
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.examples import batch_spec
    from megatron_orch.mllm.manifest import ManifestError
    from megatron_orch.orchestrator.config import OrchestratorConfig

    spec = batch_spec(load_model_config("tiny"), 192)
    examples = [scripted_example(SCENARIOS.index("mixed"), rank, j, spec, 10 * rank + j) for j in range(MBS)]
    if rank == 1:
        good = scripted_example(SCENARIOS.index("heavy_on_one_rank"), 0, 0, spec, 11)  # 8 tiles
        examples[1] = dataclasses.replace(good, items={**good.items, "vision": good.items["vision"][:3]})

    def iterator(source):
        return PostBalancingDataIterator(source, spec, OrchestratorConfig(background=False), StepShape(MBS, 1),
                                         ParallelGroups(dist.group.WORLD, Topology.uniform(world_size, 1)),
                                         compute_device=torch.device("cpu"))

    mismatch = "example 11: .* vision placeholders, expected 3 items"
    with pytest.raises(ValueError if rank == 1 else PeerFailedError, match=mismatch):
        next(iterator(iter([collate(examples, spec)])))

    loader_error = "train.jsonl line 3: image data/3.png does not exist"

    def loader():
        if rank == 1:
            raise ManifestError(loader_error)
        yield collate(examples, spec)

    with pytest.raises(ManifestError if rank == 1 else PeerFailedError, match=re.escape(loader_error)):
        next(iterator(loader()))


@pytest.mark.distributed
def test_bad_input_on_one_rank_raises_on_every_rank():
    run_distributed(_bad_input_on_one_rank, 2, timeout_s=120.0)


def _peers_with_different_plans(rank, world_size):
    """Two DP groups ({0, 1}, {2, 3}) of TP/PP peers ({0, 2}, {1, 3}): each DP group agrees on its plan,
    but the groups plan differently; every rank must raise on the peers' digest check."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from megatron_orch.balance.topology import Topology
    from megatron_orch.comm.gather import GroupMismatchError
    from megatron_orch.megatron.batch import collate
    from megatron_orch.megatron.post_balancing import ParallelGroups, PostBalancingDataIterator, StepShape
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.examples import batch_spec
    from megatron_orch.orchestrator.config import OrchestratorConfig

    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    peer_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    dp_rank = rank % 2
    spec = batch_spec(load_model_config("tiny"), 192)
    step = SCENARIOS.index("heavy_on_one_rank")
    source = iter([collate([scripted_example(step, dp_rank, m * MBS + j, spec, 100 * dp_rank + m * MBS + j)
                            for j in range(MBS)], spec) for m in range(NUM_MB)])
    config = OrchestratorConfig(background=False) if rank < 2 else \
        OrchestratorConfig(background=False, phases=("vision", "llm"))
    iterator = PostBalancingDataIterator(source, spec, config, StepShape(MBS, NUM_MB),
                                         ParallelGroups(dp_groups[rank // 2], Topology.uniform(2, 1),
                                                        peer_group=peer_groups[dp_rank]),
                                         compute_device=torch.device("cpu"))
    with pytest.raises(GroupMismatchError, match=r"plan digest \(TP/PP peers\)"):
        next(iterator)


@pytest.mark.distributed
def test_tp_pp_peers_with_different_plans_fail_loudly():
    run_distributed(_peers_with_different_plans, 4, timeout_s=120.0)


def test_the_schedule_restores_the_model_configs_callbacks():
    """The schedule wraps the gradient callbacks of the model config for one call only: left wrapped,
    every step would wrap the previous step's wrapper (a long run ends in RecursionError)."""
    from types import SimpleNamespace

    import numpy as np

    from stand_ins import EncoderlessChunk
    from megatron_orch.megatron.post_balancing import BalancedStep
    from megatron_orch.megatron.schedule import ModalityAwareSchedule

    calls = []

    def finalize(*args):
        calls.append("finalize")

    def grad_sync(*args):
        calls.append("sync")

    config = SimpleNamespace(finalize_model_grads_func=finalize, grad_sync_func=[grad_sync, grad_sync],
                             calculate_per_token_loss=True)

    def forward_backward(fail=False, **kwargs):
        calls.append(config.finalize_model_grads_func is finalize)  # wrapped during the call
        config.grad_sync_func[1]()
        config.finalize_model_grads_func()
        if fail:
            raise RuntimeError("a failing step")
        return []

    step = BalancedStep(microbatches=[], inputs={}, plan=SimpleNamespace(encoders={}), rank=0,
                        num_tokens=np.zeros(0, dtype=np.int64),
                        rows_per_item={}, comm_group=None, moves=None)
    schedule = ModalityAwareSchedule(forward_backward, dp_group=None)
    for fail in (False, False, True):
        try:
            schedule(forward_step_func=None, data_iterator=iter([step]), model=[EncoderlessChunk(config)],
                     num_microbatches=0, fail=fail)
        except RuntimeError:
            assert fail
        assert config.finalize_model_grads_func is finalize
        assert all(callback is grad_sync for callback in config.grad_sync_func) and len(config.grad_sync_func) == 2
    assert calls == [False, "sync", "finalize"] * 3


def test_the_schedule_refuses_a_number_of_microbatches_other_than_the_steps():
    """A post-balancing step has the micro-batches it loaded (``StepShape.microbatches_of_step``): a schedule call
    asking for another (upstream's per-step ``num_microbatches`` of its packing scheduler) is refused by name
    before the wrapped schedule runs; every DP rank is asked for the same number, so all refuse alike."""
    from types import SimpleNamespace

    import numpy as np

    from stand_ins import EncoderlessChunk
    from megatron_orch.megatron.post_balancing import BalancedStep
    from megatron_orch.megatron.schedule import ModalityAwareSchedule

    ran = []
    config = SimpleNamespace(finalize_model_grads_func=None, grad_sync_func=None, calculate_per_token_loss=True)
    step = BalancedStep(microbatches=[], inputs={}, plan=SimpleNamespace(encoders={}), rank=0,
                        num_tokens=np.zeros(0, dtype=np.int64), rows_per_item={}, comm_group=None, moves=None)
    schedule = ModalityAwareSchedule(lambda **kwargs: ran.append(kwargs), dp_group=None)
    with pytest.raises(ValueError, match="asked for 3 micro-batches but the post-balancing step holds 0: a step's "
                       r"micro-batches are the ones it loaded .* \(Megatron-LM's --sequence-packing-scheduler\)"):
        schedule(forward_step_func=None, data_iterator=iter([step]), model=[EncoderlessChunk(config)],
                 num_microbatches=3)
    assert not ran


def test_the_moves_run_are_the_moves_counted():
    """One list of a step's moves (``step_moves``): the routes post-balancing builds (``prepare_moves``) are
    those of the all-to-alls the byte count counts (``step_transfers``: the log, the benchmarks, the
    simulator), same names, same transfers, same order, each embeddings move followed by its gradients' (the
    inverse); a pipeline stage without encoders runs the text only. Single process, no collective."""
    import numpy as np

    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.workload import StepSizes, phase_items
    from megatron_orch.megatron.post_balancing import prepare_moves
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.orchestrator.config import OrchestratorConfig
    from megatron_orch.orchestrator.step_plan import plan_step, step_transfers

    phases = load_model_config("tiny").phases()
    num_ranks, mbs, num_mb = 4, 2, 2
    n = num_ranks * mbs * num_mb
    rng = np.random.default_rng(3)
    sizes = StepSizes(counts=np.full(num_ranks, mbs * num_mb), num_tokens=rng.integers(20, 300, n),
                      items={"vision": rng.integers(0, 5, n), "audio": rng.integers(0, 3, n)})
    plan = plan_step(sizes, phases, OrchestratorConfig(background=False), Topology.uniform(num_ranks, 2), mbs, num_mb)
    assert list(plan.encoders) == ["vision", "audio"]
    counted = step_transfers(plan, phase_items(sizes, phases))
    expected = [(t.name, backward, t.transfer.inverse() if backward else t.transfer)
                for t in counted for backward in (False, True)[:t.times]]
    assert [name for name, _, _ in expected] == ["vision inputs", "audio inputs", "text", "vision embeddings",
                                                 "vision embeddings", "audio embeddings", "audio embeddings"]

    def same(a, b):
        return all(np.array_equal(getattr(x, f), getattr(y, f)) and x.num_ranks == y.num_ranks
                   for x, y in ((a.src, b.src), (a.dst, b.dst)) for f in ("rank", "slot"))

    rows = {"vision": 3, "audio": 2}
    for rank in range(num_ranks):
        moves = prepare_moves(plan, sizes.num_tokens, rows, rank, encoder_stage=True).moves
        assert [(m.name, m.backward) for m in moves] == [(name, backward) for name, backward, _ in expected]
        assert all(same(m.transfer, transfer) for m, (_, _, transfer) in zip(moves, expected))
    text_only = prepare_moves(plan, sizes.num_tokens, rows, 0, encoder_stage=False).moves
    assert [m.name for m in text_only] == ["text"]


def test_a_step_shape_of_per_step_counts():
    """``StepShape.of_steps``: the counts up to the last change, then the last count for every later step; a count
    below 1 is refused by name."""
    from megatron_orch.megatron.post_balancing import StepShape

    shape = StepShape.of_steps(2, [1, 1, 2, 3, 3, 3], pad_to=64)
    assert (shape.micro_batch_size, shape.num_microbatches, shape.pad_to, shape.ramp_up) == (2, 3, 64, (1, 1, 2))
    assert [shape.microbatches_of_step(k) for k in range(8)] == [1, 1, 2, 3, 3, 3, 3, 3]
    assert StepShape.of_steps(2, [4, 4]) == StepShape(2, 4)
    assert [StepShape(1, 2).microbatches_of_step(k) for k in range(3)] == [2, 2, 2]
    with pytest.raises(ValueError, match=r"StepShape.ramp_up\[1\] must be an int >= 1, got 0"):
        StepShape(1, 2, ramp_up=(1, 0))
    with pytest.raises(ValueError, match="no step counts"):
        StepShape.of_steps(1, [])


def test_megatron_core_counts_are_megatron_lms_per_step_counts():
    """``megatron_core_counts`` gives each step the count Megatron-LM's train() passes its schedule (update the
    calculator with the consumed samples, ``get_num_microbatches()``, consume micro-batch size x DP per
    micro-batch), for the ramp-up of the installed release (``--rampup-batch-size`` up to 0.18, the step schedule
    from 0.19), from a resumed run's consumed samples too, and leaves the loop's calculator as it was."""
    from megatron.core import num_microbatches_calculator as calculators

    from megatron_orch.megatron.any_loop import megatron_core_counts

    mbs, dp = 1, 2
    if hasattr(calculators, "StepBatchsizeNumMicroBatchesCalculator"):
        ramp_up = dict(step_batch_size_schedule="0:2 6:4 20:8", global_batch_size=None)
    else:
        ramp_up = dict(rampup_batch_size=[2, 2, 12], global_batch_size=8)
    calculators.init_num_microbatches_calculator(rank=1, micro_batch_size=mbs, data_parallel_size=dp,
                                                 decrease_batch_size_if_needed=False, **ramp_up)
    try:
        for start in (0, 6):
            megatron_lm, consumed = [], start  # as train() steps
            for _ in range(8):
                calculators.update_num_microbatches(consumed, consistency_check=True)
                megatron_lm.append(calculators.get_num_microbatches())
                consumed += dp * mbs * calculators.get_num_microbatches()
            calculators.update_num_microbatches(start, consistency_check=True)
            assert megatron_core_counts(start, 8, mbs * dp) == megatron_lm
            assert calculators.get_num_microbatches() == megatron_lm[0]  # the loop's calculator untouched
            assert len(set(megatron_lm)) > 1, megatron_lm  # it ramps up
    finally:
        calculators.destroy_num_microbatches_calculator()
    with pytest.raises(ValueError, match="calculator is not initialised"):
        megatron_core_counts(0, 1, 2)


def test_parallel_groups_of_encoder_ranks_of_their_own_take_the_layouts_group():
    """With encoder ranks of their own, the backbone rank's groups carry the layout, the group of its ranks as
    ``encoder_group`` and a communicator (no pipeline group, the encoders' stage); anything else is refused, saying
    so."""
    from megatron_orch.balance.topology import Topology
    from megatron_orch.megatron import ParallelGroups
    from megatron_orch.orchestrator.encoder_ranks import OwnEncoderRanks

    layout = OwnEncoderRanks((0, 1), ((2, 3), (4, 5)), 6)
    group = object()  # stands for a process group: nothing runs on it here
    ParallelGroups(group, Topology.uniform(2, 1), comm_group=group, encoder_group=group, own_encoder_ranks=layout)
    for wrong in ({"comm_group": group}, {"encoder_group": group},
                  {"comm_group": group, "encoder_group": group, "pipeline_group": group},
                  {"comm_group": group, "encoder_group": group, "encoder_stage": False}):
        with pytest.raises(ValueError, match="own_encoder_ranks takes the encoder_group of the layout's ranks"):
            ParallelGroups(group, Topology.uniform(2, 1), own_encoder_ranks=layout, **wrong)
