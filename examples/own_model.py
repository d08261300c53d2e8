"""A LLaVA-style model of your own on megatron-core (a ViT and an MLP projector, a GPT language model),
trained with post-balancing by a hand-written loop shaped like Megatron-Bridge's ``train_step``: it calls
``get_forward_backward_func(pp, vp)`` itself, and :func:`megatron_orch.megatron.post_balance` wraps that
schedule and the data iterator.

    torchrun --nproc-per-node 2 examples/own_model.py                 # balancing on, then off, same init
    torchrun --nproc-per-node 2 examples/own_model.py --iters 8 --balanced-only

Runs on CPU (gloo, megatron-core through the project's CPU harness) or on GPUs (NCCL). It prints the loss
of every iteration of both runs and their largest relative difference (dropout 0: the runs agree to the
floating-point reduction order), and the balanced run checks its first step against the upstream layout.
"""
from __future__ import annotations

import argparse
import os
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

IMAGE_TOKEN, PAD_TOKEN, VOCAB = 500, 501, 512
PATCHES, PATCH_DIM = 4, 12   # an image tile: 4 patch rows of 12 values; it gives the LLM 4 embeddings
SEQ_LENGTH, MICRO_BATCH, MICRO_BATCHES = 96, 2, 2


# readme: model
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_orch.megatron import MegatronModelMixin


class PatchViT(MegatronModule):
    """Image tiles ``[n, patches, patch_dim]`` -> ``[n, patches, hidden]``, item-major."""

    def __init__(self, config: TransformerConfig):
        super().__init__(config=config)
        self.patch_embedding = torch.nn.Linear(PATCH_DIM, config.hidden_size)
        self.position = torch.nn.Parameter(torch.randn(PATCHES, config.hidden_size) * 0.02)
        self.transformer = TransformerBlock(config, get_vit_layer_with_local_spec(), post_layer_norm=True)

    def forward(self, tiles):
        x = self.patch_embedding(tiles.to(self.patch_embedding.weight.dtype)) + self.position
        x = self.transformer(x.transpose(0, 1).contiguous(), attention_mask=None)   # Megatron's [s, n, h]
        return x.transpose(0, 1)                                                       # back to [n, s, h]


def projector(config: TransformerConfig, input_size: int) -> MultimodalProjector:
    return MultimodalProjector(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                               "mlp", input_size=input_size, tp_group=parallel_state.get_tensor_model_parallel_group())


class ImageEncoder(torch.nn.Module):
    """ViT and projector in one module: phase_encoders() must hold every parameter encode() uses."""

    def __init__(self, vit: TransformerConfig, projector_config: TransformerConfig):
        super().__init__()
        self.vit = PatchViT(vit)
        self.projector = projector(projector_config, vit.hidden_size)

    def forward(self, tiles):
        return self.projector(self.vit(tiles)).flatten(0, 1)   # rows item by item: [n * patches, llm hidden]


class TinyLlava(MegatronModelMixin, MegatronModule):  # the mixin: model_type, set_input_tensor
    def __init__(self, vit: TransformerConfig, projector_config: TransformerConfig, llm: TransformerConfig):
        super().__init__(config=llm)
        self.image_encoder = ImageEncoder(vit, projector_config)
        self.language_model = GPTModel(llm, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                                       max_sequence_length=SEQ_LENGTH, position_embedding_type="rope")

    def phase_encoders(self):
        return {"image": self.image_encoder}

    def encode(self, phase, items):                     # any number of items, n may be 0
        if items.shape[0] == 0:
            return torch.zeros(0, self.config.hidden_size, dtype=self.config.params_dtype, device=items.device)
        return self.image_encoder(items)

    def forward(self, batch, embeds=None):
        if embeds is None:                              # upstream: this micro-batch's own images
            embeds = {"image": self.encode("image", batch.items["image"])}
        text = self.language_model.embedding(input_ids=batch.tokens, position_ids=batch.position_ids)
        placeholders = (batch.tokens == IMAGE_TOKEN).unsqueeze(-1)      # [b, s, 1]: rows fill it row-major
        inputs = text.transpose(0, 1).masked_scatter(placeholders, embeds["image"].to(text.dtype))
        return self.language_model(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None,
                                   decoder_input=inputs.transpose(0, 1).contiguous(), labels=batch.labels)
# readme: end


def shapes():
    """The transformer shapes (for the configs and the cost models)."""
    from megatron_orch.megatron import TransformerShape
    vit = TransformerShape(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, causal=False)
    llm = TransformerShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, causal=True,
                           vocab_size=VOCAB)
    return vit, llm


def transformer_config(shape, **changes) -> TransformerConfig:
    """A TransformerConfig for CPU or GPU; ``calculate_per_token_loss`` is what post-balancing needs."""
    settings = dict(num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
                    num_attention_heads=shape.num_attention_heads, hidden_dropout=0.0, attention_dropout=0.0,
                    calculate_per_token_loss=True, use_cpu_initialization=True, bias_activation_fusion=False,
                    masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                    gradient_accumulation_fusion=False)
    return TransformerConfig(**{**settings, **changes})


def build_model(model_class=None) -> torch.nn.Module:
    """The model (``model_class``: TinyLlava or a variant of it) with the same weights on every DP rank."""
    vit, llm = shapes()
    return (model_class or TinyLlava)(transformer_config(vit), transformer_config(llm, num_layers=1),
                                      transformer_config(llm))


# readme: data
from megatron_orch.megatron import (BackbonePhase, BatchSpec, EncoderInput, EncoderPhase, Example, ModelPhases,
                                    TransformerCost, collate)


def batch_spec() -> BatchSpec:
    """The model's phases (what balancing plans with) and what its batches hold."""
    vit, llm = shapes()
    phases = ModelPhases(
        encoders=(EncoderPhase("image", TransformerCost(vit), item_tokens=PATCHES, input_bytes=PATCHES * PATCH_DIM * 4,
                               output_rows=PATCHES, output_row_bytes=llm.hidden_size * 4),),
        backbone=BackbonePhase("text", TransformerCost(llm), token_bytes=20))
    # forward() passes no PackedSeqParams, so a packed row would attend across its examples: takes_packed_rows
    # stays False (the default), --orch-microbatching auto gives equal-count micro-batches and logs the reason.
    return BatchSpec(phases, (EncoderInput("image", (PATCHES, PATCH_DIM), IMAGE_TOKEN),), pad_token_id=PAD_TOKEN,
                     seq_length=SEQ_LENGTH, cannot_pack="TinyLlava.forward passes no PackedSeqParams to its GPTModel")


def example(sample_index: int) -> Example:
    """An image-text example: image placeholders, a prompt, an answer (the loss is on the answer)."""
    g = torch.Generator().manual_seed(sample_index)
    images = (0, 0, 0, 1, 1, 2, 4, 8)[int(torch.randint(0, 8, (1,), generator=g))]   # a long tail
    prompt = torch.randint(0, 400, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g)
    answer = torch.randint(0, 400, (int(torch.randint(4, 24, (1,), generator=g)),), generator=g)
    ids = torch.cat([torch.full((images * PATCHES,), IMAGE_TOKEN), prompt, answer])
    loss_mask = torch.zeros(ids.numel() - 1)
    loss_mask[ids.numel() - 1 - answer.numel():] = 1.0  # where the label is an answer token
    return Example(sample_index, tokens=ids[:-1], labels=ids[1:], loss_mask=loss_mask,
                   items={"image": torch.randn(images, PATCHES, PATCH_DIM, generator=g)})


def microbatches(spec: BatchSpec, dp_rank: int, dp_size: int, steps: int):
    """This DP rank's micro-batches, as a loader shards a dataset: step by step, its share of each global batch."""
    per_rank = MICRO_BATCH * MICRO_BATCHES
    for step in range(steps):
        for m in range(MICRO_BATCHES):
            first = (step * dp_size + dp_rank) * per_rank + m * MICRO_BATCH
            yield collate([example(first + j) for j in range(MICRO_BATCH)], spec)
# readme: end


# readme: loop
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_orch.megatron import OrchestratorConfig, StepShape, forward_step, post_balance


def setup(module, data_iterator, spec: BatchSpec, balanced: bool, ddp_config=None, config=OrchestratorConfig()):
    """What the training loop's setup does (as Megatron-Bridge's), plus post_balance (``config``: the planner's
    settings, shadow mode, the checked first step)."""
    ddp_config = DistributedDataParallelConfig() if ddp_config is None else ddp_config
    model = [DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=2e-3, params_dtype=torch.float32,
                                                       use_distributed_optimizer=ddp_config.use_distributed_optimizer),
                                       model)
    model_config = get_model_config(model[0])        # the callbacks megatron-core's schedules call
    model_config.no_sync_func = model[0].no_sync
    model_config.finalize_model_grads_func = finalize_model_grads
    model_config.grad_scale_func = optimizer.scale_loss
    forward_backward_func = get_forward_backward_func(parallel_state.get_pipeline_model_parallel_world_size(),
                                                      parallel_state.get_virtual_pipeline_model_parallel_world_size())
    if balanced:
        forward_backward_func, data_iterator = post_balance(
            forward_backward_func, data_iterator, spec, StepShape(MICRO_BATCH, MICRO_BATCHES), model=model,
            config=config)
    return model, optimizer, forward_backward_func, data_iterator


def train_step(forward_backward_func, data_iterator, model, optimizer, num_microbatches: int = MICRO_BATCHES) -> float:
    """One global batch, as Megatron-Bridge's train_step: zero, forward-backward, optimizer step, the loss
    (``num_microbatches``: this step's, as a batch-size ramp-up changes it)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = forward_backward_func(forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                                   num_microbatches=num_microbatches, seq_length=SEQ_LENGTH,
                                   micro_batch_size=MICRO_BATCH, decoder_seq_length=SEQ_LENGTH, forward_only=False)
    optimizer.step()
    total = torch.stack([x["lm loss"] for x in losses]).sum(dim=0)   # [sum of token losses, tokens]
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    return float(total[0] / total[1])
# readme: end


def redirect_for_cpu() -> None:
    """On a machine without CUDA, megatron-core's CUDA-only calls go to the CPU (the project's CPU harness; call
    it again after importing more of megatron-core)."""
    if not torch.cuda.is_available():
        from megatron_orch.trainer import cpu_harness
        cpu_harness.install()


def initialize(seed: int = 7) -> None:
    """Process group (torchrun's environment, or one already made), megatron-core's parallel state, seeds."""
    redirect_for_cpu()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core import tensor_parallel
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def train(balanced: bool, iters: int, build=build_model, spec_of=lambda module: batch_spec(), seed: int = 7) -> dict:
    """Train ``iters`` steps from a fresh ``build()`` (the same weights for the same ``seed``) on batches of
    ``spec_of(model)``; the global loss of every step, the parameters after the last and the schedule used."""
    from megatron.core import tensor_parallel
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    module = build()
    if torch.cuda.is_available():
        module.cuda()
    spec = spec_of(module)
    data = microbatches(spec, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                        iters)
    model, optimizer, forward_backward_func, data_iterator = setup(module, data, spec, balanced)
    losses = [train_step(forward_backward_func, data_iterator, model, optimizer) for _ in range(iters)]
    return {"losses": losses, "params": {name: p.detach().cpu().clone() for name, p in module.named_parameters()},
            "schedule": forward_backward_func}


def compare(description: str, build=build_model, spec_of=lambda module: batch_spec()) -> None:
    """The command line: balancing on (and off, from the same weights), each run's losses and their largest
    relative difference, printed on rank 0."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--balanced-only", action="store_true", help="skip the run with balancing off")
    args = parser.parse_args()
    initialize()
    runs = {"balanced": train(True, args.iters, build, spec_of)}
    if not args.balanced_only:
        runs["upstream"] = train(False, args.iters, build, spec_of)
    if dist.get_rank() == 0:
        for name, run in runs.items():
            print(f"{name:>9}: " + " ".join(f"{loss:.6f}" for loss in run["losses"]), flush=True)
        if "upstream" in runs:
            diff = max(abs(a - b) / abs(b) for a, b in zip(runs["balanced"]["losses"], runs["upstream"]["losses"]))
            print(f"balancing off vs on, DP {dist.get_world_size()}: largest relative loss difference {diff:.1e}",
                  flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    compare(__doc__.split("\n\n")[0])
