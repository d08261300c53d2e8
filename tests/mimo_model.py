"""A tiny Megatron-Core MimoModel for the MIMO adapter's tests, built from megatron-core's own classes: a
``VisionModalitySubmodules`` (a patch ViT, an MLP projector) named ``images``, an
``AudioModalitySubmodules`` (a frame-stacking transformer, an MLP projector) named ``audio``, and a
language model (RoPE) on the MLLM backbone's class: ``HybridModel`` where megatron-core has it (0.19+, with
the backbone's layer pattern and stack spec), else ``GPTModel``; each a 2-layer transformer of
megatron-core's local layers on CPU."""
from __future__ import annotations

import warnings
from typing import Optional

import torch

SEQ_LENGTH = 192
VOCAB = 1024
PLACEHOLDERS = {"images": 1000, "audio": 1001}
PAD_TOKEN_ID = 1002
PATCHES, PATCH_DIM = 4, 12  # an image: 4 patch rows of 3 x 2 x 2 values; 4 embeddings
FRAMES, MEL_BINS, STACK = 16, 8, 4  # an audio window: 16 frames of 8 mel bins; 4 frames per embedding


def _encoder_block(config, pg_collection=None):
    from megatron.core.transformer.transformer_block import TransformerBlock

    from megatron_orch.mllm.model import transformer_layer_spec
    return TransformerBlock(config, transformer_layer_spec("local", encoder=True), post_layer_norm=True,
                            pg_collection=pg_collection)


class PatchEncoder(torch.nn.Module):
    """Patch rows ``[n, patches, patch_dim]`` -> ``[n, patches, hidden]``."""

    def __init__(self, config, patch_dim: int, patches: int, pg_collection=None):
        super().__init__()
        self.embed = torch.nn.Linear(patch_dim, config.hidden_size)
        self.position = torch.nn.Parameter(torch.randn(patches, config.hidden_size) * 0.02)
        self.transformer = _encoder_block(config, pg_collection)

    def forward(self, images):
        x = self.embed(images.to(self.embed.weight.dtype)) + self.position
        return self.transformer(x.transpose(0, 1).contiguous(), attention_mask=None).transpose(0, 1)


class FrameEncoder(torch.nn.Module):
    """Mel windows ``[n, frames, mel_bins]`` -> ``[n, frames / stack, hidden]`` (``stack`` frames a token)."""

    def __init__(self, config, mel_bins: int, frames: int, stack: int, pg_collection=None):
        super().__init__()
        self.stack = stack
        self.embed = torch.nn.Linear(mel_bins * stack, config.hidden_size)
        self.position = torch.nn.Parameter(torch.randn(frames // stack, config.hidden_size) * 0.02)
        self.transformer = _encoder_block(config, pg_collection)

    def forward(self, features):
        n, frames, bins = features.shape
        x = self.embed(features.to(self.embed.weight.dtype).reshape(n, frames // self.stack, self.stack * bins))
        x = x + self.position
        return self.transformer(x.transpose(0, 1).contiguous(), attention_mask=None).transpose(0, 1)


def shapes():
    """(encoder shape, language model shape) of the tiny MIMO."""
    from megatron_orch.balance.cost import TransformerShape
    encoder = TransformerShape(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, causal=False)
    language = TransformerShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                causal=True, vocab_size=VOCAB)
    return encoder, language


def grid(tensor_parallel_size: int, world_size: int):
    """A colocated module grid of MIMO's ``module_to_grid_map``: TP (fastest) x DP over every rank."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    return HyperCommGrid([tensor_parallel_size, 1, world_size // tensor_parallel_size, 1], ["tp", "cp", "dp", "pp"])


def non_colocated_grids(encoder_ranks: int, tensor_parallel_size: int, data_parallel_size: int) -> dict:
    """MIMO's non-colocated ``module_to_grid_map`` (0.19): every modality on ranks ``0..encoder_ranks - 1`` at TP 1,
    the language model at TP x DP on the ranks after them."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    names = ["tp", "cp", "dp", "pp"]
    grids = {name: HyperCommGrid([1, 1, encoder_ranks, 1], names) for name in PLACEHOLDERS}
    grids["language"] = HyperCommGrid([tensor_parallel_size, 1, data_parallel_size, 1], names,
                                      rank_offset=encoder_ranks)
    return grids


def build_mimo(tensor_model_parallel_size: int = 1, pre_process: bool = True, post_process: bool = True,
               encoders_of_images=("vit",), sequence_parallel: bool = False,
               encoder_tensor_parallel_size: Optional[int] = None, own_grids: Optional[dict] = None):
    """The tiny MimoModel (``encoders_of_images``: the names of the image submodule's encoders); with
    ``sequence_parallel`` its language model's embedding does not scatter (MIMO shards the combined input). With
    ``encoder_tensor_parallel_size`` (0.19), colocated per-module grids (``module_to_grid_map``): the modalities
    on a grid of that TP over every rank, built on its TP group; the language model on the job's TP x DP. With
    ``own_grids`` (:func:`non_colocated_grids`, their process groups created), those grids: an encoder rank builds
    the modalities at TP 1 on its grid's TP group, a language rank the language model on the job's TP group."""
    warnings.filterwarnings("ignore", message=".*experimental.*")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.mimo import MimoModel, MimoModelConfig
    from megatron.core.models.mimo.submodules.audio import AudioModalitySubmodules
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_orch.balance.cost import TransformerShape
    from megatron_orch.mllm.model import (HYBRID_BACKBONE, ModelParallelSettings, backbone_spec, padded_vocab_size,
                                          transformer_config)

    settings = ModelParallelSettings(tensor_model_parallel_size=tensor_model_parallel_size,
                                     sequence_parallel=sequence_parallel)
    encoder, language = shapes()
    grids, encoder_tp_group, pg_collection = None, parallel_state.get_tensor_model_parallel_group(), None
    encoder_settings = settings
    if own_grids is not None:
        import dataclasses

        from megatron.core.process_groups_config import ProcessGroupCollection
        grids = own_grids
        if grids["images"].is_current_rank_in_grid():
            encoder_tp_group = grids["images"].get_pg("tp")
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            pg_collection.tp = encoder_tp_group
        encoder_settings = dataclasses.replace(settings, tensor_model_parallel_size=1)
    elif encoder_tensor_parallel_size is not None:
        import dataclasses

        from megatron.core.process_groups_config import ProcessGroupCollection
        world = torch.distributed.get_world_size()
        grids = {name: grid(encoder_tensor_parallel_size, world) for name in PLACEHOLDERS}
        grids["language"] = grid(tensor_model_parallel_size, world)
        encoder_tp_group = grids["images"].create_pg(["tp"])  # every modality's: the same ranks
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        pg_collection.tp = encoder_tp_group
        encoder_settings = dataclasses.replace(settings, tensor_model_parallel_size=encoder_tensor_parallel_size)
    encoder_config = transformer_config(encoder, encoder_settings, pipeline_split=False)
    language_config = transformer_config(language, settings, pipeline_split=True, hybrid=HYBRID_BACKBONE)
    projector_config = transformer_config(
        TransformerShape(num_layers=1, hidden_size=language.hidden_size, ffn_hidden_size=64,
                         num_attention_heads=language.num_attention_heads, causal=False), encoder_settings,
        pipeline_split=False)

    def projector():
        return ModuleSpec(module=MultimodalProjector, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                              linear_fc2=RowParallelLinear),
                          params={"config": projector_config, "projector_type": "mlp",
                                  "input_size": encoder.hidden_size,
                                  "tp_group": encoder_tp_group})

    images = ModuleSpec(module=VisionModalitySubmodules, submodules={
        "encoders": {name: ModuleSpec(module=PatchEncoder, params={"config": encoder_config, "patch_dim": PATCH_DIM,
                                                                    "patches": PATCHES,
                                                                    "pg_collection": pg_collection})
                     for name in encoders_of_images},
        "input_projections": [projector()]})
    audio = ModuleSpec(module=AudioModalitySubmodules, submodules={
        "encoders": {"frames": ModuleSpec(module=FrameEncoder, params={"config": encoder_config, "mel_bins": MEL_BINS,
                                                                        "frames": FRAMES, "stack": STACK,
                                                                        "pg_collection": pg_collection})},
        "input_projections": [projector()]})
    if HYBRID_BACKBONE:
        from megatron.core.models.hybrid.hybrid_model import HybridModel as LanguageModel
    else:
        LanguageModel = GPTModel
    language_model = ModuleSpec(module=LanguageModel, params={
        "config": language_config, "vocab_size": padded_vocab_size(VOCAB, settings),
        "max_sequence_length": SEQ_LENGTH, "pre_process": pre_process, "post_process": post_process,
        "position_embedding_type": "rope", "scatter_embedding_sequence_parallel": not sequence_parallel,
        **backbone_spec("local", language, language_config)})
    config = MimoModelConfig(language_model_spec=language_model, modality_submodules_spec={"images": images,
                                                                                           "audio": audio},
                             special_token_ids=dict(PLACEHOLDERS),
                             **({} if grids is None else {"module_to_grid_map": grids}))
    if grids is None or own_grids is not None:  # no bridge: the grids share no rank
        return MimoModel(config)
    # MIMO's colocated bridges (encoder layout to the language model's) make their groups with backend="nccl":
    # on the CPU, the default backend's (gloo), so that the model holds them as on a GPU
    from unittest import mock

    from megatron.core.models.mimo.comm import colocated_communicator
    subgroups = torch.distributed.new_subgroups_by_enumeration
    with mock.patch.object(colocated_communicator.dist, "new_subgroups_by_enumeration",
                           lambda ranks, backend=None, **kwargs: subgroups(ranks, **kwargs)):
        return MimoModel(config)


def modalities():
    """How the tiny MIMO's two modality submodules are balanced: FLOPs from the encoders' shape."""
    from megatron_orch.balance.cost import FunctionCost, TransformerCost
    from megatron_orch.megatron.mimo import MimoModality
    encoder, _ = shapes()
    return (MimoModality("images", "vit", "images", (PATCHES, PATCH_DIM), rows_per_item=PATCHES,
                         item_tokens=PATCHES, cost=TransformerCost(encoder)),
            # a user's cost function for the other: any callable of the item tokens
            MimoModality("audio", "frames", "features", (FRAMES, MEL_BINS), rows_per_item=FRAMES // STACK,
                         item_tokens=FRAMES // STACK,
                         cost=FunctionCost(lambda s: encoder.train_flops(s), memory=encoder.activation_bytes)))


def balanced_mimo(tensor_model_parallel_size: int = 1, sequence_parallel: bool = False,
                  encoder_tensor_parallel_size: Optional[int] = None):
    from megatron_orch.balance.cost import TransformerCost
    from megatron_orch.megatron.mimo import MimoBalancing
    return MimoBalancing(build_mimo(tensor_model_parallel_size, sequence_parallel=sequence_parallel,
                                    encoder_tensor_parallel_size=encoder_tensor_parallel_size), modalities(),
                         TransformerCost(shapes()[1]))
