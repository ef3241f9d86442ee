"""dvc.yaml's code dependencies: every module of the project that a stage's command imports,
directly or through another module, is a dependency of that stage, or is named below as one
that cannot change the stage's outputs.

Why each stage and not only the first that uses a module: DVC re-runs a stage when its own
dependencies change. The data stages are deterministic, so a change to, say, the tokenizer's
encoding re-runs `vocab`, which writes the same tokenizer.json, and `survey` (which encodes
with that code) would not re-run: its ids would be stale. The imports are read from the
source (``ast``), so a new module is caught the day a stage first imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aiayn.fast import extension
from tests.conftest import REPO, dvc_stages

# Modules a stage may import without listing them: none of them changes what a stage
# writes into data/ or the numbers in metrics/.
NOT_RESULTS = {
    "aiayn/config.py": "the params schema: every value a stage reads is in params.yaml, "
                       "tracked key by key under `params:`; every stage re-running on each "
                       "new knob would defeat the cache",
    "aiayn/errors.py": "exception classes",
    "aiayn/io.py": "atomic writes, free-space checks, JSON reading",
    "aiayn/tracking.py": "MLflow logging",
    "aiayn/plots.py": "the training curves' picture (drawn from the logs; no reason to train "
                      "again)",
    "aiayn/data/toy.py": "the toy corpus's generator: its text reaches later stages only through "
                    "data/raw (a dependency of `download`, which runs it)",
    "stages/common.py": "logging, the stage wrapper, reading params.yaml",
    "stages/params.py": "the composition of params.yaml; `train` reads it only to name its "
                        "MLflow run after the preset",
}
PACKAGES = ("aiayn", "stages")


def imported_modules(path: Path) -> set[Path]:
    """The project's modules that ``path`` imports anywhere in its text (function-level
    imports included), as files."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES:
                for candidate in (REPO / (name.replace(".", "/") + ".py"),
                                  REPO / name.replace(".", "/") / "__init__.py"):
                    if candidate.is_file():
                        found.add(candidate)
    return found


def import_closure(start: Path) -> set[str]:
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_modules(path))
    return {str(p.relative_to(REPO)) for p in seen if p.name != "__init__.py"}


def code_of(cmd: str | list[str]) -> set[str]:
    """The files a stage's command(s) run: ``aiayn <stage> ...`` is stages/<stage>.py and
    what it imports; the fast kernels' extension builds its C++ source when it runs."""
    code = set()
    for line in [cmd] if isinstance(cmd, str) else cmd:
        program, command, *_ = line.split()
        assert program == "aiayn", line
        code |= import_closure(REPO / "stages" / f"{command}.py")
    if "aiayn/fast/extension.py" in code:
        code.add(str(extension.SOURCE.relative_to(REPO)))
    return code


def test_the_closure_follows_imports_inside_functions_and_through_other_modules():
    """The reader against what the train stage is known to need: the trainer (imported inside
    the command's function), the model (through the trainer) and the kernels' C++ source."""
    code = code_of("aiayn train")
    assert {"stages/train.py", "aiayn/training/loop.py", "aiayn/model.py",
            str(extension.SOURCE.relative_to(REPO))} <= code
    assert "aiayn/export/convert.py" not in code  # nothing in training imports the exporter


@pytest.mark.parametrize("name", sorted(dvc_stages()))
def test_a_stage_depends_on_every_module_that_can_change_its_outputs(name):
    file, stage = dvc_stages()[name]
    deps = set(stage.get("deps", []))
    missing = sorted(code_of(stage["cmd"]) - deps - NOT_RESULTS.keys())
    assert not missing, (f"{file}: stage {name} runs {missing} but does not list them under "
                         f"`deps:`: a change there would leave its outputs stale. Add them to "
                         f"its deps, or, if they cannot change what it writes, to NOT_RESULTS "
                         f"in {Path(__file__).name} with the reason.")
    for dep in deps:  # and no dependency names a file that is not there
        assert (REPO / dep).exists() or dep.startswith(("data/", "metrics/")), (name, dep)
