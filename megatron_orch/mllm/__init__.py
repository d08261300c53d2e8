"""This project's multimodal LLM on megatron-core: the model (``model``, ``attention``), its data
(``examples``: the layout of one example; ``synthetic``: the default dataset drawn from real traces;
``manifest``: users' JSONL data; ``data``: sampler and per-rank iterator), the providers that
``megatron.training.pretrain`` and the compact trainer share (``providers``), and the compact trainer's
task (``task``: :data:`~megatron_orch.mllm.task.MLLM_TASK`)."""
