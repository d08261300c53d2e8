"""Every code block of README.md and docs/ is checked, so none can go stale: a Python block is an excerpt of a
file under ``examples/`` (which tests/megatron/test_examples.py and tests/balance/test_registry.py run); a command is parsed by
the parser of the program it runs (the compact trainer's at the script's ``--nproc`` world size, a module's
argparse, the test runner's options), or is a command a named test runs as written; an output sample's words
are words the code prints. A block this module cannot check fails it."""
import argparse
import importlib
import os
import re
import runpy
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_orch.mllm.task import MLLM_TASK
from megatron_orch.trainer import arguments

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _python_modules():
    """The modules the pages run with ``python -m``, imported once."""
    names = set(re.findall(r"python -m ([\w.]+)", "".join(page.read_text() for page in PAGES)))
    return {name: importlib.import_module(name + ".__main__" if name == "megatron_orch.sim" else name)
            for name in names}


def _page_blocks():
    """(page, number, language, text) of every code block of the pages."""
    for page in PAGES:
        for number, match in enumerate(BLOCK.finditer(page.read_text()), 1):
            yield page, number, match.group(1), match.group(2)


def _blocks():
    for page, number, language, text in _page_blocks():
        yield pytest.param(language, text, id=f"{page.name}#{number}")


def _commands(text: str):
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            yield words


class _Parsed(Exception):
    """Raised in place of running a module once its argparse parser accepted the command line."""


def _parse_only(monkeypatch, main, argv):
    """``main(argv)`` up to its argparse ``parse_args``: a wrong flag or value fails as the user would see it."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        original(parser, args, namespace)
        raise _Parsed()

    with monkeypatch.context() as patch, pytest.raises(_Parsed):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        main(argv)


def _script_defaults(script: Path):
    """The ``flags=( ... )`` defaults of a shipped launch script, which the user's flags follow."""
    body = re.search(r"^flags=\((.*?)^\)", script.read_text(), re.S | re.M).group(1)
    return shlex.split(body, comments=True)


def _train_tiny_cpu(args):
    if "--help" in args:
        return
    nproc = int(os.environ.get("NPROC", "2"))
    if "--nproc" in args:
        at = args.index("--nproc")
        nproc, args = int(args[at + 1]), args[:at] + args[at + 2:]
    arguments.parse_args(MLLM_TASK, _script_defaults(REPO / "scripts" / "train_tiny_cpu.sh") + args, world_size=nproc)


def _run_tests(args, request):
    if args[:1] == ["--megatron-core"]:
        assert args[1] in ("0.19.2", "0.16.1"), f"run_tests.sh takes megatron-core 0.19.2 or 0.16.1, not {args[1]}"
        args = args[2:]
    if args[:1] == ["-m"]:
        names = set(re.findall(r"[a-z_]+", args[1])) - {"not", "and", "or"}
        known = {line.split(":")[0] for line in request.config.getini("markers")}
        assert names <= known, f"run_tests.sh -m {args[1]!r}: unknown markers {names - known}"
        args = args[2:]
    assert args == [], f"run_tests.sh options this test does not know: {args}"


def _check_command(words, monkeypatch, request):
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words:  # FLAGS="...": tests/megatron/test_megatron_lm.py reads it from the page and trains with it
        assert list(env) == ["FLAGS"], env
        return
    program, *args = words
    if env.get("MEGATRON_ORCH_PLUGINS"):
        # tests/balance/test_registry.py::test_the_shipped_launch_script_loads_the_plugins_of_the_environment runs it
        assert (env, words[:2]) == ({"PYTHONPATH": "examples", "MEGATRON_ORCH_PLUGINS": "toy_partitioner"},
                                    ["bash", "scripts/train_tiny_cpu.sh"]), words
        return
    if program == "bash" and args[0] == "scripts/train_tiny_cpu.sh":
        return _train_tiny_cpu(args[1:])
    if program == "bash" and args[0] == "scripts/run_tests.sh":
        return _run_tests(args[1:], request)
    if program == "bash" and args[0] == "scripts/setup_env.sh":
        assert args[1:] in ([], ["--megatron-core", "0.16.1"]), words  # tests/scripts/test_setup_env.py: its options
        return
    if program == "source":
        # the default set-up's venv (tests/scripts/test_setup_env.py); test_the_pages_commands_run_in_a_fresh_shell
        # activates it as written
        assert args == [".venv/bin/activate"], words
        return
    if program == "bash" and args[0] == "scripts/run_main.sh":
        compare = runpy.run_path(str(REPO / "scripts" / "compare_baseline.py"), run_name="compare_under_docs_test")
        return compare["main"]([*args[1:], "--parse-only"])
    if program == "python" and args[:1] == ["-m"]:
        return _parse_only(monkeypatch, MODULES[args[1]].main, args[2:])
    if program == "python" and args[0].startswith("scripts/"):
        script = runpy.run_path(str(REPO / args[0]), run_name="script_under_docs_test")
        return _parse_only(monkeypatch, script["main"], args[1:])
    if program == "torchrun" and args[-1].startswith("examples/"):
        # tests/megatron/test_examples.py runs both examples under torchrun, as written here
        assert args[:2] == ["--nproc-per-node", "2"] and (REPO / args[-1]).is_file(), words
        assert f'"{Path(args[-1]).name}"' in (REPO / "tests" / "megatron" / "test_examples.py").read_text(), words
        return
    if program == "torchrun" and args[2] == "pretrain_mllm.py":
        # tests/megatron/test_megatron_lm.py trains with docs/integration.md's FLAGS, read from the page, with and
        # without --orch-post-balancing
        assert args[3:] in (["$FLAGS"], ["$FLAGS", "--orch-post-balancing"]), words
        return
    if program == "git" and args[0] == "clone":
        release = args[args.index("--branch") + 1]
        assert (REPO / "patches" / release).is_dir(), f"{release} is not a release with patches/ and its tests"
        return
    if program == "bash" and args[0] == "scripts/apply_patches.sh":
        assert len(args) == 2, words  # tests/megatron/test_megatron_lm.py applies it to each release's files this way
        return
    if program == "export":
        assert [arg.split("=")[0] for arg in args] == ["PYTHONPATH"], words  # where the checkout is imported from
        return
    raise AssertionError(f"a command tests/test_docs.py does not know how to check: {shlex.join(words)}")


MODULES = _python_modules()


def _printed_words():
    text = "".join(path.read_text() for folder in ("megatron_orch", "scripts")
                   for path in (REPO / folder).rglob("*.py"))
    return set(re.findall(r"[A-Za-z]{4,}", text))


@pytest.mark.parametrize("language, text", list(_blocks()))
def test_every_code_block_of_the_docs_is_checked(language, text, monkeypatch, request):
    if language == "python":
        sources = [path.read_text() for path in (REPO / "examples").glob("*.py")]
        assert any(text in source or textwrap.dedent(text) in source for source in sources), \
            "a Python block that is not an excerpt of examples/"
    elif language == "bash":
        commands = list(_commands(text))
        assert commands, "an empty command block"
        for words in commands:
            _check_command(words, monkeypatch, request)
    else:  # an output sample: every word in it is one the code prints (or a flag it names)
        assert language == "", f"a block of language {language!r}"
        unknown = set(re.findall(r"[A-Za-z]{4,}", text)) - _printed_words()
        assert not unknown, f"an output sample with words the code does not print: {sorted(unknown)}"


# Commands of the pages quick enough to run here as written, with their exit status (the example manifest holds
# bad examples on purpose: docs/data.md); every other command's program starts with --help (its runs are the tests
# _check_command names).
RUN_AS_WRITTEN = {
    "python -m megatron_orch.mllm.check_data --data-path data/example/manifest.jsonl --seq-length 256": 1,
    "bash scripts/train_tiny_cpu.sh --help": 0,
}


def _fresh_shell_environment():
    """This process's environment as a new shell has it: no virtual environment active or on PATH."""
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(folder for folder in env.get("PATH", "").split(os.pathsep)
                                  if folder and not (Path(folder).parent / "pyvenv.cfg").exists())
    return env


def _started_program(words):
    """The command that starts a page command's program with --help; None for the shell's own and git."""
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words = words[1:]
    if not words or words[0] in ("source", "export", "git"):
        return None
    if words[0] == "python" and words[1] == "-m":
        return words[:3] + ["--help"]
    if words[0] in ("python", "bash"):
        return words[:2] + ["--help"]
    return words[:1] + ["--help"]


@pytest.mark.distributed
def test_the_pages_commands_run_in_a_fresh_shell_after_the_set_up():
    """A new shell (no venv on PATH), then the README's ``source .venv/bin/activate`` (here the venv that runs this
    test: .venv-mcore0.16 on the 0.16.1 set-up): the quick commands of the pages run as written, and every other
    command's program starts, so none ends in 'command not found' or a module torch cannot be found for."""
    from dist_utils import scaled

    commands = [words for _, _, language, text in _page_blocks() if language == "bash" for words in _commands(text)]
    written = {shlex.join(words) for words in commands}
    assert set(RUN_AS_WRITTEN) <= written, f"commands no page has any more: {set(RUN_AS_WRITTEN) - written}"
    runs = dict(RUN_AS_WRITTEN)
    runs.update({shlex.join(started): 0 for words in commands if shlex.join(words) not in RUN_AS_WRITTEN
                 for started in [_started_program(words)] if started is not None})
    assert {"torchrun --help", "python -m megatron_orch.sim --help"} <= set(runs), runs

    env, activate = _fresh_shell_environment(), Path(sys.prefix) / "bin" / "activate"
    before = subprocess.run(["bash", "-c", "command -v torchrun python || true"], env=env, capture_output=True,
                            text=True, check=True)
    assert str(Path(sys.prefix) / "bin") not in before.stdout, f"not a fresh shell: {before.stdout}"
    failed = []
    for command, status in sorted(runs.items()):
        result = subprocess.run(["bash", "-c", f"source {shlex.quote(str(activate))} && {command}"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=scaled(120))
        if result.returncode != status or "Traceback" in result.stderr:
            failed.append(f"{command}: exit status {result.returncode} (not {status}): {result.stderr.strip()[-600:]}")
    assert not failed, "\n".join(failed)
