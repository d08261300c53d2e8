"""The checks of megatron/first_step.py and the steps they run on, function by function (the multi-rank runs
are in test_first_step.py and test_own_model.py): which steps the checked step runs on, the item-by-item check
in training mode (one item too), the check's dropout switch and the DDP settings it restores."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_orch.megatron import first_step
from megatron_orch.megatron.post_balancing import CheckedSteps


def test_the_checked_steps_are_the_first_and_the_first_with_items_of_each_phase():
    checked = CheckedSteps(["image", "audio"])
    none, image, audio, both = ({"image": np.array(i), "audio": np.array(a)}
                                for i, a in (([0, 0], [0, 0]), ([0, 2], [0, 0]), ([0, 0], [1, 0]), ([1, 1], [1, 1])))
    assert [checked.due(step) for step in (none, none, image, image, both, audio, both)] == \
        [True, False, True, False, True, False, False]
    assert checked.unchecked == set()
    first_has_all = CheckedSteps(["image", "audio"])
    assert [first_has_all.due(step) for step in (both, image, audio)] == [True, False, False]


def test_a_checked_step_that_could_not_compare_is_checked_again_with_its_phases():
    """A checked step whose loss or gradients are not finite in both layouts compares nothing: the next step is
    checked, and the phases it held stay due until a step with their items is checked."""
    checked = CheckedSteps(["image", "audio"])
    image, none, both = ({"image": np.array(i), "audio": np.array(a)} for i, a in (([0, 2], [0, 0]), ([0, 0], [0, 0]),
                                                                                   ([1, 1], [1, 1])))
    assert checked.due(image)
    checked.again(image)
    assert [checked.due(step) for step in (none, none, image, image)] == [True, False, True, False]
    assert checked.unchecked == {"audio"}
    assert checked.due(both) and not checked.due(both)


class _Encoders(torch.nn.Module):
    """Two phases of linear encoders over items ``[n, 2, 4]`` -> rows ``[n * 2, 3]``; ``sbh``: the rows in
    Megatron's ``[s, b, h]`` order flattened (the items interleaved); ``norm``: BatchNorm over the call's rows."""

    def __init__(self, sbh: bool = False, norm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.encoders = torch.nn.ModuleDict({"image": torch.nn.Linear(4, 3), "audio": torch.nn.Linear(4, 3)})
        self.norm = torch.nn.BatchNorm1d(3) if norm else None
        if norm:
            self.encoders["image"].norm = self.norm
        self.sbh = sbh
        self.calls = []

    def phase_encoders(self):
        return dict(self.encoders)

    def encode(self, phase, items):
        self.calls.append((phase, items.shape[0]))
        rows = self.encoders[phase](items)
        rows = (rows.transpose(0, 1) if self.sbh else rows).flatten(0, 1)
        return self.norm(rows) if self.norm is not None else rows


def _items(n: int) -> torch.Tensor:
    return torch.randn(n, 2, 4, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("kind", ["sbh", "norm"])
def test_the_item_by_item_check_sees_interleaved_rows_and_batch_statistics_with_one_item_too(n, kind):
    """One item is checked with a second, different one: rows in ``[s, b, h]`` order and a BatchNorm in
    training mode (statistics over the call) are refused whatever the count, and the encoder's buffers (the
    running statistics) and mode are as before the check."""
    model = _Encoders(**{kind: True})
    model.train()
    first_step.check_encode(_Encoders(), "image", _items(n), rows_per_item=2)  # the plain encoder passes
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(ValueError, match=r"encode\('image', items\) is not item by item: .* in training mode"):
        first_step.check_encode(model, "image", _items(n), rows_per_item=2)
    assert all(torch.equal(b, saved) for b, saved in zip(model.buffers(), before))
    assert model.training and all(m.training for m in model.modules())


@pytest.fixture(scope="module")
def harness():
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()


def test_each_phase_is_checked_on_the_first_step_with_its_items(harness, world_of_one):
    """EncoderChecks: a phase without items in step 1 is checked on the first step that has some, and each
    phase once."""
    model = _Encoders()

    def step(image: int, audio: int):
        counts = {"image": image, "audio": audio}
        plan = SimpleNamespace(encoders={p: SimpleNamespace(example=np.zeros(c)) for p, c in counts.items()})
        return SimpleNamespace(plan=plan, inputs={p: _items(c) for p, c in counts.items()},
                               rows_per_item={"image": 2, "audio": 2})

    checks = first_step.EncoderChecks()
    checks.run(model, step(2, 0))
    assert {phase for phase, _ in model.calls} == {"image"}
    model.calls.clear()
    checks.run(model, step(3, 0))
    assert model.calls == []
    checks.run(model, step(1, 2))
    assert {phase for phase, _ in model.calls} == {"audio"}
    model.calls.clear()
    checks.run(model, step(2, 2))
    assert model.calls == [] and checks.pending == set()


def test_dropout_goes_off_without_eval_mode_and_comes_back():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden_dropout, self.attention_dropout = 0.1, 0.2  # as Megatron's layers read them
            self.dropout, self.alpha = torch.nn.Dropout(0.5), torch.nn.AlphaDropout(0.3)
            self.norm = torch.nn.BatchNorm1d(3)

    model = torch.nn.Sequential(Layer(), Layer())
    model.train()
    with first_step._dropout_off([model]) as dropout:
        assert all(m.training for m in model.modules()) and dropout.found
        assert [(layer.hidden_dropout, layer.attention_dropout, layer.dropout.p, layer.alpha.p)
                for layer in model] == [(0.0,) * 4] * 2
    assert [(layer.hidden_dropout, layer.attention_dropout, layer.dropout.p, layer.alpha.p)
            for layer in model] == [(0.1, 0.2, 0.5, 0.3)] * 2


def test_dropout_functions_at_literal_rates_go_off_too():
    """torch's dropout functions at a rate the model passes them (no module, no attribute to set): at rate 0
    inside the block, however called, and found; as called after it."""
    from torch.nn.functional import dropout as bound_dropout

    x = torch.ones(4, 8, 2, 2, 2)
    q = torch.randn(2, 1, 5, 4)
    calls = [lambda: F.dropout(x, 0.5), lambda: bound_dropout(x, p=0.5, training=True), lambda: F.dropout3d(x, 0.5),
             lambda: F.alpha_dropout(x, 0.5, True), lambda: torch.dropout(x, 0.5, True),
             lambda: torch.nn.Dropout(0.5)(x), lambda: torch.native_dropout(x, 0.5, True)[0],
             lambda: F.scaled_dot_product_attention(q, q, q, None, 0.5),
             lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)]
    without = F.scaled_dot_product_attention(q, q, q)
    with first_step._dropout_off([torch.nn.Linear(2, 2)]) as dropout:
        assert not dropout.found
        for k, call in enumerate(calls):
            torch.testing.assert_close(call(), x if k < 7 else without, msg=lambda m: f"call {k}: {m}")
        assert dropout.found
    for k, call in enumerate(calls):
        assert not torch.allclose(call(), x if k < 7 else without), k


@pytest.mark.parametrize("fails", [False, True])
def test_the_upstream_run_restores_ddps_overlapped_reduction(fails):
    """Off for the block (and grad_sync_func unset with it), as it was after, also when the block raises."""
    sync = object()
    chunks = [SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=True)),
              SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=True))]
    config = SimpleNamespace(grad_sync_func=sync)
    with pytest.raises(RuntimeError) if fails else first_step.contextlib.nullcontext():
        with first_step._reduced_at_the_end(chunks, config):
            assert [c.ddp_config.overlap_grad_reduce for c in chunks] == [False, False]
            assert config.grad_sync_func is None
            if fails:
                raise RuntimeError("the upstream run failed")
    assert [c.ddp_config.overlap_grad_reduce for c in chunks] == [True, True] and config.grad_sync_func is sync
    plain = [SimpleNamespace(ddp_config=SimpleNamespace(overlap_grad_reduce=False))]
    with first_step._reduced_at_the_end(plain, config):
        assert config.grad_sync_func is sync
    assert not plain[0].ddp_config.overlap_grad_reduce


def test_the_upstream_run_leaves_buffers_as_it_found_them():
    norm = torch.nn.BatchNorm1d(3)
    before = [b.clone() for b in norm.buffers()]
    with first_step._buffers_unchanged([norm]):
        norm(torch.randn(8, 3))
        assert not torch.equal(norm.running_mean, before[0])
    assert all(torch.equal(b, saved) for b, saved in zip(norm.buffers(), before))
