"""megatron-orch: batch post-balancing for multimodal LLM training on Megatron."""
from setuptools import find_packages, setup

setup(
    name="megatron-orch",
    version="0.1.0",
    description="Per-phase batch post-balancing across data-parallel ranks for multimodal Megatron training",
    packages=find_packages(include=["megatron_orch", "megatron_orch.*"]),
    python_requires=">=3.11,<3.12",
    install_requires=[
        # torch==2.13.0 is the CPU build on this project's machines; on GPU clusters install the
        # matching CUDA build of the same version first and pip keeps it.
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "numpy>=1.26",
        "numba>=0.60",
        "ortools>=9.10",
        "pyyaml>=6.0",
        "tensorboard>=2.15",
        "matplotlib>=3.8",  # plots of bench.emulate and megatron_orch.sim
    ],
    extras_require={
        # six, regex, pydantic: what Megatron-LM's megatron.training imports beyond megatron-core (the
        # tests run it from ../shared/megatron-lm; a Megatron-LM checkout brings its own requirements).
        "test": ["pytest>=8", "hypothesis>=6.100", "six", "regex", "pydantic"],
        # apex is a GPU-only extra built from source: see README ("GPU extras").
        "gpu": ["transformer-engine[pytorch]"],
    },
)
