"""Ad hoc probe (2026-12-02, the record glibc_thp_probe_runs.json): glibc's malloc on
transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) against the trainer's glibc
with its trim and against tcmalloc, one worker process of bench.train_memory per mode.

Run from the repository root: ``python docs/results/multi30k/fp32-avx2/memory/glibc_thp_probe.py
STEPS ROUNDS [OUT.json]`` (it ran as ``100 1``; tcmalloc must be installed). Reformatted after
the run to pass the linter, with the paths made relative; what it measures is unchanged.
"""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO))

from aiayn.memory import allocator_env  # noqa: E402
from bench import harness  # noqa: E402
from bench import train_memory as tm  # noqa: E402

HUGE = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
PLAN = [("trim", {}, "trim"), ("notrim", HUGE, "notrim+thp"), ("trim", HUGE, "trim+thp"),
        ("tcmalloc", {}, "tcmalloc")]


def main() -> None:
    steps, rounds = sys.argv[1], int(sys.argv[2])
    out = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(f"glibc_thp_probe_{steps}.json")
    args = tm.parse_args(["--corpus", str(REPO.parent / "shared/data/multi30k"),
                          "--modes", "trim,notrim", "--steps", steps])
    spec = tm.prepare(args)
    print(harness.machine_line(), flush=True)
    runs = []
    for _ in range(rounds):
        for mode, extra, label in PLAN:
            env = {**harness.child_env(), **extra}
            if mode == "tcmalloc":
                env = allocator_env(mode, env)
            print(label, "...", flush=True)
            res = subprocess.run(
                harness.module_command("bench.train_memory", "--worker", mode, "--steps",
                                       str(args.steps), "--spec", json.dumps(spec)),
                capture_output=True, text=True, env=env, cwd=REPO)
            if res.returncode:
                sys.exit(res.stderr)
            run = json.loads(res.stdout.strip().splitlines()[-1])
            run["mode"] = label
            runs.append(run)
    tm.report(runs, args.warmup, args.steps)
    out.write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
