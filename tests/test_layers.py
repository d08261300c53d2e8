"""The planning layers (balance, orchestrator) import no torch: they run in the background planner, in
benchmarks and in simulators without it, and nothing torch-side can leak into a plan."""
import pkgutil
import subprocess
import sys

import megatron_orch.balance
import megatron_orch.orchestrator

PLANNING_PACKAGES = (megatron_orch.balance, megatron_orch.orchestrator)


def test_planning_layers_import_no_torch():
    modules = [info.name for package in PLANNING_PACKAGES
               for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
    assert "megatron_orch.orchestrator.step_plan" in modules and "megatron_orch.balance.placement" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", f"torch modules imported by the planning layers: {result.stdout}"
