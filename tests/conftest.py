"""Shared fixtures, and hypothesis without per-example deadlines: on a machine shared with other
CPU-heavy processes an example's wall time says nothing about the code (speed targets are benchmarks)."""
import datetime
import multiprocessing.process
import os
import subprocess

import pytest
from hypothesis import settings

from megatron_orch import MEGATRON_CORE_NOISE

settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


def pytest_configure(config):
    config.addinivalue_line("markers", "distributed: starts processes (gloo ranks, torchrun, scripts); the fast "
                                       "tier, pytest -m 'not distributed', leaves them out")
    for message, category, *module in MEGATRON_CORE_NOISE:  # what the entry points ignore at start-up, no more
        config.addinivalue_line("filterwarnings", ":".join(["ignore", message, category.__name__, *module]))


# Programs a test may run without the marker: git (megatron-core asks it for its version at import),
# ldconfig (ctypes.util.find_library asks it where a library is, the first time torch's CUDA lookup runs) and
# fc-list (matplotlib asks it for the system's fonts when it builds its font cache, on a fresh machine).
_UNMARKED_PROGRAMS = {"git", "ldconfig", "fc-list"}


@pytest.fixture(autouse=True)
def _processes_need_the_distributed_marker(request, monkeypatch):
    """A test that starts a process (a spawned rank, torchrun, a script) without ``@pytest.mark.distributed``
    fails here, so the fast tier stays free of them and the marker cannot be forgotten."""
    if request.node.get_closest_marker("distributed") is not None:
        return
    name = request.node.nodeid
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def checked_popen(self, args, *rest, **kw):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        if os.path.basename(str(program).split()[0]) not in _UNMARKED_PROGRAMS:
            pytest.fail(f"{name} starts a process ({args!r}): mark it @pytest.mark.distributed")
        popen_init(self, args, *rest, **kw)

    def checked_start(self):
        pytest.fail(f"{name} starts a process ({self!r}): mark it @pytest.mark.distributed")

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", checked_start)


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
