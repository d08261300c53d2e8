"""Megatron-Core's own ``MimoModel`` (an image modality submodule and a GPT language model), balanced by
``MimoBalancing`` and trained by the same hand-written loop as ``own_model.py`` (imported from beside it).

    torchrun --nproc-per-node 2 examples/mimo_model.py                # balancing on, then off, same init

Runs on CPU (gloo) or GPUs (NCCL); prints both runs' losses and their largest relative difference.
"""
from __future__ import annotations

import warnings

import own_model
from own_model import (IMAGE_TOKEN, PAD_TOKEN, PATCH_DIM, PATCHES, SEQ_LENGTH, VOCAB, PatchViT, shapes,
                       transformer_config)

warnings.filterwarnings("ignore", message=".*experimental.*")


# readme: mimo
def build_mimo(encoder=PatchViT):
    """The MimoModel wrapped for post-balancing (``encoder``: the image encoder's class)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.mimo import MimoModel, MimoModelConfig
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_orch.megatron import MimoBalancing, MimoModality, TransformerCost

    vit, llm = shapes()
    image = ModuleSpec(module=VisionModalitySubmodules, submodules={
        "encoders": {"vit": ModuleSpec(module=encoder, params={"config": transformer_config(vit)})},
        "input_projections": [ModuleSpec(module=MultimodalProjector, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), params={
                "config": transformer_config(llm, num_layers=1), "projector_type": "mlp",
                "input_size": vit.hidden_size, "tp_group": parallel_state.get_tensor_model_parallel_group()})]})
    language = ModuleSpec(module=GPTModel, params={
        "config": transformer_config(llm), "transformer_layer_spec": get_gpt_layer_local_spec(), "vocab_size": VOCAB,
        "max_sequence_length": SEQ_LENGTH, "position_embedding_type": "rope"})
    mimo = MimoModel(MimoModelConfig(language_model_spec=language, modality_submodules_spec={"image": image},
                                     special_token_ids={"image": IMAGE_TOKEN}))
    # one encoder phase per modality submodule: its encoder and the keyword its forward takes items by
    return MimoBalancing(mimo, [MimoModality("image", encoder="vit", keyword="tiles", item_shape=(PATCHES, PATCH_DIM),
                                             rows_per_item=PATCHES, item_tokens=PATCHES, cost=TransformerCost(vit),
                                             bytes_per_element=4)], backbone_cost=TransformerCost(llm))
# readme: end


def spec_of(model):
    """The batch spec of the wrapped MimoModel: its modality's items, placeholders at its special token id."""
    return model.batch_spec(seq_length=SEQ_LENGTH, pad_token_id=PAD_TOKEN)


def build():
    """The wrapped model; on a machine without CUDA, the CPU harness is applied again to the MIMO modules
    megatron-core imported just now."""
    model = build_mimo()
    own_model.redirect_for_cpu()
    return model


if __name__ == "__main__":
    own_model.compare(__doc__.split("\n\n")[0], build, spec_of)
