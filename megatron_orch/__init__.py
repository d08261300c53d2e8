"""megatron-orch: per-phase batch post-balancing for multimodal LLM training on Megatron.

Layers (imports only go downward): ``balance`` (pure numpy) -> ``comm`` -> ``orchestrator`` ->
``megatron`` -> ``pretrain_mllm.py``.
"""

__version__ = "0.1.0"
