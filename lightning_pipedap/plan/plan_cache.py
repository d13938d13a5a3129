"""Plans remembered across runs: the key of what a measured plan selection depends on, and its store.

A finished selection (the candidates measured in trials, the fastest installed) is written to a JSON file
under a *key* of everything the choice depends on (:func:`plan_key`). A later run whose key is identical
installs the remembered candidate right after its trace step, without profiling or trials, and only
verifies it (:class:`~lightning_pipedap.strategy.controller.Controller`). A key that differs in any part is
never reused; the store then says which part differed from the closest entry of the same model
(:meth:`PlanStore.lookup`).

Files: ``plan-<model digest>-<key digest>.json`` in the store's directory, written atomically (a temporary
file in the same directory, then ``os.replace``), so concurrent jobs of a sweep never see half a file; the
last writer of one key wins. Pure: no ``torch.distributed``; the strategy reads on rank 0 and broadcasts.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

#: ``format`` tag and ``version`` of an entry file
ENTRY_FORMAT = "lightning_pipedap.plan_cache"
ENTRY_VERSION = 1
#: the parts of a key, in the order a difference is reported
KEY_PARTS = ("model", "world", "backend", "device", "link", "optimizers", "options", "versions")


def plan_key(*, model_class: str, params: Sequence[Sequence[Any]], world_size: int, nodes: int,
             processes_per_node: int, backend: str, device: str, link: Mapping[str, Any],
             optimizers: Sequence[str], options: Mapping[str, Any], versions: Mapping[str, str]) -> dict[str, Any]:
    """What a selected plan depends on, as plain JSON-able data (a pure function: equal inputs, equal key).

    Args:
        model_class: the model's class name.
        params: ``[name, shape, dtype, requires_grad, owner]`` of every parameter the engine reduces, in
            traced order (order of first use in the forward; ``owner``: the module name whose forward triggers
            its update), then the frozen ones (``requires_grad`` False, owner None) in registration order.
        world_size, nodes, processes_per_node: the process layout.
        backend: the process group's backend (``"gloo"``, ``"nccl"``).
        device: the device kind (``"cpu"``, ``"cuda:NVIDIA H200"``).
        link: the link fingerprint: ``{"alpha_beta_key": ...}``, the α-β cache entry of this group (backend,
            world size, host set, master address, device kind), and a given cost model's constants, if any.
        optimizers: every optimizer's class, ``module.qualname``.
        options: every option that changes the plan or its measured speed, ``name -> repr(value)``.
        versions: package versions (``lightning_pipedap``, ``torch``) and the entry format's.

    Returns:
        ``{part: value}`` for each of :data:`KEY_PARTS`.
    """
    return {
        "model": {"class": model_class, "params": [[str(n), [int(s) for s in shape], str(dt), bool(rg),
                                                    None if own is None else str(own)]
                                                   for n, shape, dt, rg, own in params]},
        "world": {"world_size": int(world_size), "nodes": int(nodes), "processes_per_node": int(processes_per_node)},
        "backend": str(backend),
        "device": str(device),
        "link": dict(sorted(link.items())),
        "optimizers": [str(o) for o in optimizers],
        "options": dict(sorted((str(k), v) for k, v in options.items())),
        "versions": dict(sorted(versions.items())),
    }


def digest(value: Any) -> str:
    """16 hex digits of SHA-1 over ``value``'s canonical JSON (sorted keys)."""
    return hashlib.sha1(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def differing_parts(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The key parts (:data:`KEY_PARTS` order, then any other) whose values differ between keys ``a`` and ``b``."""
    parts = list(KEY_PARTS) + sorted((set(a) | set(b)) - set(KEY_PARTS))
    return [p for p in parts if a.get(p) != b.get(p)]


def _short(v: Any, limit: int = 60) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_difference(part: str, theirs: Any, mine: Any) -> str:
    """One key part's difference in words, the entry's value first: ``"options (bucket_cap_mb 25.0 -> 4.0)"``,
    ``"world (world_size 4 -> 2)"``, ``"optimizers (['torch.optim.sgd.SGD'] -> ['torch.optim.adam.Adam'])"``."""
    if isinstance(theirs, Mapping) and isinstance(mine, Mapping):
        names = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
        if part == "model":
            return "model (parameters or their traced order)" if "params" in names else f"model ({', '.join(names)})"
        shown = ", ".join(f"{k} {_short(theirs.get(k, '-'))} -> {_short(mine.get(k, '-'))}" for k in names[:4])
        return f"{part} ({shown}{', ...' if len(names) > 4 else ''})"
    return f"{part} ({_short(theirs)} -> {_short(mine)})"


@dataclass
class Lookup:
    """The answer of :meth:`PlanStore.lookup`.

    Attributes:
        entry: the entry whose key equals the one looked up, or None (a miss).
        path: the file of that entry (a hit), or of the closest entry of the same model (a miss), or None.
        reason: a miss in words: ``"no entry for this model"``, ``"the entry <file> for this model differs in
            world (world_size 4 -> 2)"``, ``"entry <file> unreadable (...)"``; None on a hit.
    """

    entry: Optional[dict[str, Any]]
    path: Optional[Path]
    reason: Optional[str] = None


class PlanStore:
    """Entries of selected plans in one directory (module docstring).

    Args:
        directory: where the entry files are (created on the first write).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()

    def path_for(self, key: Mapping[str, Any]) -> Path:
        """The file of ``key``: ``plan-<model digest>-<key digest>.json``."""
        return self.directory / f"plan-{digest(key['model'])}-{digest(key)}.json"

    @staticmethod
    def read(path: Path) -> dict[str, Any]:
        """One entry file.

        Raises:
            ValueError: not an entry of this format and version (or not JSON); OSError: unreadable.
        """
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT or data.get("version") != ENTRY_VERSION:
            found = (data.get("format"), data.get("version")) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a plan cache entry of version {ENTRY_VERSION} (found {found})")
        if not isinstance(data.get("key"), dict) or not isinstance(data.get("choice"), dict):
            raise ValueError("the entry has no 'key' or 'choice'")
        return data

    def lookup(self, key: Mapping[str, Any]) -> Lookup:
        """The entry of exactly ``key``, else why not (the closest entry of the same model: fewest differing
        parts, then the newest). An entry is returned only when its stored key equals ``key`` in every part."""
        path = self.path_for(key)
        if path.exists():
            try:
                entry = self.read(path)
            except (OSError, ValueError) as exc:
                return Lookup(None, path, f"entry {path} unreadable ({exc})")
            if entry["key"] == dict(key):
                return Lookup(entry, path)
        same_model = sorted(self.directory.glob(f"plan-{digest(key['model'])}-*.json")) \
            if self.directory.is_dir() else []
        best: Optional[tuple[int, float, Path, list[str], dict]] = None
        for p in same_model:
            try:
                other = self.read(p)["key"]
                mtime = p.stat().st_mtime
            except (OSError, ValueError):
                continue
            parts = differing_parts(other, key)
            if not parts:
                continue
            if best is None or (len(parts), -mtime) < (best[0], -best[1]):
                best = (len(parts), mtime, p, parts, other)
        if best is None:
            return Lookup(None, None, "no entry for this model")
        _, _, p, parts, other = best
        return Lookup(None, p, f"the entry {p.name} for this model differs in "
                               + ", ".join(describe_difference(q, other.get(q), key.get(q)) for q in parts))

    def save(self, key: Mapping[str, Any], entry: Mapping[str, Any]) -> Path:
        """Write ``entry`` (``format``, ``version`` and ``key`` are set here) atomically; returns its path.

        Raises:
            OSError: the directory cannot be created or written.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(key)
        data = {"format": ENTRY_FORMAT, "version": ENTRY_VERSION, **entry, "key": dict(key)}
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # (as any file this user writes; mkstemp's are private)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return path
