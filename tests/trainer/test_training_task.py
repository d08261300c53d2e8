"""The compact trainer is generic (it imports no module of this project's model, ``megatron_orch.mllm``:
``test_layers.py``): a model of one's own (``examples/own_model.py``'s TinyLlava, with its own data) trains
through it as a :class:`~megatron_orch.trainer.task.TrainingTask`, with balancing off and on."""
import warnings
from pathlib import Path

import pytest

import example_modules  # noqa: F401 -- examples/ on the path
from dist_utils import run_distributed

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")


# --- a task of one's own: examples/own_model.py's model and data ---------------------------------------------

def _add_arguments(parser):
    parser.add_argument_group("tiny llava").add_argument("--image-fraction", type=float, default=1.0)
    return parser


def _configure(args):
    import own_model

    from megatron_orch.trainer.arguments import ArgumentError
    from megatron_orch.trainer.task import ModelSummary
    if args.micro_batch_size != own_model.MICRO_BATCH or args.num_microbatches != own_model.MICRO_BATCHES:
        raise ArgumentError(f"TinyLlava's data comes in {own_model.MICRO_BATCHES} micro-batches of "
                            f"{own_model.MICRO_BATCH}")
    _, llm = own_model.shapes()
    return ModelSummary(name="tiny-llava", num_layers=llm.num_layers, phases=own_model.batch_spec().phases)


def _build_model(args, pre_process=True, post_process=True, vp_stage=None):
    import own_model
    return own_model.build_model()


def _train_data(args, consumed_samples, data_parallel_rank, data_parallel_size, **restored):
    import own_model
    return own_model.microbatches(own_model.batch_spec(), data_parallel_rank, data_parallel_size, args.train_iters)


def _post_balancing(args, config, source, forward_backward_func):
    import own_model

    from megatron_orch.megatron import StepShape, post_balance
    from megatron_orch.trainer.task import compute_device
    schedule, iterator = post_balance(forward_backward_func, source, own_model.batch_spec(),
                                      StepShape(args.micro_batch_size, args.num_microbatches), config=config,
                                      compute_device=compute_device(args))
    return iterator, schedule


def _forward_step(data_iterator, model):
    from megatron_orch.megatron import forward_step
    return forward_step(data_iterator, model)


def tiny_llava_task():
    from megatron_orch.trainer.task import TrainingTask
    return TrainingTask(program="train_tiny_llava.py", description="TinyLlava on the compact trainer.",
                        add_arguments=_add_arguments, configure=_configure, build_model=_build_model,
                        forward_step=_forward_step, build_train_data_iterator=_train_data,
                        build_post_balancing=_post_balancing, model_identity=lambda args: {"model": "TinyLlava"})


FLAGS = ["--seq-length", "96", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "2",
         "--lr", "2e-3", "--log-interval", "1", "--distributed-backend", "gloo", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--seed", "7"]


def test_a_task_of_ones_own_parses_with_its_flags_and_checks():
    from megatron_orch.trainer import arguments
    task = tiny_llava_task()
    args = arguments.parse_args(task, FLAGS + ["--image-fraction", "0.5", "--orch-post-balancing"], world_size=2)
    assert (args.model_summary.name, args.image_fraction, args.orch_config.shadow) == ("tiny-llava", 0.5, False)
    assert not hasattr(args, "model_config") and not hasattr(args, "max_bad_examples")  # the MLLM's flags are not there
    with pytest.raises(arguments.ArgumentError, match="micro-batches of 2"):
        arguments.parse_args(task, FLAGS, world_size=1)
    with pytest.raises(arguments.ArgumentError, match="unrecognized arguments: --model-config"):
        arguments.parse_args(task, FLAGS + ["--model-config", "tiny"], world_size=2)
    assert "usage: train_tiny_llava.py" in arguments.build_parser(task).format_help()


def _train(rank, world_size, out_dir, balanced):
    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, loop
    task = tiny_llava_task()
    lines = []
    args = arguments.parse_args(task, FLAGS + (["--orch-post-balancing"] if balanced else []), world_size=world_size)
    try:
        records = loop.pretrain(args, task, print_fn=lines.append)
    finally:
        parallel_state.destroy_model_parallel()
    torch.save({"losses": [r.lm_loss for r in records], "lines": lines},
               Path(out_dir) / f"{'balanced' if balanced else 'upstream'}_rank{rank}.pt")


@pytest.mark.distributed
def test_a_model_of_ones_own_trains_through_the_compact_trainer_balanced_as_upstream(tmp_path):
    """Two gloo ranks, two steps with balancing off, then on: the same losses (dropout 0, fp32)."""
    import torch
    for balanced in (False, True):
        run_distributed(_train, 2, str(tmp_path), balanced, timeout_s=240.0)
    upstream, balanced = (torch.load(tmp_path / f"{name}_rank1.pt") for name in ("upstream", "balanced"))  # logs
    assert len(upstream["losses"]) == len(balanced["losses"]) == 2
    first = torch.load(tmp_path / "balanced_rank0.pt")["lines"]
    assert any(line.startswith(" > model config tiny-llava: ") for line in first), first
    assert any(line.startswith(" > post-balancing on: ") for line in first), first
    diff = max(abs(a - b) / abs(b) for a, b in zip(balanced["losses"], upstream["losses"]))
    print(f"TinyLlava on the compact trainer, DP 2: losses {upstream['losses']} upstream, {balanced['losses']} "
          f"balanced; largest relative difference {diff:.1e}")
    assert diff < 1e-5, (upstream["losses"], balanced["losses"])
