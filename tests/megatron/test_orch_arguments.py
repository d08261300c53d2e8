"""The ``--orch-*`` command line beside Megatron-LM's own flags (megatron/orch_arguments.py)."""
import argparse

import pytest

from megatron_orch.megatron.orch_arguments import add_orch_args, orch_config_from_args


@pytest.mark.parametrize("upstream", [["--sequence-packing-scheduler", "dp_balanced"], ["--use-varlen-dataset"]])
@pytest.mark.parametrize("switch", ["--orch-post-balancing", "--orch-shadow"])
def test_upstreams_own_packing_scheduler_is_refused_by_name(upstream, switch):
    """Megatron-LM's DP-balancing packing scheduler (after core_v0.19.0) moves examples in train_step: refused
    beside post-balancing (or shadow mode) before anything runs; without either it is Megatron's business."""
    parser = add_orch_args(argparse.ArgumentParser())
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--sequence-packing-scheduler", default=None)
    parser.add_argument("--use-varlen-dataset", action="store_true")
    with pytest.raises(ValueError, match=f"^{switch} with {upstream[0]}: Megatron-LM's own DP-balancing packing"):
        orch_config_from_args(parser.parse_args([switch, *upstream]))
    assert orch_config_from_args(parser.parse_args(upstream)) is None
    assert orch_config_from_args(parser.parse_args([switch])) is not None
