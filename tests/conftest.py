"""Shared fixtures, and hypothesis without per-example deadlines: on a machine shared with other
CPU-heavy processes an example's wall time says nothing about the code (speed targets are benchmarks)."""
import datetime

import pytest
from hypothesis import settings

from megatron_orch import MEGATRON_CORE_NOISE

# process_guard: a test that starts a process needs the distributed marker; pytester: its probe
pytest_plugins = ["process_guard", "pytester"]

settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts processes (gloo ranks, torchrun, scripts); the fast "
                                       "tier, pytest -m 'not distributed', leaves them out")
    for message, category, *module in MEGATRON_CORE_NOISE:  # what the entry points ignore at start-up, no more
        config.addinivalue_line("filterwarnings", ":".join(["ignore", message, category.__name__, *module]))


@pytest.fixture(scope="module")
def world_of_one():
    """A gloo world of one process with megatron-core's model-parallel state (TP 1, PP 1) and RNG tracker,
    for single-process model tests (the test module installs the CPU harness)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from dist_utils import scaled

    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=scaled(60)))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
