"""Virtual pipeline stages (Megatron's interleaved 1F1B) on the compact trainer, on CPU over gloo: PP 2 x VPP 2
x DP 2 (two model chunks per pipeline rank: rank 0 holds backbone layers 0 and 2 and the encoders in its
first chunk, rank 1 layers 1 and 3 and the loss in its last).

Three runs of 3 steps, fp32 and dropout 0 (dropout masks follow the computing rank): a DP 2 reference
without pipelining, the interleaved run upstream (balancing off) from the reference's initial weights, and
the interleaved run with post-balancing. The upstream interleaved run reproduces the reference (losses and
every parameter after the run, within 1e-5: the chunks' layers are the reference's), and post-balancing
reproduces the upstream interleaved run; on the step with every heavy example on one DP rank the plan moved
data and lowered each phase's modeled max/mean. The steps are test_post_balancing's scripted edge cases:
all heavy examples on one rank, no images anywhere (the vision encoder's zero gradients in the first
chunk), audio on one rank only. The command-line checks of Megatron's rules and the schedule's handling of
several chunks (stand-in chunks) run in this process.
"""
import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import TRAINED_PARAMS_ATOL, run_distributed
from test_post_balancing import SCENARIOS, scripted_example
from test_train import stage_state
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

STEPS = ("heavy_on_one_rank", "no_images", "audio_on_one_rank")
MBS, NUM_MB, DP, LAYERS = 2, 2, 2, 4
COMMON = ["--model-config", "tiny", "--num-layers", str(LAYERS), "--seq-length", "192",
          "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS * NUM_MB * DP),
          "--train-iters", str(len(STEPS)), "--lr", "1e-2", "--lr-warmup-iters", "0", "--log-interval", "1",
          "--seed", "5", "--distributed-backend", "gloo", "--optimizer", "sgd",
          "--hidden-dropout", "0", "--attention-dropout", "0"]
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
BALANCED = ["--orch-post-balancing", "--orch-gpus-per-node", "2"]
TIMEOUT_S = 300.0
LAYER = re.compile(r"backbone\.decoder\.layers\.(\d+)\.(.*)")


def scripted_iterator(args, consumed_samples, dp_rank, dp_size, num_samples=None):
    """Step k of the run is test_post_balancing's scenario STEPS[k] (the same on the TP/PP peers of a DP rank);
    also the megatron.training test's data (tests/megatron/test_megatron_lm.py, whose launch also passes the samples
    its steps consume, ``num_samples``: the script has exactly ``--train-iters`` steps)."""
    from megatron_orch.megatron.batch import collate
    from megatron_orch.mllm import providers

    data = providers.data_config(args)
    mbs = args.micro_batch_size
    per_rank = mbs * args.num_microbatches
    for step in range(consumed_samples // args.global_batch_size, args.train_iters):
        scenario = SCENARIOS.index(STEPS[step])
        for m in range(args.num_microbatches):
            yield collate([scripted_example(scenario, dp_rank, m * mbs + j, data.layout.spec,
                                            step * args.global_batch_size + dp_rank * per_rank + m * mbs + j)
                           for j in range(mbs)], data.layout.spec,
                          pad_to=data.seq_length if data.pad_to_seq_length else None)


def reference_names(state: dict, first_layer: int) -> dict:
    """A chunk's parameters under the reference's names (its stack layers numbered from ``first_layer``)."""
    out = {}
    for name, value in state.items():
        layer = LAYER.match(name)
        out[f"backbone.decoder.layers.{first_layer + int(layer.group(1))}.{layer.group(2)}" if layer else name] = value
    return out


def _train(rank, world_size, argv, out_dir, initial_state, load_initial_state):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments, loop as trainer

    providers.build_train_data_iterator = scripted_iterator
    chunks = []

    def model_provider(args, pre_process, post_process, vp_stage=None):
        model = providers.build_model(args, pre_process, post_process, vp_stage)
        pp, vp = parallel_state.get_pipeline_model_parallel_rank(), vp_stage or 0
        vp_size = args.virtual_pipeline_model_parallel_size or 1
        if load_initial_state:  # the reference's weights, this chunk's share
            full = torch.load(initial_state)
            state = stage_state(full, pp, args.pipeline_model_parallel_size, vp, vp_size)
            if any(name.startswith("encoders.") for name in model.state_dict()):  # every rank's first chunk holds
                state.update({k: v for k, v in full.items() if k.startswith("encoders.")})  # them (auto: all)
            model.load_state_dict(state)
        elif rank == 0:
            torch.save(model.state_dict(), initial_state)
        layers = sum(1 for name in model.state_dict() if LAYER.match(name) and name.endswith("linear_proj.weight"))
        chunks.append((model, (vp * args.pipeline_model_parallel_size + pp) * len(model.backbone.decoder.layers)))
        assert layers == LAYERS // (args.pipeline_model_parallel_size * vp_size)  # attention layers per chunk
        return model

    args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
    try:
        task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
        records = trainer.pretrain(args, task, print_fn=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    params = {}
    for model, first_layer in chunks:
        params.update(reference_names({n: p.detach().clone() for n, p in model.named_parameters()}, first_layer))
    torch.save({"params": params, "chunks": len(chunks)}, Path(out_dir) / f"rank{rank}.pt")
    if records:
        torch.save({"losses": [r.lm_loss for r in records], "post_balancing": [r.post_balancing for r in records]},
                   Path(out_dir) / "log.pt")


def train(tmp_path: Path, name: str, world_size: int, *flags: str, load_initial_state: bool = True) -> dict:
    """A run's losses, post-balancing figures and parameters; the reference (``load_initial_state=False``)
    saves its initial weights, which the other runs load."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    run_distributed(_train, world_size, COMMON + list(flags), str(out_dir), str(tmp_path / "initial_state.pt"),
                    load_initial_state, timeout_s=TIMEOUT_S)
    log = torch.load(out_dir / "log.pt")
    log["ranks"] = [torch.load(out_dir / f"rank{r}.pt") for r in range(world_size)]
    return log


def assert_same(got: dict, want: dict, rtol: float = 1e-5) -> None:
    """Losses of every step, and every parameter of ``want`` found in ``got`` (over its ranks) within rtol."""
    assert got["losses"] == pytest.approx(want["losses"], rel=rtol), (got["losses"], want["losses"])
    for rank in want["ranks"]:
        for name, value in rank["params"].items():
            found = [r["params"][name] for r in got["ranks"] if name in r["params"]]
            assert found, name
            for other in found:
                torch.testing.assert_close(other, value, rtol=rtol, atol=TRAINED_PARAMS_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.distributed
def test_interleaved_pipeline_reproduces_the_reference_and_post_balancing_reproduces_it(tmp_path):
    reference = train(tmp_path, "reference", DP, load_initial_state=False)
    upstream = train(tmp_path, "interleaved", 2 * DP, *INTERLEAVED)
    balanced = train(tmp_path, "balanced", 2 * DP, *INTERLEAVED, *BALANCED)
    assert [r["chunks"] for r in upstream["ranks"]] == [2] * 4  # two model chunks on every rank
    assert reference["losses"][-1] < reference["losses"][0]  # it learns: not two idle models
    assert_same(upstream, reference)
    # every parameter of the interleaved run is in the reference (and the other way round: assert_same)
    assert set().union(*(r["params"] for r in upstream["ranks"])) == set(reference["ranks"][0]["params"])
    assert_same(balanced, upstream)
    heavy = balanced["post_balancing"][STEPS.index("heavy_on_one_rank")]
    assert heavy["intra-node MB"] + heavy["inter-node MB"] > 0, heavy
    for phase in ("vision", "audio", "llm"):
        assert heavy[f"{phase} before"] > 1.3, heavy
        assert heavy[f"{phase} after"] < heavy[f"{phase} before"], heavy


@pytest.mark.parametrize("flags, world_size, message", [
    (["--num-layers-per-virtual-pipeline-stage", "1"], 2, "virtual pipeline stages need --pipeline-model-parallel"
                                                          "-size > 1"),
    (INTERLEAVED + ["--num-virtual-stages-per-pipeline-rank", "2"], 4, "exclude each other"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 4,
     "the 2 backbone layers of each pipeline stage (4 / --pipeline-model-parallel-size 2) are not divisible by it"),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3"], 4,
     "do not split into 3 model chunks"),
    (INTERLEAVED + ["--global-batch-size", "4"], 4, "2 consecutive micro-batches per virtual stage, which must lie "
                                                    "in [--pipeline-model-parallel-size 2, 1]"),
    (INTERLEAVED + ["--global-batch-size", "6"], 2, "last group of 1 micro-batches is shorter than"),
])
def test_megatrons_rules_for_virtual_stages_are_checked_on_the_command_line(flags, world_size, message):
    """Each a one-line error naming the flag, before any process group exists."""
    from megatron_orch.trainer import arguments
    with pytest.raises(arguments.ArgumentError, match=re.escape(message)):
        arguments.parse_args(MLLM_TASK, COMMON + flags, world_size=world_size)
    args = arguments.parse_args(MLLM_TASK, COMMON + INTERLEAVED, world_size=4)
    assert (args.virtual_pipeline_model_parallel_size, args.num_microbatches) == (2, NUM_MB)


def test_the_schedule_feeds_every_chunk_and_runs_the_encoders_backward_from_the_first_chunk():
    """Two stand-in chunks without encoders: megatron-core's schedule gets one iterator per chunk over the step's
    micro-batches; a grad_sync_func given as one callable is spread over the chunks for the call, the first
    chunk's wrapped (it runs the encoders' backward), the others as given, and restored afterwards; iterators
    for the later chunks are refused before the step is read."""
    from types import SimpleNamespace

    import numpy as np

    from stand_ins import EncoderlessChunk
    from megatron_orch.megatron.post_balancing import BalancedStep
    from megatron_orch.megatron.schedule import ModalityAwareSchedule

    def grad_sync(*args):
        pass

    config = SimpleNamespace(finalize_model_grads_func=None, grad_sync_func=grad_sync, no_sync_func=None,
                             calculate_per_token_loss=True)

    seen = {}

    def interleaved(*, data_iterator, model, num_microbatches, **kwargs):
        seen["batches"] = [list(iterator) for iterator in data_iterator]
        seen["grad_sync"] = list(config.grad_sync_func)
        return []

    microbatches = ["micro-batch 0", "micro-batch 1"]
    step = BalancedStep(microbatches=microbatches, inputs={}, plan=SimpleNamespace(encoders={}), rank=0,
                        num_tokens=np.zeros(0, dtype=np.int64), rows_per_item={}, comm_group=None, moves=None)
    schedule = ModalityAwareSchedule(interleaved, dp_group=None)
    chunks = [EncoderlessChunk(config), EncoderlessChunk(config)]
    schedule(forward_step_func=None, data_iterator=[iter([step]), None], model=chunks, num_microbatches=2)
    assert seen["batches"] == [microbatches, microbatches]
    assert seen["grad_sync"][0] is not grad_sync and seen["grad_sync"][1] is grad_sync
    assert config.grad_sync_func is grad_sync
    steps = iter([step])
    with pytest.raises(ValueError, match="takes its steps from the first chunk's data iterator"):
        schedule(forward_step_func=None, data_iterator=[steps, iter([])], model=chunks, num_microbatches=2)
    assert next(steps) is step  # refused before the step (and its collectives) was read
