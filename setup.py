"""megatron-orch: batch post-balancing for multimodal LLM training on Megatron."""
from setuptools import find_packages, setup

setup(
    name="megatron-orch",
    version="0.1.0",
    description="Per-phase batch post-balancing across data-parallel ranks for multimodal Megatron training",
    packages=find_packages(include=["megatron_orch", "megatron_orch.*"]),
    # megatron-core 0.16.1 is the newest release for Python 3.11; 0.17 and later need 3.12.
    python_requires=">=3.11",
    install_requires=[
        # Ranges only: a GPU container's own torch build (which Transformer Engine and Apex are built
        # against) satisfies them and is kept. scripts/setup_env.sh installs the tested exact versions.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",
        # megatron-core >= 0.18 imports triton (pipeline_parallel.schedules -> moe paged_stash); those
        # releases need Python 3.12. It installs and imports on CPU machines too.
        "triton; python_version >= '3.12' and platform_system == 'Linux'",
        "numpy>=1.26",
        "numba>=0.60",
        "ortools>=9.10",
        "pyyaml>=6.0",
        "tensorboard>=2.15",
        "matplotlib>=3.8",  # plots of bench.emulate and megatron_orch.sim
        "einops>=0.8",  # megatron-core's Megatron-FSDP builds its device mesh with it (--use-megatron-fsdp)
    ],
    extras_require={
        # six, regex, pydantic: what Megatron-LM's megatron.training imports beyond megatron-core (the
        # tests run it from ../shared/megatron-lm; a Megatron-LM checkout brings its own requirements).
        "test": ["pytest>=8", "hypothesis>=6.100", "six", "regex", "pydantic"],
        # apex is a GPU-only extra built from source: see docs/integration.md ("GPU clusters").
        # The range megatron-core 0.16.1 .. 0.19.x is tested with (0.16.1's pin starts at 2.9).
        "gpu": ["transformer-engine[pytorch]>=2.9,<3"],
        # Energon datasets as --data-path (megatron_orch.mllm.energon); pure Python, tested with 7.4.1.
        "energon": ["megatron-energon>=7.4,<8"],
    },
)
