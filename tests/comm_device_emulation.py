"""A second device on a CPU-only machine, to catch tensors handed to collectives on the wrong device.

On a GPU run with NCCL every tensor given to a collective must be on the GPU; a CPU tensor fails there
("No backend type associated with device type cpu"), but on CPU with gloo the same code passes, since
the CPU is both the compute and the communication device. Under :func:`install` (one spawned test
process), the communication device of every group becomes ``commdev``, an emulated device:

* ``commdev`` is torch's PrivateUse1 backend renamed; its tensors are :class:`OnCommDevice` wrappers
  holding real CPU data (a dispatch mode creates them for factories and copies with
  ``device=commdev``), so gloo can still move the data and training runs to the end;
* like CUDA, an operation mixing a ``commdev`` tensor with a CPU tensor (other than a 0-dim one, or a
  copy) raises, so data that arrives on the communication device must be moved to the compute device
  explicitly, as it must be on a GPU whenever the two differ;
* every ``torch.distributed`` collective called from the project's code (``megatron_orch``,
  ``pretrain_mllm``) is checked: a tensor that is not on
  :func:`megatron_orch.comm.device.communication_device`'s device is recorded as a violation with its
  call site, and the collective still runs on the data so that every violation of a run is found.

Barriers carry no tensor and run as a host all-reduce. megatron-core's own collectives (gradient reduction, timers, pipeline sends) run on megatron-core's
own buffers, which it places itself; under the CPU harness those live on the CPU, so they are counted
but not checked.

**Host syncs.** Every point where a GPU run would make the host wait for the device is recorded in
:attr:`CollectiveLog.syncs` with its kind, its call stack and the step it happened in (:attr:`CollectiveLog.step`,
set by the test): on ``commdev`` tensors a read to the host (``.item()``, ``bool()``, ``.cpu()`` or a copy to
the host without ``non_blocking``; ``.tolist()`` refuses a subclass and so fails loudly), an operation whose
output size depends on the data (``nonzero``, boolean indexing, ``masked_select``, ``unique``), and a copy to
the device without ``non_blocking`` (or ``torch.tensor(data, device=...)``); on the tensors a model computes
with (the CPU here, the GPU there), the same reads and data-dependent sizes while any module's forward runs;
``torch.cuda.synchronize`` as megatron-core calls it (its timers) and barriers; and the waits for a
:class:`~megatron_orch.comm.device.HostCopy`, an event wait on a GPU. What the emulation cannot see: whether
host memory is pinned (a ``non_blocking`` copy from pageable memory blocks on a GPU), syncs in autograd's
backward, and CUDA's own implicit ones.
"""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEVICE_NAME = "commdev"
COMM_DEVICE = None  # torch.device("commdev", 0) once install() has named the backend
PROJECT_MODULES = ("megatron_orch", "pretrain_mllm")
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all", "all_to_all_single",
               "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter",
               "send", "recv", "isend", "irecv")


class OnCommDevice(torch.Tensor):
    """A tensor on the emulated device: reports ``commdev``, computes on the CPU tensor it holds."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=COMM_DEVICE, requires_grad=False)

    def __init__(self, data: torch.Tensor):
        self.data_on_host = data

    def __repr__(self):
        return f"OnCommDevice({self.data_on_host!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        kind = _sync_kind(func, args, kwargs)
        if kind is not None and LOG is not None:
            LOG.record(kind)
        leaves, _ = tree_flatten((args, kwargs))
        if func not in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            mixed = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, OnCommDevice)
                     and t.dim() > 0]
            if mixed:
                raise RuntimeError(f"{func}: expected all tensors to be on the same device, but found at least "
                                   f"two devices, {COMM_DEVICE} and {mixed[0].device}")
        target = kwargs.get("device")
        if target is not None and torch.device(target).type == DEVICE_NAME:
            kwargs["device"] = torch.device("cpu")
        result = func(*tree_map(_host_data, args), **tree_map(_host_data, kwargs))
        if "out" in kwargs:
            return kwargs["out"]
        if func._overloadpacket.__name__.endswith("_"):  # in place: the same tensor object
            return args[0]
        if target is not None and torch.device(target).type == "cpu":
            return result  # moved off the device
        return tree_map(_wrap, result)


def _host_data(value):
    return value.data_on_host if isinstance(value, OnCommDevice) else value


def _wrap(value):
    return OnCommDevice(value) if isinstance(value, torch.Tensor) and not isinstance(value, OnCommDevice) else value


_DATA_DEPENDENT = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim")
_INDEXING = ("index", "index_put", "index_put_", "_index_put_impl_")


def _on_device(value) -> bool:
    return isinstance(value, OnCommDevice)


def _sync_kind(func, args, kwargs):
    """The host sync an operation on ``commdev`` tensors would be on a GPU (module docstring), or None."""
    name = func._overloadpacket.__name__
    if name in ("_local_scalar_dense", "equal", "is_nonzero"):
        return "read"
    if name in _DATA_DEPENDENT:
        return "data-dependent size"
    if name in _INDEXING and any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
                                 for t in tree_flatten(args[1] if len(args) > 1 else ())[0]):
        return "data-dependent size"
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None:
        return "data-dependent size"
    if name == "_to_copy":
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu" and not kwargs.get("non_blocking", False):
            return "read"
    if name == "copy_":
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if not non_blocking and _on_device(args[1]) and not _on_device(args[0]):
            return "read"
        if not non_blocking and _on_device(args[0]) and not _on_device(args[1]) and args[1].dim() > 0:
            return "blocking copy to the device"
    return None


class _CreateOnCommDevice(TorchDispatchMode):
    """Factories and copies of CPU tensors with ``device=commdev`` create :class:`OnCommDevice` tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        if (target is not None and torch.device(target).type == DEVICE_NAME
                and not any(issubclass(t, OnCommDevice) for t in types)):
            blocking = func._overloadpacket.__name__ == "_to_copy" and not kwargs.get("non_blocking", False)
            if blocking and LOG is not None:
                LOG.record("blocking copy to the device")
            kwargs["device"] = torch.device("cpu")
            return tree_map(_wrap, func(*args, **kwargs))
        return func(*args, **kwargs)


class _CreateTensorsOnCommDevice(TorchFunctionMode):
    """``torch.tensor(..., device=commdev)`` and alike, which build their tensor below the dispatcher."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        if target is not None and torch.device(target).type == DEVICE_NAME and func in _BELOW_DISPATCH:
            if LOG is not None:
                LOG.record("blocking copy to the device")  # host data copied to the device as it is created
            kwargs["device"] = torch.device("cpu")
            return _wrap(func(*args, **kwargs))
        return func(*args, **kwargs)


_BELOW_DISPATCH = (torch.tensor, torch.as_tensor)


@dataclass
class CollectiveLog:
    """What the checked collectives saw in this process, and every host sync (module docstring)."""

    checked: Counter = field(default_factory=Counter)    # call site -> calls
    unchecked: Counter = field(default_factory=Counter)  # megatron-core and others
    violations: List[str] = field(default_factory=list)
    syncs: List[dict] = field(default_factory=list)      # {"kind", "stack", "step"}
    step: int = 0  # set by the test: the training step running now (0: before the first)

    def record(self, kind: str) -> None:
        self.syncs.append({"kind": kind, "stack": _stack(), "step": self.step})


LOG = None  # the process's CollectiveLog once install() ran


def _stack(depth: int = 8) -> List[str]:
    """'module:function' of the callers outside torch and this file, innermost first."""
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < depth:
        module = frame.f_globals.get("__name__", "")
        if not (module == "torch" or module.startswith("torch.") or module == __name__):
            frames.append(f"{module}:{frame.f_code.co_name}")
        frame = frame.f_back
    return frames


def _call_site():
    """(module, 'module:line function') of the first caller outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module == "torch" or module.startswith("torch.") or module == __name__):
            return module, f"{module}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "", "?"


def _checked(name: str, collective, log: CollectiveLog, project_modules):
    def collective_on_comm_device(*args, **kwargs):
        module, site = _call_site()
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if module.startswith(project_modules):
            log.checked[f"{name} @ {site}"] += 1
            for tensor in tensors:
                if tensor.device != _expected_device():
                    log.violations.append(f"{name} @ {site}: a {tuple(tensor.shape)} {tensor.dtype} tensor on "
                                          f"{tensor.device}, the group communicates on {_expected_device()}")
        else:
            log.unchecked[f"{name} @ {site}"] += 1
        return collective(*tree_map(_host_data, args), **tree_map(_host_data, kwargs))

    return collective_on_comm_device


def _expected_device() -> torch.device:
    from megatron_orch.comm import device
    return device.communication_device()


_COMPUTE_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_COMPUTE_SEARCHES = ("nonzero", "masked_select", "unique", "argwhere")


def _watch_compute_tensors(log: CollectiveLog) -> None:
    """Reads and data-dependent sizes on the tensors a model computes with, while a module's forward runs:
    the CPU here, the GPU on a GPU run (module docstring)."""
    depth = [0]

    def enter(module, args):
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave, always_call=True)

    inside = [False]  # one record per call, also where torch's implementation calls another watched one

    def watched(method, kind):
        def call(tensor, *args, **kwargs):
            if inside[0] or not depth[0] or isinstance(tensor, OnCommDevice):
                return method(tensor, *args, **kwargs)
            log.record(kind)
            inside[0] = True
            try:
                return method(tensor, *args, **kwargs)
            finally:
                inside[0] = False
        return call

    for name in _COMPUTE_READS:
        setattr(torch.Tensor, name, watched(getattr(torch.Tensor, name), "read (model)"))
    for name in _COMPUTE_SEARCHES:
        setattr(torch.Tensor, name, watched(getattr(torch.Tensor, name), "data-dependent size (model)"))
        setattr(torch, name, watched(getattr(torch, name), "data-dependent size (model)"))


def _watch_host_waits(log: CollectiveLog) -> None:
    """torch.cuda.synchronize as megatron-core calls it (the CPU harness's), and HostCopy's event waits."""
    from megatron_orch.comm import device
    from megatron_orch.trainer import cpu_harness

    synchronize = cpu_harness._CpuCuda.synchronize

    def recorded_synchronize(device=None):
        log.record("device synchronize")
        return synchronize(device)

    cpu_harness._CpuCuda.synchronize = staticmethod(recorded_synchronize)
    host_copy = getattr(device, "HostCopy", None)  # (absent before the project had it)
    if host_copy is not None:
        result = host_copy.result

        def recorded_result(self):
            log.record("event wait")
            return result(self)

        host_copy.result = recorded_result


def install(project_modules=PROJECT_MODULES) -> CollectiveLog:
    """Emulate the communication device in this process (once; a spawned test process) and return the log
    of checked collectives. Tensor creation on ``commdev`` works from then on in this thread."""
    global COMM_DEVICE
    # torch's (experimental) set-up of PrivateUse1 as a Python backend: device guard, hooks, module.
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    _setup_privateuseone_for_python_backend(rename=DEVICE_NAME)
    COMM_DEVICE = torch.device(DEVICE_NAME, 0)

    import megatron_orch.trainer.loop  # noqa: F401  (loads every module that communicates)
    from megatron_orch.comm import device
    original = device.communication_device

    def emulated_communication_device(group=None) -> torch.device:
        original(group)  # still refuses a group that does not exist
        return COMM_DEVICE

    # Every module that bound the function (under any name) gets the emulated one.
    for loaded in list(sys.modules.values()):
        if getattr(loaded, "__name__", "").startswith("megatron_orch"):
            for name, value in list(vars(loaded).items()):
                if value is original:
                    setattr(loaded, name, emulated_communication_device)

    global LOG
    log = LOG = CollectiveLog()
    all_reduce = dist.all_reduce
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, _checked(name, getattr(dist, name), log, tuple(project_modules)))

    # torch's barrier asks for the current accelerator, which is now the emulated one and has no
    # runtime: a barrier becomes an all-reduce of a host scalar (what gloo's barrier amounts to).
    def barrier(group=None, async_op=False, device_ids=None):
        log.record("barrier")
        return all_reduce(torch.zeros(1), group=group)

    dist.barrier = barrier
    _watch_compute_tensors(log)
    _watch_host_waits(log)
    _CreateOnCommDevice().__enter__()  # for the rest of this process
    _CreateTensorsOnCommDevice().__enter__()
    return log
