"""Run megatron-core 0.16.1 on CPU with torch.distributed over gloo.

This is the ONLY module of the project that redirects CUDA-only calls; it is used by CPU runs
(``pretrain_mllm.py`` with ``--distributed-backend gloo``, the default without a GPU) and by the
tests, never for GPU training. Call :func:`install` once per process before building models
(idempotent; safe to call again).

megatron-core places its own buffers on ``torch.cuda.current_device()`` or ``device='cuda'``,
synchronises with ``torch.cuda.synchronize()`` and keeps its RNG states on the CUDA generator. On a
CPU build of torch each of those raises. The redirects, and why each is needed:

1. **Device placement (all loaded ``megatron.core`` modules).** The module-global name ``torch``
   of every ``megatron.core`` module is rebound to :data:`CPU_TORCH`, a view of ``torch`` that
   differs in two ways only:

   - ``torch.cuda`` is :class:`_CpuCuda`: ``is_available()`` is False and ``device_count()`` 0
     (also on a machine with a GPU: under the harness megatron-core runs on the CPU),
     ``current_device()`` is the CPU device,
     ``synchronize``/``empty_cache`` do nothing, ``get_rng_state``/``set_rng_state``/
     ``manual_seed`` act on the CPU generator, and ``Stream``/``stream``/``default_stream``/
     ``current_stream`` are single-stream no-ops (eager CPU ops are already ordered). Everything
     else falls through to the real ``torch.cuda`` (so unexpected CUDA use still fails loudly).
   - the tensor factories (``tensor``, ``zeros``, ``empty``, ``ones``, ``full``, ...) map a CUDA
     ``device=`` (``'cuda'``, ``'cuda:N'``, an int, a CUDA ``torch.device``) to the CPU and drop
     ``pin_memory``.

   This covers, among others: ``GlobalMemoryBuffer.get_tensor`` (utils), the tensor-parallel
   mappings' gather/scatter buffers (tensor_parallel.mappings, layers), the DDP param and grad
   buffers (distributed.param_and_grad_buffer), the schedules' ``total_num_tokens`` counter and
   ``p2p_communication``'s receive buffers (pipeline_parallel), ``found_inf``/``clip_grads``
   scalars (optimizer), the timers' ``synchronize`` and all-gather buffer (timers), and the rerun
   state machine's reductions. Only megatron's modules see the view: torch and the rest of the
   project are untouched, and tensor operations pay no overhead (only factory calls are wrapped).
   Modules imported after :func:`install` are redirected by calling :func:`install` again (it is
   cheap); :func:`install` imports the megatron.core packages the project uses first.
2. **CUDA RNG tracker on the CPU generator (tensor_parallel.random).** The tracker's
   ``_get_cuda_rng_state``/``_set_cuda_rng_state`` go through ``torch.cuda.default_generators``,
   which do not exist on CPU (and ``_lazy_call`` would silently queue the set for a CUDA init
   that never comes, making ``fork()`` a no-op). They are replaced by CPU-generator get/set, so
   ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()`` give the intended
   per-TP-rank dropout and initialisation streams. Since the forked generator now IS the CPU
   generator, the tracker's "CPU RNG state changed within GPU RNG context" warning is expected and
   filtered out.
3. **``broadcast_data`` (tensor_parallel.data).** It moves tensors with ``tensor.cuda()``, a tensor
   method the module view cannot intercept; it is replaced by an equivalent that broadcasts CPU
   tensors from the first rank of the TP group.
4. **Rerun state machine disabled.** It is (re)initialised in ``RerunMode.DISABLED``: result
   validation re-runs steps and reduces over the world group on CUDA, which the CPU harness does
   not need; disabled, ``should_run_forward_backward`` runs each step exactly once.
5. **CUDA tensor type names for the optimizers (optimizer.optimizer,
   optimizer.distrib_optimizer, optimizer.clip_grads).** They accept parameters and gradients only
   if ``tensor.type()`` is ``'torch.cuda.{Float,Half,BFloat16}Tensor'``. The constructors of
   ``Float16OptimizerWithFloat16Params`` and ``DistributedOptimizer``, ``MegatronOptimizer.
   clip_grad_norm`` and ``ChainedOptimizer.step`` run with ``Tensor.type()`` reporting CPU float
   tensors under the CUDA names (only while those run), so ``--bf16``, gradient clipping and the
   distributed optimizer work on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import types
from typing import Any

import torch

_CPU = torch.device("cpu")

# megatron.core packages the project uses; imported before the redirect so all their modules
# see the CPU view of torch.
_MEGATRON_PACKAGES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.vision.multimodal_projector",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel",
    "megatron.core.rerun_state_machine",
    "megatron.core.timers",
)

_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn",
    "randint", "eye", "linspace", "empty_strided",
)


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device designation (str, int, torch.device) to the CPU; keep anything else."""
    if device is None:
        return None
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


class _NullStream:
    """Stands in for a CUDA stream: CPU ops run in program order, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as megatron.core sees it under the harness (see redirect 1)."""

    def __init__(self):
        super().__init__("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def device_count():
        return 0

    @staticmethod
    def current_device():
        return _CPU

    @staticmethod
    def synchronize(device=None):
        pass

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def get_rng_state(device=None):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state, device=None):
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    Stream = _NullStream

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def default_stream(device=None):
        return _NullStream()

    @staticmethod
    def current_stream(device=None):
        return _NullStream()


def _make_cpu_torch() -> types.ModuleType:
    view = types.ModuleType("torch")
    view.__dict__.update(torch.__dict__)
    view.cuda = _CpuCuda()
    for name in _FACTORIES:
        setattr(view, name, _cpu_factory(getattr(torch, name)))
    # Submodules imported lazily into torch later (torch._dynamo, ...) are found on torch itself.
    view.__getattr__ = lambda name: getattr(torch, name)  # module-level __getattr__ (PEP 562)
    return view


CPU_TORCH = _make_cpu_torch()
"""The view of ``torch`` bound as ``torch`` inside megatron.core modules (redirect 1)."""


def _redirect_module_torch() -> None:
    for name, module in list(sys.modules.items()):
        if (name == "megatron.core" or name.startswith("megatron.core.")) and module is not None:
            if getattr(module, "torch", None) is torch:
                module.torch = CPU_TORCH


def _get_cpu_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _broadcast_data_cpu(keys, data, datatype, tp_group=None):
    """CPU ``broadcast_data``: the first TP rank's ``data[key]`` tensors, on every TP rank."""
    from megatron.core.tensor_parallel import data as tp_data

    tp_group = tp_data.get_tensor_model_parallel_group_if_none(tp_group)
    key_size, key_numel, total_numel = tp_data._build_key_size_numel_dictionaries(
        keys, data, tp_group=tp_group
    )
    if tp_group.rank() == 0:
        tp_data._check_data_types(keys, data, datatype)
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys], dim=0)
    else:
        flat = torch.empty(total_numel, dtype=datatype)
    src = torch.distributed.get_process_group_ranks(tp_group)[0]
    torch.distributed.broadcast(flat, src, group=tp_group)
    output, offset = {}, 0
    for key in keys:
        numel = key_numel[key]
        output[key] = flat.narrow(0, offset, numel).view(key_size[key])
        offset += numel
    return output


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}
_real_tensor_type = torch.Tensor.type
_cuda_type_depth = 0


def _tensor_type_with_cuda_names(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and _cuda_type_depth > 0:
        name = _real_tensor_type(self)
        return _CUDA_TYPE_NAMES.get(name, name)
    return _real_tensor_type(self, dtype, non_blocking, **kwargs)


def _with_cuda_type_names(fn):
    """Run ``fn`` with ``Tensor.type()`` naming CPU float tensors like CUDA ones (redirect 5)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _cuda_type_depth
        _cuda_type_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _cuda_type_depth -= 1

    wrapper.__cpu_harness_wrapped__ = True
    return wrapper


def _wrap_once(owner, attr: str) -> None:
    fn = getattr(owner, attr)
    if not getattr(fn, "__cpu_harness_wrapped__", False):
        setattr(owner, attr, _with_cuda_type_names(fn))


_installed = False


def install() -> None:
    """Apply every redirect listed in the module docstring. Idempotent."""
    global _installed
    for package in _MEGATRON_PACKAGES:
        importlib.import_module(package)
    _redirect_module_torch()
    if _installed:
        return

    from megatron.core import rerun_state_machine, tensor_parallel
    from megatron.core.optimizer import distrib_optimizer, optimizer
    from megatron.core.tensor_parallel import data as tp_data
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_cuda_rng_state = _get_cpu_rng_state
    tp_random._set_cuda_rng_state = _set_cpu_rng_state
    logging.getLogger(tp_random.__name__).addFilter(_DropForkWarning())

    tp_data.broadcast_data = _broadcast_data_cpu
    tensor_parallel.broadcast_data = _broadcast_data_cpu

    rerun_state_machine.initialize_rerun_state_machine(
        mode=rerun_state_machine.RerunMode.DISABLED
    )

    torch.Tensor.type = _tensor_type_with_cuda_names
    _wrap_once(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    _wrap_once(distrib_optimizer.DistributedOptimizer, "__init__")
    _wrap_once(optimizer.MegatronOptimizer, "clip_grad_norm")
    _wrap_once(optimizer.ChainedOptimizer, "step")
    _installed = True
