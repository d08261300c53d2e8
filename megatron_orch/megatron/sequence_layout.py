"""Which part of a micro-batch's sequence one rank of a model replica computes under context parallelism (CP)
and sequence parallelism (SP), laid out as megatron-core lays it out.

Post-balancing moves whole examples between DP ranks; every rank of one DP replica (its TP, CP and PP
peers) receives the same micro-batch. Inside the replica the sequence is split as Megatron splits it:

* **CP** (``--context-parallel-size C``): a padded row is cut into ``2C`` equal chunks and CP rank ``r`` keeps
  chunks ``r`` and ``2C-1-r`` (the causal load balance of ``megatron.core.utils.get_batch_on_this_cp_rank``);
  a packed (THD) row is cut the same way sequence by sequence, each sequence padded to a multiple of ``2C``
  (TE's ``thd_get_partitioned_indices``, as megatron-core's THD batches are partitioned). The padding is pad
  tokens with loss mask 0: at the end of a padded row; after each example of a packed row, inside its sequence
  (as Megatron-LM's SFT packing pads for CP), and a padding tail after the last example is one more sequence.
  Causal attention keeps every real token's output what it is without the padding.
* **SP** (``--sequence-parallel``, TP ``t``): the CP-local sequence is split into ``t`` equal chunks where
  megatron-core scatters it to the sequence-parallel region (after the backbone's embedding); a row is
  padded to a multiple of ``t`` (``2Ct`` with CP, as megatron-core's multimodal models pad).

:meth:`SequenceLayout.shard` gives one rank's part (:class:`SequenceShard`): the CP-local token ids, labels,
loss mask and position ids, the THD parameters of a packed row, and where each encoder placeholder lands in
the rank's SP chunk, so that encoder outputs are spliced in the layout the backbone runs in. Every index is
built on the host from the batch's shape and ``host_cu_seqlens`` (no read of the device) and cached.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_orch.megatron.batch import MicroBatch, PackedRowParams


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """One rank's part of a micro-batch (:meth:`SequenceLayout.shard`).

    ``tokens``/``labels``/``loss_mask``/``position_ids``: ``[rows, T / C]``, the CP-local sequence (SP splits it
    after the embedding; the loss is computed on the whole CP-local sequence, as megatron-core does).
    ``placeholders[phase]``: ``(slot, row)`` of each of the phase's placeholders, in the order its encoder outputs
    fill them, in this rank's SP chunk ``[T / C / t, rows]`` of the backbone input; ``slot == chunk_length``
    (one past the chunk) for a placeholder this rank does not hold. ``packed_seq_params``: THD parameters of a
    packed row over the whole (padded) row, as the kernels of every CP rank take them; None for padded rows.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    placeholders: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
    chunk_length: int
    packed_seq_params: Optional[PackedRowParams]


@dataclass(frozen=True)
class SequenceLayout:
    """How a rank holds a sequence: CP rank ``context_parallel_rank`` of ``context_parallel_size``, SP chunk
    ``sequence_parallel_rank`` of ``sequence_parallel_size`` (the TP size with ``--sequence-parallel``, else 1)."""

    context_parallel_size: int = 1
    context_parallel_rank: int = 0
    sequence_parallel_size: int = 1
    sequence_parallel_rank: int = 0

    def __post_init__(self):
        for size, rank in ((self.context_parallel_size, self.context_parallel_rank),
                           (self.sequence_parallel_size, self.sequence_parallel_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"SequenceLayout: rank {rank} of size {size}")

    @classmethod
    def of_model(cls, config) -> "SequenceLayout":
        """This rank's layout for a model of megatron-core ``config`` (its backbone's: CP size, SP, TP size);
        a model without a config runs whole sequences."""
        if config is None:
            return cls()
        cp = config.context_parallel_size
        sp = config.tensor_model_parallel_size if config.sequence_parallel else 1
        return cls(cp, parallel_state.get_context_parallel_rank() if cp > 1 else 0,
                   sp, parallel_state.get_tensor_model_parallel_rank() if sp > 1 else 0)

    @property
    def is_whole(self) -> bool:
        """Whether this rank computes the whole sequence (no CP, no SP)."""
        return self.context_parallel_size == 1 and self.sequence_parallel_size == 1

    @property
    def row_multiple(self) -> int:
        """A row's length is padded to a multiple of this: ``2C`` with CP, times the TP size with SP."""
        cp = self.context_parallel_size
        return (2 * cp if cp > 1 else 1) * self.sequence_parallel_size

    def padded_length(self, num_tokens) -> np.ndarray:
        """Tokens of a sequence of ``num_tokens`` once padded for CP (to a multiple of ``2C``)."""
        multiple = 2 * self.context_parallel_size if self.context_parallel_size > 1 else 1
        return -(-np.asarray(num_tokens, dtype=np.int64) // multiple) * multiple

    def shard(self, batch: MicroBatch, pad_token_id: int = 0, tail_as_sequence: bool = False) -> SequenceShard:
        """This rank's part of ``batch`` (on any device; nothing is read back from it). ``pad_token_id``: the
        token and label of the padding this adds; ``tail_as_sequence``: without CP, a packed row's padding tail
        is one more sequence (Transformer Engine's THD kernels); with CP it always is (it is cut like one)."""
        columns = _columns(batch.tokens.shape[1], batch.host_cu_seqlens if batch.is_packed else None, self)
        device = batch.tokens.device
        source = columns.source.to(device, non_blocking=True)
        real, take = source >= 0, source.clamp(min=0)

        def local(tensor, fill):
            return torch.where(real, tensor[:, take], torch.full((), fill, dtype=tensor.dtype, device=device))

        slot_of_column = columns.slot_of_column.to(device, non_blocking=True)
        placeholders = {phase: (slot_of_column[position[1]], position[0])
                        for phase, position in batch.placeholders.items()}
        params = None
        if batch.is_packed:
            bounds = columns.bounds
            if (tail_as_sequence or self.context_parallel_size > 1) and bounds[-1] < columns.padded_length:
                bounds = (*bounds, columns.padded_length)
            cu_seqlens = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
            longest = max(end - start for start, end in zip(bounds, bounds[1:]))
            padded = cu_seqlens if self.context_parallel_size > 1 else None
            params = PackedRowParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                     cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                                     max_seqlen_q=longest, max_seqlen_kv=longest, host_cu_seqlens=bounds)
        return SequenceShard(tokens=local(batch.tokens, pad_token_id), labels=local(batch.labels, pad_token_id),
                             loss_mask=local(batch.loss_mask, 0), position_ids=local(batch.position_ids, 0),
                             placeholders=placeholders, chunk_length=columns.chunk_length, packed_seq_params=params)

    def padded_rows(self, batch: MicroBatch, pad_token_id: int) -> MicroBatch:
        """``batch`` (padded rows) with its rows padded at the end to a multiple of :attr:`row_multiple`, as
        :meth:`shard` pads them: for a model that shards the whole row itself (megatron-core's MIMO)."""
        if batch.is_packed:
            raise NotImplementedError("padded_rows: a packed row is padded example by example (shard)")
        extra = -batch.tokens.shape[1] % self.row_multiple
        if not extra:
            return batch
        pad = functools.partial(torch.nn.functional.pad, pad=(0, extra))
        return dataclasses.replace(batch, tokens=pad(batch.tokens, value=pad_token_id),
                                   labels=pad(batch.labels, value=pad_token_id), loss_mask=pad(batch.loss_mask, value=0),
                                   position_ids=pad(batch.position_ids, value=0))

    def local_positions(self, sequences) -> np.ndarray:
        """The positions of a padded row this CP rank keeps, given the row's sequences ``(start, end)`` (each a
        multiple of ``2C`` long): chunks ``r`` and ``2C-1-r`` of each, in order."""
        cp, r = self.context_parallel_size, self.context_parallel_rank
        if cp == 1:
            return np.arange(sequences[-1][1] if sequences else 0, dtype=np.int64)
        parts = []
        for start, end in sequences:
            chunk = (end - start) // (2 * cp)
            parts += [np.arange(start + r * chunk, start + (r + 1) * chunk),
                      np.arange(start + (2 * cp - 1 - r) * chunk, start + (2 * cp - r) * chunk)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class _Columns:
    """Where a rank's positions come from, for one row shape (:func:`_columns`)."""

    source: torch.Tensor          # [T / C] int64: the batch column each local position takes, -1 for padding
    slot_of_column: torch.Tensor  # [T_batch] int64: each batch column's slot in this rank's SP chunk, else chunk_length
    chunk_length: int             # T / C / t
    padded_length: int            # T: the whole row once padded
    bounds: Tuple[int, ...]       # packed rows: the (padded) examples' bounds in the padded row


@functools.lru_cache(maxsize=1024)
def _columns(length: int, bounds: Optional[Tuple[int, ...]], layout: SequenceLayout) -> _Columns:
    """:class:`_Columns` of a padded row of ``length`` tokens (``bounds`` None) or a packed row with examples at
    ``bounds`` (a padding tail after the last one), for ``layout``'s rank; host arrays, computed once per shape."""
    multiple = layout.row_multiple
    if bounds is None:
        padded_length = -(-length // multiple) * multiple
        origin = np.arange(padded_length, dtype=np.int64)
        origin[length:] = -1
        sequences, new_bounds = [(0, padded_length)], ()
    else:
        lengths = np.diff(np.asarray(bounds, dtype=np.int64))
        starts = np.concatenate(([0], np.cumsum(layout.padded_length(lengths)))).astype(np.int64)
        tail = length - bounds[-1]
        padded_length = -(-(int(starts[-1]) + tail) // multiple) * multiple
        origin = np.full(padded_length, -1, dtype=np.int64)
        for start, first, count in zip(starts[:-1], bounds, lengths):
            origin[start:start + count] = np.arange(first, first + count)
        origin[starts[-1]:starts[-1] + tail] = np.arange(bounds[-1], length)
        new_bounds = tuple(int(b) for b in starts)
        sequences = list(zip(new_bounds, new_bounds[1:]))
        if new_bounds[-1] < padded_length:
            sequences.append((new_bounds[-1], padded_length))
    positions = layout.local_positions(sequences)
    chunk_length = positions.size // layout.sequence_parallel_size
    local_of_position = np.full(padded_length, -1, dtype=np.int64)
    local_of_position[positions] = np.arange(positions.size)
    position_of_column = np.empty(length, dtype=np.int64)
    placed = np.flatnonzero(origin >= 0)
    position_of_column[origin[placed]] = placed
    local = local_of_position[position_of_column]
    here = (local >= 0) & (local // max(chunk_length, 1) == layout.sequence_parallel_rank)
    slot_of_column = np.where(here, local - layout.sequence_parallel_rank * chunk_length, chunk_length)
    return _Columns(source=torch.from_numpy(origin[positions]), slot_of_column=torch.from_numpy(slot_of_column),
                    chunk_length=chunk_length, padded_length=padded_length, bounds=new_bounds)
