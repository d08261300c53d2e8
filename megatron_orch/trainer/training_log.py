"""Per-step load counting, Megatron-style iteration lines and TensorBoard scalars.

The iteration line follows Megatron-LM's ``training_log`` (`` iteration        3/      20 |
consumed samples: ... | lm loss: 1.234567E+00 | ...``) and adds what makes the per-phase imbalance
across data-parallel ranks visible: tokens/s, and for each phase the per-rank load and time as
max/mean over the DP group (a ratio of 1.00 is perfect balance; every synchronous step runs at the
max).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import torch

from megatron_orch.balance.workload import ModelPhases
from megatron_orch.comm.gather import all_gather_to_host
from megatron_orch.megatron.post_balancing import BalancedStep, ShadowStep
from megatron_orch.trainer.data_events import DataEvent

# Timers of the whole step (Megatron timer names, recorded by megatron-core's schedule /
# finalize_model_grads and the trainer), shown after each encoder phase's forward timer.
STEP_TIMERS = ("forward-backward", "forward-compute", "backward-compute", "all-grads-sync", "optimizer")
# Post-balancing figures per step besides each phase's imbalance: bytes moved, the modeled step time saved,
# this rank's planning / dispatch times, and whether the plan was applied (0: shadow mode, planned only).
STEP_FIELDS = ("intra-node MB", "inter-node MB", "peers intra-node", "peers inter-node", "step saved %", "plan ms",
               "plan exposed ms", "dispatch ms", "applied")
# A rank's distinct peers over the run so far (what post-balancing's communicator keeps connected: NCCL keeps a
# peer's buffers for the communicator's life), on its node and across nodes: the latest step's, not summed; the
# log shows the most of any rank (max over the DP group).
RUN_PEER_FIELDS = ("run peers intra-node", "run peers inter-node")


def load_fields(phases: ModelPhases) -> Tuple[str, ...]:
    """Per-rank load of each phase, counted from the micro-batches a rank consumed: every encoder phase's
    items, then the backbone phase's tokens."""
    return tuple(f"{name} items" for name in phases.encoder_names) + (f"{phases.backbone.name} tokens",)


def phase_timers(phases: ModelPhases) -> Tuple[str, ...]:
    """Timers shown per phase: each encoder's forward (recorded by forward hooks), then the step's."""
    return tuple(f"{name}-encoder-forward" for name in phases.encoder_names) + STEP_TIMERS


def post_balancing_fields(phases: ModelPhases) -> Tuple[str, ...]:
    """Post-balancing figures per step: each phase's modeled-cost max/mean over DP before (as loaded) and
    after (as planned), then :data:`STEP_FIELDS` (the MB and the step time saved are ``StepPlan.report``'s:
    every transfer of the step, raw inputs, text, embeddings forward and their gradients back; in shadow
    mode what the plan would move and save)."""
    return tuple(f"{name} {what}" for name in phases.names for what in ("before", "after")) + STEP_FIELDS


class LoadMeter:
    """Wraps the training data iterator and counts each phase's load of what this rank computes.

    Without post-balancing the iterator yields micro-batches (the loader's assignment); with it,
    one :class:`BalancedStep` per step, whose plan says what this rank encodes and which examples
    its backbone runs, and whose statistics say how unbalanced the step was before; in shadow mode one
    :class:`ShadowStep`, whose micro-batches are the loader's and whose plan says what balancing would do.
    """

    def __init__(self, iterator: Iterator, phases: ModelPhases):
        self.iterator = iterator
        self.phases = phases
        self.fields = post_balancing_fields(phases)
        self.counts = torch.zeros(len(load_fields(phases)), dtype=torch.float64)
        self.post_balancing: Optional[torch.Tensor] = None
        self.encoded: Optional[torch.Tensor] = None  # items of each encoder phase this rank encoded (balanced)
        self.run_peers: Optional[Tuple[int, int]] = None  # RUN_PEER_FIELDS after the latest step

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.iterator)
        if isinstance(item, BalancedStep):
            plan, rank = item.plan, item.rank
            mine = plan.examples_backbone.rank == rank
            self.counts += torch.tensor([*(item.encoded(phase).counts()[item.encoding_rank()]
                                           for phase in self.phases.encoder_names),
                                         float(item.num_tokens[mine].sum())], dtype=torch.float64)
            encoded = torch.tensor([float(item.inputs[phase].shape[0]) if phase in item.inputs else 0.0
                                    for phase in self.phases.encoder_names], dtype=torch.float64)
            self.encoded = encoded if self.encoded is None else self.encoded + encoded
        elif isinstance(item, ShadowStep):
            for microbatch in item.microbatches:
                self._count(microbatch)
        else:
            self._count(item)
        if isinstance(item, (BalancedStep, ShadowStep)):
            figures = dict(item.plan.report(), **{"plan ms": item.timings["plan"] * 1e3,
                                                  "plan exposed ms": item.timings["plan_exposed"] * 1e3,
                                                  "dispatch ms": item.timings.get("dispatch", 0.0) * 1e3,
                                                  "applied": float(isinstance(item, BalancedStep))})
            step = torch.tensor([figures[name] for name in self.fields], dtype=torch.float64)
            self.post_balancing = step if self.post_balancing is None else self.post_balancing + step
            if item.run_peers is not None:
                self.run_peers = item.run_peers
        return item

    def _count(self, microbatch) -> None:
        self.counts += torch.tensor([*(microbatch.items[phase].shape[0] for phase in self.phases.encoder_names),
                                     float(microbatch.seq_lengths.sum())], dtype=torch.float64)

    def take(self) -> torch.Tensor:
        """Counts since the last call."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def take_encoded(self) -> Optional[torch.Tensor]:
        """Items of each encoder phase this rank encoded since the last call (None without balanced steps)."""
        encoded, self.encoded = self.encoded, None
        return encoded

    def take_post_balancing(self) -> Optional[torch.Tensor]:
        """Post-balancing figures summed since the last call (None without post-balancing)."""
        figures, self.post_balancing = self.post_balancing, None
        return figures


@dataclass
class IntervalStats:
    """Sums over the iterations of one log interval (this rank's view)."""

    iterations: int = 0
    elapsed_s: float = 0.0
    loss_sum: float = 0.0  # of the per-iteration global lm loss (last pipeline stage only)
    loss_iterations: int = 0
    skipped: int = 0
    nan: int = 0
    bad_examples: int = 0       # skipped and replaced (over the DP group)
    truncated_answers: int = 0  # over the DP group
    load: Optional[torch.Tensor] = None  # per load_fields(), summed
    phase_s: dict = field(default_factory=dict)  # timer -> seconds over the interval
    post_balancing: Optional[torch.Tensor] = None
    encoded: Optional[torch.Tensor] = None  # items of each encoder phase this rank encoded, summed
    run_peers: Optional[Tuple[int, int]] = None  # RUN_PEER_FIELDS after the interval's last step

    @property
    def mean_loss(self) -> Optional[float]:
        """Megatron's reported loss: the mean over the interval's iterations (skipped / NaN ones out)."""
        return self.loss_sum / self.loss_iterations if self.loss_iterations else None

    def add(self, elapsed_s: float, load: torch.Tensor, skipped: bool, lm_loss: Optional[float],
            post_balancing: Optional[torch.Tensor] = None, bad_examples: int = 0, truncated_answers: int = 0,
            encoded: Optional[torch.Tensor] = None, run_peers: Optional[Tuple[int, int]] = None) -> None:
        """One iteration; :attr:`phase_s` is set once per interval (the timers are read on log iterations)."""
        self.bad_examples += bad_examples
        self.truncated_answers += truncated_answers
        nan = lm_loss is not None and not math.isfinite(lm_loss)
        if lm_loss is not None and not nan and not skipped:
            self.loss_sum += lm_loss
            self.loss_iterations += 1
        self.iterations += 1
        self.elapsed_s += elapsed_s
        self.load = load if self.load is None else self.load + load
        if encoded is not None:
            self.encoded = encoded if self.encoded is None else self.encoded + encoded
        if run_peers is not None:
            self.run_peers = run_peers
        if post_balancing is not None:
            self.post_balancing = post_balancing if self.post_balancing is None else \
                self.post_balancing + post_balancing
        self.skipped += int(skipped)
        self.nan += int(nan)


def gather_data_events(events: List[DataEvent], group) -> List[DataEvent]:
    """Every rank's events of ``group``, in sample order, on every rank: one fixed-size collective, a
    second one carrying the events only when some rank has any."""
    encoded = json.dumps([dataclasses.astuple(e) for e in events]).encode() if events else b""
    lengths = all_gather_to_host(torch.tensor([len(encoded)], dtype=torch.int64), group).reshape(-1)
    if not lengths.any():
        return []
    buffer = torch.zeros(int(lengths.max()), dtype=torch.uint8)
    if encoded:
        buffer[:len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    rows = all_gather_to_host(buffer, group)
    gathered = [DataEvent(*fields) for row, length in zip(rows, lengths.tolist()) if length
                for fields in json.loads(bytes(row[:length].tolist()))]
    return sorted(gathered, key=lambda e: (e.position, not e.skipped))


def max_and_mean_over_group(values: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and mean of a float64 vector over the ranks of ``group``."""
    stacked = all_gather_to_host(values, group)
    return stacked.max(dim=0).values, stacked.mean(dim=0)


@dataclass(frozen=True)
class IterationRecord:
    """What one log line reports (also returned by the trainer for tests and benchmarks)."""

    iteration: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    lm_loss: Optional[float]
    grad_norm: Optional[float]
    loss_scale: float
    skipped: int
    nan: int
    tokens_per_s: float
    load_max: dict
    load_mean: dict
    phase_ms_max: dict
    phase_ms_mean: dict
    post_balancing: Optional[dict] = None  # post_balancing_fields() -> interval mean (times: max over DP), and
    # RUN_PEER_FIELDS -> their value after the interval (where the steps carried them)
    bad_examples: int = 0       # skipped in the interval (--max-bad-examples)
    truncated_answers: int = 0  # in the interval
    encoder_ranks: Optional[str] = None  # post-balancing's encoder layout (EncoderRanks value)
    items_encoded: Optional[dict] = None  # encoder phase -> items each global rank encoded per iteration

    def line(self, train_iters: int, full: bool = False) -> str:
        """Megatron-LM's iteration line with tokens/s, each phase's load imbalance (max/mean over DP) and, with
        post-balancing, each phase's cost imbalance before->after; bad examples and truncated answers where the
        interval had some; with balanced steps, the encoder layout and the items each rank encoded (min/max over
        the job's ranks). ``full`` (``--orch-log-level 1``): also the loads themselves, the phase times
        (max/mean over ranks), the bytes post-balancing moved, the most peers a rank exchanged with in a step
        (interval mean) and over the run so far (what its communicator keeps connected), its planning and dispatch
        times, and every rank's items encoded (up to 16 ranks)."""
        parts = [f" iteration {self.iteration:8d}/{train_iters:8d}",
                 f" consumed samples: {self.consumed_samples:12d}",
                 f" elapsed time per iteration (ms): {self.elapsed_ms:.1f}",
                 f" learning rate: {self.learning_rate:.6E}",
                 f" global batch size: {self.global_batch_size:5d}"]
        if self.lm_loss is not None:
            parts.append(f" lm loss: {self.lm_loss:.6E}")
        parts.append(f" loss scale: {self.loss_scale:.1f}")
        if self.grad_norm is not None:
            parts.append(f" grad norm: {self.grad_norm:.3f}")
        parts += [f" number of skipped iterations: {self.skipped:3d}",
                  f" number of nan iterations: {self.nan:3d}"]
        if full or self.bad_examples:
            parts.append(f" number of bad examples skipped: {self.bad_examples:3d}")
        if full or self.truncated_answers:
            parts.append(f" number of answers truncated: {self.truncated_answers:3d}")
        parts.append(f" tokens/s: {self.tokens_per_s:.1f}")
        if full:
            load = ", ".join(f"{name} {self.load_max[name]:.0f}/{self.load_mean[name]:.1f}"
                             f" ({_ratio(self.load_max[name], self.load_mean[name])})" for name in self.load_max)
            parts.append(f" {_LOAD}: {load}")
        else:
            load = ", ".join(f"{name} {_ratio(self.load_max[name], self.load_mean[name])}" for name in self.load_max)
            parts.append(f" {_IMBALANCE}: {load}")
        if full and self.phase_ms_max:
            times = ", ".join(f"{name} {self.phase_ms_max[name]:.1f}/{self.phase_ms_mean[name]:.1f}"
                              for name in self.phase_ms_max)
            parts.append(f" time per iteration (ms) max/mean over ranks: {times}")
        if self.post_balancing is not None:
            pb = self.post_balancing
            imbalance = ", ".join(f"{phase} {pb[phase + ' before']:.2f}->{pb[phase + ' after']:.2f}"
                                  for phase in (name[:-len(" before")] for name in pb if name.endswith(" before")))
            applied = pb["applied"] >= 0.5
            parts.append(f" {_COST if applied else _SHADOW_COST}: {imbalance}")
            if full:
                parts += [f" {_MOVED if applied else _WOULD_MOVE}: {pb['intra-node MB']:.2f}/{pb['inter-node MB']:.2f}",
                          f" {_PEERS}: {pb['peers intra-node']:.1f}/{pb['peers inter-node']:.1f}",
                          *([f" {_RUN_PEERS}: {pb[RUN_PEER_FIELDS[0]]:.0f}/{pb[RUN_PEER_FIELDS[1]]:.0f}"]
                            if RUN_PEER_FIELDS[0] in pb else []),
                          f" modeled step time saved: {pb['step saved %']:.1f}%",
                          f" plan ms: {pb['plan ms']:.1f} (exposed {pb['plan exposed ms']:.1f})",
                          f" dispatch ms: {pb['dispatch ms']:.1f}"]
        if self.items_encoded is not None:
            each = full and all(len(counts) <= 16 for counts in self.items_encoded.values())
            encoded = ", ".join(f"{phase} " + ("[" + " ".join(f"{c:g}" for c in counts) + "]" if each
                                               else f"{min(counts):g}/{max(counts):g}")
                                for phase, counts in self.items_encoded.items())
            parts.append(f" encoders {self.encoder_ranks}, items per rank {'(each)' if each else 'min/max'}: {encoded}")
        return "".join(f"{part} |" for part in parts)


_LOAD, _IMBALANCE = "load per rank max/mean over DP", "load imbalance max/mean over DP"
_COST = "post-balancing cost max/mean over DP before->after"
_SHADOW_COST = "post-balancing shadow (planned, not applied) cost max/mean over DP before->after"
_MOVED, _WOULD_MOVE = "moved MB intra/inter node", "would move MB intra/inter node"
_PEERS = "peers per rank max intra/inter node"
_RUN_PEERS = "run peers per rank max intra/inter node"


def _ratio(maximum: float, mean: float) -> str:
    return f"{maximum / mean:.2f}" if mean > 0 else "-"


class TensorBoardLog:
    """Scalars per logged iteration, written by one rank (Megatron writes from the last rank)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=log_dir, max_queue=1000)

    def write(self, record: IterationRecord) -> None:
        step, w = record.iteration, self.writer
        w.add_scalar("learning-rate", record.learning_rate, step)
        w.add_scalar("batch-size", record.global_batch_size, step)
        if record.lm_loss is not None:
            w.add_scalar("lm loss", record.lm_loss, step)
        if record.grad_norm is not None:
            w.add_scalar("grad-norm", record.grad_norm, step)
        w.add_scalar("loss-scale", record.loss_scale, step)
        w.add_scalar("iteration-time-ms", record.elapsed_ms, step)
        w.add_scalar("tokens-per-s", record.tokens_per_s, step)
        w.add_scalar("bad-examples-skipped", record.bad_examples, step)
        w.add_scalar("answers-truncated", record.truncated_answers, step)
        for name in record.load_max:
            key = name.replace(" ", "-")
            w.add_scalar(f"load/{key}-max", record.load_max[name], step)
            w.add_scalar(f"load/{key}-mean", record.load_mean[name], step)
        for name in record.phase_ms_max:
            w.add_scalar(f"time-ms/{name}-max", record.phase_ms_max[name], step)
            w.add_scalar(f"time-ms/{name}-mean", record.phase_ms_mean[name], step)
        for name, value in (record.post_balancing or {}).items():
            w.add_scalar(f"post-balancing/{name.replace(' ', '-')}", value, step)
        w.flush()

    def close(self) -> None:
        self.writer.close()


_NUMBER = r"([-+0-9.eE]+|nan|inf)"


def parse_iteration_line(line: str) -> Optional[dict]:
    """The figures of one iteration line (:meth:`IterationRecord.line`), or None for other lines.

    Returns ``iteration``, ``lm_loss``, ``elapsed_ms``, ``bad_examples``, ``truncated_answers``, ``load``
    {field: (max, mean)} and ``time_ms`` {timer: (max, mean)} (empty but in the full line) and, with
    post-balancing, ``post_balancing`` {field: value} (the cost imbalance; the rest in the full line).
    """
    match = re.match(r"\s*iteration\s+(\d+)/\s*(\d+) \|", line)
    if not match:
        return None
    out = {"iteration": int(match.group(1)), "load": {}, "time_ms": {}}
    fields = {}
    for part in line.split(" |"):
        key, _, value = part.strip().partition(": ")
        fields[key] = value
    out["elapsed_ms"] = float(fields["elapsed time per iteration (ms)"])
    out["lm_loss"] = float(fields["lm loss"]) if "lm loss" in fields else None
    out["bad_examples"] = int(fields.get("number of bad examples skipped", 0))
    out["truncated_answers"] = int(fields.get("number of answers truncated", 0))
    for name, high, mean in re.findall(rf"\s*([a-z][a-z0-9_ ]*?) {_NUMBER}/{_NUMBER}", fields.get(_LOAD, "")):
        out["load"][name.strip()] = (float(high), float(mean))
    for name, high, mean in re.findall(rf"\s*([a-z][a-z0-9_-]*) {_NUMBER}/{_NUMBER}",
                                       fields.get("time per iteration (ms) max/mean over ranks", "")):
        out["time_ms"][name] = (float(high), float(mean))
    applied = _COST in fields
    if applied or _SHADOW_COST in fields:
        pb = {"applied": float(applied)}
        for phase, before, after in re.findall(rf"([a-z][a-z0-9_]*) {_NUMBER}->{_NUMBER}",
                                               fields[_COST if applied else _SHADOW_COST]):
            pb[f"{phase} before"], pb[f"{phase} after"] = float(before), float(after)
        moved = fields.get(_MOVED if applied else _WOULD_MOVE)
        if moved is not None:  # the full line's
            intra, inter = moved.split("/")
            peers_intra, peers_inter = fields[_PEERS].split("/")
            plan = re.match(rf"{_NUMBER} \(exposed {_NUMBER}\)", fields["plan ms"])
            pb.update({"intra-node MB": float(intra), "inter-node MB": float(inter),
                       "peers intra-node": float(peers_intra), "peers inter-node": float(peers_inter),
                       "step saved %": float(fields["modeled step time saved"].rstrip("%")),
                       "plan ms": float(plan.group(1)), "plan exposed ms": float(plan.group(2)),
                       "dispatch ms": float(fields["dispatch ms"])})
            if _RUN_PEERS in fields:
                pb.update(zip(RUN_PEER_FIELDS, map(float, fields[_RUN_PEERS].split("/"))))
        out["post_balancing"] = pb
    return out


def memory_report(name: str) -> str:
    """Megatron-LM's ``report_memory`` line (megatron/training/utils.py) of this rank's CUDA memory:
    ``[Rank r] (after N iterations) memory (MB) | allocated: ... | max allocated: ... | reserved: ... |
    max reserved: ...``."""
    mb = 1024.0 * 1024.0
    return (f"[Rank {torch.distributed.get_rank()}] {name} memory (MB)"
            f" | allocated: {torch.cuda.memory_allocated() / mb:.2f}"
            f" | max allocated: {torch.cuda.max_memory_allocated() / mb:.2f}"
            f" | reserved: {torch.cuda.memory_reserved() / mb:.2f}"
            f" | max reserved: {torch.cuda.max_memory_reserved() / mb:.2f}")
