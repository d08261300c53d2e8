"""megatron-orch: per-phase batch post-balancing for multimodal LLM training on Megatron.

Layers (imports only go downward): planning without torch, ``balance`` -> ``orchestrator``; moving data,
``comm``; then ``megatron`` (the hook a Megatron-LM user imports), ``trainer`` (the compact megatron-core
trainer of any model given as a ``TrainingTask``), ``mllm`` (this project's model and data, one such task);
entry points ``pretrain_mllm.py`` and ``scripts/``. ``bench`` sits beside them and calls what training calls.

Glossary (the names in the code follow it):

* **phase**: a part of the model balanced on its own: each encoder in the order it runs, then the backbone
  (the language model). Phases are named by the model (``--orch-phases`` takes the names).
* **example**: one training sample, its text and the items it holds. It keeps its place in the global batch
  wherever it is computed, so the loss and the gradients are those of the unbalanced step.
* **item**: what an encoder phase computes as one unit (an image tile, an audio window); the backbone's item
  is an example's whole sequence.
* **medium**: the stored file or array an example's items are made from (an image, an audio clip).
* **home**: where the data loader put each example and its items (its *home rank*); the *home layout* is the
  unbalanced assignment, what upstream Megatron computes. A plan's figures "before" are the home layout's.
* **bin**: a partitioner's group of items (one per DP rank, or one per micro-batch of a rank); placement maps
  bins to ranks.
* **slot**: an item's position among the items its rank receives under a plan, the order it computes them in.
* **kept / recomputed chunk**: a rank encodes its items in chunks; a kept chunk holds its activations for the
  backward, a recomputed chunk keeps only its outputs and runs its forward again for the backward.
* **upstream**: the same run without post-balancing (megatron-core's or Megatron-LM's own path).
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


#: Log records of the same kind, as (logger, start of the message): torch's note, when megatron-core imports
#: its C++ extension loader, that it finds a CUDA toolkit but no CUDA runtime (a CPU run).
MEGATRON_CORE_LOG_NOISE = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found"),
)


def quiet_megatron_core_warnings() -> None:
    """Ignore :data:`MEGATRON_CORE_NOISE` and :data:`MEGATRON_CORE_LOG_NOISE`. The entry points call it
    (``pretrain_mllm.py``, the data checks, the scripts, the benchmarks) before megatron-core is imported, and the
    test suite applies the same list; importing the package does not, so a Megatron-LM user's own run keeps
    every warning."""
    import logging
    import warnings
    for message, category, *module in MEGATRON_CORE_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module[0] if module else "")
    for name, start in MEGATRON_CORE_LOG_NOISE:
        logging.getLogger(name).addFilter(lambda record, start=start: not str(record.msg).startswith(start))
