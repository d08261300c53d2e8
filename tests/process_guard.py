"""The fast tier's guard (a pytest plugin, loaded by tests/conftest.py): a test that starts a process (a spawned
rank, torchrun, a script) without ``@pytest.mark.distributed`` fails, naming the test, whoever starts it: the test
itself or a fixture of any scope set up for it. So ``pytest -m "not distributed"`` starts no process, and the marker
cannot be forgotten.

``subprocess.Popen`` and ``multiprocessing``'s ``Process.start`` are patched for the whole session; hooks record
which test runs (its set-up, call and tear-down, where fixtures of every scope are made and finished) and which
fixture is being set up. A fixture that started a process, for a marked test, is remembered: an unmarked test that
uses it fails too, in the whole suite as in the fast tier (where that fixture would be made for it).
"""
import multiprocessing.process
import os
import subprocess

import pytest

# Programs a test may run without the marker: git (megatron-core asks it for its version at import),
# ldconfig (ctypes.util.find_library asks it where a library is, the first time torch's CUDA lookup runs) and
# fc-list (matplotlib asks it for the system's fonts when it builds its font cache, on a fresh machine).
UNMARKED_PROGRAMS = {"git", "ldconfig", "fc-list"}


class _Guard:
    def __init__(self):
        self.item = None  # the test whose set-up, call or tear-down runs
        self.fixtures = []  # the fixtures being set up (their definitions), innermost last
        self.spawning = {}  # fixture definition -> the first process it started (by definition: two fixtures, or
        #                     a fixture and a parametrized argument, may share a name)

    def started(self, what: str):
        """A process is about to start: allowed for a marked test only."""
        if self.fixtures:
            self.spawning.setdefault(self.fixtures[-1], what)
        if self.item is None:
            pytest.fail(f"a process started outside any test (while collecting?): {what}", pytrace=False)
        if self.item.get_closest_marker("distributed") is None:
            by = f" (fixture {self.fixtures[-1].argname!r})" if self.fixtures else ""
            pytest.fail(f"{self.item.nodeid} starts a process{by}: {what}: mark it @pytest.mark.distributed",
                        pytrace=False)


_GUARD = pytest.StashKey[_Guard]()
_ORIGINALS = pytest.StashKey[tuple]()


def pytest_configure(config):
    guard = config.stash[_GUARD] = _Guard()
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start
    config.stash[_ORIGINALS] = popen_init, process_start

    def checked_popen(self, args, *rest, **kw):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        if os.path.basename(str(program).split()[0]) not in UNMARKED_PROGRAMS:
            guard.started(repr(args))
        popen_init(self, args, *rest, **kw)

    def checked_start(self):
        guard.started(repr(self))
        process_start(self)

    subprocess.Popen.__init__ = checked_popen
    multiprocessing.process.BaseProcess.start = checked_start


def pytest_unconfigure(config):
    if _ORIGINALS in config.stash:
        subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start = config.stash[_ORIGINALS]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    guard = item.config.stash[_GUARD]
    guard.item = item
    try:
        yield
    finally:
        guard.item = None


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    fixtures = request.config.stash[_GUARD].fixtures
    fixtures.append(fixturedef)
    try:
        yield
    finally:
        fixtures.pop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """An unmarked test that uses a fixture another (marked) test made by starting a process."""
    if item.get_closest_marker("distributed") is None:
        known = item.config.stash[_GUARD].spawning
        used = [defs[-1] for defs in item._fixtureinfo.name2fixturedefs.values() if defs]  # the definitions it gets
        spawning = [fixturedef for fixturedef in used if fixturedef in known]
        if spawning:
            pytest.fail(f"{item.nodeid} uses fixture {spawning[0].argname!r}, which starts a process "
                        f"({known[spawning[0]]}): mark it @pytest.mark.distributed", pytrace=False)
