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
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single",
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


class _CreateOnCommDevice(TorchDispatchMode):
    """Factories and copies of CPU tensors with ``device=commdev`` create :class:`OnCommDevice` tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        if (target is not None and torch.device(target).type == DEVICE_NAME
                and not any(issubclass(t, OnCommDevice) for t in types)):
            kwargs["device"] = torch.device("cpu")
            return tree_map(_wrap, func(*args, **kwargs))
        return func(*args, **kwargs)


class _CreateTensorsOnCommDevice(TorchFunctionMode):
    """``torch.tensor(..., device=commdev)`` and alike, which build their tensor below the dispatcher."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        if target is not None and torch.device(target).type == DEVICE_NAME and func in _BELOW_DISPATCH:
            kwargs["device"] = torch.device("cpu")
            return _wrap(func(*args, **kwargs))
        return func(*args, **kwargs)


_BELOW_DISPATCH = (torch.tensor, torch.as_tensor)


@dataclass
class CollectiveLog:
    """What the checked collectives saw in this process."""

    checked: Counter = field(default_factory=Counter)    # call site -> calls
    unchecked: Counter = field(default_factory=Counter)  # megatron-core and others
    violations: List[str] = field(default_factory=list)


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

    log = CollectiveLog()
    all_reduce = dist.all_reduce
    for name in COLLECTIVES:
        setattr(dist, name, _checked(name, getattr(dist, name), log, tuple(project_modules)))
    # torch's barrier asks for the current accelerator, which is now the emulated one and has no
    # runtime: a barrier becomes an all-reduce of a host scalar (what gloo's barrier amounts to).
    dist.barrier = lambda group=None, async_op=False, device_ids=None: all_reduce(torch.zeros(1), group=group)
    _CreateOnCommDevice().__enter__()  # for the rest of this process
    _CreateTensorsOnCommDevice().__enter__()
    return log
