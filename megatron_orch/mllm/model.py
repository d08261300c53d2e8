"""The multimodal LLM on megatron-core: its configured encoders (ViTs, audio encoders) with projectors,
and a GPT backbone: megatron-core's ``HybridModel`` where it has one (0.19+, :mod:`megatron_orch.mllm.hybrid`:
the same layers as a hybrid layer pattern, the same numerics), ``GPTModel`` before (:data:`HYBRID_BACKBONE`).

Every item (an image tile, a video frame, an audio window) is encoded independently, so an encoder
takes a variable number of items per rank and never pads an example to the longest one. The
projected embeddings replace the backbone's placeholder tokens (each encoder's own placeholder id,
``tokens_per_item`` consecutive placeholders per item, in item order).

The model meets post-balancing's contract (:class:`~megatron_orch.megatron.contract.BalanceableModel`)
like any other: its encoders by phase name (:meth:`MLLMModel.phase_encoders`), one phase over any items
(:meth:`MLLMModel.encode`), and the backbone with the encoder outputs inserted (:meth:`MLLMModel.forward`
with ``embeds``), so an orchestrator can run the encoders over a different set of items than the
backbone's examples and move the embeddings in between; without ``embeds`` :meth:`MLLMModel.forward`
encodes the batch's own items first (upstream Megatron behaviour).

Parallelism: the encoders and projectors live on the first pipeline stage, in its first model chunk
(virtual pipeline stage 0), or on every stage (``encoders=True``: post-balancing's ``EncoderRanks.ALL``); tensor
parallelism comes from Megatron's column/row-parallel layers, for the encoders at their own TP size where
``ModelParallelSettings.encoder_tensor_model_parallel_size`` is below the backbone's
(:class:`EncoderParallelism`). Sequence and context parallelism are the backbone's only (as Megatron-LM's
multimodal models run their vision encoders): its token embeddings are computed for the rank's part of the
sequence (:class:`~megatron_orch.megatron.sequence_layout.SequenceLayout`, megatron-core's layout) and each encoder
output is spliced in where its placeholder lands in that part; the encoders run over all the micro-batch's
items on every CP rank, with TP but without SP.

Layer specs (:func:`transformer_layer_spec`, Megatron's ``--transformer-impl``): ``local`` is
megatron-core's local layers with :class:`~megatron_orch.mllm.attention.SDPAttention` as core
attention; ``transformer_engine`` is megatron-core's Transformer Engine layers.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.models.vision.vit_layer_specs import (get_vit_layer_with_local_spec,
                                                         get_vit_layer_with_transformer_engine_spec)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_orch.balance.cost import TransformerShape
from megatron_orch.megatron.batch import MicroBatch
from megatron_orch.megatron.encoder_chunks import RngStates
from megatron_orch.megatron.encoder_layout import encoder_tensor_parallel_group
from megatron_orch.megatron.sequence_layout import SequenceLayout, SequenceShard
from megatron_orch.mllm.attention import SDPAttention
from megatron_orch.mllm.config import AudioEncoderConfig, MLLMConfig, VisionEncoderConfig
from megatron_orch.mllm.examples import batch_spec

# The backbone's megatron-core class: HybridModel where megatron-core has it (0.19+), else GPTModel. Their
# parameters are named differently (megatron_orch.mllm.hybrid), so a checkpoint resumes on the same class only.
HYBRID_BACKBONE = importlib.util.find_spec("megatron.core.models.hybrid") is not None
BACKBONE_MODULE = "HybridModel" if HYBRID_BACKBONE else "GPTModel"
if HYBRID_BACKBONE:
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_orch.mllm.hybrid import backbone_layer_pattern, hybrid_config_fields, hybrid_stack_spec


@functools.lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """Whether ``import transformer_engine`` succeeds (it decides ``--transformer-impl``'s default)."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError):  # OSError: installed, but its CUDA libraries do not load
        return False
    return True


@dataclass(frozen=True)
class ModelParallelSettings:
    """How the model is split and run: the settings Megatron's CLI gives besides the shapes."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None  # model chunks per pipeline rank (None: one)
    # with virtual stages, Megatron-LM's --no-overlap-p2p-communication and
    # --microbatch-group-size-per-virtual-pipeline-stage (None: the pipeline size)
    overlap_p2p_comm: bool = True
    microbatch_group_size_per_vp_stage: Optional[int] = None
    bf16: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    sequence_parallel: bool = False  # the backbone's (Megatron's --sequence-parallel); encoders never
    context_parallel_size: int = 1   # the backbone's; the encoders run whole sequences on every CP rank
    # The encoders' own TP size (post-balancing's --orch-encoder-tensor-parallel-size, with the encoders on every
    # stage; it divides the backbone's): None, the backbone's.
    encoder_tensor_model_parallel_size: Optional[int] = None
    use_cpu_initialization: bool = True  # full weights drawn on every rank, then split: TP-invariant
    calculate_per_token_loss: bool = True
    transformer_impl: str = "local"  # layer specs: "local" or "transformer_engine"
    # Parameters sharded over DP (Megatron-FSDP, torch FSDP2): gathering a module's parameters is a collective,
    # so every encoder runs in every micro-batch, over one zero item when it has none (MLLMModel.forward).
    sharded_parameters: bool = False
    # An MoE backbone (num_experts in its shape): expert parallelism and Megatron-LM's MoE flags, its defaults.
    expert_model_parallel_size: int = 1
    moe_router_load_balancing_type: Union[str, Tuple[str, ...]] = "aux_loss"
    moe_aux_loss_coeff: Union[float, Tuple[float, ...]] = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"
    moe_expert_capacity_factor: Optional[float] = None
    # megatron-core's kernel fusions (Megatron-LM's --no-*-fusion flags; --cross-entropy-loss-fusion): off
    # here, as on the CPU; the providers turn them on for a GPU run (providers.fusion_settings).
    bias_gelu_fusion: bool = False
    bias_swiglu_fusion: bool = False
    bias_dropout_fusion: bool = False
    masked_softmax_fusion: bool = False
    gradient_accumulation_fusion: bool = False
    cross_entropy_loss_fusion: bool = False


def transformer_config(shape: TransformerShape, settings: ModelParallelSettings, *,
                       pipeline_split: bool, hybrid: bool = False) -> TransformerConfig:
    """A Megatron ``TransformerConfig`` for one transformer stack of the model.

    ``pipeline_split``: whether the stack's layers are divided over the pipeline stages and their
    virtual stages, and its sequence over SP and CP ranks (the backbone), or all sit on the first stage,
    with whole sequences (encoders, projectors). ``hybrid``: the config of a ``HybridModel`` stack
    (:func:`megatron_orch.mllm.hybrid.hybrid_config_fields`).
    """
    virtual = settings.virtual_pipeline_model_parallel_size if pipeline_split else None
    overlap_p2p = virtual is not None and settings.overlap_p2p_comm
    layers = {"num_layers": shape.num_layers, **(hybrid_config_fields(shape) if hybrid else {})}
    return TransformerConfig(
        **layers,
        **_moe_config_fields(shape, settings),
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        gated_linear_unit=shape.gated_linear_unit,
        activation_func=F.silu if shape.gated_linear_unit else F.gelu,
        tensor_model_parallel_size=settings.tensor_model_parallel_size,
        pipeline_model_parallel_size=settings.pipeline_model_parallel_size if pipeline_split else 1,
        sequence_parallel=settings.sequence_parallel and pipeline_split,
        context_parallel_size=settings.context_parallel_size if pipeline_split else 1,
        virtual_pipeline_model_parallel_size=virtual,
        microbatch_group_size_per_vp_stage=settings.microbatch_group_size_per_vp_stage if pipeline_split else None,
        # Megatron-LM's pairing: overlapped point-to-point sends with virtual stages, batched ones without
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p,
        pipeline_dtype=torch.bfloat16 if settings.bf16 else torch.float32,
        params_dtype=torch.bfloat16 if settings.bf16 else torch.float32,
        bf16=settings.bf16,
        hidden_dropout=settings.hidden_dropout,
        attention_dropout=settings.attention_dropout,
        init_method_std=settings.init_method_std,
        use_cpu_initialization=settings.use_cpu_initialization,
        calculate_per_token_loss=settings.calculate_per_token_loss,
        bias_activation_fusion=settings.bias_swiglu_fusion if shape.gated_linear_unit else settings.bias_gelu_fusion,
        masked_softmax_fusion=settings.masked_softmax_fusion,
        bias_dropout_fusion=settings.bias_dropout_fusion,
        apply_rope_fusion=False,  # learned absolute positions: Megatron-LM turns it off without RoPE
        gradient_accumulation_fusion=settings.gradient_accumulation_fusion,
        cross_entropy_loss_fusion=settings.cross_entropy_loss_fusion,
        transformer_impl=settings.transformer_impl,  # FSDP2's wrapper picks its units by it
    )


def _moe_config_fields(shape: TransformerShape, settings: ModelParallelSettings) -> dict:
    """The ``TransformerConfig`` fields of an MoE stack: its shape, expert parallelism and Megatron-LM's MoE
    training flags (``ModelParallelSettings.moe_*``); none for a dense one. Its linear layers have no biases, as
    in Megatron-LM's MoE recipes (``--disable-bias-linear``): megatron-core 0.19's experts add an expert's bias
    under the router's per-token scale in place on a view of the output, which autograd refuses."""
    if not shape.is_moe:
        return {}
    return dict(add_bias_linear=False, num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_router_topk,
                moe_ffn_hidden_size=shape.expert_ffn_hidden_size,
                moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
                moe_grouped_gemm=settings.transformer_impl == "transformer_engine",
                expert_model_parallel_size=settings.expert_model_parallel_size,
                moe_router_load_balancing_type=settings.moe_router_load_balancing_type,
                moe_aux_loss_coeff=settings.moe_aux_loss_coeff, moe_z_loss_coeff=settings.moe_z_loss_coeff,
                moe_token_dispatcher_type=settings.moe_token_dispatcher_type,
                moe_expert_capacity_factor=settings.moe_expert_capacity_factor)


def _projector_config(ffn_hidden_size: int, backbone: TransformerShape,
                      settings: ModelParallelSettings) -> TransformerConfig:
    shape = TransformerShape(num_layers=1, hidden_size=backbone.hidden_size, ffn_hidden_size=ffn_hidden_size,
                             num_attention_heads=backbone.num_attention_heads, causal=False,
                             kv_channels=backbone.head_dim)
    return transformer_config(shape, settings, pipeline_split=False)


@dataclass(frozen=True, eq=False)
class EncoderParallelism:
    """How an encoder is built: its settings (the backbone's, at the encoders' TP size), its TP group, and the
    process groups of its transformer (None: megatron-core's, the backbone's TP)."""

    settings: ModelParallelSettings
    tp_group: torch.distributed.ProcessGroup
    pg_collection: Optional[ProcessGroupCollection] = None

    @classmethod
    def of(cls, settings: ModelParallelSettings) -> "EncoderParallelism":
        """At ``settings.encoder_tensor_model_parallel_size``: below the backbone's TP, on the encoder TP group of
        :func:`~megatron_orch.megatron.encoder_layout.encoder_tensor_parallel_group` (every rank builds encoders
        then, so every rank makes it)."""
        size = settings.encoder_tensor_model_parallel_size
        if size is None or size == settings.tensor_model_parallel_size:
            return cls(settings, parallel_state.get_tensor_model_parallel_group())
        group = encoder_tensor_parallel_group(size)
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        pg_collection.tp = group
        return cls(dataclasses.replace(settings, tensor_model_parallel_size=size), group, pg_collection)


class LayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm built as megatron-core builds its norms (``config``, ``hidden_size``, ``eps``), with its
    weights marked ``sequence_parallel`` under sequence parallelism as megatron-core's fused norms mark theirs:
    each TP rank then normalises its part of the sequence and ``finalize_model_grads`` sums their gradients over
    the TP group. The norm of the local layer specs (megatron-core's torch norm refuses sequence parallelism)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused):
        if config.normalization != "LayerNorm":
            raise ValueError(f"LayerNorm: normalization={config.normalization!r}")
        super().__init__(hidden_size, eps=eps)
        for parameter in self.parameters():
            parameter.sequence_parallel = config.sequence_parallel


def transformer_layer_spec(transformer_impl: str, *, encoder: bool, num_experts: Optional[int] = None) -> ModuleSpec:
    """The layer spec of the backbone (causal) or of an encoder (bidirectional, no mask).

    ``local``: megatron-core's local GPT / ViT layers with :class:`SDPAttention` as core attention and
    :class:`LayerNorm` as norm.
    ``transformer_engine``: megatron-core's TE GPT / ViT layers (TE's fused attention); untested
    here, since the development machines have neither Transformer Engine nor a GPU. ``num_experts``
    (the backbone): megatron-core's MoE layer as the FFN (its router, its experts: ``SequentialMLP`` of the
    local layers, Transformer Engine's grouped GEMM experts ``TEGroupedMLP``, and its load-balancing losses).
    """
    moe = {} if num_experts is None else {"num_experts": num_experts,
                                          "moe_grouped_gemm": transformer_impl == "transformer_engine"}
    if transformer_impl == "local":
        spec = get_vit_layer_with_local_spec() if encoder else get_gpt_layer_local_spec(**moe)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, input_layernorm=LayerNorm,
            pre_mlp_layernorm=LayerNorm if spec.submodules.pre_mlp_layernorm is not IdentityOp else IdentityOp))
        core_attention = SDPAttention
    elif transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError("transformer_impl='transformer_engine' needs Transformer Engine, which does not "
                               "import here; use 'local'")
        spec = (get_vit_layer_with_transformer_engine_spec() if encoder
                else get_gpt_layer_with_transformer_engine_spec(**moe))
        core_attention = spec.submodules.self_attention.submodules.core_attention
    else:
        raise ValueError(f"transformer_impl must be 'local' or 'transformer_engine', got {transformer_impl!r}")
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention, params={**attention.params,
                           "attn_mask_type": AttnMaskType.no_mask if encoder else AttnMaskType.causal},
        submodules=dataclasses.replace(attention.submodules, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def backbone_spec(transformer_impl: str, shape: TransformerShape, config: TransformerConfig,
                  vp_stage: Optional[int] = None) -> dict:
    """The layer arguments of the backbone's class for :func:`transformer_layer_spec`'s layers: ``HybridModel``'s
    stack spec and layer pattern (0.19+, :mod:`megatron_orch.mllm.hybrid`), ``GPTModel``'s layer spec before.
    ``local`` ends the stack in :class:`LayerNorm`, which takes sequence parallelism (megatron-core's torch norm
    refuses it); on ``GPTModel`` that is a block spec of this model chunk's layers. An MoE ``shape``: every
    layer's FFN is megatron-core's MoE layer (``HybridModel``'s ``E`` layers)."""
    layer = transformer_layer_spec(transformer_impl, encoder=False, num_experts=shape.num_experts)
    local = transformer_impl == "local"
    if HYBRID_BACKBONE:
        segments = config.pipeline_model_parallel_size * (config.virtual_pipeline_model_parallel_size or 1)
        return {"hybrid_stack_spec": hybrid_stack_spec(layer, moe=shape.is_moe,
                                                       **({"final_norm": LayerNorm} if local else {})),
                "hybrid_layer_pattern": backbone_layer_pattern(shape.num_layers, segments, moe=shape.is_moe)}
    if local:
        layer = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                           layer_norm=LayerNorm)
    return {"transformer_layer_spec": layer}


def _projector_submodules() -> MLPSubmodules:
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def padded_vocab_size(vocab_size: int, settings: ModelParallelSettings) -> int:
    """Vocabulary rounded up like Megatron's ``--make-vocab-size-divisible-by`` (times TP)."""
    multiple = settings.make_vocab_size_divisible_by * settings.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


class VisionEncoder(MegatronModule):
    """ViT over image tiles / video frames, pixel-shuffle merge, then the MLP projector.

    Input ``[n, patches, channels * patch_px**2]`` (patch rows in raster order), output
    ``[n * tokens_per_item, backbone_hidden]`` (the items' tokens one item after the other).
    """

    def __init__(self, vision: VisionEncoderConfig, backbone: TransformerShape, settings: ModelParallelSettings):
        parallelism = EncoderParallelism.of(settings)
        settings = parallelism.settings
        config = transformer_config(vision.transformer, settings, pipeline_split=False)
        super().__init__(config=config)
        hidden = vision.transformer.hidden_size
        self.grid = vision.tile_px // vision.patch_px
        self.merge = vision.merge_factor
        self.class_tokens = vision.class_tokens
        self.tokens_per_item = vision.output_rows
        self.patch_embedding = torch.nn.Linear(vision.channels * vision.patch_px ** 2, hidden)
        self.class_token = torch.nn.Parameter(torch.randn(vision.class_tokens, hidden) * settings.init_method_std)
        self.position_embedding = torch.nn.Parameter(
            torch.randn(vision.item_tokens, hidden) * settings.init_method_std)
        self.transformer = TransformerBlock(
            config, transformer_layer_spec(settings.transformer_impl, encoder=True), post_layer_norm=True,
            pg_collection=parallelism.pg_collection)
        self.projector = MultimodalProjector(
            _projector_config(vision.projector_ffn_hidden_size, backbone, settings),
            _projector_submodules(), "mlp", input_size=hidden * self.merge ** 2,
            tp_group=parallelism.tp_group)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        n = patches.shape[0]
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype))  # [n, p, h]
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1) + self.position_embedding
        x = self.transformer(x.transpose(0, 1).contiguous(), attention_mask=None)  # [s, n, h]
        x = x[self.class_tokens:].transpose(0, 1)  # [n, p, h], drop the class tokens
        g, m, h = self.grid, self.merge, x.shape[-1]
        x = x.reshape(n, g // m, m, g // m, m, h).permute(0, 1, 3, 2, 4, 5)
        x = x.reshape(n, self.tokens_per_item, m * m * h)  # pixel shuffle: m x m patches per token
        return self.projector(x.transpose(0, 1).contiguous()).transpose(0, 1).reshape(
            n * self.tokens_per_item, -1)


class AudioEncoder(MegatronModule):
    """Whisper-style: two kernel-3 convolutions subsampling mel frames, a transformer, the projector.

    Input ``[n, window_frames, mel_bins]``, output ``[n * tokens_per_item, backbone_hidden]``;
    ``projector_downsample`` consecutive encoder tokens are stacked into one LLM token.
    """

    def __init__(self, audio: AudioEncoderConfig, backbone: TransformerShape, settings: ModelParallelSettings):
        parallelism = EncoderParallelism.of(settings)
        settings = parallelism.settings
        config = transformer_config(audio.transformer, settings, pipeline_split=False)
        super().__init__(config=config)
        hidden = audio.transformer.hidden_size
        second_stride = 2 if audio.conv_stride % 2 == 0 else 1
        self.conv1 = torch.nn.Conv1d(audio.num_mel_bins, hidden, 3, stride=audio.conv_stride // second_stride,
                                     padding=1)
        self.conv2 = torch.nn.Conv1d(hidden, hidden, 3, stride=second_stride, padding=1)
        self.position_embedding = torch.nn.Parameter(
            torch.randn(audio.item_tokens, hidden) * settings.init_method_std)
        self.transformer = TransformerBlock(
            config, transformer_layer_spec(settings.transformer_impl, encoder=True), post_layer_norm=True,
            pg_collection=parallelism.pg_collection)
        self.downsample = audio.projector_downsample
        self.tokens_per_item = audio.output_rows
        self.projector = MultimodalProjector(
            _projector_config(audio.projector_ffn_hidden_size, backbone, settings),
            _projector_submodules(), "mlp", input_size=hidden * self.downsample,
            tp_group=parallelism.tp_group)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        n = mel.shape[0]
        x = mel.to(self.conv1.weight.dtype).transpose(1, 2)  # [n, mel, frames]
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))  # [n, h, tokens]
        x = x.transpose(1, 2) + self.position_embedding  # [n, t, h]
        x = self.transformer(x.transpose(0, 1).contiguous(), attention_mask=None).transpose(0, 1)
        x = x.reshape(n, self.tokens_per_item, self.downsample * x.shape[-1])
        return self.projector(x.transpose(0, 1).contiguous()).transpose(0, 1).reshape(
            n * self.tokens_per_item, -1)


ENCODER_MODULES = {VisionEncoderConfig: VisionEncoder, AudioEncoderConfig: AudioEncoder}


class MLLMModel(MegatronModule):
    """Encoders (first pipeline stage only) + the backbone; ``config`` is the backbone's.

    ``vp_stage``: which model chunk of this pipeline rank this is, with virtual pipeline stages (the
    encoders go to chunk 0 of the first stage). ``encoders``: whether this chunk holds the encoders (default:
    on the first stage; True on every stage for post-balancing's encoders on every stage). On the last pipeline stage :meth:`forward` returns the
    per-token loss ``[b, s]`` when labels are given (logits otherwise); on other stages the hidden states
    sent to the next stage.
    """

    def __init__(self, model_config: MLLMConfig, settings: ModelParallelSettings, max_sequence_length: int,
                 pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                 vp_stage: Optional[int] = None, encoders: Optional[bool] = None):
        backbone_shape = model_config.backbone.transformer
        config = transformer_config(backbone_shape, settings, pipeline_split=True, hybrid=HYBRID_BACKBONE)
        super().__init__(config=config)
        self.model_type = ModelType.encoder_or_decoder  # read by megatron-core's schedules
        chunk = {"ignore_virtual": vp_stage is None, "vp_stage": vp_stage}
        if pre_process is None:
            pre_process = parallel_state.is_pipeline_first_stage(**chunk)
        if post_process is None:
            post_process = parallel_state.is_pipeline_last_stage(**chunk)
        self.pre_process, self.post_process = pre_process, post_process
        self.transformer_impl = settings.transformer_impl
        self.sharded_parameters = settings.sharded_parameters
        self.spec = batch_spec(model_config, max_sequence_length)  # checks the config's item shapes
        self.encoders = torch.nn.ModuleDict()  # phase name -> encoder, on the first pipeline stage
        if pre_process if encoders is None else encoders:
            # Off the first stage, the encoders get the first stage's parameters later (post-balancing's
            # share_encoders): built without drawing from the RNGs, so the backbone's initialisation is the same
            # as without them.
            rng = None if pre_process else RngStates.capture(
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
            for name, encoder in model_config.encoders.items():
                self.encoders[name] = ENCODER_MODULES[type(encoder)](encoder, backbone_shape, settings)
            if rng is not None:
                rng.restore()
        backbone = dict(
            config=config,
            vocab_size=padded_vocab_size(backbone_shape.vocab_size, settings),
            max_sequence_length=model_config.backbone.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not model_config.backbone.untie_embeddings_and_output_weights,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
        layers = backbone_spec(settings.transformer_impl, backbone_shape, config, vp_stage)
        self.backbone = (HybridModel if HYBRID_BACKBONE else GPTModel)(**layers, **backbone)

    def set_input_tensor(self, input_tensor) -> None:
        self.backbone.set_input_tensor(input_tensor)

    @property
    def pg_collection(self):
        """The backbone's process groups (megatron.training's ``train()`` reads them off the model)."""
        return self.backbone.pg_collection

    # finalize_model_grads syncs tied input/output embeddings across pipeline stages through these.
    @property
    def share_embeddings_and_output_weights(self) -> bool:
        return self.backbone.share_embeddings_and_output_weights

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.backbone.shared_embedding_or_output_weight()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's distributed checkpoint of this chunk (megatron.training's ``--save``). Encoders off the first
        pipeline stage (``--orch-encoder-ranks all``: every stage's hold the first stage's parameters) are marked
        replicas of the first stage's, as megatron-core marks a tied output layer: one key, written once, read on
        every stage."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.encoders and not self.pre_process:
            for key, value in state.items():
                if key.startswith(f"{prefix}encoders."):
                    value.replica_id = (1, *value.replica_id[1:]) if isinstance(value.replica_id, tuple) else 1
        return state

    def phase_encoders(self) -> Dict[str, torch.nn.Module]:
        """The encoders by phase name (none off the first pipeline stage)."""
        return dict(self.encoders)

    def encode(self, phase: str, items: torch.Tensor) -> torch.Tensor:
        """Items ``[n, *item_shape]`` of encoder ``phase`` -> projected embeddings ``[n * tokens_per_item, h]``."""
        if phase not in self.encoders:
            raise RuntimeError(f"encoding {phase}: this model chunk holds no {phase} encoder (the encoders are on "
                               "the first pipeline stage, on every stage with --orch-encoder-ranks all)")
        if items.shape[0] == 0:
            return self._no_embeddings(items.device)
        return self.encoders[phase](items)

    def _idle_encoder_output(self, phase: str, device: torch.device) -> torch.Tensor:
        """Encoder ``phase`` over one zero item: with sharded parameters a micro-batch without items of a phase
        still runs its encoder (gathering its parameters is a collective of the DP group)."""
        shape = next(i.item_shape for i in self.spec.inputs if i.phase == phase)
        return self.encoders[phase](torch.zeros(1, *shape, device=device))

    def _no_embeddings(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(0, self.config.hidden_size, dtype=self.config.params_dtype, device=device)

    def embed(self, batch: MicroBatch, embeds: Mapping[str, torch.Tensor],
              shard: Optional[SequenceShard] = None) -> torch.Tensor:
        """Backbone input ``[s, b, h]``: token embeddings with each phase's embeddings at its placeholders
        (found at collate time: ``batch.placeholders``, so nothing here waits for the device).

        With a ``shard`` (sequence or context parallelism) the embeddings are those of this rank's part of
        the sequence, and each encoder row goes where its placeholder lands in it (one spare row takes those
        held by other ranks, then is dropped); under sequence parallelism each TP rank holds other rows of
        the encoder outputs, whose gradients are summed over the TP group on the way back."""
        tokens, positions = (batch.tokens, batch.position_ids) if shard is None else (shard.tokens, shard.position_ids)
        embeddings = self.backbone.embedding(input_ids=tokens, position_ids=positions)  # [s, b, h]
        if shard is not None:
            embeddings = torch.cat([embeddings, embeddings.new_zeros(1, *embeddings.shape[1:])])
        for encoder_input in self.spec.inputs:
            name = encoder_input.phase
            values = embeds.get(name, self._no_embeddings(batch.tokens.device))
            rows, cols = batch.placeholders[name]  # example, then position
            if rows.numel() != values.shape[0]:
                raise ValueError(f"{rows.numel()} {name} placeholder tokens in the micro-batch but "
                                 f"{values.shape[0]} {name} embeddings")
            if shard is not None:
                cols, rows = shard.placeholders[name]  # slot in this rank's part, row
                if self.config.sequence_parallel:
                    values = tensor_parallel.copy_to_tensor_model_parallel_region(values)
            if rows.numel():
                embeddings = embeddings.index_put((cols, rows), values.to(embeddings.dtype))
        return embeddings if shard is None else embeddings[:-1]

    def forward(self, batch: MicroBatch, embeds: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
        """The backbone over ``batch`` (on the model's device) with each encoder phase's embeddings at
        its placeholders (first stage): ``embeds`` from post-balancing's encoder phases, else the
        encoders run over the batch's own items here.

        Right-padded rows attend causally; a packed row (``batch.cu_seqlens``) goes to the backbone in
        Megatron's THD layout (:meth:`MicroBatch.packed_seq_params`), each example attending causally to
        itself: no mask is built. ``local``: :func:`~megatron_orch.mllm.attention.packed_attention`;
        ``transformer_engine``: megatron-core's ``TEDotProductAttention`` (TE's THD kernels, causal
        becoming ``padding_causal``), with the padding tail as one more sequence.

        With sequence or context parallelism every rank of the replica gets the whole micro-batch and runs
        its part of the sequence (:meth:`SequenceLayout.shard`); the per-token loss is that part's.
        """
        tail_as_sequence = self.transformer_impl == "transformer_engine"
        layout = SequenceLayout.of_model(self.config)
        shard = None if layout.is_whole else layout.shard(batch, self.spec.pad_token_id, tail_as_sequence)
        decoder_input = None
        if self.pre_process:
            idle = []
            if embeds is None:  # the encoders in the config's order, on every rank the same with sharded parameters
                embeds = {}
                for name in self.encoders:
                    items = batch.items.get(name)
                    if self.sharded_parameters and (items is None or items.shape[0] == 0):
                        idle.append(self._idle_encoder_output(name, batch.tokens.device))
                    elif items is not None:
                        embeds[name] = self.encode(name, items)
            decoder_input = self.embed(batch, embeds, shard)
            for output in idle:  # joins the graph with a zero gradient: its backward's collectives run too
                decoder_input = decoder_input + 0.0 * output.sum()
        if shard is None:
            return self.backbone(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None,
                                 decoder_input=decoder_input, labels=batch.labels,
                                 packed_seq_params=batch.packed_seq_params(tail_as_sequence=tail_as_sequence))
        return self.backbone(input_ids=shard.tokens, position_ids=shard.position_ids, attention_mask=None,
                             decoder_input=decoder_input, labels=shard.labels,
                             packed_seq_params=shard.packed_seq_params)
