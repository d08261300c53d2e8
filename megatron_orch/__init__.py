"""megatron-orch: per-phase batch post-balancing for multimodal LLM training on Megatron.

Layers (imports only go downward): planning without torch, ``balance`` -> ``orchestrator``; moving data,
``comm``; then ``megatron`` (the hook a Megatron-LM user imports), ``mllm`` (this project's model and
data), ``trainer`` (the compact megatron-core trainer); entry points ``pretrain_mllm.py`` and ``scripts/``.
``bench`` sits beside them and calls what training calls.
"""

__version__ = "0.1.0"
