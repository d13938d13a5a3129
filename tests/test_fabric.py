"""Lightning Fabric: ``Fabric(strategy="pipedap")`` shows user code exactly what Fabric's ``"ddp"`` shows.

Parity cases (``tests/fabric/parity_cases.py``, one launch of 2 gloo processes) train two models of
Lightning's own Fabric examples (Lightning-AI/pytorch-lightning ``examples/fabric/image_classifier/
train_fabric.py`` and ``examples/fabric/language_model/train.py``; the definitions in
``tests/fabric/models.py`` are written from them) with gradient accumulation through
``fabric.no_backward_sync`` and ``fabric.clip_gradients`` (by norm, by value), under ``"ddp"`` and under
pipedap with the ``dear``, ``allreduce`` and planned ``optimal`` schedules; checkpoints written by
``fabric.save`` are resumed with ``fabric.load`` under the other strategy. Also: registration in
Fabric's registry whatever the import order, the spawn launcher (``"pipedap_spawn"``), the default
launcher through ``examples/fabric_train.py``, and the refused options.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist_util import run_lightning_ranks

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-6
KEYS = ("losses", "norms", "grads", "params", "opt_state", "eval")


@pytest.fixture(scope="module")
def fabric_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric_parity") / "results.json"
    run_lightning_ranks(["-m", "tests.fabric.parity_cases", str(out)], world=2, timeout_s=600, cwd=str(ROOT))
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["mnist_cnn", "transformer_lm"])
@pytest.mark.parametrize("schedule", ["dear", "allreduce", "optimal", "dear_view", "optimal_view"])
def test_fabric_parity_with_ddp(fabric_results, case, schedule):
    res = fabric_results[case]
    assert "error" not in res, res.get("error")
    assert res["ddp_moved"] > 1e-3, "the reference run must actually train"
    run = res[schedule]
    for key in KEYS:  # every micro-batch loss, .grad after backward, clip norms, params, optimizer state, eval output
        assert run[key] <= TOL, f"{case}/{schedule}: max |{key} - ddp| = {run[key]:.3e}"
    assert run["rank_spread"] <= TOL
    assert run["phase"] == "run" and run["installed"]
    base = schedule.removesuffix("_view")  # (``*_view``: the same with gradient_as_bucket_view=True)
    # .grad is the bucket itself with gradient_as_bucket_view, never without; on the view path only the first
    # round of the installed engine copies (each .grad still pointed into the warm-up engine's buckets)
    assert run["grads_in_buckets"] == (base != schedule)
    if base != schedule:
        assert run["engine_copies"] <= run["engine_params"]
    else:  # (the copy path copies every gradient of every round)
        assert run["engine_copies"] >= run["engine_params"] * (run["engine_rounds"] - 1)
    if base == "optimal":
        assert run["trials"] == 2  # the controller planned and measured both candidates under Fabric
    else:
        # 10 optimizer steps; the first ran on the warm-up engine; micro-batches under no_backward_sync never
        # communicate, so the installed engine ran exactly one round per remaining step
        assert run["engine_rounds"] == 9
        assert run["installed"].startswith(base + ":")


@pytest.mark.multiprocess
def test_fabric_clipping_really_clips(fabric_results):
    assert fabric_results["mnist_cnn"]["ddp_clipped"], "the max_norm case must have gradients above the norm"
    assert fabric_results["transformer_lm"]["ddp_grad_absmax"] > 0.25, "clip_val=0.25 must cut some gradient"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["mnist_cnn", "transformer_lm"])
@pytest.mark.parametrize("direction", ["pipedap_ckpt_resumed_by_ddp", "ddp_ckpt_resumed_by_pipedap"])
def test_fabric_checkpoints_resume_across_strategies(fabric_results, case, direction):
    res = fabric_results[case]
    assert "error" not in res, res.get("error")
    for key, diff in res[direction].items():
        assert diff <= TOL, f"{case}/{direction}: max |{key} - uninterrupted ddp| = {diff:.3e}"


@pytest.mark.parametrize("imports", [
    "import lightning_pipedap\nfrom lightning.fabric.strategies import STRATEGY_REGISTRY as R",
    "import lightning.fabric\nimport lightning_pipedap\nfrom lightning.fabric.strategies import STRATEGY_REGISTRY as R",
    "from lightning_pipedap import PipeDAPStrategy\nfrom lightning.fabric.strategies import STRATEGY_REGISTRY as R",
])
def test_fabric_registry_has_pipedap_whatever_the_import_order(imports):
    code = imports + ("\nfrom lightning_pipedap import PipeDAPFabricStrategy\n"
                      "print(R['pipedap']['strategy'] is PipeDAPFabricStrategy, R['pipedap_spawn']['init_params'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True {'start_method': 'spawn'}"


@pytest.mark.multiprocess
def test_fabric_spawn_launcher_trains_like_one_big_batch():
    out = subprocess.run([sys.executable, "-m", "tests.fabric.spawn_case"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    assert res["strategy"] == "PipeDAPFabricStrategy" and res["launcher"] == "_MultiProcessingLauncher"
    diff = max(float((torch.tensor(a) - torch.tensor(b)).abs().max()) for a, b in zip(res["params"], res["reference"]))
    moved = float((torch.tensor(res["reference"][0]) - _initial_first_weight()).abs().max())
    assert moved > 1e-3 and diff <= TOL, f"max |param - one-process reference| = {diff:.3e} (moved {moved:.3e})"
    assert "sets up one model" in res["second_model"]
    assert res["hooks_left"] == 0  # teardown removed every forward and gradient hook


def _initial_first_weight() -> torch.Tensor:
    from tests.fabric.spawn_case import build

    return build()[0].weight.detach()


@pytest.mark.multiprocess
def test_fabric_example_runs_with_the_default_launcher(tmp_path):
    """``examples/fabric_train.py``: Fabric re-runs the script for rank 1 (popen launcher); the checkpoint
    is a plain state dict a single process loads into the bare model."""
    ckpt = tmp_path / "digits.ckpt"
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "fabric_train.py"), "--epochs", "3",
                          "--checkpoint", str(ckpt)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "pipedap: schedule dear:" in text
    acc = float(text.split("pipedap: final val acc ")[1].split(",")[0])
    assert acc >= 0.85, text[-2000:]
    from lightning_pipedap.models import DigitsCNN

    state = torch.load(ckpt, weights_only=True)
    assert state["epoch"] == 3 and "state" in state["optimizer"]
    DigitsCNN().load_state_dict(state["model"])  # strict: no "module." prefix, no extra keys


@pytest.mark.parametrize("kwargs,match", [
    ({"defer_update": True}, r"defer_update=True is not supported .* valid: 'auto', False"),
    ({"compression": "fp16"}, r"compression='fp16' is not supported .* valid: None"),
    ({"schedule": "nope"}, r"unknown schedule 'nope'; valid: "),
    ({"bucket_cap_mb": 0}, r"bucket_cap_mb must be a positive number, got 0"),
])
def test_fabric_strategy_refuses_bad_options(kwargs, match):
    from lightning_pipedap import PipeDAPFabricStrategy

    with pytest.raises(ValueError, match=match):
        PipeDAPFabricStrategy(**kwargs)


@pytest.mark.parametrize("kwarg,match", [
    ("find_unused_parameters", "an option of the Trainer strategy PipeDAPStrategy"),
    ("compression_mode", "an option of the Trainer strategy"),
    ("torch_ddp_margin", "also tries DDP's own reducer \\(the torch_ddp candidate\\), which Fabric's does not"),
    ("nonfinite", "an option of the Trainer strategy PipeDAPStrategy, whose own reduction paths it needs"),
    ("bucket_cap", "did you mean 'bucket_cap_mb'"),
])
def test_fabric_strategy_refuses_unknown_keywords(kwarg, match):
    from lightning_pipedap import PipeDAPFabricStrategy

    with pytest.raises(TypeError, match=match):
        PipeDAPFabricStrategy(**{kwarg: True})


def _fabric_one_process(strategy):
    import torch.distributed as dist
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(6):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
        return fabric, [p.detach().clone() for p in model.parameters()]
    finally:
        if getattr(fabric.strategy, "_rt", None) is not None:
            fabric.strategy.teardown()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fabric_one_process_runs_as_ddp_does_bit_for_bit():
    """``Fabric(devices=1, strategy="pipedap")`` used to be refused where 'ddp' runs; it runs with no run-time."""
    import lightning_pipedap  # noqa: F401

    _, ddp = _fabric_one_process("ddp")
    fabric, ours = _fabric_one_process("pipedap")
    assert all(torch.equal(a, b) for a, b in zip(ddp, ours))
    assert fabric.strategy.single_process and fabric.strategy._rt is None and fabric.strategy._last is None
