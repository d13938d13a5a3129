"""``LightningCLI`` selects the strategy by its registered name or by class path with its options.

The model and data are Lightning's own demo classes (``lightning.pytorch.demos.boring_classes``:
BoringModel, BoringDataModule), the script is the LightningCLI usage of Lightning's docs
(https://lightning.ai/docs/pytorch/stable/cli/lightning_cli.html).
"""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (pip install -e '.[dev]')")
pytestmark = pytest.mark.multiprocess

SCRIPT = textwrap.dedent("""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    import lightning_pipedap  # noqa: F401

    if __name__ == "__main__":
        LightningCLI(BoringModel, BoringDataModule)
""")
COMMON = ["fit", "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=4",
          "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.mark.parametrize("strategy_args,expect", [
    (["--trainer.strategy=pipedap"], "pipedap: schedule "),
    (["--trainer.strategy=lightning_pipedap.PipeDAPStrategy", "--trainer.strategy.schedule=dear",
      "--trainer.strategy.bucket_cap_mb=1"], "pipedap: schedule dear: "),
])
def test_lightning_cli_trains_with_pipedap(tmp_path, strategy_args, expect):
    script = tmp_path / "cli_train.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), *COMMON, *strategy_args,
                          f"--trainer.default_root_dir={tmp_path}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert expect in text and "`Trainer.fit` stopped: `max_steps=4` reached." in text, text[-3000:]
    saved = list(tmp_path.rglob("config.yaml"))
    assert saved and "pipedap" in saved[0].read_text().lower()
