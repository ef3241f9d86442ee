"""The params schema: presets compose and validate; bad values stop with a clear message."""

from __future__ import annotations

import copy

import pytest
import yaml

from aiayn.config import Params, load_params, parse_params
from aiayn.errors import ParamsError
from stages.params import compose
from tests.conftest import REPO

PRESETS = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))


def committed() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_committed_params_are_the_demo_composition():
    assert committed() == yaml.safe_load(compose(REPO / "conf", None, []))
    assert committed() == yaml.safe_load(compose(REPO / "conf", "demo", []))
    p = load_params(REPO / "params.yaml")
    assert p.data.source == "toy"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_validates(preset):
    assert {"demo", "multi30k", "wmt14_base", "wmt14_big"} <= set(PRESETS)
    p = parse_params(yaml.safe_load(compose(REPO / "conf", preset, [])), preset)
    assert isinstance(p, Params)


def test_presets_carry_the_paper_settings():
    base = parse_params(yaml.safe_load(compose(REPO / "conf", "wmt14_base", [])))
    big = parse_params(yaml.safe_load(compose(REPO / "conf", "wmt14_big", [])))
    # Table 3: base and big.
    assert (base.model.d_model, base.model.heads, base.model.d_ff) == (512, 8, 2048)
    assert (big.model.d_model, big.model.heads, big.model.d_ff) == (1024, 16, 4096)
    assert base.model.encoder_layers == base.model.decoder_layers == 6
    assert base.vocab.vocab_size == big.vocab.vocab_size == 37000
    assert base.data.hub.path == "wmt/wmt14" and base.data.hub.name == "de-en"
    assert big.model.dropout == 0.3 and base.model.dropout == 0.1
    assert base.train.average_last == 5 and big.train.average_last == 20
    assert base.train.tokens_per_step == 25000 and base.train.warmup_steps == 4000
    assert base.train.adam_betas == (0.9, 0.98) and base.train.label_smoothing == 0.1
    assert (base.decode.beam, base.decode.alpha, base.decode.max_len_b) == (4, 0.6, 50)


def test_overrides_compose_like_dvc_exp_run():
    p = parse_params(yaml.safe_load(compose(REPO / "conf", "demo", ["vocab.vocab_size=777"])))
    assert p.vocab.vocab_size == 777


def bad(mutate) -> str:
    raw = copy.deepcopy(committed())
    mutate(raw)
    with pytest.raises(ParamsError) as err:
        parse_params(raw, "params.yaml")
    return str(err.value)


def test_unknown_key_is_named():
    msg = bad(lambda r: r["vocab"].update(sise=100))
    assert "vocab.sise" in msg and "unknown key" in msg
    msg = bad(lambda r: r["vocab"].update(size=100))
    assert "vocab.size" in msg and "unknown key" in msg
    msg = bad(lambda r: r.update(trian={}))
    assert "trian" in msg


def test_wrong_type_names_key_and_value():
    msg = bad(lambda r: r["vocab"].update(vocab_size="big"))
    assert "vocab.vocab_size" in msg and "'big'" in msg and "integer" in msg


def test_negative_sizes_are_refused():
    msg = bad(lambda r: r["shard"].update(max_tokens=-5))
    assert "shard.max_tokens" in msg and "-5" in msg and "greater than 0" in msg
    msg = bad(lambda r: r["data"]["toy"].update(train_pairs=0))
    assert "data.toy.train_pairs" in msg


def test_heads_must_divide_d_model():
    msg = bad(lambda r: r["model"].update(d_model=100, heads=8))
    assert msg.endswith(": model: d_model (100) must be divisible by heads (8); e.g. heads=10")
    assert "\n" not in msg  # one line


def test_unknown_language_is_named():
    msg = bad(lambda r: r["data"].update(src_lang="xx"))
    assert "data.src_lang" in msg and "'xx'" in msg and "'de'" in msg
    msg = bad(lambda r: r["data"].update(source="hub", src_lang="fr"))
    assert "de-en" in msg


def test_same_language_on_both_sides():
    assert "both 'en'" in bad(lambda r: r["data"].update(tgt_lang="en"))


def test_max_len_must_fit_a_batch():
    msg = bad(lambda r: r["shard"].update(max_len=5000, max_tokens=2048))
    assert "max_len (5000)" in msg and "max_tokens (2048)" in msg


def test_local_pattern_needs_placeholders():
    assert "{lang}" in bad(lambda r: r["data"]["local"].update(pattern="{split}.txt"))


def test_missing_or_broken_params_file(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        load_params(tmp_path / "nope.yaml")
    broken = tmp_path / "p.yaml"
    broken.write_text("vocab: [unclosed\n")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(broken)


def test_no_param_key_is_hidden_from_dvcs_run_cache():
    """DVC drops every nested key named "size" or "nfiles" when it hashes a stage for its
    run cache (dvc/stage/cache.py excludes them to ignore file metadata), so a parameter
    with such a name would not invalidate cached runs: changing it could restore outputs
    made with another value. No parameter may carry those names."""
    from dvc.stage.cache import _get_cache_hash

    def keys(node, prefix=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield f"{prefix}{k}"
                yield from keys(v, f"{prefix}{k}.")

    hidden = {"size", "nfiles"}
    full = Params().model_dump(mode="json")
    assert not [k for k in keys(full) if k.rsplit(".", 1)[-1] in hidden]
    # The premise, checked against DVC itself: a key named "size" does not change the hash.
    assert _get_cache_hash({"params": {"vocab": {"size": 1}}}) == _get_cache_hash(
        {"params": {"vocab": {"size": 2}}})


def leaf_params(model: type, prefix: str = "") -> list[str]:
    """Dotted names of every setting in the schema (sections of sections flattened)."""
    from pydantic import BaseModel

    names = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            names += leaf_params(kind, f"{prefix}{name}.")
        else:
            names.append(f"{prefix}{name}")
    return names


def stage_params() -> dict[str, list[str]]:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    return {name: stage.get("params", []) for name, stage in stages.items()}


def reads(listed: list[str], name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in listed)


def test_every_setting_is_a_param_of_a_stage_so_changing_it_re_runs_that_stage():
    """A setting no stage lists is silently ignored by `dvc exp run -S` (the stage is
    'unchanged' and its old outputs are reused)."""
    stages = stage_params()
    missed = [name for name in leaf_params(Params)
              if not any(reads(listed, name) for listed in stages.values())]
    assert not missed, f"in no stage's params in dvc.yaml: {missed}"


def test_every_training_setting_re_runs_training_except_the_averaging():
    stages = stage_params()
    not_train = [name for name in leaf_params(Params)
                 if name.startswith("train.") and not reads(stages["train"], name)]
    assert sorted(not_train) == ["train.average", "train.average_candidates",
                                 "train.average_last"]
    assert all(reads(stages["average"], name) for name in not_train)
