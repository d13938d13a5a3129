"""``sharded_checkpoint=True``: checkpoints written through ``torch.distributed.checkpoint``, each rank its own slices
of the optimizer state (``lightning_pipedap/strategy/sharded_checkpoint.py``, docs/SHARDING.md).

In-process: the format round-trips a whole optimizer state bit for bit (:func:`consolidate_sharded_checkpoint`, the
whole-entry load) and names what is wrong (options, other parameters, missing pieces). Multi-process
(``tests/sharded_checkpoint_cases.py``; AdamW by element ranges, Muon + AdamW by parameter ownership): saved at 2
ranks, resumed at 2 (0.0 against the uninterrupted run) and at 3 (bit for bit the resume from the consolidated
checkpoint of the same step).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_pipedap import PipeDAPStrategy
from lightning_pipedap.strategy.sharded_checkpoint import (META_FILENAME, SHARDED_KEY, consolidate_sharded_checkpoint,
                                                           is_sharded_checkpoint, load_optimizer_states,
                                                           load_sharded_checkpoint, local_optimizer_state,
                                                           save_sharded_checkpoint)
from tests._dist_util import run_lightning_ranks
from tests.sharded_checkpoint_cases import _same

ROOT = Path(__file__).resolve().parents[1]


def _stepped_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    for _ in range(3):
        model(torch.randn(6, 5)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(tmp_path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Path:
    names = {id(p): n for n, p in model.named_parameters()}
    ckpt = {"state_dict": model.state_dict(), "optimizer_states": [local_optimizer_state(opt, names)],
            "global_step": 3}
    path = tmp_path / "ckpt"
    save_sharded_checkpoint(ckpt, path)
    return path


def test_one_process_round_trip_is_bit_exact(tmp_path):
    model, opt = _stepped_adam()
    path = _save(tmp_path, model, opt)
    assert is_sharded_checkpoint(path) and (path / META_FILENAME).is_file()
    full = consolidate_sharded_checkpoint(path)
    assert full["global_step"] == 3
    assert _same(full["state_dict"], model.state_dict())
    assert _same(full["optimizer_states"][0], opt.state_dict())
    # the whole-entry load (a rank that steps unsharded) gives the same optimizer
    model2, _ = _stepped_adam()
    opt2 = torch.optim.AdamW([{"params": [p for p in model2.parameters() if p.ndim > 1]},
                              {"params": [p for p in model2.parameters() if p.ndim <= 1]}], lr=0.5)
    ckpt = load_sharded_checkpoint(path)
    names = {id(p): n for n, p in model2.named_parameters()}
    load_optimizer_states([opt2], ckpt["optimizer_states"], names, lambda o: None,
                          lambda states: opt2.load_state_dict(states[0]))
    assert _same(opt2.state_dict(), opt.state_dict())


def test_errors_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="sharded_checkpoint=True .* needs shard_optimizer"):
        PipeDAPStrategy(sharded_checkpoint=True)
    with pytest.raises(ValueError, match="sharded_checkpoint must be True or False"):
        PipeDAPStrategy(shard_optimizer=True, sharded_checkpoint="yes")
    with pytest.raises(TypeError, match="storage_options"):
        PipeDAPStrategy(shard_optimizer=True, sharded_checkpoint=True).save_checkpoint({}, tmp_path / "x", {"a": 1})
    from lightning_pipedap.strategy.fabric import PipeDAPFabricStrategy
    with pytest.raises(TypeError, match="sharded_checkpoint"):
        PipeDAPFabricStrategy(sharded_checkpoint=True)
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint"):
        consolidate_sharded_checkpoint(tmp_path)
    model, opt = _stepped_adam()
    path = _save(tmp_path, model, opt)
    ckpt = load_sharded_checkpoint(path)
    with pytest.raises(ValueError, match="holds 1 optimizer states, the fit has 2"):
        load_optimizer_states([opt, opt], ckpt["optimizer_states"], {}, lambda o: None, lambda s: None)
    renamed = {id(p): n.replace("2.", "head.") for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="position 1 is 2.weight there and head.weight here"):
        load_optimizer_states([opt], ckpt["optimizer_states"], renamed, lambda o: None, lambda s: None)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    with pytest.raises(IsADirectoryError, match="not a sharded checkpoint"):
        save_sharded_checkpoint({"state_dict": {}}, tmp_path / "other")
    meta = torch.load(path / META_FILENAME, weights_only=False)  # a checkpoint that lacks a rank's pieces
    meta["optimizer_states"][0][SHARDED_KEY]["kinds"][0]["ghost"] = ("elem", "float32", (4, 5))
    torch.save(meta, path / META_FILENAME)
    with pytest.raises(ValueError, match="'ghost' of 0.weight holds 0 of the elements"):
        consolidate_sharded_checkpoint(path)


def test_consolidate_command_writes_a_torch_checkpoint(tmp_path):
    from lightning_pipedap.strategy.sharded_checkpoint import main

    model, opt = _stepped_adam()
    path = _save(tmp_path, model, opt)
    main([str(path)])
    out = torch.load(str(path) + ".consolidated", weights_only=False)
    assert _same(out["optimizer_states"][0], opt.state_dict())
    # the documented command: python -m lightning_pipedap.consolidate DIR OUT, without runpy's double-import warning
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "lightning_pipedap.consolidate", str(path), str(tmp_path / "one.ckpt")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "RuntimeWarning" not in res.stderr, res.stderr
    out = torch.load(str(tmp_path / "one.ckpt"), weights_only=False)
    assert _same(out["optimizer_states"][0], opt.state_dict())


class _Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def _fit(strategy, epochs: int, root: Path, ckpt_path=None, save: bool = False) -> dict[str, torch.Tensor]:
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(3, verbose=False)
    model = _Regression()
    callbacks = [ModelCheckpoint(dirpath=str(root), filename="e-{epoch}", every_n_epochs=1)] if save else []
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, max_epochs=epochs,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=save,
                         callbacks=callbacks, default_root_dir=str(root))
    try:
        trainer.fit(model, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in trainer.optimizers[0].state_dict()["state"].items():
        out.update({f"opt/{i}/{k}": torch.as_tensor(v).clone() for k, v in st.items()})
    return out


def test_one_process_saves_and_resumes_and_ddp_resumes_the_consolidated_form(tmp_path):
    """One process (nothing sharded, the same format): pipedap resumes from its directory, and ``ddp`` from the
    consolidated file, exactly as the uninterrupted run."""
    ref = _fit("ddp", 2, tmp_path / "ref")
    _fit(PipeDAPStrategy(shard_optimizer=True, sharded_checkpoint=True), 1, tmp_path / "a", save=True)
    path = tmp_path / "a" / "e-epoch=0.ckpt"
    assert is_sharded_checkpoint(path)
    resumed = _fit(PipeDAPStrategy(shard_optimizer=True), 2, tmp_path / "b", ckpt_path=path)
    torch.save(consolidate_sharded_checkpoint(path), tmp_path / "full.ckpt")
    resumed_ddp = _fit("ddp", 2, tmp_path / "c", ckpt_path=tmp_path / "full.ckpt")
    assert ref.keys() == resumed.keys() == resumed_ddp.keys()
    assert all(_same(ref[k], resumed[k]) and _same(ref[k], resumed_ddp[k]) for k in ref)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Launch A (2 ranks): per case a sharded and a consolidated save at step 8 (AdamW: also the uninterrupted run
    and the resume 2 -> 2). Launch B (3 ranks): resumed from both, sharded and (AdamW, start state) unsharded."""
    d = tmp_path_factory.mktemp("dcp")
    run_lightning_ranks(["-m", "tests.sharded_checkpoint_cases", str(d), "save"], world=2, timeout_s=600,
                        cwd=str(ROOT))
    run_lightning_ranks(["-m", "tests.sharded_checkpoint_cases", str(d), "resume"], world=3, timeout_s=600,
                        cwd=str(ROOT))
    return d, json.loads((d / "save.json").read_text()), json.loads((d / "resume.json").read_text())


CASES = ("adamw", "muon_adamw")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_sharded_save_at_two_ranks_writes_each_ranks_shard(launched, case):
    d, save, _ = launched
    res = save[case]
    assert "error" not in res, res.get("error")
    assert is_sharded_checkpoint(d / case / "dcp" / "mid-step=8.ckpt")
    assert res["files"] == ["__0_0.distcp", "__1_0.distcp"]
    # rank 1 wrote its slices of the optimizer state (not the model: rank 0's copy), rank 0 the model and its slices
    assert res["optim_bytes_by_rank"][1] > 0.2 * sum(res["optim_bytes_by_rank"])
    assert res["consolidated_vs_gathered"] == "equal", res["consolidated_vs_gathered"]


@pytest.mark.multiprocess
def test_resume_two_to_two_equals_the_uninterrupted_run(launched):
    _, save, _ = launched
    assert "error" not in save["adamw"], save["adamw"].get("error")
    assert save["adamw"]["two_to_two"] == 0.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_resume_at_three_ranks_equals_the_resume_from_the_consolidated_checkpoint(launched, case):
    _, _, resumed = launched
    res = resumed[case]
    assert "error" not in res, res.get("error")
    assert res["start_state_sharded"] == 0.0  # the optimizer state loaded, re-sharded to 3 ranks
    if case == "adamw":
        assert res["start_state_unsharded"] == 0.0  # assembled whole on each rank (shard_optimizer=False)
    assert res["after_steps"] == 0.0  # parameters and optimizer state after the remaining steps
    assert res["moved"] > 1e-4  # (the resumed runs really trained)
