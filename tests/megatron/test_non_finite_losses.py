"""The examples whose own loss is not finite, found per example by the contract's forward step while a trainer
records them (no host sync per micro-batch): in padded and packed micro-batches, whole or one rank's part of the
sequence under context parallelism, and none recorded when no one asks; likewise the examples whose encoder output
rows get a non-finite gradient (balanced micro-batches). One process; the trainer's tests in a world of one."""
import dataclasses

import pytest
import torch

import example_modules  # noqa: F401 -- examples/ on the path
from megatron_orch.megatron import contract
from megatron_orch.megatron.batch import collate, collate_packed
from megatron_orch.megatron.sequence_layout import SequenceLayout


class PlantedLosses(torch.nn.Module):
    """A model whose per-token loss is 1, but NaN at one token of each example in ``bad`` (by sample id)."""

    def __init__(self, bad, layout=SequenceLayout()):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.bad, self.layout = bad, layout

    def forward(self, batch, embeds=None):
        losses = torch.ones(batch.tokens.shape) * self.weight
        for i, (row, start, end) in enumerate(batch._spans()):
            if int(batch.sample_ids[i]) in self.bad:
                losses[row, end - 1] = float("nan")  # the example's last token holds a loss
        return losses if self.layout.is_whole else self.layout.shard(
            _with_position_ids(batch, losses)).position_ids


def _with_position_ids(batch, values):
    return dataclasses.replace(batch, position_ids=values)


def _examples(spec):
    import own_model
    examples = [own_model.example(i) for i in (11, 12, 13, 14)]
    for example in examples:
        example.loss_mask[-1] = 1.0  # the planted token counts in the loss
    return examples


def _flagged(model, batch, monkeypatch, layout=SequenceLayout()):
    """Sample ids forward_step's loss function records as not finite (this rank's ``layout``); the loss."""
    model.layout = layout
    monkeypatch.setattr(SequenceLayout, "of_model", classmethod(lambda cls, config: layout))
    with contract.recording_non_finite_losses() as records:
        output, loss_func = contract.forward_step(iter([batch]), model)
        loss, _, _ = loss_func(output)
    return sorted(int(i) for ids, bad in records.losses for i in ids[bad].tolist()), loss


@pytest.mark.parametrize("packed", [False, True])
def test_the_examples_whose_own_loss_is_not_finite_are_recorded(packed, monkeypatch):
    import own_model
    spec = own_model.batch_spec()
    examples = _examples(spec)
    batch = (collate_packed if packed else collate)(examples, spec)
    assert _flagged(PlantedLosses({13}), batch, monkeypatch)[0] == [13]
    assert _flagged(PlantedLosses({11, 14}), batch, monkeypatch)[0] == [11, 14]
    flagged, loss = _flagged(PlantedLosses(set()), batch, monkeypatch)
    assert flagged == [] and torch.isfinite(loss)


@pytest.mark.parametrize("packed", [False, True])
def test_under_context_parallelism_each_rank_records_the_examples_of_its_part(packed, monkeypatch):
    """CP 2: each rank's part of the sequence holds a piece of every example (megatron-core's layout); the
    planted token, an example's last, sits on one of the two ranks, which alone records it."""
    import own_model
    spec = own_model.batch_spec()
    layouts = [SequenceLayout(2, rank, 1, 0) for rank in range(2)]
    batch = (collate_packed if packed else collate)(_examples(spec), spec, pad_to_multiple_of=4)
    per_rank = [_flagged(PlantedLosses({12}), batch, monkeypatch, layout)[0] for layout in layouts]
    assert sorted(per_rank) == [[], [12]], per_rank


def _gradient_flagged(batch, nan_rows):
    """Sample ids flagged when the gradient at the encoder output rows ``nan_rows`` (of ``batch``'s placeholders,
    in order) is NaN, the rest finite."""
    rows = torch.randn(batch.placeholders["image"].shape[1], 8, requires_grad=True)
    view = rows[:]  # a balanced micro-batch's embeds: a slice of the received rows
    with contract.recording_non_finite_losses() as records:
        contract.record_non_finite_gradients(batch, {"image": view})
        gradient = torch.ones_like(view)
        gradient[list(nan_rows)] = float("nan")
        view.backward(gradient)
    assert records.losses == []
    return sorted(int(i) for ids, bad in records.gradients for i in ids[bad].tolist())


@pytest.mark.parametrize("packed", [False, True])
def test_the_examples_whose_encoder_outputs_get_a_non_finite_gradient_are_recorded(packed):
    """Rows in placeholder order: 4 per image; each example's rows are its own, whichever row or place in a packed
    row it sits in."""
    import own_model
    spec = own_model.batch_spec()
    examples = _image_examples(3)
    batch = (collate_packed if packed else collate)(examples, spec)
    first = [0] + list(torch.cumsum(torch.tensor([e.num_items("image") * 4 for e in examples]), 0).tolist())
    ids = [e.sample_index for e in examples]
    assert _gradient_flagged(batch, []) == []
    assert _gradient_flagged(batch, [first[1]]) == [ids[1]]  # the second example's first row
    assert _gradient_flagged(batch, [first[3] - 1, first[0]]) == [ids[0], ids[2]]  # the last row, the first


def test_nothing_is_recorded_unless_asked():
    import own_model
    spec = own_model.batch_spec()
    output, loss_func = contract.forward_step(iter([collate(_examples(spec), spec)]), PlantedLosses({12}))
    assert loss_func.func is contract.loss_func
    assert contract._non_finite_records is None
    rows = torch.zeros(collate(_examples(spec), spec).placeholders["image"].shape[1], 8, requires_grad=True)
    contract.record_non_finite_gradients(collate(_examples(spec), spec), {"image": rows})
    assert not rows._backward_hooks


@pytest.fixture(scope="module")
def harness():
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()


def _image_examples(count: int):
    import own_model
    return [e for e in (own_model.example(i) for i in range(40)) if e.num_items("image")][:count]


def _one_train_step(build, examples, balanced: bool, verify: bool):
    """The compact trainer's train step over ``examples`` (a world of one, 2 micro-batches of 2) on own_model's
    model built by ``build``; its result, the data iterator (post-balancing's, where balanced) and the args."""
    import types

    import own_model
    from megatron.core.timers import Timers

    from megatron_orch.megatron import OrchestratorConfig
    from megatron_orch.trainer import loop

    spec = own_model.batch_spec()
    data = (collate(examples[2 * m:2 * m + 2], spec) for m in range(2))
    torch.manual_seed(7)
    model, optimizer, forward_backward_func, data = own_model.setup(
        build(), data, spec, balanced, config=OrchestratorConfig(verify_first_step=verify))
    args = types.SimpleNamespace(num_microbatches=2, seq_length=spec.seq_length, micro_batch_size=2,
                                 global_batch_size=4)
    result = loop.train_step(contract.forward_step, data, model, optimizer, types.SimpleNamespace(step=lambda **_: None),
                             args, Timers(0, "minmax"), forward_backward_func)
    return result, data, args


@pytest.mark.parametrize("balanced, verify", [(False, False), (True, False), (True, True)])
def test_the_trainers_stop_names_the_example_that_made_the_loss_nan(balanced, verify, harness, world_of_one, capsys):
    """own_model's model in the compact trainer's train step (a world of one), one example's image planted with a
    NaN: its encoder rows, so its own loss, are NaN, the other examples' finite (each row attends within
    itself); the stop names that example alone, upstream and balanced (where it is encoded and trained in
    micro-batches other than the loader's). The checked first step compares nothing NaN in both layouts: it
    says so, leaves the naming to the trainer's stop and checks the next step instead."""
    import own_model

    from megatron_orch.trainer import loop
    from megatron_orch.trainer.checkpointing import TrainState

    examples = _image_examples(4)
    planted = examples[2].sample_index
    examples[2].items["image"][0].view(-1)[5] = float("nan")
    result, data, args = _one_train_step(own_model.build_model, examples, balanced, verify)
    assert result["non_finite_samples"] == [planted], result
    if verify:
        assert ("> post-balancing: step not checked (--orch-verify-first-step): its loss is not finite in the loader's "
                "and the balanced layout alike") in capsys.readouterr().out
        assert data._checked.first and data._checked.unchecked == {"image"}  # the next step is checked
    state = TrainState(iteration=1, consumed_samples=4)
    with pytest.raises(loop.NonFiniteStepError, match=rf"^iteration 1: the lm loss is nan.*; the examples whose own "
                                                      rf"loss is not finite: sample ids \[{planted}\]; the run stops"):
        loop._stop_if_not_finite(args, state, result, None, [])


@pytest.mark.parametrize("in_both_layouts", [True, False])
def test_the_trainers_stop_names_the_example_whose_encoder_outputs_got_a_nan_gradient(in_both_layouts, harness,
                                                                                       world_of_one):
    """own_model's model whose backbone backward makes the gradient at one example's image rows NaN (sqrt at 0)
    with every loss finite, balanced, on the checked first step: the grad norm is NaN and the stop names that
    example alone. A model that does so in the balanced layout only differs between the layouts: refused, saying
    that the gradients are not finite in the balanced one."""
    import own_model

    from megatron_orch.megatron.first_step import FirstStepMismatchError
    from megatron_orch.trainer import loop
    from megatron_orch.trainer.checkpointing import TrainState

    examples = _image_examples(4)
    planted = examples[1].sample_index

    class NanGradientAtOneExample(own_model.TinyLlava):
        def forward(self, batch, embeds=None):
            if (embeds is not None or in_both_layouts) and planted in batch.sample_ids.tolist():
                rows = embeds["image"] if embeds is not None else self.encode("image", batch.items["image"])
                where = batch.placeholders["image"]
                owner = where[0] if not batch.is_packed else torch.searchsorted(
                    torch.tensor(batch.host_cu_seqlens[1:]), where[1], right=True)
                mine = (batch.sample_ids[owner] == planted).to(rows.device)
                rows = rows.clone()
                rows[mine] = rows[mine] + torch.sqrt(rows[mine] * 0)  # 0 forward; NaN backward
                embeds = {"image": rows}
            return super().forward(batch, embeds)

    build = lambda: own_model.build_model(NanGradientAtOneExample)  # noqa: E731
    if not in_both_layouts:
        with pytest.raises(FirstStepMismatchError, match=r"the same batch's gradients are not finite in the "
                                                         r"balanced layout but finite in the loader's one"):
            _one_train_step(build, examples, True, True)
        return
    result, _, args = _one_train_step(build, examples, True, True)
    assert torch.isfinite(torch.tensor(result["lm_loss"])) and result["non_finite_samples"] == [], result
    assert result["non_finite_gradient_samples"] == [planted], result
    state = TrainState(iteration=1, consumed_samples=4)
    with pytest.raises(loop.NonFiniteStepError, match=rf"^iteration 1: the grad norm is nan; the examples whose encoder "
                                                      rf"outputs got a non-finite gradient: sample ids \[{planted}\]; "):
        loop._stop_if_not_finite(args, state, result, None, [])
