"""The params schema: presets compose and validate; bad values stop with a clear message."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from aiayn.config import (
    PARAM_EFFECTS,
    Params,
    load_params,
    parse_params,
    shapes_training,
    stage_params,
)
from aiayn.errors import ParamsError
from stages.params import compose
from tests.conftest import REPO, dvc_stages

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


def test_the_rdrop_preset_is_multi30k_with_rdrop_alone():
    """multi30k_rdrop inherits multi30k through Hydra's defaults list: the two compose to the
    same parameters but for train.rdrop, also when multi30k changes later."""
    plain = yaml.safe_load(compose(REPO / "conf", "multi30k", []))
    rdrop = yaml.safe_load(compose(REPO / "conf", "multi30k_rdrop", []))
    assert plain["train"].pop("rdrop") == 0 and rdrop["train"].pop("rdrop") == 5
    assert rdrop == plain
    # an override still wins over the preset's own value, as with dvc exp run -S
    over = parse_params(yaml.safe_load(compose(REPO / "conf", "multi30k_rdrop",
                                               ["train.rdrop=1.5", "seed=2"])))
    assert (over.train.rdrop, over.seed) == (1.5, 2)


def test_the_half_rdrop_preset_is_multi30k_rdrop_on_half_of_each_batch():
    """multi30k_rdrop_half is multi30k_rdrop on half of each batch, with less label smoothing
    (chosen for the AVX512-BF16 hour); nothing else differs."""
    full = yaml.safe_load(compose(REPO / "conf", "multi30k_rdrop", []))
    half = yaml.safe_load(compose(REPO / "conf", "multi30k_rdrop_half", []))
    assert full["train"].pop("rdrop_fraction") == 1 and half["train"].pop("rdrop_fraction") == 0.5
    assert full["train"].pop("label_smoothing") == 0.3
    assert half["train"].pop("label_smoothing") == 0.2
    assert half == full


def test_overrides_compose_like_dvc_exp_run():
    p = parse_params(yaml.safe_load(compose(REPO / "conf", "demo", ["vocab.vocab_size=777"])))
    assert p.vocab.vocab_size == 777


def test_a_preset_written_to_params_yaml_becomes_the_one_dvc_exp_run_composes(tmp_path,
                                                                               caplog):
    """`dvc exp run -S key=value` composes conf/config.yaml anew, with the preset its
    defaults list names: after `aiayn params multi30k` that must be multi30k, or the
    experiment would run the committed default (demo) with the one change."""
    import shutil

    from typer.testing import CliRunner

    from stages.params import app, default_experiment

    shutil.copytree(REPO / "conf", tmp_path / "conf")
    before = (tmp_path / "conf/config.yaml").read_text()
    assert default_experiment(tmp_path / "conf") == "demo"
    runner = CliRunner()
    # another file than the repository's params.yaml: conf/ stays as it is
    result = runner.invoke(app, ["multi30k", "--conf", str(tmp_path / "conf"),
                                 "--out", str(tmp_path / "elsewhere.yaml")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "conf/config.yaml").read_text() == before
    out = tmp_path / "params.yaml"
    result = runner.invoke(app, ["multi30k", "--conf", str(tmp_path / "conf"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    after = (tmp_path / "conf/config.yaml").read_text()
    assert default_experiment(tmp_path / "conf") == "multi30k"
    # that one line changed, comments and all else kept
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True)
               if a != b]
    assert changed == [("  - experiment: demo", "  - experiment: multi30k")]
    # what dvc exp run -S train.lr_scale=2 composes is multi30k's, with the one change
    composed = yaml.safe_load(compose(tmp_path / "conf", None, ["train.lr_scale=2"]))
    expected = yaml.safe_load(out.read_text())
    expected["train"]["lr_scale"] = 2
    assert composed == expected
    assert runner.invoke(app, ["--check", "--conf", str(tmp_path / "conf"),
                               "--out", str(out)]).exit_code == 0
    # overrides cannot go into conf/: a warning says so
    result = runner.invoke(app, ["demo", "train.lr_scale=3", "--conf", str(tmp_path / "conf"),
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert default_experiment(tmp_path / "conf") == "demo"
    assert "train.lr_scale=3 are in" in caplog.text + result.output


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


def test_rdrop_start_without_rdrop_is_refused():
    msg = bad(lambda r: r["train"].update(rdrop_start=0.5))
    assert "rdrop_start is 0.5 but rdrop is 0" in msg and "set train.rdrop" in msg
    msg = bad(lambda r: r["train"].update(rdrop=5, rdrop_start=1.0))
    assert "train.rdrop_start" in msg and "less than 1" in msg


def test_rdrop_fraction_is_checked():
    msg = bad(lambda r: r["train"].update(rdrop_fraction=0.5))
    assert "rdrop_fraction is 0.5 but rdrop is 0" in msg and "set train.rdrop" in msg
    for wrong, says in ((0.0, "greater than 0"), (1.5, "less than or equal to 1")):
        msg = bad(lambda r, f=wrong: r["train"].update(rdrop=5, rdrop_fraction=f))
        assert "train.rdrop_fraction" in msg and says in msg


def test_negative_sizes_are_refused():
    msg = bad(lambda r: r["shard"].update(max_tokens=-5))
    assert "shard.max_tokens" in msg and "-5" in msg and "greater than 0" in msg
    msg = bad(lambda r: r["data"]["toy"].update(train_pairs=0))
    assert "data.toy.train_pairs" in msg


def test_a_key_written_twice_is_refused(tmp_path):
    text = (REPO / "params.yaml").read_text()
    assert text.startswith("seed: 1\n")
    text = "seed: 1\nseed: 2\n" + text.removeprefix("seed: 1\n")
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ParamsError, match=r"params.yaml: not valid YAML: .*key 'seed' appears "
                                          r"twice in one section \(lines \d+ and \d+\)"):
        load_params(tmp_path / "params.yaml")


def test_params_check_on_a_file_that_is_not_yaml_says_it_differs(tmp_path):
    from typer.testing import CliRunner

    from stages.params import app

    out = tmp_path / "params.yaml"
    for broken in (b"a: [\n", b"seed: \xe9\n"):
        out.write_bytes(broken)
        result = CliRunner().invoke(app, ["--check", "--conf", str(REPO / "conf"),
                                          "--out", str(out)])
        assert result.exit_code == 1, result.output
        assert "differs from the composition" in result.output
        assert "Traceback" not in result.output


def test_heads_must_divide_d_model():
    msg = bad(lambda r: r["model"].update(d_model=100, heads=8))
    assert msg.endswith(": model: d_model (100) must be divisible by heads (8); e.g. heads=10")
    assert "\n" not in msg  # one line


def test_d_k_d_v_and_positions_are_checked_with_what_to_do():
    msg = bad(lambda r: r["model"].update(d_k=-4))
    assert msg.endswith(": model: d_k (-4) must be positive, or 0 for d_model / heads (128 / 4)")
    msg = bad(lambda r: r["model"].update(d_model=100, heads=8, d_k=16))
    assert "divisible by heads (8)" in msg and "d_v 0 means d_model / heads" in msg
    # Both set: heads need not divide d_model (h * d_v is projected back to d_model).
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["model"].update(d_model=100, heads=8, d_k=16, d_v=16)
    assert parse_params(raw).model.d_k == 16
    msg = bad(lambda r: r["model"].update(positions="rotary"))
    assert "model.positions" in msg and "'sinusoidal' or 'learned'" in msg
    msg = bad(lambda r: (r["model"].update(positions="learned", max_positions=64),
                         r["shard"].update(max_len=100)))
    assert "exceeds model.max_positions (64)" in msg and "one learned row per position" in msg
    # How learned positions start: only with learned positions, and not below 0.
    msg = bad(lambda r: r["model"].update(position_init_std=0.7))
    assert msg.endswith(": model: position_init_std (0.7) sets how learned positions start, "
                        "but positions is 'sinusoidal'; set positions: learned, or "
                        "position_init_std: 0")
    msg = bad(lambda r: r["model"].update(positions="learned", position_init_std=-1))
    assert "model.position_init_std" in msg and "greater than or equal to 0" in msg
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["model"].update(positions="learned", position_init_std=0.7)
    assert parse_params(raw).model.position_init_std == 0.7


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


def dvc_stage_params() -> dict[str, list[str]]:
    """Each stage's `params:` list, from dvc.yaml and the optional export/dvc.yaml."""
    return {name: stage.get("params", []) for name, (_, stage) in dvc_stages().items()}


def reads(listed: list[str], name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in listed)


def test_dvc_yaml_lists_for_each_stage_exactly_the_params_declared_for_it():
    """aiayn.config.PARAM_EFFECTS is the one declaration of what each parameter affects; a
    stage that does not list a key it reads keeps stale outputs under `dvc exp run -S`, and
    one that lists a key it does not read re-runs for nothing."""
    stages = dvc_stage_params()
    declared = {s for affects in PARAM_EFFECTS.values() for s in affects.stages}
    assert declared <= set(stages), f"declared for stages dvc.yaml lacks: {declared - set(stages)}"
    for name, listed in stages.items():
        assert sorted(listed) == sorted(stage_params(name)), name


def test_every_setting_is_declared_and_read_by_some_stage():
    """A setting no stage lists is silently ignored by `dvc exp run -S` (the stage is
    'unchanged' and its old outputs are reused)."""
    stages = dvc_stage_params()
    missed = [name for name in leaf_params(Params)
              if not any(reads(listed, name) for listed in stages.values())]
    assert not missed, f"in no stage's params in dvc.yaml: {missed}"
    undeclared = [name for name in leaf_params(Params)
                  if not any(reads([key], name) for key in PARAM_EFFECTS)]
    assert not undeclared
    for name in leaf_params(Params):
        shapes_training(name)  # every setting resolves to one declaration


def test_only_settings_the_train_stage_reads_can_shape_a_training_run():
    train = stage_params("train")
    for key, affects in PARAM_EFFECTS.items():
        if affects.shapes_training:
            assert reads(train, key), key
    # The paper's knobs shape the steps; length, logging, checkpointing and where it runs
    # do not (a longer run resumes); averaging and decoding happen after training.
    assert shapes_training("model.d_model") and shapes_training("train.lr_scale")
    assert shapes_training("seed") and shapes_training("train.label_smoothing")
    for key in ("train.steps", "train.max_minutes", "train.log_every", "train.device",
                "train.compile", "train.nproc_per_node", "train.valid_bleu_beam",
                "train.average_last", "train.average", "train.average_candidates",
                "decode.beam", "data.src_lang"):
        assert not shapes_training(key), key
    with pytest.raises(KeyError, match="nothing.here"):
        shapes_training("nothing.here")


def test_params_takes_overrides_alone_or_experiment_as_the_preset(tmp_path):
    """`aiayn params key=value` composes the default preset with it; `experiment=NAME` (as
    `dvc exp run -S` writes it) names the preset; two presets, or a misspelt key, stop with
    one line saying what to do."""
    from typer.testing import CliRunner

    from stages.params import app

    conf, out = str(REPO / "conf"), tmp_path / "p.yaml"

    def run(*args):
        return CliRunner().invoke(app, [*args, "--conf", conf, "--out", str(out)])

    assert run("train.steps=5").exit_code == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load(
        compose(REPO / "conf", None, ["train.steps=5"]))
    assert run("experiment=multi30k", "train.steps=5").exit_code == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load(
        compose(REPO / "conf", "multi30k", ["train.steps=5"]))
    two = run("demo", "experiment=multi30k")
    assert two.exit_code == 2 and "name one preset, as the first argument" in two.output
    typo = run("demo", "modle.heads=4")
    assert typo.exit_code == 2 and "modle.heads: no such key" in typo.output
    assert "Traceback" not in two.output + typo.output


def test_a_negative_seed_is_refused_when_params_load():
    msg = bad(lambda r: r.update(seed=-1))
    assert "seed = -1" in msg and "greater than or equal to 0" in msg


def test_average_last_is_checked_only_where_it_is_used():
    """With train.average_candidates the count is chosen among them and average_last is not
    used: it is not held to keep_checkpoints then; the candidates are."""
    def with_train(**kw):
        raw = committed()
        raw["train"].update(kw)
        return parse_params(raw)

    p = with_train(keep_checkpoints=5, average_last=10, average_candidates=[1, 3, 5])
    assert p.train.average_candidates == [1, 3, 5]
    with pytest.raises(ParamsError, match="average_last \\(10\\) exceeds keep_checkpoints"):
        with_train(keep_checkpoints=5, average_last=10, average_candidates=[])
    with pytest.raises(ParamsError, match="keep_checkpoints"):
        with_train(keep_checkpoints=5, average_last=1, average_candidates=[1, 10])


def test_max_len_beyond_the_positions_says_both_fixes():
    msg = bad(lambda r: (r["shard"].update(max_len=300), r["model"].update(max_positions=256)))
    assert "raise model.max_positions to 302 or lower shard.max_len to 254" in msg


def test_e_notation_that_yaml_reads_as_text_says_how_to_write_it(tmp_path):
    """PyYAML (YAML 1.1) reads 1e5 as a string: a whole-number key says so, with the number
    written as YAML reads one; a float key takes the string's number (1e-9) as it is."""
    source = (REPO / "params.yaml").read_text()
    path = tmp_path / "params.yaml"

    def with_train(key: str, text: str):
        train = source.index("\ntrain:\n")
        path.write_text(source[:train] + re.sub(rf"(?m)^(  {key}:) .*$", rf"\1 {text}",
                                                source[train:], count=1))
        return path

    with pytest.raises(ParamsError) as err:
        load_params(with_train("steps", "1e5"))
    assert "train.steps = '1e5'" in str(err.value) and "write 100000" in str(err.value)
    assert load_params(with_train("adam_eps", "1e-9")).train.adam_eps == 1e-9


def test_yes_no_and_true_false_are_not_numbers(tmp_path):
    """YAML 1.1 reads yes/no/on/off/true/false as booleans, and pydantic's lax mode would
    take them as 1/0: `encoder_layers: yes` would train one layer. A number's key (ints,
    floats, their lists and tuples) refuses them with the fix; a real bool key still
    takes them."""
    source = (REPO / "params.yaml").read_text()
    path = tmp_path / "params.yaml"
    for section, key, text in [("model", "encoder_layers", "yes"), ("model", "dropout", "off"),
                               ("train", "lr_scale", "true"),
                               ("train", "average_candidates", "[1, on]")]:
        at = source.index(f"\n{section}:\n")
        path.write_text(source[:at] + re.sub(rf"(?m)^(  {key}:) .*$", rf"\1 {text}",
                                             source[at:], count=1))
        with pytest.raises(ParamsError) as err:
            load_params(path)
        assert f"{section}.{key} = " in str(err.value), text
        assert "wants a number, not true/false" in str(err.value), text
    at = source.index("\ntrain:\n")
    path.write_text(source[:at] + re.sub(r"(?m)^(  compile:) .*$", r"\1 yes", source[at:],
                                         count=1))
    assert load_params(path).train.compile is True
    # Assigned after loading (as Hydra's overrides are applied), the same rule holds.
    p = load_params(REPO / "params.yaml")
    with pytest.raises(ValueError, match="wants a number"):
        p.model.heads = True


@pytest.mark.parametrize("kind, preset, fits, level, says", [
    ("amx", "multi30k_rdrop", True, "INFO", "+2.2 test2016 BLEU"),
    ("amx", "multi30k", False, "INFO", "`aiayn params multi30k_rdrop`"),
    ("amx", "multi30k_rdrop_half", False, "INFO", "`aiayn params multi30k_rdrop`"),
    ("amx", "multi30k_rdrop_half", False, "INFO", "42.40 against 42.50"),
    ("bf16", "multi30k_rdrop_half", True, "INFO", "without AMX"),
    ("bf16", "multi30k", False, "INFO", "41.96 against 40.87"),
    ("bf16", "multi30k", False, "INFO", "`aiayn params multi30k_rdrop_half`"),
    ("bf16", "multi30k_rdrop", False, "WARNING", "`aiayn params multi30k_rdrop_half`"),
    ("fp32", "multi30k_rdrop", False, "WARNING", "31.72 against 38.19-39.52"),
    ("fp32", "multi30k_rdrop_half", False, "WARNING", "`aiayn params multi30k`"),
    ("fp32", "multi30k", True, "INFO", "no native bf16"),
])
def test_params_names_the_multi30k_preset_for_this_cpus_kind(tmp_path, monkeypatch, caplog,
                                                             kind, preset, fits, level, says):
    """`aiayn params` on a Multi30k preset says whether it is the one recorded for this CPU's
    kind, and warns only where a costlier R-Drop step than that preset's would cost the CPU
    its hour; the records it names exist; other presets, and machines with a GPU, get no
    such line."""
    import logging

    import torch
    from typer.testing import CliRunner

    from aiayn import precision
    from stages.params import CPU_KIND_ADVICE, app, cpu_preset_advice

    records = re.findall(r"docs/\S+?\.md", " ".join(CPU_KIND_ADVICE.values()))
    assert len(records) >= 4
    for record in records:
        assert (REPO / record).is_file(), record
    monkeypatch.setattr(precision, "cpu_kind", lambda: kind)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    advice = cpu_preset_advice(preset)
    assert advice is not None and advice[0] is fits and says in advice[1]
    assert cpu_preset_advice("demo") is None
    with caplog.at_level(logging.INFO, logger="aiayn"):
        result = CliRunner().invoke(app, [preset, "--conf", str(REPO / "conf"),
                                          "--out", str(tmp_path / "p.yaml")])
    assert result.exit_code == 0, result.output
    lines = [r for r in caplog.records if says in r.getMessage()]
    assert [r.levelname for r in lines] == [level]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_preset_advice(preset) is None


def test_the_params_name_every_setting_of_the_model_they_describe():
    """model_config against the model written out by hand, with every setting
    away from its default (so that one not passed on would show)."""
    import dataclasses

    from aiayn.model import TransformerConfig
    from aiayn.training.build import model_config

    p = parse_params({
        "model": {"d_model": 48, "heads": 3, "encoder_layers": 2, "decoder_layers": 4,
                  "d_ff": 96, "dropout": 0.2, "norm": "pre", "max_positions": 80, "d_k": 8,
                  "d_v": 12, "positions": "learned", "position_init_std": 0.5,
                  "output_vocab": "target"},
        "shard": {"max_len": 60},
        "train": {"attention_dropout": 0.05, "activation_dropout": 0.15}})
    expected = TransformerConfig(
        vocab_size=321, d_model=48, heads=3, encoder_layers=2, decoder_layers=4, d_ff=96,
        dropout=0.2, attention_dropout=0.05, activation_dropout=0.15, norm="pre",
        max_positions=80, d_k=8, d_v=12, positions="learned", position_init_std=0.5,
        output_vocab="target")
    assert model_config(p, 321) == expected
    default = TransformerConfig(vocab_size=0)
    assert [f.name for f in dataclasses.fields(TransformerConfig)
            if getattr(expected, f.name) == getattr(default, f.name)] == ["pad_id"]
