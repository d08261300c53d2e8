"""The planning kernels' numba cache is stamped with every kernel file: a kernel that calls one of another file is
compiled again after that file changed (numba's own stamp, the kernel's file alone, keeps the old machine code)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from timeouts import scaled
from megatron_orch.balance import _jit, _kernels, _plan_kernels, _transport, exchange
from megatron_orch.balance._jit import KERNEL_FILES, StampedByEveryKernel, sources_stamp

BALANCE = Path(_jit.__file__).parent


def test_every_file_that_defines_a_kernel_is_stamped():
    package = BALANCE.parent
    defining = {path.relative_to(package).as_posix() for path in package.rglob("*.py")
                if "numba.njit(" in path.read_text()}
    assert defining == {Path("balance", name).as_posix() for name in KERNEL_FILES}


def test_the_kernels_are_cached_under_the_stamp_of_every_kernel_file():
    stamp = sources_stamp([BALANCE / name for name in KERNEL_FILES])
    for kernel in (_kernels.auto, _kernels.refine, _plan_kernels._rank_starts, _transport.transport, exchange._deal):
        locator = kernel._cache._impl.locator
        assert isinstance(locator, StampedByEveryKernel), kernel
        assert locator.get_source_stamp()[1] == stamp
        assert Path(locator.get_cache_path()) == Path(kernel.py_func.__code__.co_filename).parent / "__pycache__"


def test_the_stamp_follows_every_file(tmp_path):
    files = [tmp_path / name for name in ("a.py", "b.py")]
    for path in files:
        path.write_text("x = 1\n")
    before = sources_stamp(files)
    files[1].write_text("x = 2\n")
    assert sources_stamp(files) != before
    files[1].write_text("x = 1\n")
    assert sources_stamp(files) == before
    assert sources_stamp(files[::-1]) == before  # (two equal files: the order cannot tell)
    files[0].write_text("x = 1\n\n")
    assert sources_stamp(files) != before


_CALLER = """
import numba
from b import callee

@numba.njit(cache=True)
def caller():
    return callee() + 10
"""
_CALLEE = """
import numba

@numba.njit(cache=True)
def callee():
    return {value}
"""
# A fresh process calls caller() (compiled, or loaded from the cache), the files stamped as the planning kernels are
# when asked.
_RUN = """
import sys
sys.path.insert(0, {folder!r})
if {stamped}:
    from megatron_orch.balance import _jit
    from megatron_orch.balance._jit import StampedByEveryKernel, sources_stamp
    files = [{folder!r} + "/a.py", {folder!r} + "/b.py"]

    class Stamped(StampedByEveryKernel):
        stamped = frozenset(files)
        stamp = staticmethod(lambda: sources_stamp(files))

    _jit._CACHE_IMPL._locator_classes.insert(0, Stamped)
import a
print(a.caller())
"""


def _caller_after_the_callee_changed(folder: Path, stamped: bool) -> list:
    folder.mkdir()
    (folder / "a.py").write_text(_CALLER)
    results = []
    for value in (1, 2):
        (folder / "b.py").write_text(_CALLEE.format(value=value))
        run = subprocess.run([sys.executable, "-c", _RUN.format(folder=str(folder), stamped=stamped)],
                             capture_output=True, text=True, timeout=scaled(120), env=dict(os.environ))
        assert run.returncode == 0, run.stderr
        results.append(int(run.stdout.split()[-1]))
    return results


@pytest.mark.distributed
def test_a_caller_is_compiled_again_after_its_callee_changed(tmp_path):
    """numba's own cache keeps the caller's old machine code (11 after the callee returns 2): what the stamp of
    every kernel file is for; stamped, the caller is compiled again (12)."""
    assert _caller_after_the_callee_changed(tmp_path / "numba", stamped=False) == [11, 11]
    assert _caller_after_the_callee_changed(tmp_path / "stamped", stamped=True) == [11, 12]
