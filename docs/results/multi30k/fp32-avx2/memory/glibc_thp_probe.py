"""Ad hoc probe: glibc's malloc with THP (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) against the
trainer's glibc + trim and tcmalloc, 100 steps each, one process per mode."""
import json, subprocess, sys
sys.path.insert(0, "/work/main")
from bench import harness
from bench import train_memory as tm
from aiayn.memory import allocator_env

args = tm.parse_args(["--corpus", "/work/shared/data/multi30k", "--modes", "trim,notrim",
                      "--steps", sys.argv[1]])
spec = tm.prepare(args)
print(harness.machine_line(), flush=True)
plan = [("trim", {}, "trim"), ("notrim", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "notrim+thp"),
        ("trim", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "trim+thp"), ("tcmalloc", {}, "tcmalloc")]
runs = []
for rep in range(int(sys.argv[2])):
    for mode, extra, label in plan:
        env = harness.child_env()
        env.update(extra)
        if mode == "tcmalloc":
            env = allocator_env(mode, env)
        print(label, "...", flush=True)
        res = subprocess.run(harness.module_command("bench.train_memory", "--worker", mode, "--steps",
                             str(args.steps), "--spec", json.dumps(spec)), capture_output=True, text=True,
                             env=env, cwd="/work/main")
        if res.returncode:
            sys.exit(res.stderr)
        run = json.loads(res.stdout.strip().splitlines()[-1]); run["mode"] = label
        runs.append(run)
tm.report(runs, args.warmup, args.steps)
json.dump(runs, open(f"/tmp/thp/runs_{sys.argv[1]}.json", "w"))
