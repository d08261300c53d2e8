"""Run megatron-core 0.16.1 on CPU with torch.distributed over gloo.

This is the ONLY module of the project that redirects CUDA-only calls; it is used by CPU runs
(a compact-trainer run with ``--distributed-backend gloo``, the default without a GPU) and by the
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
   clip_grad_norm``, ``ChainedOptimizer.step`` and the project's ``SharedNormOptimizer.step`` run with ``Tensor.type()`` reporting CPU float
   tensors under the CUDA names (only while those run), so ``--bf16``, gradient clipping and the
   distributed optimizer work on CPU.
6. **Sharded data parallelism (distributed.torch_fully_sharded_data_parallel,
   distributed.fsdp).** Both wrappers build their ``DeviceMesh`` with ``device_type="cuda"``; their
   module-global ``DeviceMesh`` becomes one that builds a CPU mesh (FSDP2 then keeps the parameters on the
   CPU). Megatron-FSDP's own modules (``distributed.fsdp.src.megatron_fsdp``) format
   ``f"cuda:{torch.cuda.current_device()}"``, so in their view ``current_device()`` is the index 0 (the
   devices it names map to the CPU in the factories, as everywhere); their streams' ``record_event()``
   gives an event whose ``wait``/``synchronize`` do nothing; and ``validate_uneven_dtensor`` (a check of
   the shards' bounds, one all-reduce) runs with ``Tensor.cuda()`` leaving the tensor on the CPU.
7. **MoE layers (transformer.moe).** 0.16.1's router gating tests ``te_general_gemm is not None`` but binds
   the name only when Transformer Engine imports (a NameError without it): the name is bound to None,
   which selects its own torch matmul. The all-to-all token dispatcher moves its split sizes to the host
   as numpy arrays only from CUDA tensors (``maybe_move_tensor_to_cpu``); CPU tensors stayed tensors,
   which ``all_to_all_single`` does not take: in the dispatcher's view they become numpy arrays too.
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
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.vision.multimodal_projector",
    "megatron.core.distributed",
    "megatron.core.distributed.torch_fully_sharded_data_parallel",
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter",
    "megatron.core.optimizer",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.pipeline_parallel",
    "megatron.core.rerun_state_machine",
    "megatron.core.timers",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
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
        return _NullEvent() if event is None else event


class _NullEvent:
    """Stands in for a CUDA event recorded on a :class:`_NullStream`: the work before it is done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


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
    Event = _NullEvent

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def default_stream(device=None):
        return _NullStream()

    @staticmethod
    def current_stream(device=None):
        return _NullStream()


class _CpuCudaIndexed(_CpuCuda):
    """``torch.cuda`` as Megatron-FSDP's modules see it (redirect 6): the current device is the index 0."""

    @staticmethod
    def current_device():
        return 0


def _make_cpu_torch(cuda: _CpuCuda) -> types.ModuleType:
    view = types.ModuleType("torch")
    view.__dict__.update(torch.__dict__)
    view.cuda = cuda
    for name in _FACTORIES:
        setattr(view, name, _cpu_factory(getattr(torch, name)))
    # Submodules imported lazily into torch later (torch._dynamo, ...) are found on torch itself.
    view.__getattr__ = lambda name: getattr(torch, name)  # module-level __getattr__ (PEP 562)
    return view


CPU_TORCH = _make_cpu_torch(_CpuCuda())
"""The view of ``torch`` bound as ``torch`` inside megatron.core modules (redirect 1)."""
_MEGATRON_FSDP_TORCH = _make_cpu_torch(_CpuCudaIndexed())
_MEGATRON_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"


def _redirect_module_torch() -> None:
    for name, module in list(sys.modules.items()):
        if (name == "megatron.core" or name.startswith("megatron.core.")) and module is not None:
            if getattr(module, "torch", None) is torch:
                module.torch = _MEGATRON_FSDP_TORCH if name.startswith(_MEGATRON_FSDP) else CPU_TORCH


class _CpuDeviceMesh:
    """``DeviceMesh`` as the sharded data-parallel wrappers see it (redirect 6): a mesh over the CPU."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed import DeviceMesh
        return DeviceMesh.from_group(group, "cpu", *args, **kwargs)


def _with_cuda_tensor_method_on_cpu(fn):
    """Run ``fn`` with ``Tensor.cuda()`` returning the tensor itself (redirect 6)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        real = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.cuda = real

    return wrapper


def _redirect_sharded_data_parallel() -> None:
    """Redirect 6, for the wrappers this megatron-core has."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    torch_fully_sharded_data_parallel.DeviceMesh = _CpuDeviceMesh
    mcore_fsdp_adapter.DeviceMesh = _CpuDeviceMesh
    if mcore_fsdp_adapter.HAVE_MEGATRON_FSDP:
        buffers = importlib.import_module(f"{_MEGATRON_FSDP}.param_and_grad_buffer")
        buffers.validate_uneven_dtensor = _with_cuda_tensor_method_on_cpu(buffers.validate_uneven_dtensor)


def _get_cpu_rng_state(device=None, clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


class _DropMessage(logging.Filter):
    """Drops the log records that contain ``text``."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


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


def _host_copy_as_on_cuda(tensor, as_numpy=False, record_stream=False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` as it behaves for a CUDA tensor (redirect 7)."""
    from megatron.core.transformer.moe import moe_utils

    if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
        return tensor.numpy()
    return moe_utils.maybe_move_tensor_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)


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
    logging.getLogger(tp_random.__name__).addFilter(_DropMessage("CPU RNG state changed within GPU RNG context"))

    tp_data.broadcast_data = _broadcast_data_cpu
    tensor_parallel.broadcast_data = _broadcast_data_cpu

    # its warning that it is disabled, which it is on CPU by design
    logging.getLogger(rerun_state_machine.__name__).addFilter(_DropMessage("RerunStateMachine initialized in mode"))
    rerun_state_machine.initialize_rerun_state_machine(
        mode=rerun_state_machine.RerunMode.DISABLED
    )

    _redirect_sharded_data_parallel()
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy_as_on_cuda

    torch.Tensor.type = _tensor_type_with_cuda_names
    _wrap_once(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    _wrap_once(distrib_optimizer.DistributedOptimizer, "__init__")
    _wrap_once(optimizer.MegatronOptimizer, "clip_grad_norm")
    _wrap_once(optimizer.ChainedOptimizer, "step")
    from megatron_orch.megatron.own_encoder_ranks import SharedNormOptimizer
    _wrap_once(SharedNormOptimizer, "step")
    _installed = True
