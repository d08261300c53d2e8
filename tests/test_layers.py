"""The layering of DESIGN.md section 5: imports only go downward, and the planning layers (balance,
orchestrator) import no torch: they run in the background planner, in benchmarks and in simulators
without it, and nothing torch-side can leak into a plan."""
import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_orch
import megatron_orch.balance
import megatron_orch.orchestrator
from conftest import is_torch_free

PLANNING_PACKAGES = (megatron_orch.balance, megatron_orch.orchestrator)
# Torch-free outside them: the project's model configs (which the simulator reads), the simulator, and the
# command line of the compact trainer and of its task (a wrong command line fails before torch is imported).
TORCH_FREE_MODULES = ("megatron_orch.mllm.config", "megatron_orch.sim.cluster", "megatron_orch.sim.__main__",
                      "megatron_orch.trainer.arguments", "megatron_orch.trainer.task", "megatron_orch.mllm.task")


@pytest.mark.distributed
def test_planning_layers_import_no_torch():
    modules = [info.name for package in PLANNING_PACKAGES
               for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")] + list(TORCH_FREE_MODULES)
    assert "megatron_orch.orchestrator.step_plan" in modules and "megatron_orch.balance.placement" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", f"torch modules imported by the planning layers: {result.stdout}"


@pytest.mark.distributed
def test_the_torch_free_test_files_import_no_torch():
    """The test files CI runs on one megatron-core leg only (tests/conftest.py's TORCH_FREE_TESTS), and every module
    they import, at the top or within a test, import neither torch nor megatron: nothing in them can differ between
    the set-ups."""
    tests = Path(__file__).resolve().parent
    files = sorted(path for path in tests.rglob("test_*.py") if is_torch_free(path))
    assert tests / "balance" / "test_partition.py" in files and tests / "balance" / "test_registry.py" not in files
    folders = sorted({str(tests / folder) for folder in ("", "balance", "megatron", "trainer")}
                     | {str(path.parent) for path in files})
    imported = {}  # module -> the first test file that imports it
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            for name in names + [path.stem]:
                imported.setdefault(name, path.relative_to(tests).as_posix())
    code = ("import importlib, sys\n"
            f"sys.path[:0] = {folders!r}\n"
            f"for name, where in {sorted(imported.items())!r}:\n"
            "    importlib.import_module(name)\n"
            "    if any(m.split('.')[0] in ('torch', 'megatron') for m in sys.modules):\n"
            "        sys.exit(f'{where} imports {name}, which imports torch or megatron')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


# What each layer may import of the project (DESIGN.md section 5): only itself and the layers below.
ALLOWED = {
    "balance": {"balance"},
    "orchestrator": {"balance", "orchestrator"},
    "comm": {"balance", "comm"},
    "megatron": {"balance", "orchestrator", "comm", "megatron"},
    "trainer": {"balance", "orchestrator", "comm", "megatron", "trainer"},  # any model's: never mllm
    "mllm": {"balance", "orchestrator", "comm", "megatron", "trainer", "mllm"},  # the trainer's task among them
    "bench": {"balance", "orchestrator", "comm", "megatron", "mllm", "trainer", "bench"},
    "sim": {"balance", "orchestrator", "mllm", "bench", "sim"},  # torch-free (of mllm: the model configs)
}


def _project_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_orch."):
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names if alias.name.startswith("megatron_orch."))


def test_imports_only_go_downward():
    root = Path(megatron_orch.__file__).parent
    layers = sorted(p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert set(layers) == set(ALLOWED), f"a package without a place in the layering: {set(layers) ^ set(ALLOWED)}"
    upward = []
    for layer in layers:
        for path in sorted((root / layer).glob("*.py")):
            for line, module in _project_imports(path):
                target = module.split(".")[1]
                if target not in ALLOWED[layer]:
                    upward.append(f"{path.relative_to(root.parent)}:{line} imports {module}")
    assert upward == [], "\n".join(upward)
