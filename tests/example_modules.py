"""The runnable examples (``examples/*.py``) as modules for the tests: ``examples/`` at the end of the path (they
import each other by name: ``import own_model``), and ``examples/mimo_model.py`` under the name ``mimo_example``
(``mimo_model`` is ``tests/mimo_model.py``, the MIMO of ``test_mimo.py``)."""
import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))


def mimo_example():
    if "mimo_example" not in sys.modules:
        spec = importlib.util.spec_from_file_location("mimo_example", EXAMPLES / "mimo_model.py")
        sys.modules["mimo_example"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["mimo_example"])
    return sys.modules["mimo_example"]
