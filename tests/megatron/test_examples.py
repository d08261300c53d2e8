"""The examples a user starts from, run as a user runs them (``torchrun``, DP 2 on CPU), and the training API
for any loop (``post_balance`` around megatron-core's schedule, in ``examples/own_model.py``'s loop, shaped
like Megatron-Bridge's ``train_step``; Bridge itself imports Transformer Engine and modelopt, so it does not
run here) at DP 4: balancing off vs on, losses and every parameter within 1e-5 (dropout 0)."""
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import example_modules  # noqa: F401 -- examples/ on the path
from dist_utils import TRAINED_PARAMS_ATOL, run_distributed, scaled

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")


@pytest.mark.parametrize("example", ["own_model.py", "mimo_model.py"])
def test_example_runs_with_torchrun(example):
    """A complete DP-2 run, balancing on then off from the same weights: the checked first step passes and
    the losses agree."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(REPO / "examples" / example), "--iters", "3"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=scaled(120))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"> post-balancing: step checked \(--orch-verify-first-step, phases \w+, image, training "
                     r"mode\): the loader's and the balanced layout agree", result.stdout), result.stdout
    difference = re.search(r"balancing off vs on, DP 2: largest relative loss difference (\S+)", result.stdout)
    assert difference and float(difference.group(1)) <= 1e-5, result.stdout
    losses = re.findall(r"^ *(balanced|upstream): (.*)$", result.stdout, re.M)
    assert [name for name, _ in losses] == ["balanced", "upstream"] and all(len(v.split()) == 3 for _, v in losses)


def _dp4(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    import own_model
    from megatron_orch.megatron import ModalityAwareSchedule, post_balancing

    start, moved = post_balancing.start_all_to_all_items, [0.0]

    def accounted(tensors, layouts, transfer, group, routes=None):
        item_bytes = sum(layout.rows * layout.row_numel * 4 for layout in layouts)
        moved[0] += transfer.moved_bytes(item_bytes, np.zeros(world_size, dtype=np.int64)).off_gpu
        return start(tensors, layouts, transfer, group, routes)

    post_balancing.start_all_to_all_items = accounted
    own_model.initialize()
    try:
        upstream, balanced = own_model.train(False, 3), own_model.train(True, 3)
        assert isinstance(balanced["schedule"], ModalityAwareSchedule) and balanced["schedule"].first_step_check
        torch.save({"upstream": {k: upstream[k] for k in ("losses", "params")},
                    "balanced": {k: balanced[k] for k in ("losses", "params")}, "moved_bytes": moved[0]},
                   Path(out_dir) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()


def test_any_loop_api_at_dp4_balancing_off_vs_on(tmp_path):
    run_distributed(_dp4, 4, str(tmp_path), timeout_s=240.0)
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        upstream, balanced = got["upstream"], got["balanced"]
        assert got["moved_bytes"] > 0  # the plans moved examples: not the loader's assignment again
        assert upstream["losses"][-1] < upstream["losses"][0]  # it learns
        assert balanced["losses"] == pytest.approx(upstream["losses"], rel=1e-5), rank
        for name, want in upstream["params"].items():
            torch.testing.assert_close(balanced["params"][name], want, rtol=1e-5, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m: f"rank {rank} parameter {name}: {m}")
