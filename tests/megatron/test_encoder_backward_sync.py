"""The encoders' backward as Megatron DDP counts gradients: every chunk of a phase but its last runs under
the model's ``no_sync_func``, so a parameter reports its gradient ready once per step, after all of it
has accumulated. (Under ``--overlap-grad-reduce`` DDP starts a bucket's reduction at that report: one
made after the phase's first chunk would reduce a partial gradient.) One process, no collectives: the
schedule's transfers are replaced by the gradients themselves, and ``no_sync`` is a stand-in that
records, as DDP would, the gradient each parameter holds when it reports ready."""
import contextlib
import functools
import types

import numpy as np
import pytest
import torch

from megatron_orch.megatron.encoder_chunks import chunk_bounds, encode_in_chunks
from megatron_orch.megatron.schedule import ModalityAwareSchedule


class TwoEncoders(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoders = torch.nn.ModuleDict({"vision": torch.nn.Linear(3, 2), "audio": torch.nn.Linear(3, 2)})

    def phase_encoders(self):
        return dict(self.encoders)

    def encode(self, phase, items):
        return torch.tanh(self.encoders[phase](items))  # one output row per item


class RecordingNoSync:
    """``no_sync`` as DDP's: outside it, a parameter whose gradient accumulated reports ready (the
    reduction of its bucket would start); ``reported[name]`` holds the gradient it had then."""

    def __init__(self, module):
        self.inside, self.reported = False, {}
        for name, param in module.named_parameters():
            param.register_post_accumulate_grad_hook(lambda p, name=name: self._ready(name, p))

    def _ready(self, name, param):
        if not self.inside:
            self.reported.setdefault(name, []).append(param.grad.clone())

    @contextlib.contextmanager
    def __call__(self):
        self.inside = True
        try:
            yield
        finally:
            self.inside = False


def _stubbed(module, pending, pipeline_group=None):
    """For ``pending`` (the step's encoder chunks, :func:`_step_gradients`): a schedule whose gradient moves hand back
    each phase's output gradient, the no_sync recorder of ``module``, a step of ``pipeline_group``, and each
    parameter's gradient as one backward of the whole step computes it (the reference)."""
    schedule = ModalityAwareSchedule(lambda **kwargs: [], dp_group=None)
    grads = {phase: leaf.grad for phase, _, _, _, leaf in pending}
    schedule._start_move = lambda step, phase, rows, inverse=False: (lambda: grads[phase])
    step = types.SimpleNamespace(rows_per_item={"vision": 1, "audio": 1}, num_tokens=np.zeros(0),
                                 pipeline_group=pipeline_group)
    reference = TwoEncoders()
    for phase, _, inputs, _, _ in pending:
        torch.autograd.backward(reference.encode(phase, inputs), grads[phase])
    return schedule, RecordingNoSync(module), step, dict(reference.named_parameters())


def test_a_phases_gradients_report_ready_once_after_its_last_chunk():
    module = TwoEncoders()
    items = {"vision": torch.randn(5, 3), "audio": torch.randn(3, 3)}
    chunking = {"vision": (2, 2), "audio": (1, 3)}  # (items per chunk, items kept): kept and recomputed chunks
    pending = []
    for phase, inputs in items.items():
        encode = functools.partial(module.encode, phase)
        outputs, chunks = encode_in_chunks(encode, inputs, chunk_bounds(inputs.shape[0], *chunking[phase]), grad=True)
        leaf = outputs.detach().requires_grad_()
        leaf.grad = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(len(pending)))
        pending.append((phase, encode, inputs, chunks, leaf))
    assert [len(chunks) for _, _, _, chunks, _ in pending] == [3, 3]

    schedule, no_sync, step, expected = _stubbed(module, pending)
    schedule._encoders_backward(step, module, pending, no_sync, synced=True)
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad)
        assert len(no_sync.reported.get(name, [])) == 1, (name, len(no_sync.reported.get(name, [])))
        torch.testing.assert_close(no_sync.reported[name][0], param.grad, msg=lambda m: f"{name} reported early: {m}")


def _step_gradients(module, items):
    """Each phase encoded in two chunks (one kept, one recomputed), its moved outputs' gradients drawn: the
    pending backward of a step, as the schedule holds it before the encoders' backward."""
    pending = []
    for phase, inputs in items.items():
        encode = functools.partial(module.encode, phase)
        outputs, chunks = encode_in_chunks(encode, inputs, chunk_bounds(inputs.shape[0], 2, 2), grad=True)
        leaf = outputs.detach().requires_grad_()
        leaf.grad = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(len(pending)))
        pending.append((phase, encode, inputs, chunks, leaf))
    return pending


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_under_grad_sync_the_encoders_backward_reports_nothing_itself(num_chunks):
    """``--overlap-grad-reduce``: the schedule's grad_sync_func runs the encoders' backward first. megatron-core
    calls it only after every backward of the chunk ran under no_sync (the interleaved schedule; with one model
    chunk, 1F1B's later pipeline stages, which hold encoders with ``--orch-encoder-ranks all``), so the encoders'
    backward reports none (the explicit sync that follows reduces them), and the gradients are whole when the sync
    runs."""
    from megatron_orch.megatron.schedule import _run_encoders_backward_first

    module = TwoEncoders()
    items = {"vision": torch.randn(3, 3), "audio": torch.randn(4, 3)}
    pending = _step_gradients(module, items)
    schedule, no_sync, step, expected = _stubbed(module, pending)
    synced_chunks, finalized = [], []

    def grad_sync(chunk):  # the chunk's explicit sync: every encoder gradient is whole by then
        synced_chunks.append((chunk, {name: p.grad.clone() for name, p in module.named_parameters()}))

    config = types.SimpleNamespace(
        grad_sync_func=[functools.partial(grad_sync, c) for c in range(num_chunks)] if num_chunks > 1
        else functools.partial(grad_sync, 0),
        finalize_model_grads_func=lambda *args: finalized.append(args))
    _run_encoders_backward_first(
        config, num_chunks, lambda synced: schedule._encoders_backward(step, module, pending, no_sync, synced))
    (config.grad_sync_func[0] if num_chunks > 1 else config.grad_sync_func)()

    assert [chunk for chunk, _ in synced_chunks] == [0] and not finalized
    for name, grad in synced_chunks[0][1].items():
        torch.testing.assert_close(grad, expected[name].grad)
    reports = {name: len(no_sync.reported.get(name, [])) for name in expected}
    assert reports == {name: 0 for name in expected}, reports


@pytest.mark.parametrize("synced", [True, False])
def test_on_every_stage_the_encoders_report_their_gradients_once_after_the_sum_over_the_stages(monkeypatch, synced):
    """``--orch-encoder-ranks all``: every chunk's backward runs under no_sync, the whole gradients are summed over
    the pipeline stages (a stand-in for the all-reduce: doubled, as two stages with these gradients sum them), and
    then, where ``synced`` (``finalize_model_grads_func`` follows), each parameter reports ready once, holding the
    sum: DDP's overlapped reduction (``--overlap-grad-reduce``) starts on it, not on one stage's share. Not synced
    (``grad_sync_func`` follows and reduces the chunk), none reports."""
    from megatron_orch.megatron import schedule

    module = TwoEncoders()
    items = {"vision": torch.randn(5, 3), "audio": torch.randn(3, 3)}
    pending = _step_gradients(module, items)
    stages, before_sum = object(), []
    runner, no_sync, step, expected = _stubbed(module, pending, pipeline_group=stages)

    def sum_over_stages(encoders, group):
        assert encoders is module and group is stages
        before_sum.append({name: p.grad.clone() for name, p in module.named_parameters()})
        for param in module.parameters():
            param.grad.mul_(2)

    monkeypatch.setattr(schedule, "sum_encoder_gradients", sum_over_stages)
    runner._encoders_backward(step, module, pending, no_sync, synced=synced)

    assert len(before_sum) == 1
    for name, param in module.named_parameters():
        torch.testing.assert_close(before_sum[0][name], expected[name].grad, msg=lambda m: f"{name} summed early: {m}")
        torch.testing.assert_close(param.grad, 2 * expected[name].grad)
        reported = no_sync.reported.get(name, [])
        assert len(reported) == (1 if synced else 0), (name, len(reported))
        for grad in reported:
            torch.testing.assert_close(grad, 2 * expected[name].grad, msg=lambda m: f"{name} reported unsummed: {m}")
