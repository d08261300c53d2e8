"""The first step of a model of one's own, on two gloo ranks (``examples/own_model.py``'s loop and models):

* an encoder that returns Megatron's ``[s, b, h]`` (MIMO then flattens it as ``[b, s, h]``: balanced and
  upstream diverge silently) and a projector used by ``encode`` but left out of ``phase_encoders`` (with
  ``--overlap-grad-reduce`` and one image in the global batch, the rank without it fails inside DDP) stop
  on the first step, on every rank, before any encoder output moves;
* the checked first step stops an adapter that scales the inserted embeddings by 0.999 at step 1, and on a
  correct model costs one more forward-backward (the upstream one) and trains what the unchecked run trains,
  also with Megatron DDP's overlapped gradient reduction and with the distributed optimizer.
"""
import warnings
from pathlib import Path

import pytest
import torch

import example_modules  # noqa: F401 -- examples/ on the path
from dist_utils import run_distributed

pytestmark = pytest.mark.distributed
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
TIMEOUT_S = 240.0


def _count_moves() -> list:
    """Record the schedule's encoder-output moves (each a collective over the DP group) from now on."""
    from megatron_orch.megatron.schedule import ModalityAwareSchedule
    moves, start = [], ModalityAwareSchedule._start_move

    def counted(self, step, phase, *args, **kwargs):
        moves.append(phase)
        return start(self, step, phase, *args, **kwargs)

    ModalityAwareSchedule._start_move = counted
    return moves


def _one_image_a_step(rank: int, steps: int) -> list:
    """Micro-batches of two ranks whose every global batch holds one image, on rank 0 (``own_model``'s data)."""
    import own_model
    spec = own_model.batch_spec()
    none = [i for i in range(400) if own_model.example(i).num_items("image") == 0][:7 * steps]
    one = [i for i in range(400) if own_model.example(i).num_items("image") == 1][:steps]
    batches = []
    for step in range(steps):
        mine = ([one[step]] + none[7 * step:7 * step + 7])[rank * 4:rank * 4 + 4]
        batches += [own_model.collate([own_model.example(i) for i in mine[m * 2:m * 2 + 2]], spec) for m in range(2)]
    return batches


def _encoder_giving_s_b_h(rank, world_size):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    import own_model
    from example_modules import mimo_example
    from megatron_orch.comm.status import PeerFailedError

    mimo_model = mimo_example()

    class SBHViT(own_model.PatchViT):
        def forward(self, tiles):
            return super().forward(tiles).transpose(0, 1)  # Megatron's [s, n, h], as it leaves the block

    def sbh_mimo():
        model = mimo_model.build_mimo(SBHViT)
        own_model.redirect_for_cpu()
        return model

    moves = _count_moves()
    own_model.initialize()
    try:
        with pytest.raises((ValueError, PeerFailedError), match=r"encode\('image', items\) is not item by item"):
            own_model.train(True, 1, sbh_mimo, mimo_model.spec_of)
        assert moves == []
    finally:
        parallel_state.destroy_model_parallel()


def test_an_encoder_giving_s_b_h_stops_every_rank_before_the_moves():
    run_distributed(_encoder_giving_s_b_h, 2, timeout_s=TIMEOUT_S)


def _projector_outside_phase_encoders(rank, world_size):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    import own_model
    from megatron_orch.comm.status import PeerFailedError

    class ProjectorOutside(own_model.TinyLlava):
        def phase_encoders(self):
            return {"image": self.image_encoder.vit}

    moves = _count_moves()
    own_model.initialize()
    try:
        model, optimizer, schedule, data = own_model.setup(  # two steps: DDP's own check comes at step 2
            own_model.build_model(ProjectorOutside), iter(_one_image_a_step(rank, 2)), own_model.batch_spec(),
            balanced=True, ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True))
        with pytest.raises((ValueError, PeerFailedError), match=r"encode\('image', items\) uses parameters outside "
                           r"phase_encoders\(\)\['image'\]: image_encoder\.projector\."):
            for _ in range(2):
                own_model.train_step(schedule, data, model, optimizer)
        assert moves == []  # on the first step
    finally:
        parallel_state.destroy_model_parallel()


def test_a_projector_outside_phase_encoders_stops_every_rank_before_the_moves():
    run_distributed(_projector_outside_phase_encoders, 2, timeout_s=TIMEOUT_S)


def _checked(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig

    import own_model
    from megatron_orch.megatron import FirstStepMismatchError, OrchestratorConfig

    counts = {}
    stock = own_model.get_forward_backward_func

    def counting_schedule(*args, **kwargs):
        schedule = stock(*args, **kwargs)

        def run(**kw):
            counts["schedule"] += 1
            return schedule(**kw)
        return run

    own_model.get_forward_backward_func = counting_schedule

    def run(model_class, verify: bool, iters: int, data=None, ddp_config=None):
        counts.update(schedule=0, backbone=0, encoded=0)
        torch.manual_seed(7)
        module = own_model.build_model(model_class)
        module.language_model.register_forward_pre_hook(
            lambda *_: counts.__setitem__("backbone", counts["backbone"] + 1))
        module.image_encoder.register_forward_pre_hook(
            lambda _, inputs: counts.__setitem__("encoded", counts["encoded"] + inputs[0].shape[0]))
        spec = own_model.batch_spec()
        data = own_model.microbatches(spec, rank, world_size, iters) if data is None else data
        model, optimizer, schedule, data = own_model.setup(module, data, spec, True, ddp_config=ddp_config,
                                                           config=OrchestratorConfig(verify_first_step=verify))
        losses, per_step = [], []
        for _ in range(iters):
            losses.append(own_model.train_step(schedule, data, model, optimizer))
            per_step.append(dict(counts))
        return {"losses": losses, "per_step": per_step, "check": schedule.first_step_check,
                "params": {n: p.detach().clone() for n, p in module.named_parameters()}}

    class ScaledAdapter(own_model.TinyLlava):
        """A wrong adapter: the balanced path's embeddings are 0.999 of what the model's own path inserts."""

        def forward(self, batch, embeds=None):
            if embeds is not None:
                embeds = {phase: rows * 0.999 for phase, rows in embeds.items()}
            return super().forward(batch, embeds)

    own_model.initialize()
    try:
        checked, unchecked = run(None, True, 2), run(None, False, 2)
        with pytest.raises(FirstStepMismatchError,  # every rank the same verdict, no rank quoting another
                           match=r"checked first step .*phase '(text|image)' differs between the loader's and the "
                                 r"balanced layout of the same batch: (its gradient norm|the loss)"):
            run(ScaledAdapter, True, 1)
        wrong = dict(counts)
        home_items = sum(b.items["image"].shape[0]
                         for b in list(own_model.microbatches(own_model.batch_spec(), rank, world_size, 1)))
        # Megatron DDP's overlapped reduction, on data whose upstream layout leaves rank 1's encoder without
        # gradients: DDP calibrates it on the balanced run, as without the check
        overlapped = [run(None, verify, 2, iter(_one_image_a_step(rank, 2)), DistributedDataParallelConfig(
            overlap_grad_reduce=True))["losses"] for verify in (True, False)]
        # the distributed optimizer: each rank compares the gradients in its own shard of every bucket
        sharded = run(None, True, 2, ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True))
        torch.save({"checked": checked, "unchecked": unchecked, "wrong": wrong, "home_items": home_items,
                    "overlapped": overlapped, "sharded": sharded}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


def test_the_checked_first_step_stops_a_wrong_adapter_at_the_cost_of_one_step(tmp_path):
    run_distributed(_checked, 2, str(tmp_path), timeout_s=TIMEOUT_S)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        checked, unchecked = got["checked"], got["unchecked"]
        # it trains on the balanced layout: the same losses and parameters as without the check
        assert checked["losses"] == unchecked["losses"], rank
        for name, value in unchecked["params"].items():
            assert torch.equal(checked["params"][name], value), (rank, name)
        assert checked["check"]["loss"] <= 1e-5 and checked["check"]["gradient norms"] <= 1e-5, checked["check"]
        assert unchecked["check"] is None
        # its cost: step 1 runs megatron-core's schedule twice (upstream, then balanced), the backbone over
        # twice the micro-batches, the encoders over this rank's loaded items once more; step 2 as unchecked
        first, second = checked["per_step"][0], checked["per_step"][1]
        plain = unchecked["per_step"][0]
        assert (first["schedule"], plain["schedule"]) == (2, 1)
        assert first["backbone"] == 2 * plain["backbone"]
        assert first["encoded"] - plain["encoded"] == got["home_items"] > 0
        for key in ("schedule", "backbone", "encoded"):
            assert second[key] - first[key] == unchecked["per_step"][1][key] - plain[key], key
        # the wrong adapter stopped within step 1, after the two runs of it
        assert got["wrong"]["schedule"] == 2, got["wrong"]
        assert got["overlapped"][0] == got["overlapped"][1], got["overlapped"]
        sharded = got["sharded"]
        assert sharded["check"]["gradient norms"] <= 1e-5 and sharded["check"]["loss"] <= 1e-5, sharded["check"]
        assert sharded["losses"] == pytest.approx(unchecked["losses"], rel=1e-6)
