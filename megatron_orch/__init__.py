"""megatron-orch: per-phase batch post-balancing for multimodal LLM training on Megatron.

Layers (imports only go downward): planning without torch, ``balance`` -> ``orchestrator``; moving data,
``comm``; then ``megatron`` (the hook a Megatron-LM user imports), ``mllm`` (this project's model and
data), ``trainer`` (the compact megatron-core trainer); entry points ``pretrain_mllm.py`` and ``scripts/``.
``bench`` sits beside them and calls what training calls.
"""

__version__ = "0.1.0"


def quiet_megatron_core_warnings() -> None:
    """Ignore megatron-core's warnings that leave nothing to act on: the GPU-only extras (Transformer Engine,
    Apex) are absent and their local fallbacks are used (one warning per module that looks), a CUDA-graph
    default it sets itself, and, with the distributed optimizer, torch.distributed functions it still calls
    and its reads of .grad of the fp32 parameter shards (views: it finds None and uses main_grad). The entry
    points call it (``pretrain_mllm.py``, the benchmarks) before megatron-core is imported; importing the
    package does not, so a Megatron-LM user's own run keeps every warning."""
    import warnings
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    warnings.filterwarnings("ignore", message=r"full scope is deprecated")
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")
