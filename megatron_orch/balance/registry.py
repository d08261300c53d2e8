"""The choices a user picks by name: partitioners (``--orch-algorithm``) and placement methods
(``--orch-placement``), one registry each.

Each entry is a name, a function and a one-line description. The built-in ones register where they are
defined (:mod:`megatron_orch.balance.partition`, :mod:`megatron_orch.balance.placement`); a user's register
the same way, from outside the package, before the argument parser is built (its ``choices`` are read from
here when it is built)::

    from megatron_orch.balance.registry import register_partitioner

    @register_partitioner("round_robin")
    def round_robin(costs, num_bins, memory, memory_cap):
        \"\"\"Item i to bin i mod K.\"\"\"
        return np.arange(costs.size) % num_bins

The flags' choices, :class:`~megatron_orch.orchestrator.config.OrchestratorConfig`'s checks, ``partition``'s
and ``place_bins``' dispatch all read these registries. A module named in the environment variable
``MEGATRON_ORCH_PLUGINS`` (comma-separated) is imported the first time a registry is read, so the shipped
launch scripts can select a user's partitioner with no launch script of the user's own.

What a function receives and returns:

* a partitioner: ``function(costs, num_bins, memory, memory_cap)`` with ``costs`` the items' costs (float64,
  finite, >= 0), ``num_bins`` an int >= 1, ``memory`` each item's memory (zeros without a cap) and
  ``memory_cap`` each bin's (``math.inf``: none); it returns one bin id in ``0..num_bins-1`` per item, and
  raises ValueError when it cannot honour the cap. ``auto`` tries the built-in partitioners only (registered
  ones are picked by name, so ``auto`` plans the same and as fast with or without them).
* a placement method: ``function(traffic, topology, config)`` with a
  :class:`~megatron_orch.balance.placement.BinTraffic` (bytes each bin pulls from each rank; one bin per
  rank), the :class:`~megatron_orch.balance.topology.Topology` and the
  :class:`~megatron_orch.balance.placement.PlacementConfig`; it returns the rank of every bin (a
  permutation of the ranks), or (ranks, solver name).

Every rank plans on its own, so a function must be deterministic: the same inputs give the same result on
every rank (the step plan's digest is compared across ranks). This module imports nothing but the standard
library.
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

PLUGINS_ENV = "MEGATRON_ORCH_PLUGINS"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Entry:
    """One registered choice: its ``name``, the ``function`` that runs it, a one-line ``doc`` and whether it
    ships with the package (``builtin``: the partitioners ``auto`` tries)."""

    name: str
    function: Callable
    doc: str
    builtin: bool = False


class Registry:
    """The entries of one choice, in the order they were registered, after the names the dispatcher handles
    itself (``reserved``: e.g. ``auto``). The built-in entries are loaded (their module imported) the first
    time the registry is read."""

    def __init__(self, what: str, builtins_module: str, reserved: Tuple[str, ...] = (),
                 unusable: Tuple[str, ...] = ()):
        self.what = what
        self._builtins_module = builtins_module
        self._reserved = reserved
        self._unusable = unusable  # names a result uses for something else (e.g. "home"): never registered
        self._entries: Dict[str, Entry] = {}
        self._loaded = False

    def register(self, name: str, function: Optional[Callable] = None, *, doc: Optional[str] = None,
                 _builtin: bool = False):
        """Register ``function`` as ``name`` (``doc``: its description, by default its docstring's first line).
        Without ``function``, a decorator. ValueError for a name taken or not of letters, digits and
        ``_.-``."""
        if function is None:
            return lambda fn: self.register(name, fn, doc=doc, _builtin=_builtin)
        if not callable(function):
            raise ValueError(f"{self.what} {name!r}: {function!r} is not callable")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{self.what} name {name!r}: use letters, digits and _.- (not first)")
        if not _builtin:
            self._load()
        if name in self._reserved or name in self._unusable or name in self._entries:
            raise ValueError(f"{self.what} {name!r} is taken: choose another name than "
                             f"{', '.join(self._reserved + self._unusable + tuple(self._entries))}")
        lines = (doc or getattr(function, "__doc__", None) or "").strip().splitlines()
        self._entries[name] = Entry(name, function, lines[0].strip() if lines else "", _builtin)
        return function

    def unregister(self, name: str) -> None:
        """Remove a registered (not a built-in) entry."""
        entry = self.get(name)
        if entry.builtin:
            raise ValueError(f"{self.what} {name!r} is built in: it cannot be removed")
        del self._entries[name]

    def get(self, name: str) -> Entry:
        """The entry of ``name``; ValueError naming the choices if there is none (also for a reserved name)."""
        self._load()
        entry = self._entries.get(name)
        if entry is None:
            raise ValueError(self._unknown(name))
        return entry

    def check(self, name: str) -> str:
        """``name`` if it is a choice (reserved or registered), else ValueError naming the choices."""
        self._load()
        if name not in self._reserved and name not in self._entries:
            raise ValueError(self._unknown(name))
        return name

    def names(self) -> Tuple[str, ...]:
        """Every choice: the reserved names, then the entries in registration order (built-in first)."""
        self._load()
        return self._reserved + tuple(self._entries)

    def builtins(self) -> Tuple[Entry, ...]:
        """The entries that ship with the package, in registration order."""
        self._load()
        return tuple(entry for entry in self._entries.values() if entry.builtin)

    def describe(self) -> str:
        """One ``name: description`` per registered entry, comma-separated (for a flag's help)."""
        return "; ".join(f"{entry.name}: {entry.doc.rstrip('.')}" if entry.doc else entry.name
                         for entry in self._entries.values())

    def _unknown(self, name) -> str:
        return f"unknown {self.what} {name!r}; choose one of {', '.join(self.names())}"

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True  # (importing the built-ins registers them: they find it loaded)
        try:
            importlib.import_module(self._builtins_module)
            load_plugins()
        except BaseException:
            self._loaded = False
            raise


_plugins_loaded = set()


def load_plugins() -> None:
    """Import the modules named in ``$MEGATRON_ORCH_PLUGINS`` (comma-separated) that are not imported yet;
    ValueError naming the variable for one that does not import."""
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        if module in _plugins_loaded:
            continue
        _plugins_loaded.add(module)
        try:
            importlib.import_module(module)
        except BaseException as err:
            _plugins_loaded.discard(module)
            if isinstance(err, ImportError):
                raise ValueError(f"{PLUGINS_ENV}: cannot import {module!r}: {err}") from err
            raise


PARTITIONERS = Registry("partitioner", "megatron_orch.balance.partition", reserved=("auto",),
                        unusable=("home", "none", "uniform"))
PLACEMENTS = Registry("placement method", "megatron_orch.balance.placement")


def register_partitioner(name: str, function: Optional[Callable] = None, *, doc: Optional[str] = None):
    """Register a partitioner (see the module docstring); a decorator without ``function``."""
    return PARTITIONERS.register(name, function, doc=doc)


def register_placement(name: str, function: Optional[Callable] = None, *, doc: Optional[str] = None):
    """Register a placement method (see the module docstring); a decorator without ``function``."""
    return PLACEMENTS.register(name, function, doc=doc)


def partitioner_names() -> Tuple[str, ...]:
    """The ``--orch-algorithm`` choices: ``auto``, the built-in partitioners, then the registered ones."""
    return PARTITIONERS.names()


def placement_names() -> Tuple[str, ...]:
    """The ``--orch-placement`` choices: the built-in placement methods, then the registered ones."""
    return PLACEMENTS.names()
