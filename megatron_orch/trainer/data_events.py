"""What a loader reports to the trainer about its samples, and the trainer's limit on bad examples.

A training data iterator may be a :class:`DataEvents`: it then records a :class:`DataEvent` for each
sample position whose example was bad and skipped (replaced by another) or whose answer was truncated;
the trainer takes the events of the samples it has trained after each step, gathers them over the DP
group, prints them from the logging rank, counts them in the iteration lines and raises
:class:`TooManyBadExamplesError` once more than ``--max-bad-examples`` were skipped. Plain Python: a
loader imports it without torch.
"""
from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass
from typing import List, Optional, Sequence


class TooManyBadExamplesError(ValueError):
    """More bad examples were skipped than ``--max-bad-examples`` allows."""


@dataclass(frozen=True)
class DataEvent:
    """Something the user should read about one sample position: a bad example skipped (``replacement``
    says where the position's example came from instead) or an answer truncated."""

    position: int
    skipped: bool
    message: str  # "manifest.jsonl:7: <reason>"
    replacement: Optional[str] = None


class DataEvents:
    """What one DP rank's loader reports to the trainer: :class:`DataEvent` objects by sample position,
    collected as its examples are read (post-balancing reads ahead on a thread of its own) and taken once
    those samples are trained (:meth:`take_events`), and its state for a checkpoint (:meth:`loader_state`).

    The trainer also asks it :meth:`epoch_note` once before training and :meth:`describe_examples` (those
    whose own loss is not finite) or :meth:`describe_samples` (all of the step's) for the examples of a step
    whose loss or gradient norm is not finite."""

    def __init__(self):
        self.events: List[DataEvent] = []
        self._events_lock = threading.Lock()

    def _report(self, event: DataEvent) -> None:
        with self._events_lock:
            self.events.append(event)

    def take_events(self, before: int) -> List[DataEvent]:
        """The events of positions below ``before`` (the samples trained so far), removed from :attr:`events`."""
        with self._events_lock:
            taken = [e for e in self.events if e.position < before]
            self.events = [e for e in self.events if e.position >= before]
        return taken

    def loader_state(self, consumed_samples: int) -> Optional[dict]:
        """What a checkpoint saves of the loader after ``consumed_samples`` (the samples trained so far);
        None: nothing, a resumed run restarts from its consumed-sample count (a loader whose order is a
        function of the sample position)."""
        return None

    def epoch_note(self) -> Optional[str]:
        """A line the user should read before training (e.g. the run is longer than the dataset); None: none."""
        return None

    def describe_samples(self, positions: range, replaced: dict, shown: int = 8) -> str:
        """Where the samples at ``positions`` come from (``replaced``: where a skipped position's came from)."""
        return f"samples {positions.start}..{positions.stop - 1}"

    def describe_examples(self, sample_ids: Sequence[int], shown: int = 8) -> str:
        """Where the examples of ``sample_ids`` (``Example.sample_index``, as this loader sets it) come from."""
        more = f" (and {len(sample_ids) - shown} more)" if len(sample_ids) > shown else ""
        return "samples " + ", ".join(str(i) for i in sample_ids[:shown]) + more


def add_max_bad_examples_arg(group) -> None:
    """``--max-bad-examples`` (read by the trainer for a loader that is a :class:`DataEvents`), in the
    argument group of the task's data flags."""
    group.add_argument("--max-bad-examples", type=int, default=0,
                       help="bad examples (a missing or unreadable file, a limit exceeded, ...) skipped before the "
                            "run stops; each is replaced by a seeded draw of another example and reported. 0: the "
                            "first bad example ends the run")


def max_bad_examples(args: argparse.Namespace) -> int:
    """``--max-bad-examples``, 0 (the first bad example ends the run) where the task has no such flag."""
    return getattr(args, "max_bad_examples", 0)
