"""Every tensor the project hands to a collective is on its group's communication device, and a balanced
step makes the host wait for the device only where it must.

On a GPU, NCCL refuses CPU tensors; on CPU with gloo any tensor passes, so CI cannot see that class of
bug directly. These tests train with the communication device emulated as a second device
(:mod:`comm_device_emulation`): a balanced and an unbalanced run, DP 2, each a few steps with a log line
at the end and a checkpoint save, must hand every project collective tensors on that device, move
what arrives there to the compute device before computing with it, and still give equal losses.

The same runs record every host sync a GPU run would have (reads to the host, data-dependent sizes,
blocking copies to the device, device synchronisations, barriers, event waits): in a step that logs
nothing, the project's own are exactly the ones listed in :data:`BALANCED_STEP_SYNCS` (and
:data:`UPSTREAM_STEP_SYNCS`), so a new one fails the test.
"""
import json
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from megatron_orch.mllm.task import MLLM_TASK

ITERS = 4
STEADY_STEPS = (2, 3)  # neither the first step (it fills the iterator's pipeline) nor a logging one
COMMON = ["--model-config", "tiny", "--seq-length", "192", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--train-iters", str(ITERS), "--lr", "1e-2", "--log-interval", str(ITERS), "--seed", "3",
          "--distributed-backend", "gloo",
          "--hidden-dropout", "0", "--attention-dropout", "0"]  # dropout masks follow the computing rank


def _train_on_emulated_device(rank, world_size, argv, out_dir):
    warnings.filterwarnings("ignore")
    import comm_device_emulation

    log = comm_device_emulation.install(project_modules=comm_device_emulation.PROJECT_MODULES + (__name__,))
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, loop as trainer

    train_step, losses = trainer.train_step, []

    def counted_step(*args, **kwargs):
        log.step += 1  # syncs from here to the next step's start are this step's
        result = train_step(*args, **kwargs)
        losses.append(result["lm_loss"])
        return result

    trainer.train_step = counted_step
    args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
    try:
        trainer.pretrain(args, MLLM_TASK, print_fn=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    result = {"checked": dict(log.checked), "unchecked": dict(log.unchecked), "violations": list(log.violations),
              "losses": losses, "syncs": list(log.syncs)}
    # The checker itself: a CPU tensor handed to a collective from checked code is a violation.
    dist.all_reduce(torch.ones(1))
    result["self_check"] = log.violations[len(result["violations"]):]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _run(tmp_path: Path, name: str, *flags: str) -> list:
    out_dir = tmp_path / name
    out_dir.mkdir()
    argv = COMMON + ["--save", str(out_dir / "checkpoints"), *flags]
    run_distributed(_train_on_emulated_device, 2, argv, str(out_dir), timeout_s=300.0)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("emulated"), "baseline")


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("emulated"), "balanced", "--orch-post-balancing",
                "--orch-no-background-planning")


def _assert_on_communication_device(results, balanced: bool):
    for rank, result in enumerate(results):
        assert result["violations"] == [], f"rank {rank}:\n" + "\n".join(result["violations"])
        sites = " ".join(result["checked"])
        # Not vacuous: the project's own collectives were seen (metrics every step; with post-balancing
        # the size gather, the digest check and the all-to-alls of inputs, embeddings and gradients).
        assert "max_and_mean_over_group" in sites or "all_gather_to_host" in sites, sites
        assert "all_reduce @ megatron_orch.trainer.loop" in sites, sites
        if balanced:
            assert "all_to_all_single @ megatron_orch.comm.alltoall" in sites, sites
            assert sum(n for site, n in result["checked"].items() if "all_to_all_single" in site) >= 5 * ITERS


@pytest.mark.distributed
def test_unbalanced_training_uses_the_communication_device(baseline):
    _assert_on_communication_device(baseline, balanced=False)


@pytest.mark.distributed
def test_balanced_training_uses_the_communication_device(balanced):
    _assert_on_communication_device(balanced, balanced=True)


# (kind, where) -> count per steady step: ``where`` is the first project frame outside megatron_orch.comm.
BALANCED_STEP_SYNCS = {
    # the control collective: status, the next step's sizes, this plan's digest (post_balancing._agree)
    ("read", "megatron_orch.megatron.post_balancing:_agree"): 1,
    # the text (ids, mask) read back when the micro-batches are collated: a wait for the event after its copy
    ("event wait", "megatron_orch.megatron.post_balancing:<lambda>"): 2,
    # after the optimizer step (which read the gradient norm): the global loss, and the loader's events
    ("read", "megatron_orch.trainer.loop:train_step"): 1,
    ("read", "megatron_orch.trainer.training_log:gather_data_events"): 1,
}
UPSTREAM_STEP_SYNCS = {
    ("read", "megatron_orch.trainer.faults:read_step"): 1,  # every rank read its step, or all raise
    ("read", "megatron_orch.trainer.loop:train_step"): 1,
    ("read", "megatron_orch.trainer.training_log:gather_data_events"): 1,
}
PROJECT = ("megatron_orch", "pretrain_mllm", "test_comm_device")


def _project_syncs(result, step):
    """The project's syncs in ``step``, counted by (kind, where). A sync is the project's when its innermost
    caller is project code, or when it comes from megatron-core's timers (the trainer picks the timers)."""
    counts = Counter()
    for sync in result["syncs"]:
        stack = sync["stack"]
        if sync["step"] != step or not (stack[0].startswith(PROJECT) or stack[0].startswith("megatron.core.timers")):
            continue
        where = next((f for f in stack if f.startswith(PROJECT) and not f.startswith("megatron_orch.comm.")), stack[0])
        counts[(sync["kind"], where)] += 1
    return counts


def _assert_step_syncs(results, expected):
    for rank, result in enumerate(results):
        for step in STEADY_STEPS:
            got = _project_syncs(result, step)
            assert got == Counter(expected), (
                f"rank {rank}, step {step}: host syncs of the project's code differ from the budget\n"
                + "\n".join(f"  {n} x {kind} at {where}" for (kind, where), n in sorted(got.items()))
                + "\nexpected:\n" + "\n".join(f"  {n} x {kind} at {where}" for (kind, where), n in expected.items()))


@pytest.mark.distributed
def test_a_balanced_step_syncs_the_host_only_where_it_must(balanced):
    """Routes uploaded once without blocking, no search of the tokens in the model, no synchronising timers,
    no barriers, one control collective: a new host sync in the balanced step fails here."""
    _assert_step_syncs(balanced, BALANCED_STEP_SYNCS)


@pytest.mark.distributed
def test_an_upstream_step_syncs_the_host_only_where_it_must(baseline):
    _assert_step_syncs(baseline, UPSTREAM_STEP_SYNCS)


def _syncs_seen(rank, world_size):
    """The recorder itself: each kind of sync is seen, on the emulated device and inside a module's forward."""
    warnings.filterwarnings("ignore")
    import comm_device_emulation

    log = comm_device_emulation.install(project_modules=comm_device_emulation.PROJECT_MODULES + (__name__,))
    from megatron_orch.comm.device import HostCopy, communication_device

    device = communication_device()
    x = torch.arange(6, device=device)
    int(x[1]), x.cpu(), x.nonzero(), x[x > 2], torch.ones(3).to(device), x.to("cpu", non_blocking=True)
    torch.ones(3).to(device, non_blocking=True)
    HostCopy(x).result()

    class Searching(torch.nn.Module):
        def forward(self, tokens):
            return (tokens == 3).nonzero(), tokens.sum().item()

    Searching()(torch.arange(5))
    kinds = [sync["kind"] for sync in log.syncs]
    assert kinds == ["read", "read", "data-dependent size", "data-dependent size", "blocking copy to the device",
                     "event wait", "data-dependent size (model)", "read (model)"], kinds
    assert all(sync["stack"][0].startswith(__name__) for sync in log.syncs), log.syncs


@pytest.mark.distributed
def test_the_recorder_sees_each_kind_of_host_sync():
    run_distributed(_syncs_seen, 1)


@pytest.mark.distributed
def test_the_checker_flags_a_host_tensor(baseline):
    for result in baseline:
        assert len(result["self_check"]) == 1, result["self_check"]
        assert "test_comm_device" in result["self_check"][0] and "on cpu" in result["self_check"][0]


@pytest.mark.distributed
def test_emulated_runs_train_alike(baseline, balanced):
    """The emulated device carries the data: balanced and baseline losses agree on it too."""
    assert len(baseline[-1]["losses"]) == ITERS and all(torch.isfinite(torch.tensor(baseline[-1]["losses"])))
    assert balanced[-1]["losses"] == pytest.approx(baseline[-1]["losses"], rel=1e-5)


def _communication_device_of_gloo(rank, world_size):
    from megatron_orch.comm.device import communication_device, host_to_device

    assert communication_device() == torch.device("cpu")
    staged = host_to_device([torch.ones(2, 3), torch.zeros(0, 3)], communication_device(), torch.float32, (3,))
    assert staged.shape == (2, 3) and staged.device.type == "cpu"
    assert host_to_device([], torch.device("cpu"), torch.long, (2,)).shape == (0, 2)


@pytest.mark.distributed
def test_gloo_communicates_on_the_cpu():
    run_distributed(_communication_device_of_gloo, 1)


def test_nccl_communicates_on_this_ranks_gpu(monkeypatch):
    """The NCCL branch, which the emulation above replaces: a group whose backend is NCCL takes its
    tensors on this rank's current GPU (faked here: no GPU on CI), any other backend on the CPU."""
    from megatron_orch.comm import device

    monkeypatch.setattr(device.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(device.torch.cuda, "current_device", lambda: 3)
    assert device.communication_device() == torch.device("cuda", 3)
    monkeypatch.setattr(device.dist, "get_backend", lambda group=None: "gloo")
    assert device.communication_device() == torch.device("cpu")
