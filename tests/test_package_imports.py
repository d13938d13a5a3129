"""The package imports lightly and still registers its strategy names with Lightning."""

import subprocess
import sys

import pytest

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_planner_cli_and_helper_modules_do_not_import_lightning():
    code = ("import sys, lightning_pipedap, lightning_pipedap.plan, lightning_pipedap.compress.runtime, "
            "lightning_pipedap.engine.engine, lightning_pipedap.schedule\n"
            "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith('lightning.')))")
    assert _run(code) == "[]"


@pytest.mark.parametrize("order", ["pipedap_first", "lightning_first", "registry_module_only"])
def test_strategy_names_are_registered_whatever_the_import_order(order):
    imports = {
        "pipedap_first": "import lightning_pipedap\nfrom lightning.pytorch.strategies import StrategyRegistry",
        "lightning_first": "import lightning\nimport lightning_pipedap\nfrom lightning.pytorch.strategies import "
                           "StrategyRegistry",
        "registry_module_only": "import lightning_pipedap\nimport lightning.pytorch.strategies as s\n"
                                "StrategyRegistry = s.StrategyRegistry",
    }[order]
    code = imports + ("\nfrom lightning_pipedap import PipeDAPStrategy\n"
                      "print(StrategyRegistry['pipedap']['strategy'] is PipeDAPStrategy, "
                      "StrategyRegistry['pipedap_spawn']['init_params'])")
    assert _run(code) == "True {'start_method': 'spawn'}"


def test_unknown_attribute_is_a_clear_error():
    import lightning_pipedap

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightning_pipedap.nope  # noqa: B018
