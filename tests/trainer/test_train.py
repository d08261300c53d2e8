"""Training runs on CPU over gloo: DP 2, TP 2 and PP 2 (1F1B) against a one-process reference,
checkpoint resume, the torchrun entry point and the command-line checks.

The per-token loss normalisation makes the global loss independent of how the global batch is split
over ranks and micro-batches, so every parallel layout must reproduce the reference's losses (fp32:
up to reduction order). TP-invariant initialisation (full weights drawn, then split) gives TP 2 the
reference's weights; PP 2 gets them by loading the reference's initial state into each stage.
"""
import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed, scaled
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

REPO = Path(__file__).resolve().parents[2]
ITERS = 4
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
          "--train-iters", str(ITERS), "--lr", "2e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
          "--seed", "11", "--distributed-backend", "gloo",
          "--hidden-dropout", "0", "--attention-dropout", "0"]  # dropout masks follow the computing rank
TIMEOUT_S = 240.0


def _quiet_warnings():
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def stage_state(full_state: dict, pp_rank: int, pp_size: int, vp_stage: int = 0, vp_size: int = 1) -> dict:
    """The reference (PP 1) state dict entries that model chunk ``vp_stage`` of pipeline stage ``pp_rank``
    holds, renumbered. The backbone's stack layers (GPTModel's transformer layers, or HybridModel's attention
    and MLP layers) split into PP x VPP equal segments; segment ``vp_stage * pp_size + pp_rank`` is the chunk's."""
    layers = 1 + max(int(m.group(1)) for key in full_state
                     if (m := re.match(r"backbone\.decoder\.layers\.(\d+)\.", key)))
    per_chunk = layers // (pp_size * vp_size)
    first_layer = (vp_stage * pp_size + pp_rank) * per_chunk
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == pp_size - 1 and vp_stage == vp_size - 1
    out = {}
    for key, value in full_state.items():
        layer = re.match(r"backbone\.decoder\.layers\.(\d+)\.(.*)", key)
        if layer:
            index = int(layer.group(1)) - first_layer
            if 0 <= index < per_chunk:
                out[f"backbone.decoder.layers.{index}.{layer.group(2)}"] = value
        elif key.startswith(("encoders.", "backbone.embedding.")):
            if first:
                out[key] = value
        elif key.startswith(("backbone.decoder.", "backbone.output_layer.")):  # the final norm, the logits
            if last:
                out[key] = value
        else:
            raise AssertionError(f"unexpected model state key {key}")
    return out


def _train(rank, world_size, argv, out_dir, save_initial_state=None, load_initial_state=None):
    """One rank of a training run; the logging rank saves its loss per iteration to out_dir/losses.pt."""
    _quiet_warnings()
    from megatron.core import parallel_state

    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments, loop as trainer

    def model_provider(args, pre_process, post_process):
        model = providers.build_model(args, pre_process, post_process)
        if save_initial_state:
            torch.save(model.state_dict(), save_initial_state)
        if load_initial_state:
            full = torch.load(load_initial_state)
            model.load_state_dict(stage_state(full, parallel_state.get_pipeline_model_parallel_rank(),
                                              args.pipeline_model_parallel_size))
        return model

    args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
    try:
        task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
        records = trainer.pretrain(args, task, print_fn=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    if records:
        torch.save({r.iteration: r.lm_loss for r in records}, Path(out_dir) / "losses.pt")


def train(tmp_path: Path, name: str, world_size: int, *flags: str, save_initial_state=None,
          load_initial_state=None) -> dict:
    """Losses per iteration of a run of ``world_size`` ranks with ``flags`` added to COMMON."""
    out_dir = tmp_path / name
    out_dir.mkdir()
    run_distributed(_train, world_size, COMMON + list(flags), str(out_dir), save_initial_state,
                    load_initial_state, timeout_s=TIMEOUT_S)
    return torch.load(out_dir / "losses.pt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 4 micro-batches of 1 example per step: losses and the initial weights."""
    tmp_path = tmp_path_factory.mktemp("reference")
    initial = tmp_path / "initial_state.pt"
    return train(tmp_path, "run", 1, save_initial_state=str(initial)), initial


def assert_same_losses(losses: dict, expected: dict, rtol: float = 1e-5):
    assert sorted(losses) == list(range(1, ITERS + 1))
    for iteration, loss in expected.items():
        assert losses[iteration] == pytest.approx(loss, rel=rtol), (iteration, losses, expected)


@pytest.mark.distributed
def test_reference_loss_decreases(reference):
    losses, _ = reference
    assert losses[ITERS] < losses[1] - 0.3, losses


DP2_FLAGS = ("--use-distributed-optimizer",)


@pytest.fixture(scope="module")
def data_parallel_2(tmp_path_factory):
    """DP 2 with the distributed optimizer, 2 micro-batches of 1 example per rank and step."""
    return train(tmp_path_factory.mktemp("dp2"), "run", 2, *DP2_FLAGS)


@pytest.mark.distributed
def test_data_parallel_2_with_distributed_optimizer_matches_reference(reference, data_parallel_2):
    assert_same_losses(data_parallel_2, reference[0])


@pytest.mark.distributed
def test_tensor_parallel_2_matches_reference(reference, tmp_path):
    losses = train(tmp_path, "tp2", 2, "--tensor-model-parallel-size", "2")
    assert_same_losses(losses, reference[0])


@pytest.mark.distributed
def test_pipeline_parallel_2_1f1b_matches_reference(reference, tmp_path):
    losses = train(tmp_path, "pp2", 2, "--pipeline-model-parallel-size", "2",
                   load_initial_state=str(reference[1]))
    assert_same_losses(losses, reference[0])


@pytest.mark.distributed
def test_resume_from_checkpoint_gives_identical_losses(data_parallel_2, tmp_path):
    """Stop after 2 iterations (saving), resume to 4: the same losses as 4 uninterrupted iterations."""
    checkpoint = str(tmp_path / "checkpoint")
    first = train(tmp_path, "first", 2, *DP2_FLAGS, "--exit-interval", "2", "--save", checkpoint)
    second = train(tmp_path, "second", 2, *DP2_FLAGS, "--load", checkpoint)
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    assert {**first, **second} == data_parallel_2


@pytest.mark.distributed
def test_torchrun_entry_point_logs_megatron_iteration_lines(reference, tmp_path):
    """scripts/train_tiny_cpu.sh's launch (torchrun, DP 2), here in bf16: Megatron iteration lines with
    the per-phase load, TensorBoard scalars, and the reference's first loss up to bf16 precision."""
    tensorboard = tmp_path / "tb"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "pretrain_mllm.py"), *COMMON, "--train-iters", "3", "--tensorboard-dir", str(tensorboard),
           "--bf16", "--orch-log-level", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(TIMEOUT_S))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a CPU run is quiet: no CUDA, Transformer Engine / Apex, MIMO or rerun-machine notes of the libraries
    for noise in ("No CUDA runtime", "not installed", "Mimo", "RerunStateMachine"):
        assert noise not in proc.stdout + proc.stderr, (noise, proc.stderr[-3000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith(" iteration ")]
    assert [int(re.search(r"iteration +(\d+)/ +3 \|", line).group(1)) for line in lines] == [1, 2, 3]
    for line in lines:
        assert re.search(r"\| lm loss: \d\.\d{6}E[+-]\d\d \|", line), line
        assert re.search(r"\| tokens/s: [\d.]+ \|", line), line
        assert re.search(r"load per rank max/mean over DP: vision items \d+/[\d.]+ \([\d.-]+\), audio items "
                         r"\d+/[\d.]+ \([\d.-]+\), llm tokens \d+/[\d.]+ \([\d.]+\) \|", line), line
        assert "forward-backward" in line and "optimizer" in line, line
    first_loss = float(re.search(r"\| lm loss: (\S+) \|", lines[0]).group(1))
    assert first_loss == pytest.approx(reference[0][1], abs=0.05)
    assert list(tensorboard.glob("events.out.tfevents.*")), "no TensorBoard event file"


@pytest.mark.parametrize("flags, world_size, message", [
    (["--global-batch-size", "6"], 4, "--global-batch-size 6 is not divisible by --micro-batch-size (1) x "
                                      "data-parallel size (4)"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by"),
    (["--tensor-model-parallel-size", "8"], 8, "num_attention_heads=4 is not divisible by "
                                               "--tensor-model-parallel-size 8"),
    (["--pipeline-model-parallel-size", "4"], 4, "2 layers (--num-layers) are not divisible by"),
    (["--seq-length", "5000"], 1, "exceeds the backbone's max_position_embeddings"),
    (["--save-interval", "2"], 1, "--save-interval needs --save"),
    (["--lr-warmup-iters", "4"], 1, "--lr-warmup-iters 4 must be >= 0 and below --lr-decay-iters"),
])
def test_inconsistent_flags_are_named_in_the_error(flags, world_size, message):
    from megatron_orch.trainer import arguments
    with pytest.raises(arguments.ArgumentError, match=re.escape(message)):
        arguments.parse_args(MLLM_TASK, COMMON + flags, world_size=world_size)


def test_unknown_and_abbreviated_flags_are_rejected():
    from megatron_orch.trainer import arguments
    for flag in (["--no-such-flag", "1"], ["--tensor-model-parallel", "2"]):
        with pytest.raises(arguments.ArgumentError, match="unrecognized arguments"):
            arguments.parse_args(MLLM_TASK, COMMON + flag, world_size=1)


def test_backbone_shape_flags_override_the_model_config(tmp_path):
    from megatron_orch.trainer import arguments
    manifest = tmp_path / "x.jsonl"
    manifest.write_text('{"text": "a"}\n')
    args = arguments.parse_args(MLLM_TASK, COMMON + ["--num-layers", "4", "--hidden-size", "32", "--data-path", str(manifest)],
                                world_size=2)
    backbone = args.mllm_config.backbone.transformer
    assert (backbone.num_layers, backbone.hidden_size, backbone.ffn_hidden_size) == (4, 32, 256)
    assert args.mllm_config.encoders["vision"].transformer.hidden_size == 64
    assert (args.data_parallel_size, args.num_microbatches, args.lr_decay_iters) == (2, 2, ITERS)
