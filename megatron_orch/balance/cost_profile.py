"""Measured per-item costs of every phase: a profile fitted to forward+backward timings on one device.

FLOPs from the model's shape (:mod:`megatron_orch.balance.cost`) are a poor clock on a real device:
short sequences and small encoder batches run far below peak, long ones lose time to attention. A
cost profile replaces them with seconds measured on the device (``python -m
megatron_orch.bench.calibrate`` writes one). Per phase, the time of one item of ``s`` tokens is

    item_seconds(s) = c0 + c1 * s + c2 * s**2

and an encoder phase adds ``call_overhead`` once per rank that encodes at least one item (one batched
call per rank and step). Every item of an encoder phase has the same length, so there ``c1 = c2 = 0``
and ``c0`` is the time of one item at that length; only the backbone's examples vary in length. The
planner balances ``item_seconds`` (the call overhead is the same on every rank that has items);
:func:`rank_seconds` adds the overhead for modeled rank times.

A profile is valid only for the phases it was measured on (per phase: the cost model's signature, e.g.
layers, widths, heads, and an encoder's item length: :func:`phase_signatures`);
:meth:`CostProfile.apply` refuses any other, naming the field, and gives the phases the profile's
costs (:class:`ProfileCost`).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np
import yaml

from megatron_orch.balance.cost import CostModel
from megatron_orch.balance.workload import ModelPhases

PROFILE_KIND = "megatron-orch cost profile"
PROFILE_VERSION = 2  # 2: an encoder's embedding rows per item are output_rows_per_item


def phase_signatures(phases: ModelPhases) -> Dict[str, dict]:
    """What a profile's timings depend on, per phase: its cost model's signature, and for an encoder the
    tokens of one item and the rows it gives the backbone."""
    out = {phase.name: {**phase.cost.signature(), "item_tokens": phase.item_tokens,
                        "output_rows_per_item": phase.output_rows} for phase in phases.encoders}
    out[phases.backbone.name] = phases.backbone.cost.signature()
    return out


def _number_problem(value) -> Optional[str]:
    """Why ``value`` is not a finite number >= 0, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return f"must be a finite number >= 0, got {value!r}"
    return None


@dataclass(frozen=True)
class PhaseFit:
    """Seconds of forward+backward per item of ``s`` tokens: ``c0 + c1*s + c2*s^2``, plus ``call_overhead``
    per call (encoder phases). ``residual_rms`` / ``residual_max``: relative residuals of the fit over its
    ``num_points`` measurements."""

    c0: float
    c1: float
    c2: float
    call_overhead: float
    residual_rms: float
    residual_max: float
    num_points: int

    def __post_init__(self):
        for f in fields(self):
            problem = _number_problem(getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name} {problem}")
        if self.c0 == self.c1 == self.c2 == 0:
            raise ValueError("c0, c1 and c2 are all 0: every item would be free")

    def item_seconds(self, seq_len) -> np.ndarray:
        s = np.asarray(seq_len, dtype=np.float64)
        return self.c0 + self.c1 * s + self.c2 * s * s


@dataclass(frozen=True, eq=False, repr=False)
class CostProfile:
    """A loaded, validated profile (see the module docstring). ``phases`` has one fit per phase of the
    model it was measured on."""

    source: str  # where it was loaded from (for messages)
    device: str
    dtype: str
    model_name: str
    shape: Dict[str, dict]  # phase_signatures() of the measured model
    phases: Dict[str, PhaseFit]

    def __repr__(self) -> str:  # short: the trainer logs its config
        return f"CostProfile({self.source!r}, device={self.device!r}, dtype={self.dtype!r}, model={self.model_name!r})"

    def apply(self, phases: ModelPhases) -> ModelPhases:
        """``phases`` with this profile's costs; ValueError unless measured on exactly these phases."""
        wanted = phase_signatures(phases)
        for phase in sorted(set(wanted) | set(self.shape)):
            if phase not in self.shape or phase not in wanted:
                raise ValueError(f"cost profile {self.source}: model.shape.{phase}: measured "
                                 f"{'without' if phase not in self.shape else 'with'} a {phase} phase, but the "
                                 f"model ({', '.join(phases.names)}) {'has' if phase in wanted else 'has no'} one")
            for key in sorted(set(wanted[phase]) | set(self.shape[phase])):
                measured, have = self.shape[phase].get(key), wanted[phase].get(key)
                if measured != have:
                    raise ValueError(f"cost profile {self.source}: model.shape.{phase}.{key}: measured on "
                                     f"{measured!r}, but the model has {have!r}; calibrate a profile for this "
                                     f"model (python -m megatron_orch.bench.calibrate)")
        for phase in phases.encoders:
            fit = self.phases[phase.name]
            if fit.c1 or fit.c2:
                raise ValueError(f"cost profile {self.source}: phases.{phase.name}.c1: must be 0 (with c2) for an "
                                 "encoder phase: its items all have one length")
        if self.phases[phases.backbone.name].call_overhead != 0:
            raise ValueError(f"cost profile {self.source}: phases.{phases.backbone.name}.call_overhead: must be 0 "
                             "for the backbone phase (its cost is per example)")

        def measured(phase):
            return dataclasses.replace(phase, cost=ProfileCost(self.phases[phase.name], phase.cost))
        return ModelPhases(encoders=tuple(measured(p) for p in phases.encoders), backbone=measured(phases.backbone))


@dataclass(frozen=True)
class ProfileCost:
    """A phase's measured cost model: the fit's seconds per item; activation memory and the signature are
    those of the cost model it replaces (``base``)."""

    fit: PhaseFit
    base: CostModel

    def item_cost(self, tokens) -> np.ndarray:
        return self.fit.item_seconds(tokens)

    def item_memory(self, tokens) -> np.ndarray:
        return self.base.item_memory(tokens)

    def signature(self) -> Dict[str, object]:
        return self.base.signature()


def rank_seconds(fit: PhaseFit, item_seconds, rank, num_ranks: int) -> np.ndarray:
    """Modeled seconds of one phase on every rank: its items' seconds, plus the call overhead on every
    rank that has an item."""
    rank = np.asarray(rank, dtype=np.int64)
    loads = np.bincount(rank, weights=np.asarray(item_seconds, dtype=np.float64), minlength=num_ranks)
    return loads + fit.call_overhead * (np.bincount(rank, minlength=num_ranks) > 0)


def fit_phase(items_per_call: Sequence[float], seq_len: Sequence[float], seconds: Sequence[float],
              call_overhead: bool) -> PhaseFit:
    """Least-squares fit of ``seconds = [overhead] + n * (c0 + c1*s + c2*s^2)`` with every coefficient
    >= 0, over calls of ``n`` items of ``s`` tokens each; relative residuals are minimised, so short calls
    count as much as long ones. With a single length ``s`` only ``c0`` (and the overhead) can be told
    apart: ``c1 = c2 = 0``.

    Non-negative least squares by trying every subset of coefficients (at most 16): exact for so few. An
    item always costs something: noisy timings that fall with more items give a per-item time, never a
    call overhead alone.
    """
    n, s, t = (np.asarray(v, dtype=np.float64) for v in (items_per_call, seq_len, seconds))
    if not (n.shape == s.shape == t.shape and n.ndim == 1):
        raise ValueError(f"items_per_call, seq_len and seconds must be 1-D of one length, got "
                         f"{n.shape}, {s.shape}, {t.shape}")
    if n.size == 0 or n.min() < 1 or s.min() < 1 or not np.all(np.isfinite(t)) or t.min() <= 0:
        raise ValueError("a fit needs measurements with >= 1 item of >= 1 token and seconds > 0")
    names = ["c0"] + (["c1", "c2"] if np.ptp(s) > 0 else []) + (["call_overhead"] if call_overhead else [])
    columns = {"c0": n, "c1": n * s, "c2": n * s * s, "call_overhead": np.ones_like(n)}
    if n.size < len(names):
        raise ValueError(f"{n.size} measurements cannot fit {len(names)} coefficients {names}")
    a = np.stack([columns[name] for name in names], axis=1) / t[:, None]  # relative residuals
    best, best_err = np.zeros(len(names)), math.inf
    for size in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), size):
            item_terms = [i for i in subset if names[i] != "call_overhead"]
            if not item_terms:
                continue  # items must cost something
            coef, *_ = np.linalg.lstsq(a[:, subset], np.ones(n.size), rcond=None)
            if coef.min() < 0 or not coef[[subset.index(i) for i in item_terms]].any():
                continue
            full = np.zeros(len(names))
            full[list(subset)] = coef
            err = float(np.sum((a @ full - 1.0) ** 2))
            if err < best_err - 1e-15:
                best, best_err = full, err
    if not math.isfinite(best_err):
        raise ValueError("no fit with non-negative coefficients explains these timings")
    coef = dict(zip(names, best))
    relative = a @ best - 1.0
    return PhaseFit(c0=float(coef["c0"]), c1=float(coef.get("c1", 0.0)), c2=float(coef.get("c2", 0.0)),
                    call_overhead=float(coef.get("call_overhead", 0.0)),
                    residual_rms=float(np.sqrt(np.mean(relative ** 2))), residual_max=float(np.abs(relative).max()),
                    num_points=int(n.size))


_TOP_KEYS = {"kind", "version", "device", "dtype", "model", "phases"}
_OPTIONAL_TOP_KEYS = {"measured_at", "command", "notes"}
_PHASE_KEYS = {f.name for f in fields(PhaseFit)}
_OPTIONAL_PHASE_KEYS = {"points"}
_POINT_KEYS = {"items", "seq_len", "seconds", "fitted_seconds"}


def profile_dict(device: str, dtype: str, model_name: str, phases: ModelPhases, fits: Dict[str, PhaseFit],
                 points: Dict[str, list], **extra) -> dict:
    """The YAML document of a profile of ``phases`` (what :func:`load_cost_profile` reads back)."""
    documented = {}
    for name, fit in fits.items():
        documented[name] = {f.name: getattr(fit, f.name) for f in fields(PhaseFit)}
        documented[name]["points"] = points.get(name, [])
    return {"kind": PROFILE_KIND, "version": PROFILE_VERSION, "device": device, "dtype": dtype,
            "model": {"name": model_name, "shape": phase_signatures(phases)}, "phases": documented, **extra}


def cost_profile_from_dict(data, source: str = "<dict>") -> CostProfile:
    """Validate a profile document; a missing, unknown or bad field raises ValueError naming it."""
    def fail(field: str, why: str):
        raise ValueError(f"cost profile {source}: {field}: {why}")

    if not isinstance(data, dict):
        fail("(top level)", f"expected a mapping, got {type(data).__name__}")
    for key in sorted(_TOP_KEYS - set(data)):
        fail(key, "missing")
    for key in sorted(set(data) - _TOP_KEYS - _OPTIONAL_TOP_KEYS):
        fail(key, f"unknown field; allowed: {sorted(_TOP_KEYS | _OPTIONAL_TOP_KEYS)}")
    if data["kind"] != PROFILE_KIND:
        fail("kind", f"expected {PROFILE_KIND!r}, got {data['kind']!r}")
    if data["version"] != PROFILE_VERSION:
        fail("version", f"expected {PROFILE_VERSION}, got {data['version']!r}")
    for key in ("device", "dtype"):
        if not isinstance(data[key], str) or not data[key]:
            fail(key, f"expected a non-empty string, got {data[key]!r}")
    model = data["model"]
    if not isinstance(model, dict) or set(model) != {"name", "shape"}:
        fail("model", f"expected a mapping with keys name and shape, got {model!r:.200}")
    shape = model["shape"]
    if not isinstance(shape, dict) or not shape:
        fail("model.shape", f"expected a non-empty mapping of the measured model's phases, got {shape!r:.200}")
    for phase, values in shape.items():
        if not isinstance(values, dict):
            fail(f"model.shape.{phase}", f"expected a mapping, got {values!r:.200}")
    phases = data["phases"]
    if not isinstance(phases, dict):
        fail("phases", f"expected a mapping, got {type(phases).__name__}")
    for phase in sorted(set(shape) - set(phases)):
        notes = f"; its notes: {data['notes']}" if data.get("notes") else ""
        fail(f"phases.{phase}", f"missing (the measured model has this phase){notes}")
    for phase in sorted(set(phases) - set(shape)):
        fail(f"phases.{phase}", "the measured model (model.shape) has no such phase")
    fits = {}
    for phase, values in phases.items():
        where = f"phases.{phase}"
        if not isinstance(values, dict):
            fail(where, f"expected a mapping, got {values!r:.200}")
        for key in sorted(_PHASE_KEYS - set(values)):
            fail(f"{where}.{key}", "missing")
        for key in sorted(set(values) - _PHASE_KEYS - _OPTIONAL_PHASE_KEYS):
            fail(f"{where}.{key}", f"unknown field; allowed: {sorted(_PHASE_KEYS | _OPTIONAL_PHASE_KEYS)}")
        for key in sorted(_PHASE_KEYS):
            problem = _number_problem(values[key])
            if problem:
                fail(f"{where}.{key}", problem)
        _check_points(values.get("points", []), f"{where}.points", fail)
        try:
            fits[phase] = PhaseFit(**{key: values[key] for key in _PHASE_KEYS})
        except ValueError as err:
            fail(where, str(err))
    return CostProfile(source=source, device=data["device"], dtype=data["dtype"], model_name=str(model["name"]),
                       shape=shape, phases=fits)


def _check_points(points, where: str, fail) -> None:
    if not isinstance(points, list):
        fail(where, f"expected a list, got {type(points).__name__}")
    for i, point in enumerate(points):
        if not isinstance(point, dict) or set(point) != _POINT_KEYS:
            fail(f"{where}[{i}]", f"expected a mapping with keys {sorted(_POINT_KEYS)}, got {point!r:.200}")
        for key in sorted(_POINT_KEYS):
            problem = _number_problem(point[key])
            if problem:
                fail(f"{where}[{i}].{key}", problem)


def load_cost_profile(path: str, phases: Optional[ModelPhases] = None) -> CostProfile:
    """Read and validate a profile YAML; with ``phases``, also refuse it unless measured on those phases."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"cost profile {path}: no such file")
    with open(p) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ValueError(f"cost profile {path}: not valid YAML: {err}") from None
    profile = cost_profile_from_dict(data, str(path))
    if phases is not None:
        profile.apply(phases)
    return profile
