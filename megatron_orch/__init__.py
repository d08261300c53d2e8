"""megatron-orch: per-phase batch post-balancing for multimodal LLM training on Megatron.

Layers (imports only go downward): planning without torch, ``balance`` -> ``orchestrator``; moving data,
``comm``; then ``megatron`` (the hook a Megatron-LM user imports), ``mllm`` (this project's model and
data), ``trainer`` (the compact megatron-core trainer); entry points ``pretrain_mllm.py`` and ``scripts/``.
``bench`` sits beside them and calls what training calls.
"""

__version__ = "0.1.0"


#: Warnings of megatron-core (and of the libraries it drives) that leave our user nothing to act on, as
#: (message regex, category[, module regex]), without colons (pytest reads them too): the GPU-only extras
#: (Transformer Engine, Apex) are absent and their local fallbacks are used (one warning per module that
#: looks); a CUDA-graph default it sets itself; with the distributed optimizer, torch.distributed functions it
#: still calls and its reads of .grad of the fp32 parameter shards (views: it finds None and uses main_grad);
#: its own TransformerLayer building an MLP without the ffn_hidden_size it later requires; at import,
#: torch.jit.script_method in its fused kernels and a note on its own inference imports; Energon's loader
#: asking for pinned memory on a machine without an accelerator; megatron-core 0.19's
#: RowParallelLinear.forward calling its linear function without the tp_group it holds (every forward).
MEGATRON_CORE_NOISE = (
    (r".*(Transformer Engine|Apex).*not installed", Warning),
    (r"full scope is deprecated", UserWarning),
    (r"`torch\.distributed\.\w+` is deprecated", Warning),
    (r"The \.grad attribute of a Tensor that is not a leaf Tensor", UserWarning),
    (r"MLP requires ffn_hidden_size, but it was not provided", DeprecationWarning),
    (r"`torch\.jit\.script_method` is deprecated", DeprecationWarning),
    (r"The following imports from `dynamic_context\.py` will be removed", DeprecationWarning),
    (r"'pin_memory' argument is set as true but no accelerator is found", UserWarning),
    (r"Warning. tp_group is None", DeprecationWarning, r"megatron\.core\.tensor_parallel\.layers"),
)


def quiet_megatron_core_warnings() -> None:
    """Ignore :data:`MEGATRON_CORE_NOISE`. The entry points call it (``pretrain_mllm.py``, the benchmarks)
    before megatron-core is imported, and the test suite applies the same list; importing the package does
    not, so a Megatron-LM user's own run keeps every warning."""
    import warnings
    for message, category, *module in MEGATRON_CORE_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module[0] if module else "")
