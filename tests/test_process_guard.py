"""The probe of the fast tier's guard (tests/process_guard.py): pytest sessions run in this process (pytester's
in-process run) with the guard loaded; a process started for an unmarked test, by the test or by a fixture of
any scope, fails that session naming the test, before the process starts."""
import pytest

SPAWNING_FIXTURES = """
import multiprocessing
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def module_run():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.fixture(scope="session")
def session_rank():
    rank = multiprocessing.get_context("spawn").Process(target=print)
    rank.start()
    rank.join()
"""


def _run(pytester, source, *args):
    pytester.makeini("[pytest]\nmarkers =\n    distributed: starts processes\n")
    pytester.makepyfile(test_probe=source)
    return pytester.runpytest_inprocess("-p", "process_guard", "-p", "no:cacheprovider", *args)


def test_a_process_started_by_a_fixture_of_any_scope_fails_the_unmarked_test(pytester):
    result = _run(pytester, SPAWNING_FIXTURES + """

def test_module_fixture(module_run):
    pass


def test_session_fixture(session_rank):
    pass


def test_itself():
    subprocess.run(["true"])
""")
    result.assert_outcomes(failed=1, errors=2)
    result.stdout.fnmatch_lines([
        "*test_probe.py::test_module_fixture starts a process (fixture 'module_run'): *: mark it "
        "@pytest.mark.distributed",
        "*test_probe.py::test_session_fixture starts a process (fixture 'session_rank'): *SpawnProcess*",
        "*test_probe.py::test_itself starts a process: *'true'*: mark it @pytest.mark.distributed"])


def test_a_process_started_while_collecting_fails_the_run(pytester):
    result = _run(pytester, "import subprocess\nsubprocess.run(['true'])\n\ndef test_nothing():\n    pass\n")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*a process started outside any test (while collecting?): *'true'*"])


@pytest.mark.distributed
def test_an_unmarked_test_fails_on_a_fixture_a_marked_one_made_by_starting_a_process(pytester):
    result = _run(pytester, SPAWNING_FIXTURES + """

@pytest.mark.distributed
def test_marked(module_run):
    pass


def test_unmarked_after_it(module_run):
    pass
""")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*test_probe.py::test_unmarked_after_it uses fixture 'module_run', which starts a "
                                 "process (*): mark it @pytest.mark.distributed"])


@pytest.mark.distributed
def test_a_parametrized_argument_named_like_a_spawning_fixture_is_not_that_fixture(pytester):
    """The guard knows fixtures by definition, not by name: a test whose parametrized argument shares the name
    of a fixture that started a process (in another module, say) uses no such fixture."""
    result = _run(pytester, SPAWNING_FIXTURES + """

@pytest.mark.distributed
def test_marked(module_run):
    pass


@pytest.mark.parametrize("module_run", [1, 2])
def test_unmarked_with_an_argument_of_that_name(module_run):
    assert module_run in (1, 2)
""")
    result.assert_outcomes(passed=3)
