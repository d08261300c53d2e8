"""GPU defaults as Megatron-LM's, checked as far as a CPU allows: the fusion settings a GPU launch gets,
their way into megatron-core's TransformerConfig, and a process group not bound to a device.

What the fusions save on a GPU (time, the fp32 copy of the logits) needs a GPU to measure; not here.
"""
import argparse

import pytest
import torch.distributed as dist
from megatron.core.tensor_parallel import layers

from megatron_orch.balance.cost import TransformerShape
from megatron_orch.mllm import providers
from megatron_orch.mllm.model import ModelParallelSettings, transformer_config
from megatron_orch.trainer import arguments, loop
from megatron_orch.mllm.task import MLLM_TASK

ARGV = ["--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
FUSIONS = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
           "gradient_accumulation_fusion", "cross_entropy_loss_fusion")


def _args(backend: str) -> argparse.Namespace:
    return arguments.parse_args(MLLM_TASK, ARGV + ["--distributed-backend", backend], world_size=1)


def test_fusions_are_off_on_the_cpu():
    assert providers.fusion_settings(_args("gloo")) == dict.fromkeys(FUSIONS, False)
    settings = providers.model_parallel_settings(_args("gloo"))
    assert not any(getattr(settings, name) for name in FUSIONS)


@pytest.mark.parametrize("apex", [False, True])
def test_a_gpu_launch_gets_every_fusion_and_gradient_accumulation_fusion_only_with_apex(monkeypatch, apex):
    # megatron-core's ColumnParallelLinear (the output layer, the projectors; also beside Transformer
    # Engine's layers) refuses the gradient-accumulation fusion without Apex's CUDA extension.
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", apex)
    expected = dict.fromkeys(FUSIONS, True)
    expected["gradient_accumulation_fusion"] = apex
    assert providers.fusion_settings(_args("nccl")) == expected
    settings = providers.model_parallel_settings(_args("nccl"))
    assert {name: getattr(settings, name) for name in FUSIONS} == expected


def test_megatron_lms_fusion_flags_are_kept(monkeypatch):
    """Under megatron.training the namespace is Megatron-LM's: its --no-*-fusion flags (and its
    --cross-entropy-loss-fusion, off unless given) decide."""
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    args = _args("nccl")
    args.bias_gelu_fusion, args.masked_softmax_fusion, args.cross_entropy_loss_fusion = False, False, False
    settings = providers.fusion_settings(args)
    assert settings == {**dict.fromkeys(FUSIONS, True), "bias_gelu_fusion": False, "masked_softmax_fusion": False,
                        "cross_entropy_loss_fusion": False}


@pytest.mark.parametrize("gated", [False, True])
def test_fusion_settings_reach_the_transformer_config(gated):
    shape = TransformerShape(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, causal=True,
                             gated_linear_unit=gated)
    on = ModelParallelSettings(**{**dict.fromkeys(FUSIONS, True), "bias_gelu_fusion": not gated,
                                  "bias_swiglu_fusion": gated})
    config = transformer_config(shape, on, pipeline_split=False)
    assert config.bias_activation_fusion  # Megatron-LM: the swiglu flag with a gated FFN, else the gelu one
    assert config.bias_dropout_fusion and config.masked_softmax_fusion
    assert config.gradient_accumulation_fusion and config.cross_entropy_loss_fusion
    assert not config.apply_rope_fusion  # learned absolute positions: no RoPE to fuse
    other = ModelParallelSettings(bias_gelu_fusion=gated, bias_swiglu_fusion=not gated)
    assert not transformer_config(shape, other, pipeline_split=False).bias_activation_fusion
    off = transformer_config(shape, ModelParallelSettings(), pipeline_split=False)
    assert not any((off.bias_activation_fusion, off.bias_dropout_fusion, off.masked_softmax_fusion,
                    off.gradient_accumulation_fusion, off.cross_entropy_loss_fusion))


def test_the_process_group_is_not_bound_to_a_device(monkeypatch):
    """As Megatron-LM: no ``device_id`` (bound, NCCL would split the world's communicator eagerly at every
    new_group). Whether that is faster at scale needs a cluster to measure."""
    calls = []

    class Stop(Exception):
        pass

    def init_process_group(*args, **kwargs):
        calls.append((args, kwargs))
        raise Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(loop.torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    with pytest.raises(Stop):
        loop.initialize(_args("nccl"))
    assert calls[0] == ("set_device", 0)
    (args, kwargs), = calls[1:]
    assert args == ("nccl",) and "device_id" not in kwargs and "timeout" in kwargs
