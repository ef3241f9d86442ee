"""bench/train_throughput.py: how ``--arm`` contenders are read and checked (no training here:
the benchmark itself is timed by hand, never in tests)."""

from __future__ import annotations

import pytest
import yaml

from bench import train_throughput as throughput
from tests.conftest import REPO


@pytest.fixture(scope="module")
def preset() -> dict:
    from stages.params import compose

    return yaml.safe_load(compose(REPO / "conf", "multi30k", []))


def test_an_arm_is_fast_with_its_settings_parsed_as_yaml():
    name, spec = throughput.parse_arm("d192:model.d_model=192,model.heads=3,train.compile=true")
    assert name == "d192"
    assert spec == {"kernels": "fast", "model": {"d_model": 192, "heads": 3}, "compile": True}


@pytest.mark.parametrize("text", ["model.d_ff=512", ":model.d_ff=512", "fast:model.d_ff=512",
                                  "x@8:model.d_ff=512", "x:data.vocab_size=4000",
                                  "x:model.d_ff", "x:d_ff=512"])
def test_a_malformed_arm_stops_with_the_form_to_use(text):
    with pytest.raises(SystemExit, match=r"--arm .*(NAME:KEY=VALUE|model\.KEY=VALUE)"):
        throughput.parse_arm(text)


def test_arms_are_validated_as_params_are_and_the_preset_is_untouched(preset):
    before = yaml.safe_dump(preset)
    arms = [throughput.parse_arm("ff512:model.d_ff=512"),
            throughput.parse_arm("l2:model.encoder_layers=2,model.decoder_layers=2")]
    checked = throughput.check_arms(preset, dict(arms))
    assert checked["ff512"].model.d_ff == 512
    assert checked["ff512"].model.d_model == preset["model"]["d_model"]
    assert (checked["l2"].model.encoder_layers, checked["l2"].model.decoder_layers) == (2, 2)
    assert checked["l2"].model.d_ff == preset["model"]["d_ff"]
    assert yaml.safe_dump(preset) == before


@pytest.mark.parametrize("setting, named", [("model.dff=512", "model.dff"),
                                            ("train.lr_sclae=2", "train.lr_sclae"),
                                            ("model.d_model=-8", "model.d_model")])
def test_a_misspelt_or_invalid_arm_setting_names_the_arm_and_the_key(preset, setting, named):
    with pytest.raises(SystemExit) as info:
        throughput.check_arms(preset, dict([throughput.parse_arm(f"typo:{setting}")]))
    assert "--arm typo" in str(info.value) and named in str(info.value)


def test_a_bad_arm_stops_the_run_before_any_data_is_made(tmp_path):
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match="model.dff"):
        throughput.main(["--preset", "demo", "--workdir", str(work), "--contenders",
                         "fast,typo", "--arm", "typo:model.dff=64"])
    assert not work.exists() or not any(work.iterdir())
    assert "typo" not in throughput.TRAINERS  # an arm lives in its run, not in the module
