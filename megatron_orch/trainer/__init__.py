"""The compact megatron-core trainer, for machines without a Megatron-LM checkout: the loop (``loop``),
Megatron-LM's flag names (``arguments``), iteration lines and TensorBoard (``training_log``), checkpoints
(``checkpointing``) and the CPU harness (``cpu_harness``: the only module that redirects megatron-core's
CUDA-only calls; CPU runs and tests only)."""
