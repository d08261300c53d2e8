"""The compact megatron-core trainer, for machines without a Megatron-LM checkout and for any model of the
balancing contract, handed to it as a task (``task``: :class:`~megatron_orch.trainer.task.TrainingTask`):
the loop (``loop``), Megatron-LM's flag names (``arguments``), iteration lines and TensorBoard
(``training_log``), the loaders' reports of bad examples (``data_events``), checkpoints (``checkpointing``)
and the CPU harness (``cpu_harness``: the only module that redirects megatron-core's CUDA-only calls; CPU
runs and tests only).

The public API (what docs/own_model.md shows; its signatures are pinned by tests/test_public_api.py, and a
change keeps the old call working for a release with a DeprecationWarning naming the new one) is
:data:`PUBLIC`: each name, importable from its module.
"""

#: module -> the public names it defines
PUBLIC = {
    "megatron_orch.trainer.task": ("TrainingTask", "ModelSummary"),
    "megatron_orch.trainer.arguments": ("parse_args", "parse_args_or_exit", "check_data_or_exit", "ArgumentError"),
    "megatron_orch.trainer.loop": ("pretrain",),
}
