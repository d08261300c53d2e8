"""The hook a Megatron-LM user imports: post-balancing around Megatron's own training loop.

* :class:`PostBalancingDataIterator` wraps the training data iterator: per global batch it gathers
  sizes over the DP group, plans every phase and moves the data, and yields one :class:`BalancedStep`;
* :class:`ModalityAwareSchedule` wraps ``get_forward_backward_func()``: encoders over the rank's
  balanced items, their outputs to the backbone rank of their example, Megatron's schedule for the
  backbone, then the encoders' backward before gradients are finalised;
* the ``--orch-*`` flags (:func:`add_orch_args`, Megatron's ``extra_args_provider`` convention) and
  the config they build (:func:`orch_config_from_args`).

The batch contract (:mod:`megatron_orch.megatron.batch`): the wrapped iterator yields
:class:`MicroBatch` objects, ``micro_batch_size`` examples each, whose :meth:`MicroBatch.examples`
give :class:`Example` objects on the host: int64 ``tokens``/``labels`` and a float ``loss_mask`` of one
length, image tiles / video frames ``[n_v, patches, patch_dim]`` and audio windows ``[n_a, frames,
mel_bins]`` (float), with ``vision_llm_tokens_per_item`` :data:`IMAGE_TOKEN_ID` placeholders per vision
item and ``audio_llm_tokens_per_item`` :data:`AUDIO_TOKEN_ID` placeholders per audio window in the
tokens, in item order (:class:`ExampleShape` says the numbers and checks each example). The model must
offer ``encode_vision(items)`` / ``encode_audio(items)`` returning ``tokens_per_item`` rows per item,
hold the encoders as ``vision_encoder`` / ``audio_encoder`` modules (an encoder without items on a rank
in a step gets zero gradients through them: Megatron DDP's ``--overlap-grad-reduce`` needs every
parameter to report each step), and take ``vision_embeds`` / ``audio_embeds`` in place of raw inputs in
its forward. Inside Megatron-LM's own loop: :mod:`megatron_orch.megatron.megatron_lm`.
"""
import importlib

# Names are imported on first use (PEP 562), so that ``megatron_orch.megatron.orch_arguments`` (the
# --orch-* flags) imports without torch: pretrain_mllm.py checks its command line before torch loads.
_EXPORTS = {
    "megatron_orch.megatron.batch": ("AUDIO_TOKEN_ID", "IMAGE_TOKEN_ID", "Example", "ExampleShape", "MicroBatch",
                                     "collate", "collate_packed"),
    "megatron_orch.megatron.orch_arguments": ("add_orch_args", "orch_config_from_args"),
    "megatron_orch.megatron.post_balancing": ("BalancedMicroBatch", "BalancedStep", "PostBalancingDataIterator"),
    "megatron_orch.megatron.schedule": ("ModalityAwareSchedule",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
