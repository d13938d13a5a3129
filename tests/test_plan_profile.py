"""Model profiles: our JSON format, the PipeDAP reference format, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_pipedap.plan.profile import LayerProfile, ModelProfile, load_profile, save_profile
from lightning_pipedap.plan.profile import PACKAGED_PROFILES_DIR

DATA = Path(__file__).resolve().parent / "data"
SHARED = PACKAGED_PROFILES_DIR  # the reference profiles shipped with the package


def test_tiny_profile_loads_with_bytes_and_times():
    p = load_profile(DATA / "tiny_profile.json")
    assert p.name == "tiny_mlp"
    assert p.num_layers == 5
    assert p.sizes_bytes == (65536 * 4, 262144 * 4, 512 * 4, 131072 * 4, 20480)
    assert p.layers[4].numel is None and p.layers[0].numel == 65536
    assert p.t_update == pytest.approx(4e-4)
    assert p.t_forward == pytest.approx(0.00151)
    assert p.t_backward == pytest.approx(0.00322)


def test_save_load_round_trip(tmp_path):
    p = ModelProfile("m", (LayerProfile.from_numel("a", 10, 2, 0.1, 0.2), LayerProfile("b", 7, 0.0, 0.3)), 0.05,
                     {"device": "cpu"})
    back = load_profile(save_profile(p, tmp_path / "p.json"))
    assert back == p
    assert back.layers[0].nbytes == 20 and back.layers[1].nbytes == 7
    assert back.meta["device"] == "cpu"


def test_milliseconds_are_converted(tmp_path):
    d = {"format": "lightning_pipedap.profile", "version": 1, "name": "x", "unit_time": "ms", "t_update": 2,
         "layers": [{"name": "a", "nbytes": 8, "t_f": 1.5, "t_b": 3}]}
    p = load_profile(d)
    assert p.layers[0].t_f == pytest.approx(1.5e-3)
    assert p.t_update == pytest.approx(2e-3)


def test_reference_format_from_dict_uses_params_times_bytes():
    d = {"model": "toy", "unit_time": "s",
         "layers": [{"name": "a", "params": 100, "t_f": 0.1, "t_b": 0.2}],
         "layers_repaired": [{"name": "a", "params": 150, "t_f": 0.1, "t_b": 0.25}]}
    p = load_profile(d)
    assert p.name == "toy" and p.layers[0].nbytes == 400 and p.layers[0].numel == 100
    q = load_profile(d, repaired=True, bytes_per_element=2)
    assert q.layers[0].nbytes == 300 and q.layers[0].t_b == 0.25


def test_shared_reference_profiles_match_their_totals():
    for name in ("vgg16", "resnet50", "densenet201", "bert_base", "gpt2"):
        raw = json.loads((SHARED / f"{name}.json").read_text())
        p = load_profile(SHARED / f"{name}.json")
        assert p.num_layers == raw["num_layers"]
        assert p.total_bytes == 4 * raw["totals"]["params"]
        assert p.t_forward == pytest.approx(raw["totals"]["t_f"], rel=1e-12)
        assert p.t_backward == pytest.approx(raw["totals"]["t_b"], rel=1e-12)
        r = load_profile(SHARED / f"{name}.json", repaired=True)
        assert r.total_bytes == 4 * raw["totals_repaired"]["params"]


@pytest.mark.parametrize("bad, match", [
    ({"format": "nope"}, "is not a profile"),
    ({"format": "lightning_pipedap.profile", "version": 9, "layers": []}, "unsupported profile version"),
    ({"format": "lightning_pipedap.profile", "version": 1, "unit_time": "h", "layers": []}, "unit_time 'h'"),
    ({"format": "lightning_pipedap.profile", "version": 1, "layers": [{"name": "a", "t_f": 0, "t_b": 0}]},
     "needs 'nbytes' or 'numel'"),
    ({"format": "lightning_pipedap.profile", "version": 1, "layers": []}, "has no layers"),
])
def test_bad_profiles_are_rejected(bad, match):
    with pytest.raises(ValueError, match=match):
        load_profile(bad)


def test_layer_validation():
    with pytest.raises(ValueError, match="t_b of layer 'x'"):
        LayerProfile("x", 4, 0.1, -1.0)
    with pytest.raises(ValueError, match="nbytes of layer 'x'"):
        LayerProfile("x", -4, 0.1, 0.1)
    with pytest.raises(ValueError, match="bytes_per_element"):
        LayerProfile.from_numel("x", 4, 0, 0.1, 0.1)


def test_unknown_name_lists_valid_names():
    with pytest.raises(FileNotFoundError, match="no profile file 'no_such_model'"):
        load_profile("no_such_model")
