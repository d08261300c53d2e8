"""Megatron-Core's MimoModel balanced out of the box (``megatron_orch.megatron.mimo``), on CPU over gloo.

A tiny MimoModel (``mimo_model``: an image and an audio modality submodule of megatron-core's own classes,
a GPT language model) trains upstream (``MimoModel.forward`` per micro-batch, Megatron's schedule) and
with post-balancing (the same model wrapped in ``MimoBalancing``, the post-balancing iterator and the
modality-aware schedule), with the compact trainer's own building blocks (Megatron DDP, SGD, per-token
loss): the losses of every step and the parameters after the run agree within 1e-5, and on the step with
every heavy example on one rank the plan moved data and lowered each phase's modeled max/mean. Layouts:
DP 4 and TP 2 x DP 2 (and TP 2 + SP x DP 2 on 0.19). On 0.19, whose MimoModel.forward takes THD
``packing_kwargs``, the default micro-batching packs: a packed row gives each example the losses and gradients
of a row of its own, no example attending to another, and packed post-balancing agrees with upstream at DP 2
and TP 2 + SP x DP 2; on 0.16.1 packed rows are refused, saying why. PP 2 x DP 2 is refused, with MIMO's
reason (MimoModel does not run a language model split over pipeline stages under Megatron's schedules), as is
what else the adapter cannot keep invariant. On 0.19, a MimoModel with colocated per-module grids
(``module_to_grid_map``: the modalities at TP 1 x DP 4 under a language model at TP 2 x DP 2) is post-balanced as
the encoders on every rank at TP 1 and agrees with upstream MIMO at TP 2; the grids it does not run are refused by
name. Non-colocated grids (the modalities on ranks of their own) are read as encoder ranks of their own, and the
moves over them (2 encoder ranks + the language model at TP 2 x DP 2, 6 ranks) agree with a gather; their training
step is not run, and the adapter refuses them saying so.
"""
import dataclasses
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_utils import TRAINED_PARAMS_ATOL, run_distributed
from mimo_model import FRAMES, MEL_BINS, PAD_TOKEN_ID, PATCH_DIM, PATCHES, SEQ_LENGTH
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

ITERS, MBS, NUM_MB = 4, 2, 2
FLAGS = ["--seq-length", str(SEQ_LENGTH), "--micro-batch-size", str(MBS), "--train-iters", str(ITERS),
         "--lr", "1e-2", "--lr-warmup-iters", "0", "--seed", "5", "--distributed-backend", "gloo", "--optimizer", "sgd"]
SCENARIOS = ("mixed", "heavy_on_one_rank", "no_images", "audio_on_one_rank")
TIMEOUT_S = 300.0


def scripted_example(step: int, dp_rank: int, position: int, spec, sample_index: int):
    from megatron_orch.mllm.examples import assemble_example

    scenario = SCENARIOS[step % len(SCENARIOS)]
    g = torch.Generator().manual_seed(1000 * step + 10 * dp_rank + position)
    images, windows = int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(0, 3, (1,), generator=g))
    answer = int(torch.randint(4, 20, (1,), generator=g))
    if scenario == "heavy_on_one_rank":
        images, windows, answer = (9, 5, 40) if dp_rank == 0 else (0, 0, 4)
    elif scenario == "no_images":
        images = 0
    elif scenario == "audio_on_one_rank":
        windows = windows + 1 if dp_rank == 0 else 0
    items = {"images": torch.randn(images, PATCHES, PATCH_DIM, generator=g),
             "audio": torch.randn(windows, FRAMES, MEL_BINS, generator=g)}
    prompt = torch.randint(0, 256, (4,), generator=g).tolist()
    return assemble_example(sample_index, prompt, torch.randint(0, 256, (answer,), generator=g).tolist(), items, spec)


def _train(rank, world_size, tp, sp, balanced, out_dir, microbatching="equal_count", encoder_tp=None):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_orch.balance.topology import Topology
    from megatron_orch.megatron import (ModalityAwareSchedule, OrchestratorConfig, ParallelGroups,
                                        PostBalancingDataIterator, StepShape, forward_step, post_balance,
                                        share_encoders)
    from megatron_orch.megatron.encoder_layout import encoder_groups
    from megatron_orch.trainer import arguments, cpu_harness, loop as trainer
    from mimo_model import balanced_mimo

    dp = world_size // tp
    args = arguments.parse_args(MLLM_TASK, FLAGS + ["--tensor-model-parallel-size", str(tp), *["--sequence-parallel"] * sp,
                                         "--global-batch-size", str(MBS * NUM_MB * dp)], world_size=world_size)
    trainer.initialize(args)
    try:
        built = []

        def model_provider(args, pre_process, post_process):
            built.append(balanced_mimo(tp, sp, encoder_tp))
            cpu_harness.install()  # megatron.core.models.mimo was imported just now
            return built[-1]

        timers = trainer.Timers(log_level=1, log_option="minmax")
        model = trainer.build_model(args, model_provider)
        if encoder_tp is not None:  # the encoder replicas of a TP group start equal (each seeded its own)
            share_encoders(model, encoder_groups(encoder_tp)[1])
        optimizer, scheduler = trainer.build_optimizer(args, model, timers)
        trainer.attach_to_model_config(model, optimizer, timers)
        spec = built[0].batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
        dp_group = parallel_state.get_data_parallel_group()
        source = _loader(args, spec, parallel_state.get_data_parallel_rank())
        schedule, iterator = None, source
        if encoder_tp is not None:  # the modalities' own grid: the encoders on every rank at its TP, which the
            # default encoder_ranks AUTO decides from the model (every rank's holding the encoders, at encoder_tp)
            config = OrchestratorConfig(microbatching=microbatching, verify_first_step=False)
            schedule, iterator = post_balance(get_forward_backward_func(), source, spec, StepShape(MBS, NUM_MB),
                                              model=model, config=config, compute_device=torch.device("cpu"))
        elif balanced:
            groups = ParallelGroups(dp_group, Topology.uniform(args.data_parallel_size, 1), encoder_stage=True,
                                    peer_group=parallel_state.get_model_parallel_group())
            iterator = PostBalancingDataIterator(source, spec, OrchestratorConfig(microbatching=microbatching),
                                                 StepShape(MBS, NUM_MB), groups,
                                                 compute_device=torch.device("cpu"))
            schedule = ModalityAwareSchedule(get_forward_backward_func(), dp_group)
        losses, reports, packed, encoded, norms = [], [], [], [], []
        for _ in range(ITERS):
            result = trainer.train_step(forward_step, iterator, model, optimizer, scheduler, args, timers, schedule)
            losses.append(result["lm_loss"])
            norms.append(float(result["grad_norm"]))
            if schedule is not None:
                reports.append(schedule.last_step.plan.report())
                packed.append([m.batch.is_packed for m in schedule.last_step.microbatches])
                placements = {p: schedule.last_step.encoded(p) for p in ("images", "audio")}
                encoded.append({p: torch.bincount(torch.as_tensor(e.rank), minlength=e.num_ranks).tolist()
                                for p, e in placements.items()})  # items per encoder-group rank
        torch.save({"losses": losses, "reports": reports, "packed": packed, "encoded": encoded, "norms": norms,
                    "params": {name: p.detach().clone() for name, p in built[0].named_parameters()}},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


def train(tmp_path: Path, name: str, tp: int, sp: bool, balanced: bool, world_size: int = 4,
          microbatching: str = "equal_count", encoder_tp=None) -> list:
    out = tmp_path / name
    out.mkdir()
    run_distributed(_train, world_size, tp, sp, balanced, str(out), microbatching, encoder_tp, timeout_s=TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt") for r in range(world_size)]


def _mimo_takes_packing_kwargs() -> bool:
    """0.19's MimoModel.forward takes THD parameters (packing_kwargs); 0.16.1's not."""
    from megatron.core.models.mimo import MimoModel

    from megatron_orch.megatron.mimo import takes_packing_kwargs
    return takes_packing_kwargs(MimoModel.__new__(MimoModel))


def _mimo_shards_its_input() -> bool:
    """0.19's MimoModel shards the language model's input for sequence and context parallelism; 0.16.1's not."""
    from megatron.core.models.mimo.model import base
    return hasattr(base, "PartitionAdapter")


def _assert_same_training_and_data_moved(balanced, upstream) -> dict:
    """Every rank's losses and parameters within 1e-5 of upstream's, and the plan of the step with all heavy
    examples on one rank moved data; its report."""
    for rank, (got, want) in enumerate(zip(balanced, upstream)):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), rank
        assert got["params"].keys() == want["params"].keys()
        for name in want["params"]:
            torch.testing.assert_close(got["params"][name], want["params"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} parameter {name}: {m}")
    heavy = balanced[0]["reports"][SCENARIOS.index("heavy_on_one_rank")]
    assert heavy["intra-node MB"] + heavy["inter-node MB"] > 0, heavy
    return heavy


@pytest.fixture(scope="module")
def upstream_tp2_dp2(tmp_path_factory) -> list:
    """Upstream MIMO at TP 2 x DP 2 (no grids), trained once for the tests that compare with it."""
    return train(tmp_path_factory.mktemp("upstream_tp2_dp2"), "upstream", 2, False, False)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)], ids=["dp4", "tp2_dp2", "tp2_sp_dp2"])
def test_mimo_upstream_and_balanced_agree_and_the_plan_balances(tp, sp, tmp_path, request):
    if sp and not _mimo_shards_its_input():
        pytest.skip("this megatron-core's MimoModel (0.16) does not shard for sequence parallelism, which the "
                    "adapter refuses (test_sequence_or_context_parallelism_needs_a_mimo_that_shards)")
    upstream = (request.getfixturevalue("upstream_tp2_dp2") if (tp, sp) == (2, False)
                else train(tmp_path, "upstream", tp, sp, False))
    balanced = train(tmp_path, "balanced", tp, sp, True)
    assert upstream[0]["losses"][-1] < upstream[0]["losses"][0]  # it learns: not two idle models
    heavy = _assert_same_training_and_data_moved(balanced, upstream)
    for phase in ("images", "audio", "language"):
        assert heavy[f"{phase} before"] > 1.3, heavy
        assert heavy[f"{phase} after"] < heavy[f"{phase} before"], heavy


@pytest.mark.distributed
@pytest.mark.parametrize("world_size, tp, sp", [(2, 1, False), (4, 2, True)], ids=["dp2", "tp2_sp_dp2"])
def test_mimo_packed_by_default_agrees_with_upstream(world_size, tp, sp, tmp_path):
    """0.19: post-balancing's default micro-batching (``auto``) packs a MimoModel's micro-batches (THD
    ``packing_kwargs``); losses and parameters equal upstream's (``MimoModel.forward`` on right-padded rows of the
    loader's micro-batches) within 1e-5. TP 2 + SP: MIMO's own sequence-parallel sharding of the packed row."""
    if not _mimo_takes_packing_kwargs():
        pytest.skip("this megatron-core's MimoModel (0.16) takes no packing_kwargs: auto gives equal-count "
                    "micro-batches (test_packed_rows_where_the_installed_mimo_takes_them)")
    upstream = train(tmp_path, "upstream", tp, sp, False, world_size)
    balanced = train(tmp_path, "packed", tp, sp, True, world_size, microbatching="auto")
    assert upstream[0]["losses"][-1] < upstream[0]["losses"][0]
    assert all(all(step) for result in balanced for step in result["packed"]), balanced[0]["packed"]
    _assert_same_training_and_data_moved(balanced, upstream)


@pytest.mark.distributed
def test_mimo_with_its_own_encoder_grid_is_balanced_over_it(tmp_path, request):
    """0.19's colocated ``module_to_grid_map``: the language model at TP 2 x DP 2, the modalities on a grid of their
    own at TP 1 x DP 4 over the same 4 ranks. Post-balanced (the encoders on every rank at TP 1: each phase over the
    4 encoder DP ranks, any number of items per example, outputs to the language DP rank of each example) against
    upstream MIMO at TP 2 without grids (every encoder at the language model's TP): the losses of every step within
    1e-5, every parameter at the trained-parameter tolerance (an encoder weight TP 2 splits against its half of the
    whole TP-1 one), and on the heavy step every encoder rank encoded images."""
    if not _mimo_has_grids():
        pytest.skip("this megatron-core's MimoModelConfig (0.16) takes no module_to_grid_map: no per-module grids")
    upstream = request.getfixturevalue("upstream_tp2_dp2")
    balanced = train(tmp_path, "grid", 2, False, True, encoder_tp=1)
    assert upstream[0]["losses"][-1] < upstream[0]["losses"][0]
    for tp_rank in (0, 1):
        got, want = balanced[tp_rank], upstream[tp_rank]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), tp_rank
        assert got["params"].keys() == want["params"].keys()
        split = 0
        for name, expected in want["params"].items():
            value = got["params"][name]
            dims = [d for d in range(value.dim()) if value.shape[d] != expected.shape[d]]
            if dims:  # an encoder weight: whole at TP 1, halved at TP 2
                assert ".modality_submodules." in name and value.shape[dims[0]] == 2 * expected.shape[dims[0]], name
                value, split = value.chunk(2, dim=dims[0])[tp_rank], split + 1
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m: f"TP rank {tp_rank} parameter {name}: {m}")
        assert split  # the encoders did run at TP 1
        worst = max(abs(g - w) / abs(w) for g, w in zip(got["losses"], want["losses"]))
        print(f"TP rank {tp_rank}: largest relative loss difference {worst:.1e} over {len(want['losses'])} steps")
    heavy = balanced[0]["encoded"][SCENARIOS.index("heavy_on_one_rank")]
    print(f"heavy step, items per encoder rank: {heavy}")
    assert len(heavy["images"]) == 4 and min(heavy["images"]) > 0, heavy
    assert max(heavy["images"]) - min(heavy["images"]) <= 1, heavy
    assert balanced[0]["reports"][SCENARIOS.index("heavy_on_one_rank")]["images after"] < 1.3


def _loader(args, spec, dp_rank: int):
    """DP rank ``dp_rank``'s micro-batches of every step, as ``_train`` loads them."""
    from megatron_orch.megatron import collate

    per_rank = MBS * NUM_MB
    return (collate([scripted_example(step, dp_rank, m * MBS + j, spec,
                                      step * args.global_batch_size + dp_rank * per_rank + m * MBS + j)
                     for j in range(MBS)], spec)
            for step in range(ITERS) for m in range(NUM_MB))


ENCODER_RANKS = 2  # of the non-colocated layout: then the language model at TP 2 x DP 2


def _train_on_own_encoder_ranks(rank, world_size, out_dir):
    """A non-colocated MimoModel trained post-balanced on ``world_size`` ranks: the modalities on ranks 0..1 (their
    grid at TP 1 x DP 2: OwnEncoderRanksLoop), the language model on ranks 2..5 at TP 2 x DP 2 (the post-balancing
    iterator and schedule); each module's DDP, optimizer and gradient reduction on its own grid's process groups,
    stepping with the whole model's gradient norm (SharedNormOptimizer). The language ranks start from the language
    model the colocated reference builds (its encoders are built first, from the same seed)."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_orch.balance.cost import TransformerCost
    from megatron_orch.balance.topology import Topology
    from megatron_orch.comm.communicator import dedicated_group
    from megatron_orch.megatron import (ModalityAwareSchedule, OrchestratorConfig, ParallelGroups,
                                        PostBalancingDataIterator, StepShape, forward_step)
    from megatron_orch.megatron.mimo import MimoBalancing
    from megatron_orch.megatron.own_encoder_ranks import (OwnEncoderRanksLoop, SharedNormOptimizer,
                                                          grid_process_groups)
    from megatron_orch.trainer import arguments, cpu_harness, loop as trainer
    from mimo_model import build_mimo, modalities, non_colocated_grids, shapes

    tp, dp = 2, (world_size - ENCODER_RANKS) // 2
    args = arguments.parse_args(MLLM_TASK, FLAGS + ["--tensor-model-parallel-size", str(tp),
                                                    "--global-batch-size", str(MBS * NUM_MB * dp)],
                                world_size=tp * dp)  # the language model's grid: the reference's job
    cpu_harness.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)  # TP groups (0, 1), (2, 3), (4, 5)
    try:
        trainer.set_random_seed(args.seed)
        grids = non_colocated_grids(ENCODER_RANKS, tp, dp)
        groups_of = grid_process_groups(grids)
        on_encoder_rank = rank < ENCODER_RANKS
        reference = None if on_encoder_rank else build_mimo(tp)  # the colocated reference's initial model
        mimo = build_mimo(tp, own_grids=grids)
        cpu_harness.install()  # megatron.core.models.mimo was imported just now
        if reference is not None:
            mimo.language_model.load_state_dict(reference.language_model.state_dict())
        model = MimoBalancing(mimo, modalities(), TransformerCost(shapes()[1]))
        layout = model.own_encoder_ranks
        pgs = groups_of["images" if on_encoder_rank else "language"]
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model, pg_collection=pgs)
        optimizer, scheduler = trainer.build_optimizer(args, [ddp], pg_collection=pgs)
        group = dist.new_group(list(range(world_size)))  # the layout's ranks: the moves, the sizes, the norm
        comm_group = dedicated_group(pgs.dp)  # every rank, each its own DP group's (the language ranks use theirs)
        optimizer = SharedNormOptimizer(optimizer, group, encoder_rank=on_encoder_rank)
        spec = model.batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
        config = OrchestratorConfig(microbatching="equal_count", verify_first_step=False)
        losses, norms, encoded = [], [], []
        if on_encoder_rank:
            loop = OwnEncoderRanksLoop(ddp, optimizer, spec, config, StepShape(MBS, NUM_MB), layout, group,
                                       compute_device=torch.device("cpu"))
            for _ in range(ITERS):
                result = loop.train_step()
                norms.append(result["grad_norm"])
                encoded.append(dict(loop.items_encoded))
                if not result["skipped"]:
                    scheduler.step(increment=args.global_batch_size)
            ended = loop.train_step() is None  # the language ranks' data ended: told, nothing else runs
        else:
            trainer.attach_to_model_config([ddp], optimizer, trainer.Timers(log_level=1, log_option="minmax"))
            parallel = ParallelGroups(pgs.dp, Topology.uniform(dp, 1), encoder_stage=True, peer_group=pgs.mp,
                                      comm_group=comm_group, encoder_group=group, own_encoder_ranks=layout)
            iterator = PostBalancingDataIterator(_loader(args, spec, pgs.dp.rank()), spec, config,
                                                 StepShape(MBS, NUM_MB), parallel, compute_device=torch.device("cpu"))
            schedule = ModalityAwareSchedule(get_forward_backward_func(), pgs.dp)
            for _ in range(ITERS):
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                reports = schedule(forward_step_func=forward_step, data_iterator=iterator, model=[ddp],
                                   num_microbatches=NUM_MB, seq_length=SEQ_LENGTH, micro_batch_size=MBS,
                                   forward_only=False, pg_collection=pgs)
                updated, grad_norm, _ = optimizer.step()
                norms.append(grad_norm)
                if updated:
                    scheduler.step(increment=args.global_batch_size)
                report = torch.stack([x["lm loss"] for x in reports]).sum(dim=0).double()
                dist.all_reduce(report, group=pgs.dp)  # the loss of the step: sum of token losses / loss tokens
                losses.append(float(report[0] / report[1]))
            ended = next(iterator, None) is None  # tells the encoder ranks
        torch.save({"losses": losses, "norms": norms, "encoded": encoded, "ended": ended,
                    "params": {name: p.detach().clone() for name, p in model.named_parameters()}},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.distributed
def test_mimo_with_encoder_ranks_of_their_own_trains_as_colocated(tmp_path, request):
    """0.19's non-colocated ``module_to_grid_map``: the modalities on 2 encoder ranks of their own (TP 1 x DP 2), the
    language model on 4 others at TP 2 x DP 2, trained post-balanced (each phase balanced over the encoder ranks, any
    number of items per example; the encoder ranks encode, the language ranks receive the outputs and send the
    gradients back) against the same modules colocated, upstream MIMO at TP 2 x DP 2 with balancing off: the same
    math, as upstream's own non-colocated bridge needs NCCL and CUDA and does not run on gloo. The losses of every
    step within 1e-5, the whole model's gradient norm (encoder parameters counted once) on every rank within 1e-5,
    every parameter at the trained-parameter tolerance (each encoder weight whole on both encoder ranks against the
    reference's TP halves), and on the heavy step both encoder ranks encoded images, within one of each other. After
    the last step the language ranks' iterator ends and the encoder ranks' loop is told so."""
    if not _mimo_has_grids():
        pytest.skip("this megatron-core's MimoModelConfig (0.16) takes no module_to_grid_map: no per-module grids")
    upstream = request.getfixturevalue("upstream_tp2_dp2")
    out = tmp_path / "own"
    out.mkdir()
    run_distributed(_train_on_own_encoder_ranks, ENCODER_RANKS + 4, str(out), timeout_s=TIMEOUT_S)
    own = [torch.load(out / f"rank{r}.pt") for r in range(ENCODER_RANKS + 4)]
    assert upstream[0]["losses"][-1] < upstream[0]["losses"][0]  # it learns: not two idle models
    for rank, got in enumerate(own):
        assert got["norms"] == pytest.approx(upstream[0]["norms"], rel=1e-5), rank
        assert got["ended"], rank
    for r, want in enumerate(upstream):  # language rank 2 + r holds reference rank r's TP shard
        got = own[ENCODER_RANKS + r]
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5), r
        language = {name: value for name, value in want["params"].items() if ".language_model." in name}
        assert got["params"].keys() == language.keys()
        for name, expected in language.items():
            torch.testing.assert_close(got["params"][name], expected, rtol=1e-5, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m: f"language rank {ENCODER_RANKS + r} parameter {name}: {m}")
    for rank in range(ENCODER_RANKS):
        got = own[rank]["params"]
        encoders = {name for name in upstream[0]["params"] if ".modality_submodules." in name}
        assert got.keys() == encoders
        for tp_rank in (0, 1):
            for name in encoders:
                expected, value = upstream[tp_rank]["params"][name], got[name]
                dims = [d for d in range(value.dim()) if value.shape[d] != expected.shape[d]]
                if dims:  # whole at TP 1, halved at TP 2
                    value = value.chunk(2, dim=dims[0])[tp_rank]
                torch.testing.assert_close(value, expected, rtol=1e-5, atol=TRAINED_PARAMS_ATOL,
                                           msg=lambda m: f"encoder rank {rank} parameter {name}: {m}")
    worst = max(abs(g - w) / abs(w) for g, w in zip(own[ENCODER_RANKS]["losses"], upstream[0]["losses"]))
    print(f"largest relative loss difference {worst:.1e} over {ITERS} steps; gradient norms {own[0]['norms']}")
    heavy = [own[rank]["encoded"][SCENARIOS.index("heavy_on_one_rank")]["images"] for rank in range(ENCODER_RANKS)]
    print(f"heavy step, images per encoder rank: {heavy}")
    assert min(heavy) > 0 and max(heavy) - min(heavy) <= 1, heavy


def _grid(tp, dp, offset=0, names=("tp", "cp", "dp", "pp")):
    """A module's HyperCommGrid of TP x DP from rank ``offset`` (every other dim 1), in dims order ``names``."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    sizes = {"tp": tp, "dp": dp}
    return HyperCommGrid([sizes.get(n, 1) for n in names], list(names), rank_offset=offset)


def _with_grids(language, images, audio=None, tp=2):
    """What the grid readers read of a MimoModel: its module_to_grid_map and its language model's TP."""
    grids = {"language": language, "images": images, "audio": audio or images}
    return SimpleNamespace(mimo_config=SimpleNamespace(module_to_grid_map=grids),
                           config=SimpleNamespace(tensor_model_parallel_size=tp))


def test_non_colocated_grids_are_encoder_ranks_of_their_own(monkeypatch):
    """0.19's non-colocated ``module_to_grid_map`` (the modalities on ranks of their own at TP 1, the language model
    on the others) as the layout post-balancing plans and moves over (``OwnEncoderRanks``: global ranks); colocated
    grids or none give none; modalities on different ranks, a grid sharing some of the language model's ranks, and
    encoder TP above 1 are refused by name. (0.16.1 has no grids: MimoModelConfig refuses the field itself.)"""
    from megatron_orch.megatron.mimo import own_encoder_ranks
    from megatron_orch.orchestrator.encoder_ranks import OwnEncoderRanks

    if not _mimo_has_grids():
        from megatron.core.models.mimo import MimoModelConfig
        with pytest.raises(TypeError, match="module_to_grid_map"):
            MimoModelConfig(language_model_spec=None, module_to_grid_map={})
        assert own_encoder_ranks(SimpleNamespace(mimo_config=SimpleNamespace())) is None
        return
    monkeypatch.setenv("WORLD_SIZE", "7")  # HyperCommGrid reads the world's size from it
    assert own_encoder_ranks(_with_grids(_grid(2, 2, offset=2), _grid(1, 2))) == OwnEncoderRanks(
        (0, 1), ((2, 3), (4, 5)), 6)
    assert own_encoder_ranks(_with_grids(_grid(1, 4), _grid(1, 3, offset=4), tp=1)) == OwnEncoderRanks(
        (4, 5, 6), ((0,), (1,), (2,), (3,)), 7)
    assert own_encoder_ranks(_with_grids(_grid(2, 2), _grid(1, 4))) is None  # colocated
    assert own_encoder_ranks(SimpleNamespace(mimo_config=SimpleNamespace())) is None
    with pytest.raises(NotImplementedError, match=r"grids span different ranks \(language ranks 2..5, images ranks "
                                                  r"0..1, audio ranks 6..6\)"):
        own_encoder_ranks(_with_grids(_grid(2, 2, offset=2), _grid(1, 2), _grid(1, 1, offset=6)))
    with pytest.raises(NotImplementedError, match=r"shares some ranks with the language model's \(language ranks "
                                                  r"2..5, images ranks 1..2"):
        own_encoder_ranks(_with_grids(_grid(2, 2, offset=2), _grid(1, 2, offset=1)))
    with pytest.raises(NotImplementedError, match=r"encoder ranks of their own at TP \{'images': 2, 'audio': 2\}"):
        own_encoder_ranks(_with_grids(_grid(2, 2, offset=2), _grid(2, 1)))
    with pytest.raises(ValueError, match=r"module_to_grid_map\['language'\] has TP 2, its language model config 1"):
        own_encoder_ranks(_with_grids(_grid(2, 2, offset=2), _grid(1, 2), tp=1))


def _check_own_encoder_ranks_moves(rank, world_size):
    """On 6 gloo ranks, the layout of a non-colocated MimoModel (encoder ranks 0, 1 at TP 1; the language model at
    TP 2 x DP 2 on ranks 2..5): every rank builds the global batch from a seed (the gather) and each move's result is
    checked against selecting from it. Raw inputs from TP rank 0 of the DP rank that loaded each example reach their
    encoder rank (each phase balanced: ceil(n / 2) on the busiest); an elementwise stand-in encoder's outputs reach
    both TP ranks of the DP rank that runs each example, in the order the colocated plan delivers them; gradients
    from its TP rank 0 come back to the encoder rank of each item. Examples have 0-9 images and 0-2 audio windows."""
    import numpy as np

    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.workload import StepSizes
    from megatron_orch.comm.alltoall import ItemLayout, all_to_all_items
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.orchestrator.config import OrchestratorConfig
    from megatron_orch.orchestrator.encoder_ranks import (CopiedStepMove, OwnEncoderRanks, encode_on_own_ranks,
                                                          own_ranks_moves)
    from megatron_orch.orchestrator.step_plan import plan_step

    layout = OwnEncoderRanks((0, 1), ((2, 3), (4, 5)), world_size)
    dp, n = 2, 8
    rng = np.random.default_rng(21)
    images = np.where(np.arange(n) < n // dp, rng.integers(3, 10, n), rng.integers(0, 2, n))  # heavy on DP rank 0
    sizes = StepSizes(counts=np.full(dp, n // dp), items={"vision": images, "audio": rng.integers(0, 3, n)},
                      num_tokens=rng.integers(20, 120, n))
    plan = plan_step(sizes, load_model_config("tiny").phases(),
                     OrchestratorConfig(background=False, microbatching="equal_count"), Topology.uniform(dp, dp), 2, 2)
    encode = encode_on_own_ranks(plan, layout)
    rows, width = 3, 4  # rows per raw item (and per output), its width; outputs twice as wide

    def encoded(x):  # exact on any grouping of items
        return torch.cat([x, 2 * x + 1], dim=-1)

    def packed(tensors, ids, trailing):
        return torch.cat([tensors[i] for i in ids]) if len(ids) else torch.zeros(0, trailing)

    moves = {(move.items_of, move.kind): move for move in own_ranks_moves(plan, layout, encode)}
    for k, phase in enumerate(plan.encoders):
        items = torch.randn(plan.encoders[phase].example.size, rows, width, generator=torch.Generator().manual_seed(k))
        raw = list(items)
        counts = encode[phase].counts()
        assert counts[[0, 1]].max() == -(-items.shape[0] // 2) and counts.sum() == items.shape[0], counts
        inputs = moves[(phase, "inputs")].transfer
        layout_in = ItemLayout(np.full(items.shape[0], rows), (width,), torch.float32)
        (got,) = all_to_all_items([packed(raw, inputs.src.items_on(rank), width)], [layout_in], inputs)
        assert torch.equal(got, packed(raw, inputs.dst.items_on(rank), width)), (rank, phase, "inputs")

        outputs = moves[(phase, "embeddings")]
        copies = outputs.copies if isinstance(outputs, CopiedStepMove) else 1
        assert copies == 2
        send = encoded(got).repeat(copies, 1)  # as the schedule sends a copied move's rows (Move.send_rows)
        layout_out = ItemLayout(np.full(outputs.transfer.src.num_items, rows), (2 * width,), torch.float32)
        (embeds,) = all_to_all_items([send], [layout_out], outputs.transfer)
        if rank >= 2:
            dp_rank = (rank - 2) // 2
            colocated = plan.output_transfer(phase).dst.items_on(dp_rank)  # what DP rank d gets, encoders colocated
            assert torch.equal(embeds, packed([encoded(x) for x in raw], colocated, 2 * width)), (rank, phase)
        else:
            assert embeds.shape[0] == 0

        gradients = outputs.gradients()
        grads = (3 * embeds - 1)[:gradients.src.counts()[rank] * rows]  # TP rank 0 sends them, TP rank 1 nothing
        layout_back = ItemLayout(np.full(gradients.src.num_items, rows), (2 * width,), torch.float32)
        (back,) = all_to_all_items([grads], [layout_back], gradients)
        expected = packed([3 * encoded(x) - 1 for x in raw], encode[phase].items_on(rank), 2 * width)
        assert torch.equal(back, expected), (rank, phase, "gradients")


@pytest.mark.distributed
def test_encoder_ranks_of_their_own_move_every_item_as_a_gather_selects_it():
    """The moves of a non-colocated MimoModel's layout (2 encoder ranks + the language model at TP 2 x DP 2) on 6
    gloo ranks against a gather (:func:`_check_own_encoder_ranks_moves`)."""
    run_distributed(_check_own_encoder_ranks_moves, 6)


def _mimo_has_grids() -> bool:
    """0.19's MimoModelConfig takes per-module grids (module_to_grid_map); 0.16.1's not."""
    from megatron.core.models.mimo import MimoModelConfig
    return "module_to_grid_map" in {f.name for f in dataclasses.fields(MimoModelConfig)}


# -- what the adapter refuses, and why ----------------------------------------------------------------

@pytest.fixture(scope="module")
def harness():
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()


def test_the_adapter_meets_the_contract(harness, world_of_one):
    from megatron_orch.megatron import BalanceableModel
    from mimo_model import balanced_mimo

    model = balanced_mimo()
    assert isinstance(model, BalanceableModel)
    assert model.phases.names == ("images", "audio", "language")
    spec = model.batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
    assert [(i.phase, i.item_shape, i.placeholder_id) for i in spec.inputs] == [
        ("images", (PATCHES, PATCH_DIM), 1000), ("audio", (FRAMES, MEL_BINS), 1001)]
    with torch.no_grad():  # the submodule's own forward, item by item: any grouping gives the same rows
        images = torch.randn(3, PATCHES, PATCH_DIM)
        together = model.encode("images", images)
        assert together.shape == (3 * PATCHES, 64)
        torch.testing.assert_close(torch.cat([model.encode("images", images[:1]), model.encode("images", images[1:])]),
                                   together, rtol=1e-5, atol=1e-6)
        assert model.encode("audio", torch.zeros(0, FRAMES, MEL_BINS)).shape == (0, 64)


def test_a_language_model_split_over_pipeline_stages_is_refused(harness, world_of_one):
    from megatron_orch.balance.cost import TransformerCost
    from megatron_orch.megatron.mimo import MimoBalancing
    from mimo_model import build_mimo, modalities, shapes

    for stage in ({"pre_process": False}, {"post_process": False}):
        with pytest.raises(NotImplementedError, match="split over pipeline stages, which MimoModel does not run"):
            MimoBalancing(build_mimo(**stage), modalities(), TransformerCost(shapes()[1]))


def test_what_would_break_invariance_is_refused(harness, world_of_one):
    import dataclasses

    from megatron_orch.balance.cost import TransformerCost
    from megatron_orch.megatron import collate_packed
    from megatron_orch.megatron.mimo import MimoBalancing
    from mimo_model import balanced_mimo, build_mimo, modalities, shapes

    cost = TransformerCost(shapes()[1])
    with pytest.raises(NotImplementedError, match=r"modality images has encoders \['vit', 'siglip'\]; exactly one"):
        MimoBalancing(build_mimo(encoders_of_images=("vit", "siglip")), modalities(), cost)
    with pytest.raises(ValueError, match="must name every modality submodule"):
        MimoBalancing(build_mimo(), modalities()[:1], cost)
    spec = balanced_mimo().batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
    with pytest.raises(ValueError, match="placeholder ids .* and pad id 1000 must be distinct"):
        dataclasses.replace(spec, pad_token_id=1000)


def test_which_module_grids_are_balanced(harness, world_of_one, monkeypatch):
    """A colocated ``module_to_grid_map`` gives the encoders their grid's TP (None where it is the language
    model's, and for non-colocated grids: encoder ranks of their own, ``own_encoder_ranks``); other dims or rank
    orders, and encoder TPs that are not one size dividing the language model's are refused by name. Such a model refuses MIMO's own forward (upstream, shadow mode), and
    ``post_balance`` a config that does not put its encoders on every rank at that TP, before any collective; a model
    on encoder ranks of their own ``post_balance`` refuses (its groups are not the global parallel state's)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    from megatron_orch.megatron import StepShape, collate, post_balance
    from megatron_orch.megatron.mimo import encoder_grid_tensor_parallel_size
    from megatron_orch.orchestrator.config import EncoderRanks, OrchestratorConfig
    from mimo_model import balanced_mimo

    monkeypatch.setenv("WORLD_SIZE", "6")  # HyperCommGrid reads the world's size from it
    tp_dp = _grid

    def etp(language, images, audio=None, tp=2):
        return encoder_grid_tensor_parallel_size(_with_grids(language, images, audio, tp))

    assert encoder_grid_tensor_parallel_size(SimpleNamespace(mimo_config=SimpleNamespace())) is None  # 0.16.1
    assert etp(tp_dp(2, 2), tp_dp(1, 4)) == 1
    assert etp(tp_dp(2, 2), tp_dp(2, 2)) is None  # the language model's layout: nothing of its own
    assert etp(tp_dp(2, 2, offset=2), tp_dp(1, 2)) is None  # non-colocated: encoder ranks of their own
    with pytest.raises(NotImplementedError, match=r"module_to_grid_map\['images'\] has dims \['dp', 'tp'\]"):
        etp(tp_dp(2, 2), tp_dp(2, 2, names=("dp", "tp")))
    with pytest.raises(NotImplementedError, match=r"\['images'\] has dims .*pp.* of sizes \[1, 1, 2, 2\]"):
        etp(tp_dp(2, 2), HyperCommGrid([1, 1, 2, 2], ["tp", "cp", "dp", "pp"]))
    with pytest.raises(NotImplementedError, match=r"TP \{'images': 4, 'audio': 4\}; .* dividing the language"):
        etp(tp_dp(2, 2), tp_dp(4, 1))
    with pytest.raises(NotImplementedError, match=r"grids have TP \{'images': 1, 'audio': 2\}"):
        etp(tp_dp(2, 2), tp_dp(1, 4), tp_dp(2, 2))
    with pytest.raises(ValueError, match=r"module_to_grid_map\['language'\] has TP 1, its language model config 2"):
        etp(tp_dp(1, 4), tp_dp(1, 4))

    model = balanced_mimo()
    model.encoder_tensor_parallel_size = 1  # as a grid of TP 1 under a language model of TP 2 gives it
    spec = model.batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
    batch = collate([_example(spec, 0, images=1, windows=1, seed=3)], spec)
    with pytest.raises(NotImplementedError, match="encoders run on a grid of their own .* not upstream or in shadow"):
        model(batch)
    model.config.calculate_per_token_loss = True
    for config in (OrchestratorConfig(),
                   OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, verify_first_step=False),
                   OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, encoder_tensor_parallel_size=2,
                                      verify_first_step=False),
                   OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, encoder_tensor_parallel_size=1, shadow=True)):
        with pytest.raises(ValueError, match="encoders are built at tensor-parallel size 1 .* encoder_ranks ALL and "
                                             "encoder_tensor_parallel_size 1"):
            post_balance(None, iter(()), spec, StepShape(1, 1), model=model, config=config)
    from megatron_orch.orchestrator.encoder_ranks import OwnEncoderRanks
    model.encoder_tensor_parallel_size = None
    model.own_encoder_ranks = OwnEncoderRanks((0, 1), ((2, 3), (4, 5)), 6)  # as non-colocated grids give it
    with pytest.raises(NotImplementedError, match="encoders run on ranks of their own .* not upstream or in shadow"):
        model(batch)
    with pytest.raises(ValueError, match="post_balance builds its groups from megatron-core's global parallel state.*"
                                         "OwnEncoderRanksLoop"):
        post_balance(None, iter(()), spec, StepShape(1, 1), model=model, config=OrchestratorConfig())


def test_packed_rows_where_the_installed_mimo_takes_them(harness, world_of_one):
    """0.19 (``MimoModel.forward`` takes ``packing_kwargs``): ``--orch-microbatching auto`` packs. 0.16.1: it gives
    equal-count micro-batches, ``packed`` is refused and a packed row reaching the adapter too, saying why; on any
    release a language model of megatron-core's local DotProductAttention, or context parallelism, stays unpacked."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_orch.megatron import collate_packed
    from megatron_orch.megatron import mimo as adapter
    from megatron_orch.orchestrator.config import OrchestratorConfig
    from mimo_model import balanced_mimo, build_mimo

    model = balanced_mimo()
    spec = model.batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
    packed = collate_packed([scripted_example(0, 0, j, spec, j) for j in range(2)], spec)
    if _mimo_takes_packing_kwargs():
        assert spec.takes_packed_rows and spec.why_not_packed() is None
        assert OrchestratorConfig().resolve_microbatching(spec.why_not_packed()).microbatching == "packed"
        mimo = build_mimo()
        attention = next(m for m in mimo.language_model.modules() if hasattr(m, "core_attention"))
        attention.core_attention = DotProductAttention.__new__(DotProductAttention)  # its class is what counts
        torch.nn.Module.__init__(attention.core_attention)
        assert adapter.cannot_pack(mimo) == adapter.CANNOT_PACK_ATTENTION.format("DotProductAttention")
        mimo = build_mimo()
        mimo.config.context_parallel_size = 2
        assert adapter.cannot_pack(mimo) == adapter.CANNOT_PACK_CP
        return
    assert not spec.takes_packed_rows and spec.why_not_packed() == spec.cannot_pack == adapter.CANNOT_PACK
    with pytest.raises(NotImplementedError, match="MimoBalancing does not hand packed rows to this MimoModel"):
        model(packed)
    # --orch-microbatching auto gives it equal-count micro-batches; packed ones are refused, saying why
    assert OrchestratorConfig().resolve_microbatching(spec.why_not_packed()).microbatching == "equal_count"
    with pytest.raises(ValueError, match="packed: MimoBalancing does not hand packed rows to this MimoModel"):
        OrchestratorConfig(microbatching="packed").resolve_microbatching(spec.why_not_packed())


def _example(spec, sample_index: int, images: int, windows: int, seed: int, answer: int = 12):
    from megatron_orch.mllm.examples import assemble_example

    g = torch.Generator().manual_seed(seed)
    items = {"images": torch.randn(images, PATCHES, PATCH_DIM, generator=g),
             "audio": torch.randn(windows, FRAMES, MEL_BINS, generator=g)}
    prompt = torch.randint(0, 256, (5,), generator=g).tolist()
    return assemble_example(sample_index, prompt, torch.randint(0, 256, (answer,), generator=g).tolist(), items, spec)


def test_a_packed_row_is_its_examples_each_alone(harness, world_of_one):
    """0.19: a packed row through MimoModel (THD ``packing_kwargs``, a padding tail) gives each example the per-token
    losses and, summed, the gradients it gets in a row of its own; changing one example's tokens and items leaves the
    others' losses unchanged (no attention across examples); the language model got THD params with the row's
    bounds; encoder outputs handed in (post-balancing's path) give the same; MIMO's SP padding of the tail is the
    loss mask forward_step applies."""
    if not _mimo_takes_packing_kwargs():
        pytest.skip("this megatron-core's MimoModel (0.16) takes no packing_kwargs "
                    "(test_packed_rows_where_the_installed_mimo_takes_them)")
    from megatron_orch.megatron import collate, collate_packed
    from megatron_orch.megatron.batch import PackedRowParams
    from megatron_orch.megatron.mimo import _padded_tail
    from megatron_orch.megatron.sequence_layout import SequenceLayout
    from mimo_model import balanced_mimo

    torch.manual_seed(0)
    model = balanced_mimo()
    spec = model.batch_spec(SEQ_LENGTH, PAD_TOKEN_ID)
    examples = [_example(spec, 0, 2, 1, seed=1), _example(spec, 1, 0, 2, seed=2, answer=20),
                _example(spec, 2, 1, 0, seed=3, answer=7)]
    packed = collate_packed(examples, spec, pad_to_multiple_of=32)
    bounds = packed.host_cu_seqlens
    assert packed.tokens.shape[1] > bounds[-1]  # a padding tail

    seen = []
    model.mimo.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("packed_seq_params")), with_kwargs=True)

    def losses_and_grads(batches, embeds=None):
        model.zero_grad(set_to_none=True)
        outputs = [model(batch, embeds) for batch in batches]
        sum(torch.sum(out * batch.loss_mask) for out, batch in zip(outputs, batches)).backward()
        return ([out.detach() for out in outputs],
                {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})

    (row,), grads = losses_and_grads([packed])
    params = seen[-1]
    assert isinstance(params, PackedRowParams) and params.qkv_format == "thd"
    whole = (*bounds, packed.tokens.shape[1])  # the tail is one more sequence (RoPE splits the row by them)
    assert params.host_cu_seqlens == whole and params.cu_seqlens_q.tolist() == list(whole)
    alone, alone_grads = losses_and_grads([collate([e], spec) for e in examples])
    assert seen[-1] is None
    for i, out in enumerate(alone):
        torch.testing.assert_close(row[0, bounds[i]:bounds[i + 1]], out[0], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"example {i}: {m}")
    assert grads.keys() == alone_grads.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        torch.testing.assert_close(grads[name], alone_grads[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"parameter {name}: {m}")
    with torch.no_grad():
        embeds = {name: model.encode(name, packed.items[name]) for name in ("images", "audio")}
        torch.testing.assert_close(model(packed, embeds), row, rtol=1e-5, atol=1e-6)
        changed = [examples[0], _example(spec, 1, 0, 2, seed=9, answer=20), examples[2]]  # other tokens, items
        other = model(collate_packed(changed, spec, pad_to_multiple_of=32))
    assert collate_packed(changed, spec).host_cu_seqlens == bounds
    for i in (0, 2):
        torch.testing.assert_close(other[0, bounds[i]:bounds[i + 1]], row[0, bounds[i]:bounds[i + 1]],
                                   rtol=1e-6, atol=1e-7, msg=lambda m: f"example {i} saw example 1: {m}")
    assert not torch.allclose(other[0, bounds[1]:bounds[2]], row[0, bounds[1]:bounds[2]])
    sp = SequenceLayout(1, 0, 2, 0)
    unpadded = collate_packed(examples, spec)
    assert unpadded.tokens.shape[1] % 2  # odd: the tail MIMO's SP sharding needs
    torch.testing.assert_close(_padded_tail(unpadded, sp.row_multiple, PAD_TOKEN_ID).loss_mask,
                               sp.shard(unpadded).loss_mask)


def test_sequence_or_context_parallelism_needs_a_mimo_that_shards(harness, world_of_one):
    """0.16.1's MimoModel runs its language model on the whole sequence: the adapter refuses SP and CP there;
    0.19's shards it itself, and the adapter takes it."""
    from megatron_orch.balance.cost import TransformerCost
    from megatron_orch.megatron.mimo import MimoBalancing
    from mimo_model import build_mimo, modalities, shapes

    for setting in ({"sequence_parallel": True}, {"context_parallel_size": 2}):
        mimo = build_mimo()
        for name, value in setting.items():
            setattr(mimo.config, name, value)
        if _mimo_shards_its_input():
            MimoBalancing(mimo, modalities(), TransformerCost(shapes()[1]))
        else:
            with pytest.raises(NotImplementedError, match="does not shard the language model's input"):
                MimoBalancing(mimo, modalities(), TransformerCost(shapes()[1]))
