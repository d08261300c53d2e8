"""The examples whose own loss is not finite, found per example by the contract's forward step while a trainer
records them (no host sync per micro-batch): in padded and packed micro-batches, whole or one rank's part of the
sequence under context parallelism, and none recorded when no one asks. One process, no collectives."""
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
    return sorted(int(i) for ids, bad in records for i in ids[bad].tolist()), loss


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


def test_nothing_is_recorded_unless_asked():
    import own_model
    spec = own_model.batch_spec()
    output, loss_func = contract.forward_step(iter([collate(_examples(spec), spec)]), PlantedLosses({12}))
    assert loss_func.func is contract.loss_func
    assert contract._non_finite_records is None


@pytest.fixture(scope="module")
def harness():
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()


@pytest.mark.parametrize("balanced", [False, True])
def test_the_trainers_stop_names_the_example_that_made_the_loss_nan(balanced, harness, world_of_one):
    """own_model's model in the compact trainer's train step (a world of one), one example's image planted with a
    NaN: its encoder rows, so its own loss, are NaN, the other examples' finite (each row attends within
    itself); the stop names that example alone, upstream and balanced (where it is encoded and trained in
    micro-batches other than the loader's)."""
    import types

    import own_model
    from megatron.core.timers import Timers

    from megatron_orch.megatron import OrchestratorConfig
    from megatron_orch.trainer import loop
    from megatron_orch.trainer.checkpointing import TrainState

    spec = own_model.batch_spec()
    examples = [own_model.example(i) for i in range(40) if own_model.example(i).num_items("image")][:4]
    planted = examples[2].sample_index
    examples[2].items["image"][0].view(-1)[5] = float("nan")
    data = (collate(examples[2 * m:2 * m + 2], spec) for m in range(2))
    torch.manual_seed(7)
    model, optimizer, forward_backward_func, data = own_model.setup(  # the checked step compares no NaN
        own_model.build_model(), data, spec, balanced, config=OrchestratorConfig(verify_first_step=False))
    args = types.SimpleNamespace(num_microbatches=2, seq_length=spec.seq_length, micro_batch_size=2,
                                 global_batch_size=4)
    result = loop.train_step(contract.forward_step, data, model, optimizer, types.SimpleNamespace(step=lambda **_: None),
                             args, Timers(0, "minmax"), forward_backward_func)
    assert result["non_finite_samples"] == [planted], result
    state = TrainState(iteration=1, consumed_samples=4)
    with pytest.raises(loop.NonFiniteStepError, match=rf"^iteration 1: the lm loss is nan.*; the examples whose own "
                                                      rf"loss is not finite: sample ids \[{planted}\]; the run stops"):
        loop._stop_if_not_finite(args, state, result, None, [])
