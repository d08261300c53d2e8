"""Post-balancing with parameters sharded over DP: torch FSDP2 and Megatron-FSDP (``--use-torch-fsdp2``,
``--use-megatron-fsdp``) in the compact trainer, on CPU over gloo, DP 4.

Each wrapper is trained upstream and with post-balancing, and both runs are compared with Megatron DDP on
the same data (dropout 0: masks follow the computing rank): the losses of every step and all parameters
after the last agree within 1e-5. The scripted steps (``test_post_balancing``) have no images anywhere,
audio on one rank only, then one example far longer than a fair share: ranks run an encoder over no items
of their own, which with sharded parameters must still join its gathers and reduce-scatters.
"""
import dataclasses
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from dist_utils import TRAINED_PARAMS_ATOL, run_distributed, scaled
from test_post_balancing import BALANCED, COMMON, MBS, NUM_MB, SCENARIOS, scripted_iterator
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

ITERS = 3  # no images anywhere, audio on one rank only, one example longer than a fair share
# The distributed optimizer (and so Megatron-FSDP) is built for Adam only. Adam's step g / (sqrt(v) + eps) turns
# the rounding noise of a near-zero gradient (other reduction orders: other DP wrappers, other placements) into
# a step of up to the learning rate; eps 1e-4 keeps such steps proportional to the gradient.
FLAGS = ["--train-iters", str(ITERS), "--optimizer", "adam", "--adam-eps", "1e-4"]
TIMEOUT_S = 300.0
MEGATRON_FSDP_COLLECTIVE_TIMEOUT_S = 40.0  # (idle machine, scaled) one collective of these runs takes well under a second
STUCK_OUTSIDE_COLLECTIVES = "did not reach a collective"  # trainer/faults.py's diagnosis of a rank that stopped


def _train(rank, world_size, argv, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments, loop as trainer

    providers.build_train_data_iterator = scripted_iterator
    built, held = [], []

    def model_provider(args, pre_process, post_process):
        built.append(providers.build_model(args, pre_process, post_process))
        return built[-1]

    args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
    if args.orch_config is not None:
        _watch_gathered_encoder_layers(held)
    lines = []
    try:
        task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
        records = trainer.pretrain(args, task, print_fn=lines.append)
        # Whole parameters (a collective over the shards: every rank takes part). The state dict: Megatron-FSDP
        # puts its sharded parameters in place for it (after a step the module holds its gathered buffers' views).
        values = built[0].state_dict(keep_vars=True)
        state = {name: _whole(values[name], args.use_megatron_fsdp).detach().clone()
                 for name, _ in built[0].named_parameters()}
    finally:
        parallel_state.destroy_model_parallel()
    torch.save(state, Path(out_dir) / f"params_rank{rank}.pt")
    torch.save(held, Path(out_dir) / f"held_rank{rank}.pt")
    if records:
        torch.save({"losses": {r.iteration: r.lm_loss for r in records},
                    "post_balancing": [r.post_balancing for r in records]}, Path(out_dir) / "log.pt")


def _whole(param, megatron_fsdp: bool) -> torch.Tensor:
    """A parameter's whole value: FSDP2 shards each parameter evenly (``full_tensor``); Megatron-FSDP shards
    its flat buffers, so a parameter's shards are uneven, which gloo's all-gather does not take
    (megatron-core's ``uneven_dtensor_to_full_tensor``: "ProcessGroupGloo::allgather: invalid tensor size").
    Each rank puts its shard at its offsets into zeros, and a sum over the shard groups assembles the whole:
    the shards are disjoint, so the sum adds only zeros (exact)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not isinstance(param, DTensor):
        return param
    if not megatron_fsdp:
        return param.full_tensor()
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

    chunk = gather_and_compute_chunk_metadata(param)
    whole = torch.zeros(param.shape, dtype=param.dtype)
    whole[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))] = param.to_local()
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, (Shard, _StridedShard)):
            dist.all_reduce(whole, group=param.device_mesh.get_group(mesh_dim))
    return whole


def _watch_gathered_encoder_layers(held: list) -> None:
    """Record, when the backbone schedule starts (the encoders' forward is over), the encoder layers whose
    gathered FSDP2 parameters are still held: none may be (upstream frees them after each forward)."""
    from megatron_orch.megatron import schedule
    from megatron_orch.megatron.contract import check_model

    def gathered_layers(model_chunk) -> list:
        module = check_model([model_chunk])
        return [f"{phase}.{name}" for phase, encoder in module.phase_encoders().items()
                for name, layer in encoder.named_modules() if hasattr(layer, "_get_fsdp_state")
                and any(group.is_unsharded for group in layer._get_fsdp_state()._fsdp_param_groups)]

    original = schedule.ModalityAwareSchedule.__init__

    def init(self, forward_backward_func, *args, **kwargs):
        def watched(**kw):
            held.append(gathered_layers(kw["model"][0]))
            return forward_backward_func(**kw)
        original(self, watched, *args, **kwargs)

    schedule.ModalityAwareSchedule.__init__ = init


def train(tmp_path: Path, name: str, *flags: str) -> dict:
    global_batch = ["--global-batch-size", str(MBS * NUM_MB * 4)]
    argv = COMMON + global_batch + FLAGS + list(flags)
    # Megatron-FSDP on CPU over gloo now and then kills a rank in native code (SIGABRT "malloc(): unaligned
    # tcache chunk detected", or SIGSEGV), in upstream runs as well as balanced ones: once in about ten runs
    # on some hosts, every other run on others. A balanced run has also hung (twice in CI on 2026-12-05, never in 40
    # runs of this test alone): rank 1 waited on Megatron-FSDP's parameter all-gather before the backward of an
    # encoder chunk (megatron/encoder_chunks.py backward_chunk <- schedule._encoders_backward) while ranks 0, 2, 3
    # waited in its gradient reduce-scatter: the ranks' collectives out of order in post-balancing's chunked encoder
    # backward under sharded parameters, an open bug of ours (docs/sharding_and_moe.md), not found yet. Its
    # collectives time out after MEGATRON_FSDP_COLLECTIVE_TIMEOUT_S, not ten minutes (the stopped rank's stacks go to
    # the test's output). Either trouble is run once more, with a warning that carries where the ranks' collectives
    # parted (dist_utils' trace: different collectives, or the same ones and a stalled transport); a second is
    # reported as an expected failure naming both, never as a pass. Any other failure fails the test.
    fsdp = "--use-megatron-fsdp" in flags
    if fsdp:
        argv += ["--distributed-timeout-minutes", f"{scaled(MEGATRON_FSDP_COLLECTIVE_TIMEOUT_S) / 60:g}"]
    troubles = []
    while True:
        out_dir = tmp_path / (f"{name}_again" if troubles else name)
        out_dir.mkdir()
        try:
            run_distributed(_train, 4, argv, str(out_dir), timeout_s=TIMEOUT_S)
            break
        except mp.ProcessExitedException as crash:
            if not fsdp or crash.signal_name not in ("SIGABRT", "SIGSEGV"):
                raise
            troubles.append(f"a rank died by {crash.signal_name} in native code ({_notes(crash)})")
        except RuntimeError as failure:
            if not fsdp or STUCK_OUTSIDE_COLLECTIVES not in str(failure):
                raise
            troubles.append("a rank stopped outside any collective while its peers waited (the open bug above; "
                            f"{_notes(failure)})")
        if len(troubles) == 2:
            pytest.xfail(f"{name} run with --use-megatron-fsdp: {troubles[0]}, then {troubles[1]}, in Megatron-FSDP "
                         "on CPU over gloo (not checked this time)")
        warnings.warn(f"{name} run with --use-megatron-fsdp: {troubles[0]}; run again")
    log = torch.load(out_dir / "log.pt")
    log["params"] = [torch.load(out_dir / f"params_rank{r}.pt") for r in range(4)]
    log["held"] = [torch.load(out_dir / f"held_rank{r}.pt") for r in range(4)]
    return log


def _notes(failure: BaseException) -> str:
    """run_distributed's note on a failure: where the ranks' collectives parted (dist_utils)."""
    return " ".join(getattr(failure, "__notes__", ())) or "no note"


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5):
    assert sorted(got["losses"]) == list(range(1, ITERS + 1))
    for iteration, loss in want["losses"].items():
        assert got["losses"][iteration] == pytest.approx(loss, rel=rtol), (iteration, got["losses"], want["losses"])
    for rank, (params, reference) in enumerate(zip(got["params"], want["params"])):
        assert params.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(params[name], reference[name], rtol=rtol, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m: f"rank {rank} parameter {name}: {m}")
    loss_diff = max(abs(got["losses"][i] - loss) / abs(loss) for i, loss in want["losses"].items())
    param_diff = max((params[name] - reference[name]).abs().max().item()
                     for params, reference in zip(got["params"], want["params"]) for name in reference)
    print(f"largest relative loss difference {loss_diff:.2e}, largest parameter difference {param_diff:.2e}")


def test_sharding_flags_are_checked_as_megatron_lm_checks_them():
    from megatron_orch.trainer import arguments

    base = COMMON + FLAGS + ["--global-batch-size", "8"]
    args = arguments.parse_args(MLLM_TASK, base + ["--use-megatron-fsdp"], world_size=2)
    assert args.use_distributed_optimizer and args.data_parallel_sharding_strategy == "optim_grads_params"
    # the checked first step is off with sharded parameters, also for a model config of the user's own
    args = arguments.parse_args(MLLM_TASK, base + ["--use-torch-fsdp2", "--orch-post-balancing"], world_size=2)
    assert args.orch_config is not None and not args.orch_config.verify_first_step
    for flags, message in ((["--use-torch-fsdp2", "--use-megatron-fsdp"], "exclude each other"),
                           (["--use-torch-fsdp2", "--use-distributed-optimizer"], "does not take --use-distributed"),
                           (["--data-parallel-sharding-strategy", "optim"], "needs --use-megatron-fsdp"),
                           (["--use-megatron-fsdp", "--optimizer", "sgd"], "--optimizer adam only"),
                           (["--use-torch-fsdp2", "--tensor-model-parallel-size", "2"], "over data parallelism only"),
                           (["--use-megatron-fsdp", "--save", "ckpt"], "--save with --use-megatron-fsdp"),
                           (["--use-torch-fsdp2", "--orch-post-balancing", "--orch-verify-first-step"],
                            "--orch-verify-first-step with --use-torch-fsdp2")):
        with pytest.raises(arguments.ArgumentError, match=re.escape(message)):
            arguments.parse_args(MLLM_TASK, base + flags, world_size=2)


def test_a_megatron_fsdp_run_stuck_or_crashed_twice_is_an_expected_failure_never_a_pass(monkeypatch, tmp_path):
    """train's rule for Megatron-FSDP's known troubles on CPU, with the runs played by a stand-in: a rank stopped
    outside any collective (trainer/faults.py's diagnosis) or killed in native code is run once more, a second time
    is an expected failure naming both; any other failure, or any failure without Megatron-FSDP, is raised."""
    stuck = RuntimeError("_train failed on 4 ranks: iteration 2: a collective failed on rank 3 ... rank(s) 1 "
                         f"{STUCK_OUTSIDE_COLLECTIVES} (no report within 60 s of this rank's failure)")
    stuck.add_note("the ranks' collectives parted ways in process group 5 [0, 1, 2, 3], collective #7")
    calls = []

    def failing(*failures):
        def run(fn, world_size, argv, out_dir, timeout_s):
            calls.append(argv)
            raise failures[min(len(calls), len(failures)) - 1]
        return run

    monkeypatch.setattr(sys.modules[__name__], "run_distributed", failing(stuck, stuck))
    warned = pytest.warns(UserWarning, match=r"twice run with --use-megatron-fsdp: a rank stopped .* collective "
                                             r"#7\); run again")
    expected_failure = pytest.raises(pytest.xfail.Exception, match=r"stopped outside any collective while its peers "
                                     r"waited \(the open bug above; the ranks' collectives parted ways in process "
                                     r"group 5 \[0, 1, 2, 3\], collective #7\), then a rank stopped")
    with warned, expected_failure:
        train(tmp_path, "twice", "--use-megatron-fsdp")
    assert len(calls) == 2 and "--distributed-timeout-minutes" in calls[0]
    for flags, failure in ((["--use-megatron-fsdp"], RuntimeError("_train failed on 4 ranks: loss mismatch")),
                           (["--use-torch-fsdp2"], stuck)):
        monkeypatch.setattr(sys.modules[__name__], "run_distributed", failing(failure))
        calls.clear()
        with pytest.raises(RuntimeError, match=re.escape(str(failure)[:40])):
            train(tmp_path, flags[0].strip("-"), *flags)
        assert len(calls) == 1


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ddp"), "ddp")


@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", ["--use-torch-fsdp2", "--use-megatron-fsdp"])
def test_sharded_training_equals_ddp_upstream_and_balanced(ddp, wrapper, tmp_path):
    upstream = train(tmp_path, "upstream", wrapper)
    balanced = train(tmp_path, "balanced", wrapper, *BALANCED)
    assert_same_training(upstream, ddp)
    assert_same_training(balanced, ddp)
    assert_same_training(balanced, upstream)
    assert ddp["losses"][ITERS] < ddp["losses"][1]  # the runs train: not two idle models
    long_step = balanced["post_balancing"][SCENARIOS.index("one_long_example")]
    assert long_step["intra-node MB"] + long_step["inter-node MB"] > 0, long_step
    assert long_step["llm after"] < long_step["llm before"], long_step
    if wrapper == "--use-torch-fsdp2":
        assert all(steps == [[]] * ITERS for steps in balanced["held"]), balanced["held"]
