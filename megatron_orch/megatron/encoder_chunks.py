"""One encoder phase of a rank in chunks, with exact recompute: bounded activation memory, the same gradients.

The plan (:class:`~megatron_orch.orchestrator.step_plan.EncoderChunks`) cuts a rank's items of a phase
into chunks of consecutive items and says how many of them keep their activations through the backbone.
:func:`encode_in_chunks` runs the kept chunks with autograd and the others without (only their outputs
stay); :func:`backward_chunk` runs one chunk's backward, recomputing its forward first if it was not kept.

A recomputed chunk draws the dropout masks of its first forward: the RNG states that forward started
from (the CPU generator, the CUDA generator of the chunk's device, every stream of Megatron's RNG
tracker, :class:`RngStates`) are replayed, and the states found before the recompute are put back after
it, so every stream goes on as if nothing had been recomputed. Gradients with dropout then equal those
of keeping the activations (what Megatron's ``tensor_parallel.checkpoint`` does for a transformer layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import tensor_parallel


@dataclass(frozen=True, eq=False)
class RngStates:
    """Every RNG state a forward may draw from: the CPU generator, the CUDA generator of ``device`` (a CUDA
    chunk only) and the streams of Megatron's RNG tracker (its model-parallel dropout streams)."""

    device: torch.device
    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]
    tracker: Dict[str, torch.Tensor]

    @classmethod
    def capture(cls, device: torch.device) -> "RngStates":
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        # a copy of the dict: the tracker replaces its states' entries as streams are used
        return cls(device, torch.get_rng_state(), cuda, dict(tensor_parallel.get_cuda_rng_tracker().get_states()))

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(self.tracker))


@dataclass(eq=False)
class Chunk:
    """Items ``start:stop`` of a rank's items of one phase: the RNG states its forward started from, and its
    outputs with their autograd graph if kept (None: recompute for the backward)."""

    start: int
    stop: int
    rng: RngStates
    outputs: Optional[torch.Tensor] = None

    @property
    def kept(self) -> bool:
        return self.outputs is not None


@dataclass(frozen=True)
class ChunkBounds:
    """Items ``start:stop`` run as one chunk; ``keep``: its activations stay for the backward."""

    start: int
    stop: int
    keep: bool


def chunk_bounds(count: int, chunk_items: int, kept_items: int) -> List[ChunkBounds]:
    """``count`` items in chunks of ``chunk_items`` consecutive items, the first ``kept_items`` items kept."""
    return [ChunkBounds(start, min(start + chunk_items, count), min(start + chunk_items, count) <= kept_items)
            for start in range(0, count, chunk_items)]


def encode_in_chunks(encode: Callable[[torch.Tensor], torch.Tensor], items: torch.Tensor,
                     bounds: Sequence[ChunkBounds], grad: bool) -> Tuple[torch.Tensor, List[Chunk]]:
    """The outputs of ``encode`` over ``items`` (detached, item by item) and its chunks (``bounds``, which
    cover the items in order): the kept ones with autograd (when ``grad``), the others without. No chunks: the
    empty output of ``encode`` over no items."""
    if not bounds:
        with torch.no_grad():
            return encode(items[:0]), []
    outputs, chunks = [], []
    for bound in bounds:
        start, stop = bound.start, bound.stop
        chunk = Chunk(start, stop, RngStates.capture(items.device))
        keep = grad and bound.keep
        with torch.set_grad_enabled(keep):
            out = encode(items[start:stop])
        if keep:
            chunk.outputs = out
        outputs.append(out.detach())
        chunks.append(chunk)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), chunks


def backward_chunk(encode: Callable[[torch.Tensor], torch.Tensor], items: torch.Tensor, chunk: Chunk,
                   grad_rows: torch.Tensor) -> None:
    """Backward of one chunk given the gradient of its output rows; a chunk that was not kept is recomputed
    first, under the RNG states of its forward. Its graph is freed."""
    outputs = chunk.outputs
    if outputs is None:
        found = RngStates.capture(items.device)
        chunk.rng.restore()
        try:
            with torch.enable_grad():
                outputs = encode(items[chunk.start:chunk.stop])
        finally:
            found.restore()
    chunk.outputs = None
    if outputs.requires_grad:
        torch.autograd.backward(outputs, grad_rows.to(outputs.dtype))
