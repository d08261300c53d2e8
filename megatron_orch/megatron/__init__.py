"""Megatron integration: the multimodal model, its data, the training entry point and the CPU harness.

``model`` (MLLM on megatron-core), ``batch``/``data`` (example format, datasets, per-rank iterator),
``arguments`` (Megatron-LM flag names), ``providers`` (model / data / forward-step providers shared by
the compact ``trainer`` and ``megatron.training.pretrain``), ``training_log``, ``checkpointing``, and
``cpu_harness`` (the only module that redirects megatron-core's CUDA-only calls; CPU runs only).
"""
