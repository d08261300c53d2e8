"""Shadow mode (``--orch-shadow``): every step planned and logged, nothing moved. On two gloo ranks, the compact
trainer runs the scripted stream of ``test_post_balancing`` (no images, audio on one rank, one long
example, every heavy example on one rank) in shadow mode and then with post-balancing: the shadow run's
logged figures (each phase's cost max/mean before and after, the MB, the modeled step time saved) are the
ones the balanced run logs on the same data with the same planner; counted by the byte accountant
(``Transfer.moved_bytes`` of every all-to-all started), the shadow run moves nothing and the balanced run
moves data; both train alike (losses within 1e-5, dropout 0)."""
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from test_post_balancing import COMMON, MBS, NUM_MB, scripted_iterator
from megatron_orch.mllm.task import MLLM_TASK

pytestmark = pytest.mark.distributed
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

ITERS, DP = 4, 2
RUNS = {"shadow": ["--orch-shadow", "--orch-gpus-per-node", "2", "--orch-log-level", "1"],  # the full line
        "balanced": ["--orch-post-balancing", "--orch-gpus-per-node", "2"]}
PLANNED = ("intra-node MB", "inter-node MB", "step saved %")  # besides each phase's before/after
TIMEOUT_S = 300.0


def _runs(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.megatron import post_balancing
    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments, loop as trainer

    providers.build_train_data_iterator = scripted_iterator
    start, moved = post_balancing.start_all_to_all_items, []

    def accounted(tensors, layouts, transfer, group, routes=None):
        """The bytes this all-to-all sends off their rank, by the project's byte accountant."""
        item_bytes = sum(layout.rows * layout.row_numel * torch.empty(0, dtype=layout.dtype).element_size()
                         for layout in layouts)
        moved[-1] += transfer.moved_bytes(item_bytes, np.arange(world_size) // 2).off_gpu
        return start(tensors, layouts, transfer, group, routes)

    post_balancing.start_all_to_all_items = accounted
    results = {}
    for name, flags in RUNS.items():
        moved.append(0.0)
        lines = []
        argv = COMMON + ["--train-iters", str(ITERS), "--global-batch-size", str(MBS * NUM_MB * world_size), *flags]
        try:
            records = trainer.pretrain(arguments.parse_args(MLLM_TASK, argv, world_size=world_size), MLLM_TASK, print_fn=lines.append)
        finally:
            parallel_state.destroy_model_parallel()
        results[name] = {"moved_bytes": moved[-1], "lines": lines, "losses": [r.lm_loss for r in records],
                         "post_balancing": [r.post_balancing for r in records]}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def test_shadow_mode_logs_what_balancing_then_achieves_and_moves_nothing(tmp_path):
    run_distributed(_runs, DP, str(tmp_path), timeout_s=TIMEOUT_S)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(DP)]
    for rank in ranks:
        assert rank["shadow"]["moved_bytes"] == 0.0
        assert rank["balanced"]["moved_bytes"] > 0  # the accountant sees the balanced run's moves
    logged = ranks[-1]  # the compact trainer logs from the last rank
    shadow, balanced = logged["shadow"], logged["balanced"]
    assert len(shadow["post_balancing"]) == len(balanced["post_balancing"]) == ITERS
    for step, (would, did) in enumerate(zip(shadow["post_balancing"], balanced["post_balancing"]), 1):
        assert would["applied"] == 0.0 and did["applied"] == 1.0
        planned = [name for name in did if name.endswith((" before", " after"))] + list(PLANNED)
        assert {name: would[name] for name in planned} == pytest.approx({name: did[name] for name in planned}), step
    heavy = shadow["post_balancing"][3]  # every heavy example on one rank: balancing would gain
    assert heavy["llm before"] > heavy["llm after"] and heavy["step saved %"] > 0, heavy
    assert heavy["intra-node MB"] > 0, heavy
    assert shadow["losses"] == pytest.approx(balanced["losses"], rel=1e-5)
    line = next(line for line in shadow["lines"] if line.lstrip().startswith("iteration        4/"))
    assert "post-balancing shadow (planned, not applied) cost max/mean over DP before->after" in line, line
    assert "would move MB intra/inter node" in line and "modeled step time saved" in line, line
    assert any("post-balancing shadow mode (every step planned and logged, nothing moved)" in line
               for line in ranks[0]["shadow"]["lines"])
