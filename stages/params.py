"""params: compose conf/ (base + experiment preset) into params.yaml, as `dvc exp run` does.

`dvc exp run -S experiment=NAME` composes conf/config.yaml with Hydra and overwrites
params.yaml; this command performs the same composition by hand (for `dvc repro` and the
stage commands), validates the result, and can check that params.yaml is up to date.

`dvc exp run -S key=value` composes conf/config.yaml anew too, with the preset its defaults
list names, not the one params.yaml was made from. So writing the repository's params.yaml
with a preset also makes that preset conf/config.yaml's default: the experiments a user
runs next build on the preset chosen, not on the committed default.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from aiayn.config import parse_params
from aiayn.errors import ParamsError
from aiayn.io import write_text
from stages.common import log, single_command_app, stage


def compose(conf_dir: Path, experiment: str | None, overrides: list[str]) -> str:
    """The YAML text Hydra composes from conf_dir (identical to what DVC writes)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    if not (conf_dir / "config.yaml").is_file():
        raise ParamsError(f"{conf_dir}/config.yaml: missing; run from the repository root")
    all_overrides = ([f"experiment={experiment}"] if experiment else []) + list(overrides)
    try:
        with initialize_config_dir(str(conf_dir.resolve()), version_base=None):
            cfg = hydra_compose(config_name="config", overrides=all_overrides)
    except HydraException as exc:
        presets = sorted(p.stem for p in (conf_dir / "experiment").glob("*.yaml"))
        if experiment and f"Could not find 'experiment/{experiment}'" in str(exc):
            raise ParamsError(f"{conf_dir}/experiment/{experiment}.yaml: no such preset; known "
                              f"experiments: {', '.join(presets)}") from None
        unknown = re.search(r"Could not override '([^']+)'", str(exc))
        if unknown:
            raise ParamsError(f"{unknown.group(1)}: no such key in {conf_dir}/ (misspelt? the "
                              "keys are those of params.yaml, e.g. model.heads)") from None
        raise ParamsError(f"{conf_dir}: cannot compose {all_overrides}: "
                          f"{' '.join(str(exc).split())}; known experiments: "
                          f"{', '.join(presets)}") from None
    OmegaConf.resolve(cfg)
    return OmegaConf.to_yaml(cfg)


_DEFAULT_EXPERIMENT = re.compile(r"^(\s*-\s*experiment\s*:\s*)([^\s#]+)(.*)$", re.MULTILINE)


def default_experiment(conf_dir: Path) -> str | None:
    """The preset conf_dir/config.yaml's defaults list names (``- experiment: NAME``)."""
    found = _DEFAULT_EXPERIMENT.search((conf_dir / "config.yaml").read_text(encoding="utf-8"))
    return found.group(2) if found else None


def set_default_experiment(conf_dir: Path, name: str) -> bool:
    """Make ``name`` the preset of conf_dir/config.yaml's defaults list, editing that one
    line (comments and the rest stay); whether the file changed."""
    path = conf_dir / "config.yaml"
    text = path.read_text(encoding="utf-8")
    new, count = _DEFAULT_EXPERIMENT.subn(lambda m: m.group(1) + name + m.group(3), text,
                                          count=1)
    if count == 0:
        raise ParamsError(f"{path}: its defaults list names no `- experiment: NAME`, so "
                          "`dvc exp run` would compose no preset; add one")
    if new == text:
        return False
    write_text(path, new)
    return True


def differences(a: dict, b: dict, prefix: str = "") -> dict[str, Any]:
    """The settings (dotted keys) whose value in ``b`` differs from ``a``, with b's value."""
    out: dict[str, Any] = {}
    for key in b:
        here = f"{prefix}{key}"
        if isinstance(b[key], dict) and isinstance(a.get(key), dict):
            out.update(differences(a[key], b[key], here + "."))
        elif a.get(key, object()) != b[key]:
            out[here] = b[key]
    return out


def nearest_preset(current: dict, conf_dir: Path, presets: list[str] | None = None
                   ) -> tuple[str, dict[str, Any]] | None:
    """The preset of CONF_DIR/experiment/ (or of ``presets``) whose composition differs from
    the params mapping ``current`` in the fewest settings, and those settings (dotted keys,
    with current's values); None where there is no preset."""
    names = presets or sorted(p.stem for p in (conf_dir / "experiment").glob("*.yaml"))
    best = None
    for name in names:
        changed = differences(yaml.safe_load(compose(conf_dir, name, [])), current)
        if best is None or len(changed) < len(best[1]):
            best = (name, changed)
    return best


# The Multi30k preset to train on each CPU kind (aiayn.precision.cpu_kind): R-Drop trains each
# batch, or half of it, twice; its gain needs a step rate that leaves enough steps in the hour.
MULTI30K_FOR_CPU = {"amx": "multi30k_rdrop", "bf16": "multi30k_rdrop_half", "fp32": "multi30k"}
# Most to least R-Drop per step: a preset earlier in this list than the CPU kind's costs it steps.
RDROP_COST_ORDER = ("multi30k_rdrop", "multi30k_rdrop_half", "multi30k")
RDROP_RECORD = "docs/results/multi30k/bf16-amx-rdrop/README.md"
RDROP_HALF_RECORD = "docs/results/multi30k/rdrop-share-screen/README.md"
RDROP_HALF_AMX_RECORD = "docs/results/multi30k/bf16-amx-rdrop-half/README.md"
RDROP_HALF_LS_RECORD = "docs/results/multi30k/rdrop-half-less-reg-screen/README.md"
RDROP_HALF_LS_HOUR_RECORD = "docs/results/multi30k/bf16-avx512-rdrop-half-ls0.2/README.md"
CPU_KIND_ADVICE = {
    "amx": ("this CPU has AMX: on such a CPU `multi30k_rdrop` scored +2.2 test2016 BLEU over "
            f"`multi30k` in the hour (mean of 2 seeds; {RDROP_RECORD}), and R-Drop on half of "
            "each batch (`multi30k_rdrop_half`, at label smoothing 0.3) tied it on valid, 42.40 "
            f"against 42.50 ({RDROP_HALF_AMX_RECORD})"),
    "bf16": ("this CPU has native bf16 without AMX (e.g. AVX512-BF16): there R-Drop on the "
             "whole batch costs ~2x a plain step and tied `multi30k` on valid; on half of "
             "each batch (~1.5x) and with label smoothing 0.2 it scored valid 41.96 against "
             "40.87 for `multi30k` and test2016 40.30 against 38.91 in such a CPU's hour "
             f"(2 seeds; {RDROP_HALF_LS_HOUR_RECORD}; label smoothing 0.2 chosen over 0.3 in "
             f"the hour's steps: {RDROP_HALF_LS_RECORD}; the share chosen in step budgets: "
             f"{RDROP_HALF_RECORD})"),
    "fp32": ("this CPU has no native bf16 (e.g. AVX2 only), so training computes in fp32: "
             "there R-Drop's step runs at 0.51x the plain one's tokens/s, and its hour scored "
             f"test2016 31.72 against 38.19-39.52 for `multi30k` ({RDROP_RECORD}); on a "
             "quarter of each batch it lost 0.83 valid BLEU to `multi30k` in that hour's "
             f"steps ({RDROP_HALF_RECORD})"),
}


def cpu_preset_advice(experiment: str | None) -> tuple[bool, str] | None:
    """For a Multi30k preset trained on this machine's CPU: (whether the preset is the one
    for this CPU's kind, the line that says so and why); None for other presets, or where a
    GPU is visible (the stages train there)."""
    if experiment not in MULTI30K_FOR_CPU.values():
        return None
    import torch

    from aiayn.precision import cpu_kind

    if torch.cuda.is_available():
        return None
    kind = cpu_kind()
    best = MULTI30K_FOR_CPU[kind]
    if experiment == best:
        return True, f"{best} is the Multi30k preset for this CPU ({CPU_KIND_ADVICE[kind]})"
    return False, f"{CPU_KIND_ADVICE[kind]}; `aiayn params {best}` trains the preset for it"


def costlier_than_advised(experiment: str) -> bool:
    """Whether the Multi30k preset ``experiment`` trains more R-Drop per step than the one for
    this machine's CPU kind (so its hour holds fewer steps than that preset's)."""
    from aiayn.precision import cpu_kind

    best = MULTI30K_FOR_CPU[cpu_kind()]
    return RDROP_COST_ORDER.index(experiment) < RDROP_COST_ORDER.index(best)


@stage
def params(
    experiment: Annotated[str | None, typer.Argument(help="Preset in conf/experiment/ (default: conf/config.yaml's).")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(help="Hydra overrides, e.g. vocab.vocab_size=8000.")] = None,
    out: Annotated[Path, typer.Option(help="File to write.")] = Path("params.yaml"),
    conf: Annotated[Path, typer.Option(help="Folder of Hydra configs.")] = Path("conf"),
    check: Annotated[bool, typer.Option("--check", help="Only check that OUT equals the composition; exit 1 if not.")] = False,
) -> None:
    """Compose conf/config.yaml with an experiment preset into params.yaml and validate it.

    Reads: CONF/config.yaml and CONF/experiment/EXPERIMENT.yaml. Writes: OUT (atomically;
    nothing with --check). When OUT is the params.yaml beside CONF (the one DVC composes),
    EXPERIMENT also becomes CONF/config.yaml's default preset, so that `dvc exp run -S
    key=value` experiments build on it.

    Examples: `aiayn params multi30k`, `aiayn params demo train.lr_scale=2`,
    `aiayn params --check`. Under `dvc exp run -S experiment=NAME` DVC does this itself.
    """
    overrides = list(overrides or [])
    if experiment and "=" in experiment:  # overrides alone: the default preset
        experiment, overrides = None, [experiment, *overrides]
    chosen = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") == "experiment"]
    if len(chosen) == 1 and experiment is None:  # as `dvc exp run -S experiment=NAME` says it
        experiment = chosen[0].split("=", 1)[1]
        overrides.remove(chosen[0])
    elif chosen:
        raise ParamsError(f"{' '.join(chosen)}: name one preset, as the first argument, e.g. "
                          f"`aiayn params {chosen[-1].split('=', 1)[1]} key=value`")
    text = compose(conf, experiment, overrides)
    parse_params(yaml.safe_load(text), f"composition of {conf}/ {experiment or ''}".strip())
    if check:
        try:
            current = yaml.safe_load(out.read_text(encoding="utf-8")) if out.is_file() else None
        except (yaml.YAMLError, UnicodeDecodeError):
            current = None  # not YAML or not UTF-8: it differs, and the message says how
        if current != yaml.safe_load(text):
            preset = experiment or default_experiment(conf) or "<preset>"
            typer.secho(f"{out} differs from the composition of {conf}/ with preset {preset}; "
                        f"run `aiayn params {preset}` to regenerate it (or `aiayn params "
                        "<preset> --check` to compare with another preset)",
                        fg=typer.colors.RED, err=True)
            raise typer.Exit(code=1)
        log.info("%s is up to date with %s/", out, conf)
        return
    write_text(out, text)
    log.info("wrote %s (%s)", out, experiment or "default experiment")
    advice = cpu_preset_advice(experiment)
    if advice:  # a warning where R-Drop's costlier step would cost this CPU its hour
        fits, line = advice
        (log.warning if not fits and costlier_than_advised(experiment) else log.info)("%s", line)
    if out.resolve() != conf.resolve().parent / "params.yaml":
        return  # not the params.yaml that `dvc exp run` composes
    if experiment and set_default_experiment(conf, experiment):
        log.info("%s/config.yaml: the default preset is now %s, so that `dvc exp run -S "
                 "key=value` builds on it (it composes conf/ anew)", conf, experiment)
    if overrides:
        log.warning("%s are in %s only: `dvc exp run` composes %s/ anew and drops them; "
                    "pass them to it with -S too, or put them in a preset",
                    " ".join(overrides), out, conf)


app = single_command_app(params, "Compose params.yaml from conf/.")

if __name__ == "__main__":
    app()
