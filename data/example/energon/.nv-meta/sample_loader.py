# MultimodalSample: the .json part is a manifest entry, the other parts are the media it names.
from megatron_orch.mllm.energon import part_filter, sample_loader  # noqa: F401
