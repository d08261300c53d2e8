"""Agree on per-rank failures before the next collective: every rank raises, with the failing rank's message.

A rank that fails on its own (a loader error, an unreadable checkpoint file) and simply raises leaves
its peers waiting in their next collective until the timeout, and the peers' errors ("Connection closed
by peer", a timeout) say nothing about the cause. Instead every rank passes its outcome (``None`` or the
exception it caught) to :func:`raise_if_any_rank_failed` at the same point of the program: one
fixed-size collective when nothing failed, a second one carrying the messages when something did.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megatron_orch.comm.gather import all_gather_to_host

MAX_MESSAGE_BYTES = 4096
_SHOWN_RANKS = 4


class PeerFailedError(RuntimeError):
    """Another rank failed; ``failures`` maps its global rank to its message."""

    def __init__(self, what: str, failures: Dict[int, str]):
        self.failures = failures
        shown = "; ".join(f"rank {rank}: {message}" for rank, message in list(failures.items())[:_SHOWN_RANKS])
        more = f" (and {len(failures) - _SHOWN_RANKS} more ranks)" if len(failures) > _SHOWN_RANKS else ""
        super().__init__(f"{what} failed on rank(s) {sorted(failures)[:64]}: {shown}{more}")


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def gather_failures(error: Optional[BaseException], group=None) -> Dict[int, str]:
    """``{global rank: message}`` of every rank of ``group`` that passed an error (same on every rank)."""
    encoded = b"" if error is None else describe(error).encode("utf-8")[:MAX_MESSAGE_BYTES]
    failed = error is not None
    flags = all_gather_to_host(torch.tensor([int(failed), len(encoded)], dtype=torch.int64), group)
    if not flags[:, 0].any():
        return {}
    buffer = torch.zeros(int(flags[:, 1].max()), dtype=torch.uint8)
    if encoded:
        buffer[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    rows = all_gather_to_host(buffer, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return {rank: bytes(rows[i, :int(flags[i, 1])].tolist()).decode("utf-8", errors="replace")
            for i, rank in enumerate(ranks) if flags[i, 0]}


def raise_if_any_rank_failed(error: Optional[BaseException], group=None, what: str = "a step") -> None:
    """Call on every rank of ``group`` at the same point; returns only if no rank passed an error.

    A rank that failed re-raises its own ``error``; the others raise :class:`PeerFailedError` quoting
    the failing ranks' messages, so every rank's log says what went wrong and where.
    """
    failures = gather_failures(error, group)
    if not failures:
        return
    if error is not None:
        raise error
    raise PeerFailedError(what, failures)
