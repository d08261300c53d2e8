"""Shared fixtures, and hypothesis without per-example deadlines: on a machine shared with other
CPU-heavy processes an example's wall time says nothing about the code (speed targets are benchmarks)."""
import datetime
from pathlib import Path

import pytest
from hypothesis import settings

from megatron_orch import MEGATRON_CORE_NOISE

TESTS = Path(__file__).resolve().parent

# process_guard: a test that starts a process needs the distributed marker; pytester: its probe
pytest_plugins = ["process_guard", "pytester"]

settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


# Test files that import no torch, so no megatron-core (tests/test_layers.py checks it): the planning layers, the
# simulator, the planning benchmark, the harness's probes. Nothing in them can differ between the megatron-core
# set-ups, so .ci/run runs them on the 0.19.2 leg only (-m "not torch_free" on the 0.16.1 leg). A folder ends in /.
TORCH_FREE_TESTS = ("balance/", "orchestrator/", "sim/", "bench/test_bench_planning.py", "scripts/test_setup_env.py",
                    "test_layers.py", "test_process_guard.py")
# test_registry trains with a plugin; test_step_plan draws a batch from the (torch) synthetic dataset
NOT_TORCH_FREE = ("balance/test_registry.py", "orchestrator/test_step_plan.py")


def is_torch_free(path) -> bool:
    """Is this test file (a path under tests/) one of TORCH_FREE_TESTS?"""
    path = Path(path).resolve()
    name = path.relative_to(TESTS).as_posix() if path.is_relative_to(TESTS) else None
    return name is not None and name not in NOT_TORCH_FREE and any(
        name.startswith(entry) if entry.endswith("/") else name == entry for entry in TORCH_FREE_TESTS)


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts processes (gloo ranks, torchrun, scripts); the fast "
                                       "tier, pytest -m 'not distributed', leaves them out")
    config.addinivalue_line("markers", "torch_free: in a test file of TORCH_FREE_TESTS (tests/conftest.py): imports no "
                                       "torch, so CI runs it on one megatron-core leg only")
    for message, category, *module in MEGATRON_CORE_NOISE:  # what the entry points ignore at start-up, no more
        config.addinivalue_line("filterwarnings", ":".join(["ignore", message, category.__name__, *module]))


def pytest_collection_modifyitems(items):
    for item in items:
        if is_torch_free(item.path):
            item.add_marker(pytest.mark.torch_free)


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
