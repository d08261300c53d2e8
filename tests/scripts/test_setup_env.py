"""scripts/setup_env.sh: the two tested set-ups, its options, and a missing Python named in one line.
(The installs themselves are what every CI run does from scratch: .ci/run sets up both ends.)"""
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "setup_env.sh"


def _run(*args, cwd=None, env=None):
    return subprocess.run(["bash", str(SCRIPT if cwd is None else cwd / "scripts" / "setup_env.sh"), *args],
                          capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.distributed
@pytest.mark.parametrize("version, venv", [("0.19.2", ".venv"), ("0.16.1", ".venv-mcore0.16")])
def test_each_set_up_has_its_own_venv(version, venv):
    result = _run("--megatron-core", version, "--print-venv")
    assert result.returncode == 0 and result.stdout == f"{venv}\n", result.stderr
    assert _run("--print-venv").stdout == ".venv\n"  # the default: megatron-core 0.19.2


@pytest.mark.distributed
def test_options_are_checked_before_anything_runs():
    for args, message in ((["--megatron-core", "0.18.2"], "--megatron-core 0.18.2 is not a tested set-up"),
                          (["--bogus"], "unknown option '--bogus'"), (["--megatron-core"], "needs a version")):
        result = _run(*args)
        assert result.returncode == 1 and result.stdout == ""
        assert result.stderr.startswith("setup_env.sh: error: ") and result.stderr.count("\n") == 1, result.stderr
        assert message in result.stderr
    assert "--megatron-core VERSION" in _run("--help").stdout


@pytest.mark.distributed
def test_a_missing_python_is_one_line_naming_what_to_install(tmp_path):
    """No python3.12 on PATH and no pyenv: the set-up stops before making a venv, naming the Python."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    shutil.copy(REPO / "setup.py", tmp_path)
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    if subprocess.run(["bash", "-c", "command -v python3.12 || command -v pyenv"], env=bare,
                      capture_output=True).returncode == 0:
        pytest.skip("this machine has Python 3.12 or pyenv in /usr/bin:/bin")
    result = _run(cwd=tmp_path, env=bare)
    assert result.returncode == 1 and not (tmp_path / ".venv").exists()
    assert result.stderr == ("setup_env.sh: error: Python 3.12 not found (megatron-core 0.19.2 needs it): install it "
                             "(e.g. 'pyenv install 3.12') or point PYTHON at it\n")
    result = _run(cwd=tmp_path, env={**bare, "PYTHON": "/usr/bin/python3.11"})
    assert result.returncode == 1 and "PYTHON=/usr/bin/python3.11 is not a working Python 3.12" in result.stderr
