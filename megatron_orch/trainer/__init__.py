"""The compact megatron-core trainer, for machines without a Megatron-LM checkout and for any model of the
balancing contract, handed to it as a task (``task``: :class:`~megatron_orch.trainer.task.TrainingTask`):
the loop (``loop``), Megatron-LM's flag names (``arguments``), iteration lines and TensorBoard
(``training_log``), the loaders' reports of bad examples (``data_events``), checkpoints (``checkpointing``)
and the CPU harness (``cpu_harness``: the only module that redirects megatron-core's CUDA-only calls; CPU
runs and tests only)."""
