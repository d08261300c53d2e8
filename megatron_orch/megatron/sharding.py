"""The encoder phases under sharded data parallelism: torch FSDP2 and Megatron-FSDP (Megatron-LM's
``--use-torch-fsdp2``, ``--use-megatron-fsdp``).

A sharded wrapper gathers a module's parameters before it runs (an all-gather per FSDP unit) and
reduce-scatters its gradients after its backward: collectives that every rank of the DP group joins, unit
by unit, in the same order. Post-balancing gives the ranks different numbers of items of a phase, so with
sharded parameters the modality-aware schedule

* runs each phase in the same chunks on every rank (:func:`aligned_chunks`): as many as the rank with
  the most, at least one, each of one kind on every rank (it keeps its activations only where every rank's
  plan keeps that chunk, so no rank holds more than its plan). A rank's chunks past its own items run over
  one zero item each: their rows go nowhere and their gradient is zero, so an encoder without items gets
  its zero gradient through the wrapper's own reduce-scatter;
* runs the encoders' backward phase after phase, in the same order on every rank;
* calls the encoders through the wrapper's root module (:func:`sharded_encode`), whose hooks gather what
  the encoders' own FSDP units do not hold (FSDP2's root unit: an encoder's embeddings and projector) and
  put the module's parameters back in place after an optimizer step (Megatron-FSDP).

Gathered weights are held no longer than upstream holds them: each encoder layer (an FSDP unit) is
gathered for a chunk's forward and freed after it, gathered again for that chunk's backward and freed
after it (FSDP2 ``reshard_after_forward``, Megatron-FSDP ``optim_grads_params``), as upstream does for each
micro-batch; the root unit stays gathered from the first forward of the step to its backward, upstream too.
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import numpy as np
import torch
from megatron.core.distributed.fsdp import mcore_fsdp_adapter
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

from megatron_orch.megatron.encoder_chunks import ChunkBounds

TORCH_FSDP2 = "torch FSDP2"
MEGATRON_FSDP = "Megatron-FSDP"
# Megatron-FSDP's wrapper classes: ``FullyShardedDataParallel`` up to megatron-core 0.19.x; on Megatron-LM main
# (from 2026-08) that name is a factory of the classes ``FullyShardedDataParallelV1`` and ``V2``.
MEGATRON_FSDP_WRAPPERS = tuple(
    wrapper for wrapper in (getattr(mcore_fsdp_adapter, name, None) for name in (
        "FullyShardedDataParallel", "FullyShardedDataParallelV1", "FullyShardedDataParallelV2"))
    if isinstance(wrapper, type))


def sharding_of(model_chunk: torch.nn.Module) -> Optional[str]:
    """Which sharded wrapper holds ``model_chunk`` (a model chunk as Megatron's schedules get it): None for
    Megatron DDP or no wrapper."""
    module = model_chunk
    while module is not None:
        if isinstance(module, TorchFullyShardedDataParallel):
            return TORCH_FSDP2
        if isinstance(module, MEGATRON_FSDP_WRAPPERS):
            return MEGATRON_FSDP
        module = getattr(module, "module", None)
    return None


def sharded_encode(model_chunk: torch.nn.Module, encode: Callable[[torch.Tensor], torch.Tensor]
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """``encode`` called through the sharded wrapper's root module: for the duration of the call the root's
    ``forward`` is ``encode``, so the wrapper's hooks run around it as around a forward of the model."""
    wrapper = model_chunk
    while not isinstance(wrapper, (TorchFullyShardedDataParallel, *MEGATRON_FSDP_WRAPPERS)):
        wrapper = wrapper.module
    # FSDP2: the root unit is the wrapped module. Megatron-FSDP: the module inside ``MegatronFSDP``, whose
    # ``forward`` puts the module's parameters back in place (after an optimizer step), then calls the module:
    # through its hooks from megatron-core 0.17 on, ``module.forward`` past them in 0.16.1, where the root's
    # pre-backward hook (it reduces the gradients of the parameters a backward does not reach) is then left to
    # a backbone layer's output and never runs for an encoder chunk. Calling the root itself runs it on every
    # release.
    megatron_fsdp = None if isinstance(wrapper, TorchFullyShardedDataParallel) else wrapper.module
    root = wrapper.module if megatron_fsdp is None else megatron_fsdp.module

    def call(items: torch.Tensor) -> torch.Tensor:
        if megatron_fsdp is not None:
            megatron_fsdp._replace_param_with_raw_if_needed()  # what MegatronFSDP.forward does first
        with _forward_as(root, encode):
            return root(items)

    return call


@contextlib.contextmanager
def _forward_as(module: torch.nn.Module, forward: Callable):
    module.forward = forward  # an instance attribute: nn.Module.__call__ runs it between the module's hooks
    try:
        yield
    finally:
        del module.forward


def aligned_chunks(counts: np.ndarray, chunk_items: int, kept: np.ndarray, rank: int) -> List[ChunkBounds]:
    """Rank ``rank``'s chunks of one phase when every rank runs the same chunks: ``counts[r]`` items on rank
    r, chunks of ``chunk_items``, the first ``kept[r]`` items of rank r kept (whole chunks, or all). Chunks
    past this rank's ``counts[rank]`` items cover one item each, the zero items :func:`pad_items` appends."""
    counts, kept = np.asarray(counts, dtype=np.int64), np.asarray(kept, dtype=np.int64)
    chunks = -(-counts // chunk_items)
    kept_chunks = -(-np.minimum(kept, counts) // chunk_items)
    own, count = int(chunks[rank]), int(counts[rank])
    bounds = []
    for j in range(max(1, int(chunks.max(initial=0)))):
        keep = bool(np.all(kept_chunks[chunks > j] > j))  # every rank with a real chunk here keeps it
        start = j * chunk_items if j < own else count + j - own
        bounds.append(ChunkBounds(start, min(start + chunk_items, count) if j < own else start + 1, keep))
    return bounds


def pad_items(items: torch.Tensor, bounds: List[ChunkBounds]) -> torch.Tensor:
    """``items`` with the zero items that ``bounds`` reaches past them."""
    missing = max((b.stop for b in bounds), default=0) - items.shape[0]
    if missing <= 0:
        return items
    return torch.cat([items, items.new_zeros(missing, *items.shape[1:])])
