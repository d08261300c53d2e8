"""Pure planning layer: cost models, partitioning, plans and their algebra. No torch.distributed, no Megatron."""
