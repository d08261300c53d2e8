"""The numba options of every kernel, defined once: compiled without the GIL, cached on disk; and the one line
that says so while numba compiles them (the first use after an install or an edit of a kernel)."""
import contextlib
import time
from typing import Callable, Optional

from numba.core import event

_JIT = dict(cache=True, nogil=True)
# Helpers called in the refinement's inner loop are inlined (measured: the loop runs ~1.6x faster
# than with calls that pass a dozen arrays).
_INLINE = dict(_JIT, inline="always")

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
