"""The numba options of every planning kernel, defined once: compiled without the GIL, cached on disk, the cache
stamped with every kernel file; and the one line that says so while numba compiles them (the first use after an
install or an edit of a kernel).

numba stamps a cached kernel with its own file alone: a kernel that calls (and inlines) one of another file kept its
cached machine code after that other file changed, so an edited or updated checkout planned with the kernels it had
before (measured: ``auto`` linking an older ``refine``). Here every kernel of :data:`KERNEL_FILES` is cached under a
stamp of all of them: a change to any one compiles them all again once."""
import contextlib
import functools
import hashlib
import os
import time
from typing import Callable, Optional, Tuple

from numba.core import caching, event

_BALANCE = os.path.dirname(os.path.abspath(__file__))
_CACHE_IMPL = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # (its name in older numba releases)
# Every file that defines a planning kernel, relative to megatron_orch/balance (tests/balance/test_jit.py checks
# that no other file of the package does).
KERNEL_FILES = ("_plan_kernels.py", "_transport.py", "exchange.py",
                *(os.path.join("_kernels", name) for name in (
                    "_heap.py", "_segment_tree.py", "auto.py", "bounds.py", "differencing.py", "first_fit.py",
                    "groups.py", "local_search.py", "locality.py", "longest_first.py", "order.py", "pipeline.py",
                    "repair.py")))


def sources_stamp(paths) -> str:
    """One digest of the contents of ``paths`` (in that order): what every kernel's cache is stamped with."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            content = handle.read()
        digest.update(len(content).to_bytes(8, "little"))
        digest.update(content)
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _kernels_stamp() -> str:
    return sources_stamp([os.path.join(_BALANCE, name) for name in KERNEL_FILES])


class StampedByEveryKernel(caching._CacheLocator):
    """The locator numba would use for a kernel of :data:`KERNEL_FILES` (its cache folder and names unchanged), its
    source stamp extended by the stamp of every kernel file (module docstring). Registered first among numba's
    locators; a function of any other file gets numba's own."""

    stamped = frozenset(os.path.realpath(os.path.join(_BALANCE, name)) for name in KERNEL_FILES)
    stamp = staticmethod(_kernels_stamp)

    def __init__(self, locator: caching._CacheLocator):
        self._locator = locator

    def ensure_cache_path(self):
        self._locator.ensure_cache_path()

    def get_cache_path(self):
        return self._locator.get_cache_path()

    def get_disambiguator(self):
        return self._locator.get_disambiguator()

    def get_source_stamp(self) -> Tuple[object, str]:
        return self._locator.get_source_stamp(), self.stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if os.path.realpath(py_file) not in cls.stamped:
            return None
        for other in _CACHE_IMPL._locator_classes:
            locator = None if issubclass(other, StampedByEveryKernel) else other.from_function(py_func, py_file)
            if locator is not None:
                return cls(locator)
        return None


if not any(issubclass(c, StampedByEveryKernel) for c in _CACHE_IMPL._locator_classes):
    _CACHE_IMPL._locator_classes.insert(0, StampedByEveryKernel)

_JIT = dict(cache=True, nogil=True)
# Helpers called in the refinement's inner loop are inlined (measured: the loop runs ~1.6x faster
# than with calls that pass a dozen arrays).
_INLINE = dict(_JIT, inline="always")
# A kernel that allocates nothing and passes arrays to many inlined helpers: compiled without reference counting
# (numba counts every array bound to a helper's argument, two atomic operations per array per call: measured, a
# quarter of localize's passes' time).
_NO_REFCOUNT = dict(_JIT, _nrt=False)

# Compiling every planning kernel from a cold cache (scripts/setup_env.sh does it once): 63 s of CPU, 83 s of
# wall time on a 2-core machine at load 2; loading them from the cache: under a second.
COMPILE_COST = "about a minute of CPU per process"


PROGRESS_EVERY_S = 10.0  # while compiling, a line at the first kernel done this long after the last line


class _Compiling(event.Listener):
    def __init__(self, announce: Callable[[str], None]):
        self.announce, self.start, self.said, self.compiled = announce, None, 0.0, 0

    def on_start(self, event_):
        if self.start is None:
            self.start = self.said = time.perf_counter()
            self.announce(f"compiling the planning kernels (numba; first use after an install or an edit, cached "
                          f"on disk afterwards; {COMPILE_COST}) ...")

    def on_end(self, event_):
        self.compiled += 1
        if time.perf_counter() - self.said >= PROGRESS_EVERY_S:
            self.said = time.perf_counter()
            self.announce(f"  ... kernels compiled: {self.compiled}, {self.said - self.start:.0f} s")


@contextlib.contextmanager
def announcing_compilation(announce: Optional[Callable[[str], None]]):
    """Within it, the first kernel numba compiles (a cache miss; loads from the cache say nothing) makes
    ``announce`` say what is happening and how long it takes, then how far it got every ~10 s; leaving it says how
    long it took."""
    if announce is None:
        yield
        return
    listener = _Compiling(announce)
    with event.install_listener("numba:compile", listener):
        yield
    if listener.start is not None:
        announce(f"planning kernels compiled in {time.perf_counter() - listener.start:.0f} s")
