"""Megatron-LM's flags on the compact trainer (``pretrain_mllm.py --orch-trainer compact``).

Megatron DDP's overlap flags (``--overlap-grad-reduce``, ``--overlap-param-gather``, ``--ddp-bucket-size``): a DP 2
run with them, several buckets, trains as the run without them (losses and every parameter at the end), and their
combinations are checked as Megatron-LM checks them. A Megatron-LM flag the compact trainer does not implement is
refused with why and what to use instead, a misspelt flag gets the closest real one, and ``--orch-trainer
megatron-lm`` on a machine without CUDA is refused before megatron.training is imported.

Both runs are post-balanced: without post-balancing the MLLM's encoders skip micro-batches without images or
audio, which the overlapped reduction refuses (the MLLM refuses the flag there, as on the Megatron-LM launch).
"""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import TRAINED_PARAMS_ATOL, run_distributed
from test_launch import _load_pretrain_mllm
from megatron_orch.mllm.task import MLLM_TASK, OVERLAP_NEEDS_POST_BALANCING
from megatron_orch.trainer import arguments, launch

FLAGS = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "2", "--lr", "2e-3", "--log-interval", "1", "--seed", "5", "--distributed-backend", "gloo",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer", "--orch-post-balancing"]
# Buckets of 200k parameters: the tiny MLLM's 757k split into several, each reduced and gathered on its own.
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "200000"]


def _train(rank, world_size, argv, out_dir):
    """One rank: train, then save the losses (logging rank) and this rank's parameters as the run left them."""
    import warnings
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from megatron.core import parallel_state

    from megatron_orch.trainer import loop as trainer

    built, wrapped = [], []

    def build_model(*args, **kwargs):
        built.append(MLLM_TASK.build_model(*args, **kwargs))
        return built[-1]

    def wrap(*args, **kwargs):  # the DDP wrapper as built: its settings and buckets
        wrapped.append(wrap_data_parallel(*args, **kwargs))
        return wrapped[-1]

    wrap_data_parallel = trainer.wrap_data_parallel
    trainer.wrap_data_parallel = wrap

    args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
    try:
        records = trainer.pretrain(args, dataclasses.replace(MLLM_TASK, build_model=build_model),
                                   print_fn=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    torch.save({name: p.detach().clone() for name, p in built[0].named_parameters()},
               Path(out_dir) / f"params{rank}.pt")
    ddp = wrapped[0]
    torch.save({"overlap": (ddp.ddp_config.overlap_grad_reduce, ddp.ddp_config.overlap_param_gather),
                "buckets": len(ddp.bucket_groups)}, Path(out_dir) / f"ddp{rank}.pt")
    if records:
        torch.save({r.iteration: r.lm_loss for r in records}, Path(out_dir) / "losses.pt")


def _run(tmp_path: Path, name: str, flags) -> tuple:
    out = tmp_path / name
    out.mkdir()
    run_distributed(_train, 2, FLAGS + list(flags), str(out), timeout_s=240.0)
    return (torch.load(out / "losses.pt"), [torch.load(out / f"params{rank}.pt") for rank in range(2)],
            torch.load(out / "ddp0.pt"))


@pytest.mark.distributed
def test_overlapped_reduce_and_gather_train_as_without(tmp_path):
    losses, params, ddp = _run(tmp_path, "plain", [])
    overlapped_losses, overlapped_params, overlapped_ddp = _run(tmp_path, "overlap", OVERLAP)
    assert ddp == {"overlap": (False, False), "buckets": 1}
    assert overlapped_ddp["overlap"] == (True, True) and overlapped_ddp["buckets"] >= 3  # 757k in buckets of 200k
    assert sorted(overlapped_losses) == [1, 2]
    for iteration, loss in losses.items():
        assert overlapped_losses[iteration] == pytest.approx(loss, rel=1e-5), (overlapped_losses, losses)
    for rank in range(2):
        for name, value in params[rank].items():
            torch.testing.assert_close(overlapped_params[rank][name], value, rtol=0, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


def test_overlap_flags_combine_as_in_megatron_lm():
    """The flags as parsed, and Megatron-LM's rules for combining them, each refusal one line naming the flag."""
    args = arguments.parse_args(MLLM_TASK, FLAGS + OVERLAP, world_size=2)
    assert (args.overlap_grad_reduce, args.overlap_param_gather, args.ddp_bucket_size) == (True, True, 200000)
    for flags, message in (
            (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
            (["--ddp-bucket-size", "1000"], "--ddp-bucket-size needs --overlap-grad-reduce"),
            (["--overlap-grad-reduce", "--ddp-bucket-size", "0"], "--ddp-bucket-size must be >= 1"),
            (["--overlap-grad-reduce", "--use-torch-fsdp2"], "--overlap-grad-reduce with --use-torch-fsdp2")):
        argv = [flag for flag in FLAGS if flag != "--use-distributed-optimizer"] + flags
        with pytest.raises(arguments.ArgumentError, match=message):
            arguments.parse_args(MLLM_TASK, argv, world_size=2)
    upstream = [flag for flag in FLAGS if flag != "--orch-post-balancing"]
    with pytest.raises(arguments.ArgumentError) as refused:
        arguments.parse_args(MLLM_TASK, upstream + ["--overlap-grad-reduce"], world_size=2)
    assert str(refused.value) == OVERLAP_NEEDS_POST_BALANCING


def _refusal(*flags: str) -> str:
    with pytest.raises(arguments.ArgumentError) as refused:
        arguments.parse_args(MLLM_TASK, FLAGS + list(flags), world_size=2)
    return str(refused.value)


@pytest.mark.parametrize("flags, reason", [
    (["--recompute-activations"], "--orch-encoder-recompute"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "--orch-encoder-recompute"),
    (["--use-flash-attn"], "--transformer-impl"),
    (["--tp-comm-overlap"], "Megatron-LM's own loop on GPUs"),
    (["--fp16"], "fp32 or bf16 (--bf16)"),
    (["--no-align-param-gather"], "--overlap-param-gather"),
    (["--swiglu"], "the MLLM's architecture comes from --model-config"),  # the task's reason (megatron_flags)
    (["--log-throughput"], "--orch-trainer megatron-lm"),
])
def test_megatron_lm_flags_not_implemented_say_why_and_what_instead(flags, reason):
    message = _refusal(*flags)
    named = [flag for flag in flags if flag.startswith("--")]
    assert message.count("is not implemented by the compact trainer") == len(named), message
    assert all(f"{flag} (Megatron-LM's) is not implemented" in message for flag in named), message
    assert reason in message and "unrecognized" not in message and "\n" not in message, message


def test_a_misspelt_flag_gets_the_closest_real_one():
    assert _refusal("--train-iter", "3") == "unrecognized arguments: --train-iter 3 (did you mean --train-iters?)"
    assert _refusal("--train-iter", "3", "--lrr", "1") == (
        "unrecognized arguments: --train-iter 3 --lrr 1 (did you mean --train-iters for --train-iter, --lr for --lrr?)")
    assert _refusal("--no-such-flag") == "unrecognized arguments: --no-such-flag"
    assert _refusal("--recompute-activations", "--train-iter", "3") == (
        "--recompute-activations (Megatron-LM's) is not implemented by the compact trainer: "
        + arguments.NOT_IMPLEMENTED["recompute_activations"]
        + "; unrecognized arguments: --train-iter 3 (did you mean --train-iters?)")


def test_megatron_lm_launch_on_cpu_is_refused_before_megatron_training_loads(monkeypatch, capsys):
    """run() decides from find_spec and torch.cuda alone: main_megatron_lm (the only importer of
    megatron.training) is never reached on a machine without CUDA."""
    pretrain_mllm = _load_pretrain_mllm()

    def must_not_run():
        raise AssertionError("main_megatron_lm ran on a machine without CUDA")

    monkeypatch.setattr(pretrain_mllm, "megatron_lm_available", lambda: True)
    monkeypatch.setattr(pretrain_mllm, "main_megatron_lm", must_not_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["pretrain_mllm.py", "--orch-trainer", "megatron-lm", "--swiglu"])
    for name in ("RANK", "TORCHELASTIC_ERROR_FILE", launch._LAUNCHER_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stopped:
        pretrain_mllm.run()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == ("pretrain_mllm.py: error: --orch-trainer megatron-lm needs GPUs (Megatron-LM's "
                                       "initialisation asserts CUDA); on CPU the compact trainer (--orch-trainer "
                                       "compact, the default) trains the same model from the same flags\n")
