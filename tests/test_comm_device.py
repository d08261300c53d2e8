"""Every tensor the project hands to a collective is on its group's communication device.

On a GPU, NCCL refuses CPU tensors; on CPU with gloo any tensor passes, so CI cannot see that class of
bug directly. These tests train with the communication device emulated as a second device
(:mod:`comm_device_emulation`): a balanced and an unbalanced run, DP 2, each a few steps with logging
every step and a checkpoint save, must hand every project collective tensors on that device, move
what arrives there to the compute device before computing with it, and still give equal losses.
"""
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed

ITERS = 3
COMMON = ["--model-config", "tiny", "--seq-length", "192", "--micro-batch-size", "2", "--global-batch-size", "8",
          "--train-iters", str(ITERS), "--lr", "1e-2", "--log-interval", "1", "--seed", "3",
          "--distributed-backend", "gloo",
          "--hidden-dropout", "0", "--attention-dropout", "0"]  # dropout masks follow the computing rank


def _train_on_emulated_device(rank, world_size, argv, out_dir):
    warnings.filterwarnings("ignore")
    import comm_device_emulation

    log = comm_device_emulation.install(project_modules=comm_device_emulation.PROJECT_MODULES + (__name__,))
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, loop as trainer

    args = arguments.parse_args(argv, world_size=world_size)
    try:
        records = trainer.pretrain(args, print_fn=lambda line: None)
    finally:
        parallel_state.destroy_model_parallel()
    result = {"checked": dict(log.checked), "unchecked": dict(log.unchecked), "violations": list(log.violations),
              "losses": [r.lm_loss for r in records]}
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


def test_unbalanced_training_uses_the_communication_device(baseline):
    _assert_on_communication_device(baseline, balanced=False)


def test_balanced_training_uses_the_communication_device(balanced):
    _assert_on_communication_device(balanced, balanced=True)


def test_the_checker_flags_a_host_tensor(baseline):
    for result in baseline:
        assert len(result["self_check"]) == 1, result["self_check"]
        assert "test_comm_device" in result["self_check"][0] and "on cpu" in result["self_check"][0]


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
