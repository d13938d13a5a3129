"""Model profiles: per-layer sizes and compute times, the planners' input.

A :class:`ModelProfile` is an ordered tuple of :class:`LayerProfile` in **forward order**
(``layers[0]`` runs first in forward and last in backward) plus the optimizer-update time. A
"layer" is whatever the runtime fuses as one unit; the runtime profiler writes one layer per
parameter group, so a schedule's bucket ``(i, j, ...)`` names layer indices of the profile.

Two file formats are read by :func:`load_profile`:

* our own (written by :func:`save_profile` and the runtime profiler)::

      {"format": "lightning_pipedap.profile", "version": 1, "name": "resnet50",
       "unit_time": "s", "t_update": 0.004,
       "layers": [{"name": "conv1", "numel": 9408, "bytes_per_element": 4,
                   "t_f": 3.0e-05, "t_b": 4.0e-03}, ...],
       "meta": {...}}

  (a layer may give ``"nbytes"`` instead of ``numel``/``bytes_per_element``);
* the PipeDAP reference profiles in ``lightning_pipedap/plan/profiles/<model>.json`` (``unit_time: "s"``, layers
  with ``params`` = element count, see that folder's README).

Nothing here imports ``torch``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "LayerProfile",
    "ModelProfile",
    "load_profile",
    "load_reference_profile",
    "save_profile",
    "shared_profiles_dir",
    "resolve_profile_path",
]

PROFILE_FORMAT = "lightning_pipedap.profile"  # the file format's name (a per-layer profile), not a module path
PROFILE_VERSION = 1
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def _check_time(name: str, what: str, v: float) -> float:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise ValueError(f"{what} of layer {name!r} must be a finite number of seconds >= 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class LayerProfile:
    """One layer (fusion unit) of the profile.

    Attributes:
        name: layer or parameter-group name.
        nbytes: gradient size in bytes (>= 0).
        t_f: forward compute seconds per iteration (>= 0).
        t_b: backward compute seconds per iteration (>= 0).
        numel: number of gradient elements, when known (``None`` otherwise).

    Raises:
        ValueError: on a negative or non-finite size or time.
    """

    name: str
    nbytes: int
    t_f: float
    t_b: float
    numel: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"nbytes of layer {self.name!r} must be an int >= 0, got {self.nbytes!r}")
        _check_time(self.name, "t_f", self.t_f)
        _check_time(self.name, "t_b", self.t_b)

    @classmethod
    def from_numel(cls, name: str, numel: int, bytes_per_element: int, t_f: float, t_b: float) -> "LayerProfile":
        """Layer of ``numel`` elements of ``bytes_per_element`` bytes each (fp32: 4, fp16/bf16: 2).

        Raises:
            ValueError: if ``numel < 0`` or ``bytes_per_element <= 0``.
        """
        if int(numel) != numel or numel < 0:
            raise ValueError(f"numel of layer {name!r} must be an int >= 0, got {numel!r}")
        if int(bytes_per_element) != bytes_per_element or bytes_per_element <= 0:
            raise ValueError(f"bytes_per_element of layer {name!r} must be an int > 0, got {bytes_per_element!r}")
        return cls(name, int(numel) * int(bytes_per_element), float(t_f), float(t_b), int(numel))


@dataclass(frozen=True)
class ModelProfile:
    """Ordered layer profiles (forward order) plus the optimizer-update time.

    Attributes:
        name: model name (for tables and logs).
        layers: the layers in forward order.
        t_update: seconds of the optimizer update per iteration, all buckets together (>= 0). The
            simulator charges bucket ``b`` the share ``t_update * nbytes(b) / total bytes`` on the
            compute stream right before the first forward that uses it.
        meta: provenance (source file, batch size, device, ...).

    Raises:
        ValueError: if there are no layers or ``t_update`` is invalid.
    """

    name: str
    layers: tuple[LayerProfile, ...]
    t_update: float = 0.0
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError(f"profile {self.name!r} has no layers; need at least one")
        _check_time(self.name, "t_update", self.t_update)

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.layers)

    @property
    def sizes_bytes(self) -> tuple[int, ...]:
        """Gradient bytes per layer, forward order."""
        return tuple(layer.nbytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        """Gradient bytes of the whole model."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def t_forward(self) -> float:
        """Total forward seconds."""
        return sum(layer.t_f for layer in self.layers)

    @property
    def t_backward(self) -> float:
        """Total backward seconds."""
        return sum(layer.t_b for layer in self.layers)

    @property
    def t_compute(self) -> float:
        """Forward + backward + update seconds: the iteration time with free communication."""
        return self.t_forward + self.t_backward + self.t_update

    def scaled(self, time_factor: float = 1.0) -> "ModelProfile":
        """Copy with every compute time (``t_f``, ``t_b``, ``t_update``) multiplied by ``time_factor``."""
        if not (time_factor >= 0 and math.isfinite(time_factor)):
            raise ValueError(f"time_factor must be a finite number >= 0, got {time_factor}")
        layers = tuple(LayerProfile(layer.name, layer.nbytes, layer.t_f * time_factor, layer.t_b * time_factor,
                                    layer.numel)
                       for layer in self.layers)
        return ModelProfile(self.name, layers, self.t_update * time_factor, dict(self.meta))

    def to_dict(self) -> dict:
        """JSON-ready dict in our own format (version 1)."""
        layers = []
        for layer in self.layers:
            d: dict[str, Any] = {"name": layer.name}
            if layer.numel is not None and layer.numel > 0 and layer.nbytes % layer.numel == 0:
                d.update(numel=layer.numel, bytes_per_element=layer.nbytes // layer.numel)
            else:
                d["nbytes"] = layer.nbytes
            d.update(t_f=layer.t_f, t_b=layer.t_b)
            layers.append(d)
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": self.name, "unit_time": "s",
                "t_update": self.t_update, "layers": layers, "meta": dict(self.meta)}


def save_profile(profile: ModelProfile, path: str | Path) -> Path:
    """Write ``profile`` in our JSON format to ``path``; return the path."""
    p = Path(path)
    p.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return p


#: the reference profiles shipped with the package (``lightning_pipedap/plan/profiles``, see its README)
PACKAGED_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def shared_profiles_dir() -> Path | None:
    """The folder of the reference profiles: ``$PIPEDAP_PROFILES_DIR`` when set, else the copy shipped
    with the package (:data:`PACKAGED_PROFILES_DIR`); ``None`` only if neither exists."""
    cands = []
    env = os.environ.get("PIPEDAP_PROFILES_DIR")
    if env:
        cands.append(Path(env))
    cands.append(PACKAGED_PROFILES_DIR)
    for c in cands:
        if c.is_dir():
            return c
    return None


def resolve_profile_path(path_or_name: str | Path) -> Path:
    """Turn a file path or a shared profile name (``"resnet50"``) into an existing path.

    Raises:
        FileNotFoundError: naming the paths tried and the shared profile names available.
    """
    p = Path(path_or_name)
    if p.is_file():
        return p
    d = shared_profiles_dir()
    if d is not None:
        q = d / (p.name if p.suffix == ".json" else p.name + ".json")
        if q.is_file():
            return q
        names = sorted(f.stem for f in d.glob("*.json") if f.stem != "alpha_beta")
    else:
        names = []
    raise FileNotFoundError(
        f"no profile file {str(path_or_name)!r} and no shared profile of that name "
        f"(shared folder: {d}); valid names: {names}"
    )


def load_reference_profile(data_or_path: Mapping[str, Any] | str | Path, *, repaired: bool = False,
                           bytes_per_element: int = 4) -> ModelProfile:
    """Read a PipeDAP reference profile (``lightning_pipedap/plan/profiles/<model>.json``).

    Args:
        data_or_path: the parsed JSON, a path, or a shared profile name.
        repaired: use ``layers_repaired`` (every tensor counted) instead of ``layers`` (the
            reference's merge, bit for bit, with its dropped tensors).
        bytes_per_element: bytes per gradient element (fp32: 4); sizes become
            ``params * bytes_per_element``.

    Returns:
        The profile; ``t_update`` is 0 (the reference does not model the update).

    Raises:
        ValueError: if the time unit is not one of s/ms/us or a field is missing.
    """
    if isinstance(data_or_path, Mapping):
        data, src = data_or_path, "<dict>"
    else:
        path = resolve_profile_path(data_or_path)
        data, src = json.loads(path.read_text()), str(path)
    unit = data.get("unit_time", "s")
    if unit not in _TIME_UNITS:
        raise ValueError(f"unit_time {unit!r} of {src} not understood; valid: {sorted(_TIME_UNITS)}")
    scale = _TIME_UNITS[unit]
    key = "layers_repaired" if repaired else "layers"
    if key not in data:
        raise ValueError(f"{src} has no {key!r} list; is it a reference profile?")
    layers = tuple(
        LayerProfile.from_numel(str(entry["name"]), int(entry["params"]), bytes_per_element,
                                float(entry["t_f"]) * scale, float(entry["t_b"]) * scale)
        for entry in data[key]
    )
    return ModelProfile(str(data.get("model", Path(src).stem)), layers, 0.0,
                        {"source": src, "variant": key, "bytes_per_element": bytes_per_element})


def _own_profile(data: Mapping[str, Any], src: str) -> ModelProfile:
    if data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{src}: unsupported profile version {data.get('version')!r}; valid: {PROFILE_VERSION}")
    unit = data.get("unit_time", "s")
    if unit not in _TIME_UNITS:
        raise ValueError(f"{src}: unit_time {unit!r} not understood; valid: {sorted(_TIME_UNITS)}")
    scale = _TIME_UNITS[unit]
    layers = []
    for i, entry in enumerate(data.get("layers", [])):
        name = str(entry.get("name", f"layer{i}"))
        if "nbytes" in entry:
            layers.append(LayerProfile(name, int(entry["nbytes"]), float(entry["t_f"]) * scale,
                                       float(entry["t_b"]) * scale, entry.get("numel")))
        elif "numel" in entry:
            layers.append(LayerProfile.from_numel(name, int(entry["numel"]), int(entry.get("bytes_per_element", 4)),
                                                  float(entry["t_f"]) * scale, float(entry["t_b"]) * scale))
        else:
            raise ValueError(f"{src}: layer {i} ({name!r}) needs 'nbytes' or 'numel' (+ 'bytes_per_element')")
    return ModelProfile(str(data.get("name", "model")), tuple(layers), float(data.get("t_update", 0.0)) * scale,
                        dict(data.get("meta", {}), source=src))


def load_profile(path_or_name: str | Path | Mapping[str, Any], *, repaired: bool = False,
                 bytes_per_element: int = 4) -> ModelProfile:
    """Load a profile in our format or the PipeDAP reference format (detected from the content).

    Args:
        path_or_name: a JSON file, a shared profile name such as ``"resnet50"``, or parsed JSON.
        repaired, bytes_per_element: passed to :func:`load_reference_profile` for reference files
            (ignored for our own format, which stores bytes per layer).

    Raises:
        FileNotFoundError: if neither a file nor a shared profile of that name exists.
        ValueError: if the content is neither format (the message says what was found).
    """
    if isinstance(path_or_name, Mapping):
        data, src = path_or_name, "<dict>"
    else:
        path = resolve_profile_path(path_or_name)
        data, src = json.loads(path.read_text()), str(path)
    if data.get("format") == PROFILE_FORMAT:
        return _own_profile(data, src)
    if "layers" in data and "unit_time" in data and "model" in data:
        return load_reference_profile(data, repaired=repaired, bytes_per_element=bytes_per_element)
    raise ValueError(
        f"{src} is not a profile: expected format {PROFILE_FORMAT!r} or a PipeDAP reference profile "
        f"(keys 'model', 'unit_time', 'layers'); found keys {sorted(data)[:10]}"
    )
