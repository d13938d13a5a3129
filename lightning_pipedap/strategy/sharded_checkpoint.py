"""A sharded checkpoint through ``torch.distributed.checkpoint`` (DCP): ``PipeDAPStrategy(sharded_checkpoint=True)``.

With ``shard_optimizer`` each rank holds the optimizer state of its slices only; a plain checkpoint gathers it whole
on rank 0. With ``sharded_checkpoint=True`` ``trainer.save_checkpoint`` / ``ModelCheckpoint`` write a directory
instead, as Lightning's FSDP strategy does with ``state_dict_type="sharded"`` (the same file names)::

    <path>/.metadata, __<rank>_0.distcp    DCP's files; the keys:
        model/<key>                         every tensor of the model's state dict (rank 0's copy: replicas are equal)
        optim/<k>/<name>/<entry>/<lo>-<hi>  1-D: elements [lo, hi) (row-major) of optimizer k's state entry (Adam's
                                            exp_avg, ...) of parameter <name>, written by the rank that holds them
    <path>/meta.pt                          rank 0, ``torch.save``: the rest of Lightning's checkpoint (loops,
                                            callbacks, hyper-parameters, LR schedulers, pipedap's plan); its
                                            ``optimizer_states`` keep each optimizer's ``param_groups``, the parameter
                                            names in torch's packing order and each entry's kind (element-wise:
                                            dtype and shape; a scalar such as Adam's ``step``: its value, taken once)

Loading (:func:`load_sharded_checkpoint` before set-up, :func:`load_optimizer_states` after it) needs no equal world
size: DCP reads any subset of keys, so each rank reads the pieces that overlap its own slices (the engine installed
at load time; its later engines move the state shard to shard as in training) and assembles them; a rank that steps
unsharded (one process, ``shard_optimizer="auto"``'s unsharded warm-up) assembles whole entries. The result is what
loading the consolidated checkpoint would give, bit for bit: the same casts as ``Optimizer.load_state_dict``, the
same slicing as :meth:`~lightning_pipedap.engine.shard_step.ShardedOptimizer.absorb`.

Lightning's ``ddp`` cannot read a directory: :func:`consolidate_sharded_checkpoint` (or ``python -m
lightning_pipedap.consolidate DIR [OUT]``) writes the one-file checkpoint it loads.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.optim import Optimizer

__all__ = ["META_FILENAME", "SHARDED_KEY", "consolidate_sharded_checkpoint", "is_sharded_checkpoint",
           "load_optimizer_states", "load_sharded_checkpoint", "local_optimizer_state", "save_sharded_checkpoint"]

log = logging.getLogger(__name__)

#: the file holding everything but the tensors (the name Lightning's FSDP strategy uses for the same role)
META_FILENAME = "meta.pt"
#: the key of an optimizer state (rank-local, and in ``meta.pt``) that marks this format
SHARDED_KEY = "pipedap_sharded"
#: ``meta.pt``: the format's version and the world size that wrote it
FORMAT_KEY = "pipedap_sharded_checkpoint"
FORMAT_VERSION = 1
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether ``path`` is a directory written by :func:`save_sharded_checkpoint` (``meta.pt`` and DCP's
    ``.metadata`` in it)."""
    p = Path(path)
    return p.is_dir() and (p / META_FILENAME).is_file() and (p / ".metadata").is_file()


# ---------------------------------------------------------------------------------------------- saving
def _packed(optimizer: Optimizer) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """``param_groups`` packed as ``Optimizer.state_dict`` packs them (parameters numbered in group order) and the
    parameters in that order."""
    index: dict[int, int] = {}
    order: list[torch.Tensor] = []
    groups = []
    for g in optimizer.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        for p in g["params"]:
            if id(p) not in index:
                index[id(p)] = len(order)
                order.append(p)
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
    return groups, order


def _value(v: Any) -> tuple:
    """A non-element-wise entry (a scalar such as Adam's ``step``) as it travels: ``("value", v on CPU, device)``."""
    return ("value", v.detach().cpu(), str(v.device)) if torch.is_tensor(v) else ("value", v, None)


def _elem(v: torch.Tensor, param: torch.Tensor) -> tuple:
    return ("elem", str(v.dtype).replace("torch.", ""), tuple(param.shape))


def local_optimizer_state(optimizer: Optimizer, names: dict[int, str], sharded: Any = None,
                          whole: bool = True) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, what ``strategy.optimizer_state`` returns with
    ``sharded_checkpoint`` (as Lightning's FSDP strategy returns its shard): a local read, no collective.

    Args:
        optimizer: the user's optimizer.
        names: ``id(parameter) -> name`` (the module's ``named_parameters``); a parameter without a name is keyed
            by its packing index.
        sharded: the optimizer's :class:`~lightning_pipedap.engine.shard_step.ShardedOptimizer` when its state is
            held in this rank's slices (absorbed), else None.
        whole: add the entries held whole in ``optimizer.state`` (identical on every rank: only rank 0 passes True).

    Returns:
        ``{"state": {}, "param_groups": [...], SHARDED_KEY: {"names": [...], "pieces": {(index, entry, lo, hi):
        1-D tensor}, "kinds": {index: {entry: ("elem", dtype, shape) | ("value", value, device)}}}}``.
    """
    groups, order = _packed(optimizer)
    index = {id(p): i for i, p in enumerate(order)}
    pieces: dict[tuple[int, str, int, int], torch.Tensor] = {}
    kinds: dict[int, dict[str, tuple]] = defaultdict(dict)
    if whole:
        for p, st in dict.items(optimizer.state):  # (dict's own items: a ShardedState's unsharded entries)
            i = index.get(id(p))
            if i is None or not isinstance(st, dict):
                continue
            for k, v in st.items():
                if torch.is_tensor(v) and v.shape == p.shape:  # (element-wise: shaped like the parameter)
                    pieces[(i, k, 0, p.numel())] = v.detach().reshape(-1)
                    kinds[i][k] = _elem(v, p)
                else:
                    kinds[i][k] = _value(v)
    if sharded is not None:
        for sl in sharded.slices.values():
            for s in sl:
                i = index.get(id(s.param))
                if i is None:
                    continue
                for k, v in sharded.state.get(s.tensor, {}).items():
                    # (element-wise as ShardedOptimizer gathers it: one value per element of the slice)
                    if torch.is_tensor(v) and v.numel() == s.hi - s.lo and (
                            v.dim() == 1 or (s.whole and v.shape == s.param.shape)):
                        pieces[(i, k, s.p_lo, s.p_hi)] = v.detach().reshape(-1)
                        kinds[i][k] = _elem(v, s.param)
                    elif s.p_lo == 0:  # (a scalar: from the rank holding the parameter's first element)
                        kinds[i][k] = _value(v)
    return {"state": {}, "param_groups": groups,
            SHARDED_KEY: {"names": [names.get(id(p), f"#{i}") for i, p in enumerate(order)], "pieces": pieces,
                          "kinds": dict(kinds)}}


def rank_part(rt: Any, optimizer: Optimizer, module: torch.nn.Module, rank: int) -> dict[str, Any]:
    """:func:`local_optimizer_state` for the strategy (``rt``: its run-time, None with one process): this rank's
    slices when the engine holds the optimizer's state sharded, and (rank 0) the entries held whole."""
    sharded = None
    if rt is not None and rt.slot.holds_sharded(optimizer):
        rt.slot.engine.wait_idle()
        sharded = rt.slot.engine.shard.sharded_of(optimizer)
    names = {id(p): n for n, p in module.named_parameters()}
    return local_optimizer_state(optimizer, names, sharded, whole=rank == 0)


def sharded_of(rt: Any) -> Callable[[Optimizer], Any]:
    """``optimizer -> its ShardedOptimizer`` on the installed engine (attached now) when that engine steps some of
    its parameters sharded, else None (for :func:`load_optimizer_states`)."""
    def of(optimizer: Optimizer) -> Any:
        engine = rt.slot.engine if rt is not None else None
        if engine is None or engine.shard is None:
            return None
        sopt = engine.shard.attach(optimizer)
        return sopt if sopt.owned else None
    return of


def _piece_key(k: int, name: str, entry: str, lo: int, hi: int) -> str:
    return f"{OPTIM_PREFIX}{k}/{name}/{entry}/{lo}-{hi}"


def _prepare_dir(path: Path) -> None:
    """Rank 0: a file at ``path`` is replaced, an earlier sharded checkpoint there removed (no stale shards)."""
    if path.is_file() or path.is_symlink():
        path.unlink()
    elif is_sharded_checkpoint(path):
        shutil.rmtree(path)
    elif path.is_dir() and any(path.iterdir()):
        raise IsADirectoryError(f"pipedap: sharded_checkpoint: {path} is a directory that is not a sharded "
                                "checkpoint and not empty; give a new path")
    path.mkdir(parents=True, exist_ok=True)


def save_sharded_checkpoint(checkpoint: dict[str, Any], path: Any) -> None:
    """Write Lightning's ``checkpoint`` (its ``optimizer_states`` made by :func:`local_optimizer_state`) as a
    directory at ``path`` (module docstring). A collective on the default group: every rank calls it (as
    ``Trainer.save_checkpoint`` calls the strategy's ``save_checkpoint``). ``checkpoint`` loses ``state_dict`` and
    ``optimizer_states`` (moved into the files).

    Raises:
        ValueError: an optimizer state not made by :func:`local_optimizer_state` (named by its position).
        IsADirectoryError: ``path`` is a non-empty directory that is not a sharded checkpoint (rank 0).
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    model = checkpoint.pop("state_dict", None)
    opt_states = checkpoint.pop("optimizer_states", None)
    flat: dict[str, Any] = {}
    model_rest: dict[str, Any] = {}
    if rank == 0 and model is not None:
        for k, v in model.items():
            if torch.is_tensor(v):
                flat[MODEL_PREFIX + k] = v.detach()
            else:
                model_rest[k] = v
    skeletons: Optional[list[dict[str, Any]]] = None
    if opt_states is not None:
        for k, st in enumerate(opt_states):
            if not (isinstance(st, dict) and SHARDED_KEY in st):
                raise ValueError(f"pipedap: sharded_checkpoint: optimizer state {k} is a plain state dict, not this "
                                 "rank's part (strategy.optimizer_state makes it with sharded_checkpoint=True)")
        mine = [st[SHARDED_KEY]["kinds"] for st in opt_states]
        every = [None] * world
        if distributed:
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        skeletons = []
        for k, st in enumerate(opt_states):
            info = st[SHARDED_KEY]
            for (i, entry, lo, hi), t in info["pieces"].items():
                if hi > lo:
                    flat[_piece_key(k, info["names"][i], entry, lo, hi)] = t
            kinds: dict[int, dict[str, tuple]] = {}
            for part in every:
                for i, entries in part[k].items():
                    kinds.setdefault(i, {}).update(entries)
            skeletons.append({"param_groups": st["param_groups"],
                              SHARDED_KEY: {"names": list(info["names"]), "kinds": kinds}})
    if rank == 0:
        _prepare_dir(path)
    if distributed:
        dist.barrier()
    with warnings.catch_warnings():  # (one process without a group: DCP says it saves in a single process)
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(path), no_dist=not distributed)
    if rank == 0:
        meta = dict(checkpoint)
        if model is not None:
            meta["state_dict"] = model_rest
        if skeletons is not None:
            meta["optimizer_states"] = skeletons
        meta[FORMAT_KEY] = {"version": FORMAT_VERSION, "world_size": world}
        torch.save(meta, path / META_FILENAME)  # (last: a directory with meta.pt is complete)


# ---------------------------------------------------------------------------------------------- loading
def _read(path: Path, keys: Iterable[str], md: Any) -> dict[str, torch.Tensor]:
    """The tensors at ``keys`` (whole), read by this process alone (``no_dist``: any subset on any rank)."""
    out = {}
    for k in keys:
        m = md.state_dict_metadata[k]
        out[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if out:
        with warnings.catch_warnings():  # (DCP's note that no process group is used: the point of no_dist)
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(out, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return out


def load_sharded_checkpoint(path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's checkpoint dict from the directory at ``path``: ``meta.pt`` with ``state_dict`` filled (every model
    tensor read whole, in CPU memory) and ``optimizer_states`` left as their skeletons (each with the path), for
    :func:`load_optimizer_states` after set-up. Local: no collective.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint (named).
    """
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"pipedap: {path} is not a sharded checkpoint (a directory with {META_FILENAME} and "
                                "DCP's .metadata)")
    meta = torch.load(path / META_FILENAME, weights_only=weights_only)
    md = dcp.FileSystemReader(path).read_metadata()
    model = _read(path, [k for k in md.state_dict_metadata if k.startswith(MODEL_PREFIX)], md)
    if "state_dict" in meta:
        meta["state_dict"] = {**meta["state_dict"], **{k[len(MODEL_PREFIX):]: v for k, v in model.items()}}
    for st in meta.get("optimizer_states", []):
        st[SHARDED_KEY]["path"] = str(path)
    return meta


def is_sharded_state(state: Any) -> bool:
    """Whether an optimizer state of a loaded checkpoint is a sharded checkpoint's skeleton."""
    return isinstance(state, dict) and SHARDED_KEY in state


class _Pieces:
    """The saved pieces of one checkpoint, ``(optimizer, name, entry) -> [(lo, hi, key)]``, from DCP's metadata."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.md = dcp.FileSystemReader(path).read_metadata()
        self.of: dict[tuple[int, str, str], list[tuple[int, int, str]]] = defaultdict(list)
        for key in self.md.state_dict_metadata:
            if not key.startswith(OPTIM_PREFIX):
                continue
            k, _, rest = key[len(OPTIM_PREFIX):].partition("/")
            name, entry, span = rest.rsplit("/", 2)
            lo, hi = (int(x) for x in span.split("-"))
            self.of[(int(k), name, entry)].append((lo, hi, key))

    def overlapping(self, k: int, name: str, entry: str, lo: int, hi: int) -> list[tuple[int, int, str]]:
        return [(a, b, key) for a, b, key in self.of.get((k, name, entry), ()) if a < hi and b > lo]

    def assemble(self, k: int, name: str, entry: str, lo: int, hi: int, read: dict[str, torch.Tensor],
                 dtype: torch.dtype) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the entry from the pieces in ``read``.

        Raises:
            ValueError: the checkpoint lacks some of those elements (named).
        """
        out = torch.empty(hi - lo, dtype=dtype)
        covered = 0
        for a, b, key in sorted(self.overlapping(k, name, entry, lo, hi)):
            x, y = max(a, lo), min(b, hi)
            out[x - lo:y - lo].copy_(read[key][x - a:y - a])
            covered += y - x
        if covered != hi - lo:
            raise ValueError(f"pipedap: sharded checkpoint {self.path}: optimizer {k}'s {entry!r} of {name} holds "
                             f"{covered} of the elements [{lo}, {hi}) (a rank's files are missing or the checkpoint "
                             "is incomplete)")
        return out


def _as_loaded(param: torch.Tensor, value: torch.Tensor, key: str, group: dict[str, Any]) -> torch.Tensor:
    """``value`` as ``Optimizer.load_state_dict`` stores a state entry of ``param`` (torch 2.13's rule: ``step``
    kept, unless ``fused``/``capturable`` (float32 on the parameter's device); other entries in the parameter's
    dtype when it is floating, on its device)."""
    if key == "step":
        if group.get("fused", False) or group.get("capturable", False):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


def _restore_value(kind: tuple, param: Optional[torch.Tensor]) -> Any:
    """A ``("value", v, device)`` entry back as saved (a tensor on its device: CPU, or the parameter's)."""
    v, device = kind[1], kind[2]
    if not torch.is_tensor(v):
        return v
    if device is None or device == "cpu" or param is None:
        return v.clone()
    return v.to(param.device)


def _check_names(k: int, saved: Sequence[str], now: Sequence[str]) -> None:
    if list(saved) != list(now):
        diff = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b), min(len(saved), len(now)))
        raise ValueError(f"pipedap: the sharded checkpoint's optimizer {k} has {len(saved)} parameters, this one "
                         f"{len(now)}; position {diff} is {saved[diff] if diff < len(saved) else 'missing'} there and "
                         f"{now[diff] if diff < len(now) else 'missing'} here: resume with the same model and "
                         "optimizer parameters")


def load_optimizer_states(optimizers: Sequence[Optimizer], states: Sequence[dict[str, Any]], names: dict[int, str],
                          sharded_of: Callable[[Optimizer], Any], load: Callable[[list[dict[str, Any]]], None]) -> None:
    """Load a sharded checkpoint's optimizer states (``states``: the skeletons of :func:`load_sharded_checkpoint`)
    into ``optimizers``, after set-up, on every rank (local reads: no collective).

    Args:
        names: ``id(parameter) -> name``, as at save.
        sharded_of: ``optimizer -> its ShardedOptimizer`` when the installed engine steps it sharded (attached, not
            absorbed), else None: its state is assembled whole.
        load: ``states -> None``: the strategy's own load of torch-style state dicts (``Optimizer.load_state_dict``
            and Lightning's device move); it gets the whole entries and every scalar.

    Each sharded optimizer's element-wise entries are read for this rank's slices only (the pieces overlapping
    them), cast as ``load_state_dict`` casts and put into the slices; then
    :meth:`~lightning_pipedap.engine.shard_step.ShardedOptimizer.absorb` takes the scalars, as after loading a
    consolidated checkpoint.

    Raises:
        ValueError: another number of optimizers, other parameters, or missing pieces (named).
    """
    if len(states) != len(optimizers):
        raise ValueError(f"pipedap: the sharded checkpoint holds {len(states)} optimizer states, the fit has "
                         f"{len(optimizers)} optimizers: resume with the same optimizers")
    paths = {st[SHARDED_KEY]["path"] for st in states if is_sharded_state(st)}
    pieces = _Pieces(Path(paths.pop())) if paths else None
    plans = []  # (k, optimizer, order, sharded optimizer or None, info)
    wanted: set[str] = set()
    for k, (opt, st) in enumerate(zip(optimizers, states)):
        if not is_sharded_state(st):
            plans.append((k, opt, None, None, None))
            continue
        info = st[SHARDED_KEY]
        _, order = _packed(opt)
        _check_names(k, info["names"], [names.get(id(p), f"#{i}") for i, p in enumerate(order)])
        sopt = sharded_of(opt)
        sliced = defaultdict(list)
        if sopt is not None:
            for sl in sopt.slices.values():
                for s in sl:
                    sliced[id(s.param)].append(s)
        # (every rank's sharded parameters of this optimizer: a rank reads its slices of them, or nothing)
        mine = {id(sopt.params[i]) for i in sopt.owned} if sopt is not None else set()
        for i, p in enumerate(order):
            for entry, kind in info["kinds"].get(i, {}).items():
                if kind[0] != "elem":
                    continue
                spans = [(s.p_lo, s.p_hi) for s in sliced.get(id(p), ())] if id(p) in mine else [(0, p.numel())]
                for lo, hi in spans:
                    wanted.update(key for _, _, key in pieces.overlapping(k, info["names"][i], entry, lo, hi))
        plans.append((k, opt, order, sopt, (info, sliced, mine)))
    read = _read(pieces.path, sorted(wanted), pieces.md) if pieces is not None else {}
    torch_states: list[dict[str, Any]] = []
    for k, opt, order, sopt, extra in plans:
        if order is None:
            torch_states.append(states[k])
            continue
        info, _, mine = extra
        state: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(order):
            for entry, kind in info["kinds"].get(i, {}).items():
                if kind[0] == "value":
                    state.setdefault(i, {})[entry] = _restore_value(kind, p)
                elif id(p) not in mine:
                    full = pieces.assemble(k, info["names"][i], entry, 0, p.numel(), read, getattr(torch, kind[1]))
                    state.setdefault(i, {})[entry] = full.view(kind[2])
        torch_states.append({"state": state, "param_groups": states[k]["param_groups"]})
    load(torch_states)
    for k, opt, order, sopt, extra in plans:
        if sopt is None:
            continue
        info, sliced, mine = extra
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        for i, p in enumerate(order):
            if id(p) not in mine:
                continue
            for entry, kind in info["kinds"].get(i, {}).items():
                if kind[0] != "elem":
                    continue
                for s in sliced.get(id(p), ()):
                    t = pieces.assemble(k, info["names"][i], entry, s.p_lo, s.p_hi, read, getattr(torch, kind[1]))
                    t = _as_loaded(p, t, entry, group_of.get(id(p), {}))
                    sopt.state[s.tensor][entry] = t.view(p.shape) if s.whole else t
        sopt.absorb(sopt.owned)  # (the scalars into the slices, optimizer.state without the sharded parameters)


def consolidate_sharded_checkpoint(path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """The one-file form of the sharded checkpoint at ``path``: Lightning's checkpoint dict with the whole model
    state and torch-style optimizer states (``{"state": {index: {entry: tensor shaped like the parameter}},
    "param_groups": ...}``), what a run with ``sharded_checkpoint=False`` saves at the same step. ``torch.save`` it
    to resume under ``ddp`` or one process, or load it with ``LightningModule.load_from_checkpoint``. Reads every
    piece into CPU memory; needs no process group.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint. ValueError: missing pieces (named).
    """
    ckpt = load_sharded_checkpoint(path, weights_only=weights_only)
    states = ckpt.get("optimizer_states")
    if states:
        pieces = _Pieces(Path(path))
        read = _read(pieces.path, [key for v in pieces.of.values() for _, _, key in v], pieces.md)
        out = []
        for k, st in enumerate(states):
            info = st[SHARDED_KEY]
            state: dict[int, dict[str, Any]] = {}
            for i, entries in sorted(info["kinds"].items()):
                for entry, kind in entries.items():
                    if kind[0] == "value":
                        state.setdefault(i, {})[entry] = _restore_value(kind, None)
                        continue
                    numel = 1
                    for d in kind[2]:
                        numel *= d
                    full = pieces.assemble(k, info["names"][i], entry, 0, numel, read, getattr(torch, kind[1]))
                    state.setdefault(i, {})[entry] = full.view(kind[2])
            out.append({"state": dict(sorted(state.items())), "param_groups": st["param_groups"]})
        ckpt["optimizer_states"] = out
    ckpt.pop(FORMAT_KEY, None)
    return ckpt


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m lightning_pipedap.consolidate DIR [OUT]``: write the consolidated checkpoint
    (default ``DIR.consolidated``, as Lightning's ``consolidate_checkpoint`` for FSDP)."""
    parser = argparse.ArgumentParser(description="Consolidate a pipedap sharded checkpoint into one file that "
                                                 "strategy='ddp' and one process load.")
    parser.add_argument("checkpoint_folder", help="the directory written with sharded_checkpoint=True")
    parser.add_argument("output_file", nargs="?", default=None, help="default: <checkpoint_folder>.consolidated")
    args = parser.parse_args(argv)
    out = args.output_file or str(Path(args.checkpoint_folder)) + ".consolidated"
    torch.save(consolidate_sharded_checkpoint(args.checkpoint_folder, weights_only=False), out)
    logging.basicConfig(level=logging.INFO)
    log.info("pipedap: wrote %s", out)


if __name__ == "__main__":
    main()
