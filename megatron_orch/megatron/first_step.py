"""What the modality-aware schedule checks before and on the first steps: a model's mistake stops the run
with one line naming the fix, instead of training differently from upstream or failing late.

* **Before the first step's collectives** (:func:`check_model_and_config`): the model meets the contract
  (:func:`~megatron_orch.megatron.contract.check_model`: ``phase_encoders``, ``encode``, ``forward``,
  ``model_type``, ``set_input_tensor``) and its config normalises the loss per token
  (``calculate_per_token_loss``, which makes moving examples between DP ranks loss-invariant).
* **On the first step with items of an encoder phase** (:class:`EncoderChecks`), on each rank holding some
  (every rank, with parameters sharded over DP: :func:`check_encode`):
  a few items encoded together give the rows they give one at a time, in training mode (``encode`` is item by
  item, e.g. ``[n * rows, hidden]``, not Megatron's ``[s, b, h]`` flattened as it comes, and no BatchNorm-like
  statistic over the items of a call), and every parameter the
  encode reaches (its autograd graph) belongs to the phase's module in ``phase_encoders()`` (a rank without
  items of the phase gives that module zero gradients; a parameter outside it reports none, on which Megatron
  DDP's overlapped reduction fails). Every rank of the job agrees on the outcome in one collective, so all
  of them stop together, before the step's moves.
* **On the same step, after the backbone schedule** (:func:`check_embeds_read`): ``forward(batch, embeds)``
  read ``embeds[phase]`` of every micro-batch holding rows of the phase (a forward that encodes ``batch.items``
  instead, which balanced micro-batches leave empty, either fails inside the backbone or trains on something
  else), agreed by every rank of the job.
* **The checked first step** (:func:`checked_step`, ``OrchestratorConfig.verify_first_step``,
  ``--orch-verify-first-step``): the first step, and then the first step with items of each encoder phase
  no checked step had (:class:`~megatron_orch.megatron.post_balancing.CheckedSteps`), runs twice on the same
  batch, the loader's (upstream) layout through megatron-core's own schedule, then the balanced one, which
  the step trains on. They must agree within the dtype's tolerance (:func:`tolerance`), phase by phase:
  whether each encoder gets gradients at all (``torch.no_grad()`` in one branch of ``forward``), each encoder
  phase's outputs (the balanced ones moved back to the rank that loaded their example), the loss, the
  backbone's and then each encoder's gradient norm; the first that differs stops the run, named. This
  catches what no rule above lists (an adapter whose ``forward(batch, embeds)`` is not its ``forward(batch)``).
  A step whose loss or gradients are not finite in both layouts is not compared (announced; the next step is
  checked instead), in one layout only it differs. With the encoders on every rank (``EncoderRanks.ALL``) the
  loader's layout encodes on the first stage alone, and every encoder replica is given the first one's gradients
  before DDP reduces them (where the balanced step sums its replicas'), so each rank's encoder gradient norms
  compare the replicas' summed gradients with upstream's; the encoder outputs are compared on the first stage,
  whose backbone takes them.
  Its cost: one more forward-backward of the step, and one forward of the encoders without gradients when
  ``forward(batch)`` does not encode through ``encode`` (so its outputs cannot be recorded); one such step at
  most per phase. Both layouts run in training mode (BatchNorm and the like as they train), with dropout off
  when the model has some (masks follow the rank that computes an example, so no two layouts agree with it
  on; rates set to 0, those of modules and of torch's dropout functions alike, modes left alone), and so does the
  step trained on; the upstream run leaves the
  buffers (running statistics) as it found them. Megatron DDP's overlapped reduction is off for the upstream
  run (its gradients are reduced when the schedule ends), so that DDP calibrates it on the balanced one.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.utils import get_model_config
from torch.overrides import TorchFunctionMode

from megatron_orch.balance.plan import Transfer
from megatron_orch.comm.alltoall import ItemLayout, all_to_all_items
from megatron_orch.comm.device import to_communication_device
from megatron_orch.comm.status import raise_if_any_rank_failed
from megatron_orch.megatron.contract import BalanceableModel, check_model
from megatron_orch.megatron.post_balancing import BalancedStep

FLAG = "--orch-verify-first-step"


class FirstStepMismatchError(RuntimeError):
    """The loader's and the balanced layout of the checked first step differ (the message names the phase)."""


def print_on_rank_0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def check_model_and_config(model) -> BalanceableModel:
    """The contract's members, and per-token loss normalisation in the model config: raises before any
    collective (the same on every rank), naming what to change."""
    module = check_model(model)
    config = get_model_config(model[0] if isinstance(model, (list, tuple)) else model)
    if not getattr(config, "calculate_per_token_loss", False):
        raise ValueError("post-balancing needs calculate_per_token_loss=True in the model's TransformerConfig "
                         "(Megatron-LM: --calculate-per-token-loss): the loss must be normalised by the global "
                         "number of loss tokens for moving examples between DP ranks to change nothing")
    return module


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    """Relative difference two layouts of a step may show: reduction order only (fp32 on the CPU: 1e-5; with
    TF32 on a GPU: 5e-3), or the rounding of 16-bit parameters."""
    if dtype == torch.bfloat16:
        return 2e-2
    if dtype == torch.float16:
        return 1e-2
    tf32 = device.type == "cuda" and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    return 5e-3 if tf32 else 1e-5


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest magnitude of ``want`` (inf for other shapes)."""
    if got.shape != want.shape:
        return math.inf
    if want.numel() == 0:
        return 0.0
    got, want = got.double(), want.double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


_DROPOUT_RATES = ("hidden_dropout", "attention_dropout")  # rates a module reads when it runs (Megatron's layers)
# torch's dropout functions: the name and place of their rate (a dropout module calls one of them too)
_DROPOUT_FUNCTIONS = {
    **{f: ("p", 1) for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                             F.feature_alpha_dropout, torch.dropout, torch.feature_dropout, torch.alpha_dropout,
                             torch.feature_alpha_dropout, torch.native_dropout)},
    F.scaled_dot_product_attention: ("dropout_p", 4),
}


class _NoDropout(TorchFunctionMode):
    """torch's dropout functions called at rate 0 however the model calls them (a literal rate, a name bound at
    import); ``found``: whether one was called at a rate above 0. Hand-made dropout (a mask from ``torch.rand``)
    is not seen: its masks differ between the layouts, and the check stops the run."""

    def __init__(self):
        super().__init__()
        self.found = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        rate = _DROPOUT_FUNCTIONS.get(func)
        if rate is not None:
            name, place = rate
            if name in kwargs:
                self.found |= bool(kwargs[name])
                kwargs[name] = 0.0
            elif len(args) > place:
                self.found |= bool(args[place])
                args = (*args[:place], 0.0, *args[place + 1:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def _dropout_off(modules: Sequence[torch.nn.Module]) -> Iterator[_NoDropout]:
    """Dropout off for the duration, every module left in its mode (training: BatchNorm and the like keep
    their statistics over the call): torch's dropout modules and functions at rate 0 (:class:`_NoDropout`,
    which it yields: its ``found`` also says whether the modules had some) and the float rates a module reads
    when it runs (``hidden_dropout``, ``attention_dropout``) at 0; then as they were."""
    changed = []
    for m in {id(m): m for root in modules for m in root.modules()}.values():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            changed.append((m, "p", m.p))
        changed += [(m, name, getattr(m, name)) for name in _DROPOUT_RATES
                    if isinstance(getattr(m, name, None), float) and getattr(m, name) > 0]
    for m, name, _ in changed:
        setattr(m, name, 0.0)
    no_dropout = _NoDropout()
    no_dropout.found = bool(changed)
    try:
        with no_dropout:
            yield no_dropout
    finally:
        for m, name, rate in changed:
            setattr(m, name, rate)


@contextlib.contextmanager
def _buffers_unchanged(modules: Sequence[torch.nn.Module]) -> Iterator[None]:
    """The modules' buffers (BatchNorm's running statistics) as they were before the block, after it: a run
    made for a check must leave the run trained on what it would be without it."""
    # torch's method, not Megatron DDP's attribute of the same name (its gradient buffers)
    buffers = {id(b): b for root in modules for b in torch.nn.Module.buffers(root)}.values()
    saved = [(b, b.detach().clone()) for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@contextlib.contextmanager
def _rng_unchanged() -> Iterator[None]:
    """torch's generators and Megatron's RNG tracker as they were before the block, after it."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            tracker.set_states(states)


# -- the encoders, on the first step with items of each phase ----------------------------------------

def _parameters_reached(rows: torch.Tensor) -> set:
    """ids of the leaves (parameters) ``rows``' autograd graph reaches; nothing runs backward."""
    found, seen, stack = set(), set(), [rows.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf that requires grad
        if variable is not None:
            found.add(id(variable))
        stack.extend(parent for parent, _ in node.next_functions)
    return found


def _shifted(items: torch.Tensor) -> torch.Tensor:
    """Each item's values shifted by one place (in its flattened order): another item of the same values."""
    return items.reshape(items.shape[0], -1).roll(1, dims=1).view_as(items)


def check_encode(module: BalanceableModel, phase: str, items: torch.Tensor, rows_per_item: int,
                 sharded_encode: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
    """Raise ValueError (naming the fix) unless ``encode(phase, ·)`` is item by item on a few of ``items`` and
    uses parameters of ``phase_encoders()[phase]`` only (module docstring). The encoder runs as it trains (its
    modules' mode kept, dropout off, buffers such as BatchNorm's running statistics restored after), so a
    statistic over the items of one call shows. One item is checked with a second made of its values shifted
    by one place: two different items expose both that statistic and rows of ``[s, b, h]`` flattened (which
    interleave the items).

    ``sharded_encode``: the phase's encode through a sharded wrapper (parameters sharded over DP are gathered by
    collectives, so every rank runs this check, with the same calls): three items, zero items past the rank's
    own, without gradients. The parameter check is left out there: with sharded parameters every rank runs
    every encoder phase in every step, so no gradient depends on which module ``phase_encoders()`` names."""
    if phase not in module.phase_encoders():
        raise ValueError(f"post-balancing: phase_encoders() has no module of encoder phase {phase!r} (it has "
                         f"{sorted(module.phase_encoders())}); return it on the pipeline stage that encodes")
    sample = items[:3] if items.shape[0] > 1 else torch.cat([items, _shifted(items)])
    encode = functools.partial(module.encode, phase) if sharded_encode is None else sharded_encode
    if sharded_encode is not None:
        sample = torch.cat([sample, sample.new_zeros(3 - sample.shape[0], *sample.shape[1:])])
    n = sample.shape[0]
    with _dropout_off([module]), _buffers_unchanged([module]), _rng_unchanged(), \
            torch.set_grad_enabled(sharded_encode is None):
        together = encode(sample)
        with torch.no_grad():
            apart = torch.cat([encode(sample[i:i + 1]) for i in range(n)])
    where = f"post-balancing: encode({phase!r}, items)"
    if together.dim() != 2 or together.shape[0] != n * rows_per_item:
        raise ValueError(f"{where} gave rows of shape {tuple(together.shape)} for {n} items; expected "
                         f"[{n} x {rows_per_item} rows, hidden] (the phase's output_rows per item, item by item)")
    difference = _relative(together.detach(), apart)
    if difference > 10 * tolerance(together.dtype, together.device):
        raise ValueError(f"{where} is not item by item: {n} items encoded together give other rows than one at a "
                         f"time, in training mode (largest relative difference {difference:.1e}); return each "
                         f"item's {rows_per_item} rows after the other, [n * {rows_per_item}, hidden] (an encoder "
                         "output in Megatron's [s, b, h] layout must become [b, s, h] before it is flattened), and "
                         "use no statistic over the items of a call (BatchNorm: a per-item norm such as LayerNorm)")
    if sharded_encode is not None:
        return
    reached = _parameters_reached(together)
    own = {id(p) for p in module.phase_encoders()[phase].parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) in reached and id(p) not in own]
    if outside:
        shown = ", ".join(outside[:3]) + (f" and {len(outside) - 3} more" if len(outside) > 3 else "")
        raise ValueError(f"{where} uses parameters outside phase_encoders()[{phase!r}]: {shown}; return a module "
                         f"that holds every parameter encode({phase!r}) uses (e.g. the encoder and its projector in "
                         "one module) as phase_encoders()[" + repr(phase) + "]: a rank without items of the phase "
                         "gives that module zero gradients, and a parameter outside it none")


class WatchedEmbeds(Mapping):
    """A balanced micro-batch's ``embeds`` that records which phases ``forward`` read (on the first step with
    items of each phase, :func:`check_embeds_read`)."""

    def __init__(self, embeds: Mapping[str, torch.Tensor]):
        self._embeds, self.read = dict(embeds), set()

    def __getitem__(self, phase: str) -> torch.Tensor:
        self.read.add(phase)
        return self._embeds[phase]

    def __contains__(self, phase) -> bool:  # asking is not reading
        return phase in self._embeds

    def __iter__(self):
        return iter(self._embeds)

    def __len__(self) -> int:
        return len(self._embeds)


def check_embeds_read(module: BalanceableModel, microbatches: Sequence, phases: Sequence[str],
                      error: Optional[BaseException] = None) -> None:
    """Raise ValueError naming the phase when ``forward(batch, embeds)`` left ``embeds[phase]`` of a micro-batch
    holding rows of it unread (``microbatches``' embeds: :class:`WatchedEmbeds`); ``error``: what the backbone
    schedule raised, chained (a forward that encodes ``batch.items`` instead fails on their absence)."""
    for microbatch in microbatches:
        embeds = microbatch.embeds
        unread = [p for p in phases if p in embeds and p not in embeds.read and embeds._embeds[p].shape[0]]
        # with an error: only where forward read no embeds at all (one that did failed for another reason)
        if unread and (error is None or not any(mb.embeds.read for mb in microbatches)):
            phase = unread[0]
            raise ValueError(
                f"post-balancing: {type(module).__name__}.forward(batch, embeds) did not read embeds[{phase!r}] of a "
                f"micro-batch holding {embeds._embeds[phase].shape[0]} of its rows"
                + (f" (it raised {type(error).__name__}: {error})" if error is not None else "")
                + f": balanced micro-batches carry text only (batch.items[{phase!r}] is empty) and the phase's encoder "
                f"outputs in embeds[{phase!r}]; insert them at the placeholders when embeds is given (encode "
                "batch.items only when embeds is None)") from error


class EncoderChecks:
    """:func:`check_encode` once per encoder phase, on the first step whose global batch holds items of it
    (the plan says which, the same on every rank), agreed by every rank of the job."""

    def __init__(self):
        self.pending: Optional[set] = None  # phases not checked yet (None: no step seen)

    def run(self, module: BalanceableModel, step: BalancedStep,
            sharded_encode: Optional[Callable[[str], Callable[[torch.Tensor], torch.Tensor]]] = None) -> List[str]:
        """``sharded_encode(phase)``: the phase's encode through a sharded wrapper, for every rank
        (:func:`check_encode`). Returns the phases checked now (the step's forward is then watched:
        :func:`check_embeds_read`)."""
        encoders = step.plan.encoders
        if self.pending is None:
            self.pending = set(encoders)
        due = [phase for phase in encoders if phase in self.pending and encoders[phase].example.size]
        if not due:
            return due
        self.pending -= set(due)
        problem = None
        try:
            for phase in due:
                items = step.inputs.get(phase)
                if sharded_encode is not None and items is not None:
                    check_encode(module, phase, items, step.rows_per_item[phase], sharded_encode(phase))
                elif items is not None and items.shape[0]:
                    check_encode(module, phase, items, step.rows_per_item[phase])
        except Exception as err:  # noqa: BLE001 -- every rank must stop, not only those with items
            problem = err
        raise_if_any_rank_failed(problem, what="post-balancing's check of the encoders")
        return due


# -- the checked first step ---------------------------------------------------------------------------

def _reduced_gradients(chunk: torch.nn.Module) -> Iterator[Tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, the part of its gradient this rank holds reduced over DP after the step): Megatron DDP's
    ``main_grad`` (with the distributed optimizer, the part inside this rank's shard of each bucket, the
    only part its reduce-scatter reduced), else ``.grad``."""
    ddp_config = getattr(chunk, "ddp_config", None)
    if ddp_config is not None and ddp_config.use_distributed_optimizer:
        for buffer in [*chunk.buffers, *chunk.expert_parallel_buffers]:
            size, rank = dist.get_world_size(buffer.data_parallel_group), dist.get_rank(buffer.data_parallel_group)
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                bucket = buffer.buckets[bucket_id]
                shard = bucket.grad_data.numel() // size
                low = bucket.offset + rank * shard
                start, end = max(start, low), min(end, low + shard)
                if start < end:
                    yield param, buffer.grad_data[start:end]
        return
    for param in chunk.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            yield param, grad


def _gradient_norms(chunks: Sequence[torch.nn.Module], module: BalanceableModel, phases: Sequence[str]) -> np.ndarray:
    """Squared norm of this rank's reduced gradients per encoder phase (its module's parameters), then of the
    rest (the backbone)."""
    encoders = module.phase_encoders()
    owner = {id(p): k for k, phase in enumerate(phases) if phase in encoders for p in encoders[phase].parameters()}
    parts: List[List[torch.Tensor]] = [[] for _ in range(len(phases) + 1)]
    for chunk in chunks:
        for param, grad in _reduced_gradients(chunk):
            parts[owner.get(id(param), len(phases))].append(grad.double().pow(2).sum())
    return np.array([float(torch.stack(p).sum()) if p else 0.0 for p in parts])


@contextlib.contextmanager
def _reduced_at_the_end(chunks: Sequence[torch.nn.Module], model_config) -> Iterator[None]:
    """Megatron DDP's overlapped gradient reduction off for the block (its gradients reduced when the schedule
    finishes, as without it): DDP calibrates the overlapped reduction on its first step, recording which
    parameters report a gradient in the last micro-batch, and that step must be a balanced one (the upstream
    layout may skip an encoder in its last micro-batch, which DDP would then refuse). The model config's
    ``grad_sync_func`` is unset with it: without the overlap, DDP's ``start_grad_sync`` reduces at once, and
    ``finalize_model_grads_func`` would reduce the same gradients again."""
    configs = list({id(c.ddp_config): c.ddp_config for c in chunks
                    if getattr(getattr(c, "ddp_config", None), "overlap_grad_reduce", False)}.values())
    grad_sync = getattr(model_config, "grad_sync_func", None)
    for config in configs:
        config.overlap_grad_reduce = False
    if configs and grad_sync is not None:
        model_config.grad_sync_func = None
    try:
        yield
    finally:
        for config in configs:
            config.overlap_grad_reduce = True
        if configs and grad_sync is not None:
            model_config.grad_sync_func = grad_sync


def _zero_gradients(chunks: Sequence[torch.nn.Module]) -> None:
    for chunk in chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
        for param in chunk.parameters():
            param.grad = None


@contextlib.contextmanager
def _recording_encode(module: BalanceableModel, phases: Sequence[str]) -> Iterator[Dict[str, List[torch.Tensor]]]:
    """The rows every ``module.encode`` call gives during the block, by phase (the upstream ``forward(batch)``
    of most models encodes through it)."""
    recorded: Dict[str, List[torch.Tensor]] = {phase: [] for phase in phases}
    encode = module.encode

    def recording(phase, items):
        rows = encode(phase, items)
        if phase in recorded:
            recorded[phase].append(rows.detach())
        return rows

    module.encode = recording
    try:
        yield recorded
    finally:
        del module.encode


def _home_outputs(module: BalanceableModel, step: BalancedStep, recorded: Mapping[str, List[torch.Tensor]]):
    """Each encoder phase's rows of this rank's loaded items, in the loader's order: as recorded during the
    upstream pass where that saw each item once, else encoded here without gradients."""
    device = next(module.parameters()).device
    out = {}
    for phase in step.inputs:
        items = [mb.items[phase] for mb in step.home]
        expected = sum(i.shape[0] for i in items) * step.rows_per_item[phase]
        rows = torch.cat(recorded[phase]) if recorded[phase] else None
        if rows is None or rows.shape[0] != expected:
            with torch.no_grad(), _rng_unchanged():
                rows = torch.cat([module.encode(phase, i.to(device)) for i in items])
        out[phase] = rows
    return out


def _moved_home(step: BalancedStep, phase: str, rows: torch.Tensor) -> torch.Tensor:
    """The balanced rows of ``phase`` (on the backbone rank of their example, as the schedule received them)
    moved to the rank that loaded their example, in the loader's order."""
    encoder = step.plan.encoders[phase]
    transfer = Transfer(step.plan.examples_backbone.expand(encoder.example), encoder.home)
    layout = ItemLayout(np.full(encoder.example.size, step.rows_per_item[phase], dtype=np.int64),
                        tuple(rows.shape[1:]), rows.dtype)
    moved, = all_to_all_items([to_communication_device(rows, step.comm_group)], [layout], transfer, step.comm_group)
    return moved.to(rows.device)


def _loss_totals(losses: Sequence[Mapping[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Per reported key, the sum over micro-batches of its per-token ``[sum, count]``."""
    out = {}
    for key in (losses[0] if losses else {}):
        values = [x[key].reshape(-1) for x in losses]
        if values[0].numel() == 2:
            out[key] = torch.stack(values).sum(dim=0).double()
    return out


def _loss_difference(home, balanced, dp_group) -> Tuple[float, np.ndarray]:
    """Largest relative difference of the global per-token losses, and whether they are finite in the loader's
    and in the balanced layout (last pipeline stage; 0 and finite elsewhere)."""
    home, balanced = _loss_totals(home), _loss_totals(balanced)
    if not home:  # not the last pipeline stage (the same on every rank of its DP group)
        return 0.0, np.ones(2, dtype=bool)
    missing = torch.full((2,), math.nan, dtype=torch.float64)  # a key the balanced run did not report
    totals = torch.stack([torch.stack([home[k], balanced.get(k, missing).to(home[k].device)]) for k in home])
    totals = to_communication_device(totals, dp_group)
    dist.all_reduce(totals, group=dp_group)
    totals = totals.cpu()
    loss = totals[..., 0] / totals[..., 1].clamp_min(1)
    finite = torch.isfinite(loss).all(dim=0).numpy()
    return float(((loss[:, 1] - loss[:, 0]).abs() / loss[:, 0].abs().clamp_min(1e-30)).max()), finite


def checked_step(run_home: Callable[[], list], run_balanced: Callable[[dict], list], step: BalancedStep,
                 module: BalanceableModel, chunks: Sequence[torch.nn.Module], dp_group,
                 announce: Callable[[str], None]) -> Tuple[list, dict]:
    """The checked first step (module docstring): ``run_home()`` (megatron-core's own schedule over the loader's
    micro-batches ``step.home``, every model chunk fed them), then ``run_balanced(captured)`` (the
    modality-aware schedule's own run, which fills ``captured`` with each phase's received encoder outputs),
    compared; returns the balanced run's result, whose gradients the step keeps, and the figures compared.
    Raises :class:`FirstStepMismatchError` on every rank when they differ. A step whose loss or gradients are not
    finite in both layouts is not compared (no layout makes a difference there: the data or the model does; a
    trainer's non-finite check names its examples): announced, its figures ``{"not finite": what}``, and the
    next step checked in its place (``step.check_again``); not finite in one layout only, they differ."""
    config = get_model_config(chunks[0])
    phases, backbone = list(step.plan.encoders), step.plan.backbone
    grads_reduced = config.finalize_model_grads_func is not None
    with _dropout_off(chunks) as dropout:
        with _reduced_at_the_end(chunks, config), _buffers_unchanged(chunks):
            with _recording_encode(module, phases) as recorded, _rng_unchanged():
                home_losses = run_home()
            home_grads = _gradient_norms(chunks, module, phases)
            # the encoder outputs are compared where the backbone takes them (the first stage's ranks)
            home_rows = {} if step.encodes_for_other_stages else _home_outputs(module, step, recorded)
            del recorded
            _zero_gradients(chunks)
        captured: Dict[str, torch.Tensor] = {}
        losses = run_balanced(captured)
        balanced_grads = _gradient_norms(chunks, module, phases)
    loss_difference, loss_finite = _loss_difference(home_losses, losses, dp_group)
    # per layout (the loader's, the balanced): the loss not finite, the gradients not finite
    grads_finite = [np.isfinite(norms).all() for norms in (home_grads, balanced_grads)]
    not_finite = np.concatenate([~loss_finite, ~np.array(grads_finite)])
    outputs = np.zeros(len(phases))
    for k, phase in enumerate(phases):
        if phase in home_rows:  # where the backbone takes the encoder outputs
            outputs[k] = _relative(_moved_home(step, phase, captured[phase]), home_rows[phase])
    grads = np.abs(np.sqrt(balanced_grads) - np.sqrt(home_grads)) / np.maximum(np.sqrt(home_grads), 1e-30)
    if not grads_reduced:  # gradients stay where computed: no layout-independent figure to compare
        grads[:] = 0.0
    # whether each encoder got any gradient in each layout: the job's maximum says whether any rank's did
    trained = np.concatenate([home_grads[:-1] > 0, balanced_grads[:-1] > 0]).astype(np.float64)
    figures = np.concatenate([outputs, [loss_difference], grads[-1:], grads[:-1], trained, not_finite])
    figures = torch.tensor(np.nan_to_num(figures, nan=math.inf), dtype=torch.float64)
    figures = to_communication_device(figures, None)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # every rank of the job, the same verdict
    figures = figures.cpu().numpy()
    figures, not_finite = figures[:-4], figures[-4:].reshape(2, 2) > 0
    figures, trained = figures[:-2 * len(phases)], figures[-2 * len(phases):].reshape(2, len(phases)) > 0
    if not_finite.any():
        return losses, _not_finite(not_finite, step, announce)
    for phase, upstream, balanced in zip(phases, *trained):
        if upstream != balanced:
            raise FirstStepMismatchError(_gradient_in_one_layout(phase, upstream))
    device = next(module.parameters()).device
    limit = tolerance(config.params_dtype, device)
    names = ([(phase, "its encoder outputs") for phase in phases] + [(backbone, "the loss"),
             (backbone, "its gradient norm")] + [(phase, "its gradient norm") for phase in phases])
    packed = any(mb.batch.is_packed for mb in step.microbatches) and not any(mb.is_packed for mb in step.home)
    for (phase, what), value in zip(names, figures):
        if value > limit:
            raise FirstStepMismatchError(_mismatch(phase, what, value, limit, phase == backbone, packed))
    result = {"encoder outputs": dict(zip(phases, figures[:len(phases)].tolist())), "loss": float(figures[len(phases)]),
              "gradient norms": float(figures[len(phases) + 1:].max(initial=0.0)), "tolerance": limit}
    notes = ("; dropout off for the check" if dropout.found else "") + (
        "" if grads_reduced else "; gradients not compared: the model config reduces none (finalize_model_grads_func "
        "is None)")
    present = [phase for phase in phases if step.plan.encoders[phase].example.size]
    announce(f"> post-balancing: step checked ({FLAG}, phases {', '.join([backbone, *present])}, training mode): "
             f"the loader's and the balanced layout agree (largest "
             f"relative differences: loss {result['loss']:.1e}, gradient norms {result['gradient norms']:.1e}, "
             f"encoder outputs {max(result['encoder outputs'].values(), default=0.0):.1e}; tolerance {limit:.0e}"
             f"{notes}); training on the balanced layout")
    return losses, result


def _not_finite(not_finite: np.ndarray, step: BalancedStep, announce: Callable[[str], None]) -> dict:
    """The verdict on a checked step whose loss or gradients are not finite (``not_finite``: loss, gradients by
    layout, the loader's then the balanced, over the job): not compared where both layouts are, else a
    :class:`FirstStepMismatchError` naming the layout."""
    what = "loss is" if not_finite[0].any() else "gradients are"
    layouts = not_finite.any(axis=0)
    if not layouts.all():
        bad, good = ("the loader's", "the balanced") if layouts[0] else ("the balanced", "the loader's")
        raise FirstStepMismatchError(
            f"post-balancing's checked first step ({FLAG}): the same batch's {what} not finite in {bad} layout but "
            f"finite in {good} one: forward(batch, embeds) with encode(phase, items) must compute what forward(batch) "
            "computes")
    step.check_again()
    announce(f"> post-balancing: step not checked ({FLAG}): its {what} not finite in the loader's and the balanced "
             "layout alike (the data or the model, not the layout: the run's non-finite check names the examples); "
             "the next step is checked in its place")
    return {"not finite": what.split()[0]}


def _gradient_in_one_layout(phase: str, upstream: bool) -> str:
    has, lacks = ("the loader's", "the balanced") if upstream else ("the balanced", "the loader's")
    return (f"post-balancing's checked first step ({FLAG}): phase {phase!r}'s encoder gets gradients in {has} "
            f"layout of the same batch but none in {lacks}: forward(batch) (the loader's layout) and "
            f"encode({phase!r}, items) (the balanced one) must agree on whether the encoder trains (no "
            "torch.no_grad() or detach() in one of them; freeze an encoder with requires_grad_(False))")


def _mismatch(phase: str, what: str, value: float, limit: float, backbone: bool, packed: bool) -> str:
    if what == "its encoder outputs":
        fix = (f"encode({phase!r}, items) must give each item the rows it gives alone, whichever items share the "
               "call (no statistics over the items in a call, no randomness but dropout)")
    elif backbone:
        fix = ("every encoder phase's outputs agree, so forward(batch, embeds) must give what forward(batch) gives "
               "when embeds[phase] = encode(phase, batch.items[phase]), inserted at the phase's placeholders "
               "example by example, row-major")
    else:
        fix = (f"its outputs agree, so the gradient forward(batch, embeds) gives embeds[{phase!r}] must be the one "
               "forward(batch) gives the encoder's outputs")
    if packed:  # the likeliest cause, named first
        fix = ("the balanced micro-batches are packed rows (several examples back to back; the loader's are not): "
               "forward must keep attention within each example of a row (pass batch.packed_seq_params() to its "
               "attention), else leave BatchSpec.takes_packed_rows False or pass --orch-microbatching "
               f"equal_count; otherwise {fix}")
    return (f"post-balancing's checked first step ({FLAG}): phase {phase!r} differs between the loader's and the "
            f"balanced layout of the same batch: {what} (largest relative difference {value:.1e} > {limit:.0e}); "
            f"{fix}")
