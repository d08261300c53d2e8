"""Test doubles that run Megatron-LM's ``megatron.training.pretrain`` (core_v0.16.1 .. core_v0.19.x) on CPU
over gloo.

Tests only, never product code. Where the Megatron-LM files come from (:func:`megatron_lm_files_or_skip`):
megatron-core wheels from 0.17 on ship ``megatron/training`` (0.19.2's equals core_v0.19.0's byte for
byte), and the tests use the installed wheel's own; the 0.16.1 wheel lacks it, and the tests take the tag's
unmodified files from ``../shared/megatron-lm/core_v0.16.1`` (:data:`SHARED_TREE`). A Megatron-LM checkout
first on ``PYTHONPATH`` (main, or a fork) is used as it is: its ``training.py`` is the pre-image of no
``patches/`` folder (main has no patch by design), so the patch tests skip and the training tests run
through the run-time hook. Either is copied to a
temporary folder, patched with ``scripts/apply_patches.sh`` (:func:`patched_copy`), and put first on
``sys.path`` (:func:`install`): ``megatron`` is a namespace package (no ``__init__.py`` in the wheel or the
tree), so ``megatron.core`` comes from the wheel and ``megatron.training`` from the copy; ``install(None)``
keeps the wheel's own, unpatched ``megatron.training``. What :func:`install` changes, and why each is
needed on a CPU-only machine:

1. ``triton``, where it is not installed (the 0.16.1 set-up), is a stub module while
   ``megatron.training`` imports: ``megatron.training.initialize`` imports megatron-core's batch-invariant
   kernels, which import triton (GPU-only) and decorate kernels with ``triton.jit`` at import time.
2. The project's CPU harness (:mod:`megatron_orch.trainer.cpu_harness`) for megatron.core, and its
   view of torch (CUDA devices -> CPU, no-op synchronise, CPU RNG) bound as ``torch`` in every
   ``megatron.training`` / ``megatron.legacy`` module: pretrain() all-reduces start times and flags in
   ``device='cuda'`` tensors and calls ``torch.cuda.synchronize``/``empty_cache``.
3. ``initialize_megatron(allow_no_cuda=True)``: it asserts CUDA otherwise.
4. ``_compile_dependencies`` does nothing: it runs ``make`` for the dataset helpers and builds fused
   kernels with nvcc, neither of which the MLLM's external data path uses.
5. ``set_jit_fusion_options`` does nothing: it warms up fused bias-GeLU/dropout kernels on CUDA.
6. ``torch.nn.Module.cuda`` returns the module unchanged: ``get_model`` moves every chunk to the GPU.
7. ``get_device_arch_version`` (read by Megatron-LM's argument checks with TP > 1) answers 9 (Hopper),
   and :func:`prepare_run` sets ``CUDA_DEVICE_MAX_CONNECTIONS=1`` as Megatron-LM requires of such a launch.
8. Model-parallel state and the CUDA RNG tracker are created before ``pretrain()``
   (:func:`prepare_run`): Megatron-LM's initialisation skips both when
   ``torch.cuda.device_count()`` is 0.

:func:`reset` clears megatron.training's globals and the model-parallel state, so one process can run
``pretrain()`` more than once (the tests run post-balancing off, then on, in the same ranks).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.machinery
import importlib.util
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SHARED_TREE = REPO.parent / "shared" / "megatron-lm" / "core_v0.16.1"
BASE_FILE = "megatron/training/training.py"


@dataclasses.dataclass(frozen=True)
class MegatronLMFiles:
    """The Megatron-LM files under test: ``root`` holds ``megatron/training`` (the wheel's site-packages, a
    checkout on ``PYTHONPATH``, or :data:`SHARED_TREE`); ``release`` is the ``patches/`` folder made for them
    (None: a checkout of main or a fork, which no patch is made for); ``on_path``: importable where they are
    (the wheel's or the checkout's), so the unpatched tests put nothing on ``sys.path``."""
    root: Path
    release: Optional[str]
    on_path: bool

    @property
    def patch(self) -> Path:
        return REPO / "patches" / self.release / "0001-forward-backward-func-wrapper.patch"

    def no_patch_reason(self) -> Optional[str]:
        """Why no patch test runs on these files (None: they are a release's)."""
        if self.release is not None:
            return None
        return (f"{self.root / BASE_FILE} is the training.py of no patches/ folder (Megatron-LM main or a fork: no "
                "patch is made for it, by design; post-balancing reaches its train() through the run-time hook)")


def hash_object(path: Path) -> str:
    return subprocess.run(["git", "hash-object", str(path)], check=True, capture_output=True, text=True).stdout.strip()


def _release_of(training_file: Path, required: bool) -> Optional[str]:
    """The patches/ folder whose pre-image is ``training_file``; None if there is none, an error if a
    release's (a wheel's, the shared tree's) file has no folder: that is a missing patch, never a skip."""
    blob = hash_object(training_file)
    for patch in sorted((REPO / "patches").glob("core_v*/*.patch")):
        if f"index {blob}.." in patch.read_text():
            return patch.parent.name
    if required:
        raise AssertionError(f"{training_file} (blob {blob}) is the training.py of no patches/ folder")
    return None


def _from_installed_wheel(training_file: Path) -> bool:
    """Whether ``training_file`` is the installed megatron-core wheel's (not a checkout's on the path)."""
    import importlib.metadata
    try:
        shipped = importlib.metadata.distribution("megatron-core").locate_file(BASE_FILE)
    except importlib.metadata.PackageNotFoundError:
        return False
    return Path(shipped).resolve() == training_file.resolve()


def megatron_lm_files_or_skip() -> MegatronLMFiles:
    """The ``megatron/training`` that imports (a checkout first on the path, else the megatron-core >= 0.17
    wheel's), else the shared 0.16.1 files, or skip the calling test saying why."""
    import pytest

    spec = importlib.util.find_spec("megatron.training")
    if spec is not None and spec.origin is not None:
        root = Path(spec.origin).parents[2]
        training_file = root / BASE_FILE
        return MegatronLMFiles(root, _release_of(training_file, required=_from_installed_wheel(training_file)),
                               on_path=True)
    if not (SHARED_TREE / BASE_FILE).is_file():
        pytest.skip(f"the installed megatron-core ships no megatron/training and the Megatron-LM core_v0.16.1 "
                    f"files are not at {SHARED_TREE} (CI clones them next to the repository as "
                    "../shared/megatron-lm); the megatron.training tests need one of them")
    return MegatronLMFiles(SHARED_TREE, _release_of(SHARED_TREE / BASE_FILE, required=True), on_path=False)


def unpatched_copy(files: MegatronLMFiles, destination: Path) -> Path:
    """A writable copy of the release's Megatron-LM files at ``destination`` (a tree holding ``megatron/``)."""
    if files.on_path:
        shutil.copytree(files.root / "megatron" / "training", destination / "megatron" / "training")
    else:
        shutil.copytree(files.root, destination)
    for path in [destination, *destination.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    return destination


def patched_copy(files: MegatronLMFiles, destination: Path) -> Path:
    """:func:`unpatched_copy` with the project's patch applied by ``scripts/apply_patches.sh``."""
    unpatched_copy(files, destination)
    subprocess.run(["bash", str(REPO / "scripts" / "apply_patches.sh"), str(destination)], check=True,
                   capture_output=True, text=True)
    return destination


def _triton_stub() -> types.ModuleType:
    def jit(fn=None, **options):
        return fn if fn is not None else (lambda f: f)

    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    triton.jit = jit
    language = types.ModuleType("triton.language")
    language.__spec__ = importlib.machinery.ModuleSpec("triton.language", None)
    language.constexpr = object
    triton.language = language
    return triton


_installed_tree = None


def install(tree: Optional[Path]) -> None:
    """Make ``megatron.training`` of ``tree`` (None: the installed wheel's) importable and runnable on CPU
    (see the module docstring)."""
    global _installed_tree
    if _installed_tree is not None:
        if _installed_tree != (tree,):
            raise RuntimeError(f"megatron_lm_doubles already installed for {_installed_tree[0]}, not {tree}")
        return
    if tree is not None:
        sys.path.insert(0, str(tree))
    import torch
    import torch._dynamo  # noqa: F401  (before the stub: torch checks what triton it finds)

    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()

    # Where triton is not installed, the stub serves megatron.training's import only; afterwards triton
    # is absent again.
    stub = _triton_stub() if importlib.util.find_spec("triton") is None else None
    if stub is not None:
        sys.modules["triton"], sys.modules["triton.language"] = stub, stub.language
    try:
        import megatron.training
        from megatron.training import arguments, initialize, training
    finally:
        if stub is not None:
            del sys.modules["triton"], sys.modules["triton.language"]
    if tree is not None and not str(Path(megatron.training.__file__)).startswith(str(tree)):
        raise RuntimeError(f"megatron.training imports from {megatron.training.__file__}, not from {tree}")
    cpu_harness.install()  # megatron.core modules megatron.training imported
    for name, module in list(sys.modules.items()):
        if name.startswith(("megatron.training", "megatron.legacy")) and getattr(module, "torch", None) is torch:
            module.torch = cpu_harness.CPU_TORCH
    training.initialize_megatron = functools.partial(initialize.initialize_megatron, allow_no_cuda=True)
    initialize._compile_dependencies = lambda: None
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    arguments.get_device_arch_version = lambda: 9
    torch.nn.Module.cuda = lambda self, device=None: self
    _installed_tree = (tree,)


def prepare_run(tensor_model_parallel_size: int, pipeline_model_parallel_size: int, seed: int,
                virtual_pipeline_model_parallel_size: Optional[int] = None, context_parallel_size: int = 1) -> None:
    """Before each ``pretrain()`` in a spawned rank of an initialised gloo group: torchrun's environment
    (Megatron-LM's parser reads the world size and rank from it), and what Megatron-LM's initialisation
    skips without CUDA: model-parallel groups and the RNG tracker, seeded as ``_set_random_seed`` would
    (one seed per pipeline stage)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state, rerun_state_machine, tensor_parallel

    os.environ.update(WORLD_SIZE=str(dist.get_world_size()), RANK=str(dist.get_rank()),
                      LOCAL_RANK=str(dist.get_rank()), LOCAL_WORLD_SIZE=str(dist.get_world_size()),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")

    # Megatron-LM initialises the rerun state machine from --rerun-mode; the CPU harness made one already.
    rerun_state_machine.destroy_rerun_state_machine()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                             virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
                                             context_parallel_size=context_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())


def reset() -> None:
    """Forget one ``pretrain()`` run: megatron.training's globals, the micro-batch calculator, the
    model-parallel groups."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars

    global_vars.unset_global_variables()
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()
