"""Training-step throughput on CPU: the trainer's own step, side by side with its rivals.

Each contender (``fast``, ``plain``, ``main`` of ``--baseline REF``, an ``--arm``, any of
them on a C heap as ``NAME/ALLOC``, and ``matmul``, the machine's product rate) runs in a
worker process of its own; the workers take turns in alternating rounds on the same
batches of the ``--preset``. It prints each contender's target tokens/s, model GFLOP/s,
share of the matmul rate, wall and CPU seconds, page faults and memory per step, and the
ratios (medians of per-round ratios). The guide: bench/README.md, ``train_throughput.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import harness

# No aiayn import up here: a worker of contender main imports this module, then the aiayn of
# a baseline commit, which may lack what the newest one has.
REPO = harness.REPO

TRAINERS = {  # contender -> train.* overrides on top of the preset (model.*: under "model")
    "fast": {"kernels": "fast"},
    "plain": {"kernels": "plain"},
    "main": {},
}
OTHERS = ("matmul",)
DEFAULT = "fast,plain,matmul"
MATMULS = ((2048, 2048, 2048), (4096, 256, 1024))


# =========================================================================== workers


def _known_params(raw: dict, model) -> dict:
    """``raw`` without the keys a (possibly older) pydantic params schema does not know."""
    out = {}
    for key, value in raw.items():
        field = model.model_fields.get(key)
        if field is None:
            continue
        sub = field.annotation
        if isinstance(value, dict) and isinstance(sub, type) and hasattr(sub, "model_fields"):
            out[key] = _known_params(value, sub)
        else:
            out[key] = value
    return out


class TrainerWorker:
    """The Trainer of the aiayn this process imports (this checkout's, or the baseline
    tree's: see Worker), stepping through its own loader."""

    def __init__(self, spec: dict):
        import torch
        import yaml

        from aiayn.config import Params, parse_params
        try:
            from aiayn.training.checkpoint import file_sha256
        except ImportError:  # a baseline tree from before these modules were in aiayn.training
            from aiayn.checkpoint import file_sha256
        try:
            from aiayn.training.distributed import World
        except ImportError:  # as above: the flat layout
            from aiayn.distributed import World
        try:
            from aiayn.data.tokenizer import load_tokenizer
        except ImportError:  # a baseline tree from before aiayn.data: the flat layout
            from aiayn.tokenizer import load_tokenizer
        try:
            from aiayn.training.build import build_trainer as make_trainer
            from aiayn.training.loop import TrainPaths
        except ImportError:  # a baseline tree from before aiayn.training
            from aiayn.trainer import Trainer as make_trainer
            from aiayn.trainer import TrainPaths

        raw, train, model = with_settings(yaml.safe_load(Path(spec["params"]).read_text()),
                                          spec["train"])
        known = _known_params(raw, Params)
        dropped = sorted(f"{section}.{k}" for section in ("model", "train")
                         for k in set(raw[section]) - set(known[section]))
        asked = {f"train.{k}" for k in train} | {f"model.{k}" for k in model}
        if missing := sorted(asked & set(dropped)):
            raise SystemExit(f"{spec['name']}: this tree has no {missing[0]}")
        p = parse_params(known, spec["params"])
        run = Path(spec["scratch"]) / "".join(x if x.isalnum() else "_" for x in spec["name"])
        paths = TrainPaths(shards=Path(spec["shards"]), checkpoints=run / "checkpoints",
                           metrics=run / "train.json", train_log=run / "train_log.tsv",
                           valid_log=run / "valid_log.tsv")
        tok = Path(spec["tokenizer"])
        self.trainer = make_trainer(p, load_tokenizer(tok).get_vocab_size(), file_sha256(tok),
                                    paths, World(), progress=False)
        self.trainer.model.train()
        self.it = iter(self.trainer.loader)
        self.log_every = p.train.log_every
        # trees that defer the loss read (its name in older trees: _flush)
        self.flush = getattr(self.trainer, "flush", None) or getattr(self.trainer, "_flush",
                                                                        None)
        self.micro_batches = (getattr(self.trainer, "micro_batches", None)
                              or self.trainer._micro_batches)
        self.heap = getattr(self.trainer, "heap", None)
        self.torch = torch
        model = self.trainer.model
        spanned = model.output_vocab() if hasattr(model, "output_vocab") else None
        self.info = {"aiayn": str(Path(sys.modules["aiayn"].__file__).parent),
                     "dropped_params": dropped, "precision": p.train.precision,
                     "output_vocab": (model.cfg.vocab_size if spanned is None
                                      else int(spanned.ids.numel()))}

    def step(self) -> None:
        t = self.trainer
        t.train_step(self.micro_batches(self.it))
        if self.heap is not None:
            self.heap.after_step(t.state.step)
        if self.flush is not None and t.state.step % self.log_every == 0:
            self.flush()

    def extra(self) -> dict:
        try:
            from torch._dynamo.utils import counters
        except ImportError:
            return {}
        return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(counters["graph_break"].values()))}


class MatmulWorker:
    """Each 'step' is one product of each shape in MATMULS, in the dtype the trainers'
    matmuls run in (spec["matmul_dtype"]: float32 or bfloat16); reports GFLOP/s per shape."""

    def __init__(self, spec: dict):
        import torch

        self.torch = torch
        dtype = getattr(torch, spec.get("matmul_dtype", "float32"))
        self.ops = []
        for m, k, n in MATMULS:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            out = torch.empty(m, n, dtype=dtype)
            self.ops.append((f"{m}x{k}x{n}", a, b, out, 2.0 * m * k * n))
        self.seconds = {name: 0.0 for name, *_ in self.ops}
        self.products = 0
        self.info = {}

    def step(self) -> None:
        for name, a, b, out, _ in self.ops:
            t = time.perf_counter()
            for _ in range(4):
                self.torch.mm(a, b, out=out)
            self.seconds[name] += time.perf_counter() - t
        self.products += 4

    def extra(self) -> dict:
        rates = {name: self.products * flops / self.seconds[name] / 1e9
                 for name, *_, flops in self.ops}
        self.seconds = {name: 0.0 for name in self.seconds}
        self.products = 0
        return {"gflops": rates}


def timed_run(worker, n: int) -> dict:
    """``n`` steps of ``worker``: wall and CPU seconds, page faults, and the resident memory
    after them."""
    import resource

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        worker.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return {"wall": wall, "cpu": cpu, "faults": faults, "rss_mib": harness.rss_mib(),
            **worker.extra()}


def worker_main(spec: dict) -> None:
    """Serve 'run N' requests on stdin with one JSON line each on stdout."""
    harness.import_from_tree()
    import torch

    torch.set_num_threads(spec["threads"])
    name = spec["name"]
    worker = (MatmulWorker if name == "matmul" else TrainerWorker)(spec)
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever the code prints must not reach the protocol stream
    print(json.dumps({"ready": True, **worker.info}), file=out, flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit":
            break
        n = int(arg)
        if cmd == "profile":
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(n):
                    worker.step()
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                              max_name_column_width=55)
            # The same time by operator and input shapes: which copy or product it is.
            table += "\n" + prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=30,
                max_shapes_column_width=70)
            print(json.dumps({"profile": table}), file=out, flush=True)
            continue
        print(json.dumps(timed_run(worker, n)), file=out, flush=True)


class Worker:
    """The coordinator's handle on one worker process: this script with --worker, importing
    aiayn from ``tree`` (a baseline commit's, from harness.extract_tree) when given, else
    from this checkout."""

    def __init__(self, spec: dict, tree: Path | None = None, heap: str | None = None):
        from aiayn.training.memory import allocator_env, loaded_allocator

        self.name = spec["name"]
        env = harness.child_env(*[tree] if tree else [])
        self.proc = subprocess.Popen(
            harness.module_command("bench.train_throughput", "--worker", json.dumps(spec)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=allocator_env(heap, env) if heap else env, cwd=spec["scratch"])
        self.info = self._read()
        # the heap it runs on, read from its memory map (a baseline tree may not know how)
        self.info["allocator"] = loaded_allocator(self.proc.pid)
        if heap and self.info["allocator"] != heap:
            raise SystemExit(f"error: contender {self.name} runs on {self.info['allocator']}, "
                             f"not {heap}: LD_PRELOAD did not take")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"error: contender {self.name} died (see its messages above)")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


# =========================================================================== data and FLOPs


def with_settings(raw: dict, settings: dict) -> tuple[dict, dict, dict]:
    """(params ``raw`` with a contender's ``settings`` applied, its train.* settings, its
    model.* settings); ``raw`` itself is left as it was."""
    train = dict(settings)
    model = train.pop("model", {})
    raw = {**raw, "train": {**raw.get("train", {}), **train},
           "model": {**raw.get("model", {}), **model}}
    return raw, train, model


def check_arms(raw: dict, arms: dict[str, dict]) -> dict:
    """Each arm's params (``raw``, the composed preset, with the arm's settings), validated
    as the pipeline validates params.yaml: a misspelt key or a bad value stops the run here,
    before any data is made or any worker starts, naming the arm and the key."""
    from aiayn.config import ParamsError, parse_params

    checked = {}
    for name, spec in arms.items():
        try:
            checked[name] = parse_params(with_settings(raw, spec)[0], f"--arm {name}")
        except ParamsError as e:
            raise SystemExit(f"error: {e}") from None
    return checked


def split_allocator(name: str) -> tuple[str, str | None]:
    """``fast/tcmalloc`` -> ("fast", "tcmalloc"); ``fast`` -> ("fast", None). The heaps are
    glibc and this checkout's aiayn.training.memory.ALLOCATORS (imported here, not at the top: the
    module also runs under baseline trees, whose aiayn may have none)."""
    from aiayn.training.memory import ALLOCATORS

    heaps = ("glibc", *ALLOCATORS)
    core, slash, heap = name.partition("/")
    if not slash:
        return name, None
    if heap not in heaps:
        raise SystemExit(f"error: contender {name}: NAME/ALLOC needs ALLOC one of "
                         f"{', '.join(heaps)}, e.g. fast/tcmalloc")
    return core, heap


def parse_arm(text: str) -> tuple[str, dict]:
    """``ff512:model.d_ff=512,train.x=y`` -> ("ff512", {"kernels": "fast", "model":
    {"d_ff": 512}, "x": y}): a trainer contender's overrides (values parsed as YAML)."""
    import yaml

    name, colon, settings = text.partition(":")
    if not colon or not name or name in TRAINERS or name in OTHERS or "/" in name:
        raise SystemExit(f"error: --arm {text}: give NAME:KEY=VALUE,... with a new NAME, e.g. "
                         "ff512:model.d_ff=512")
    spec: dict = {"kernels": "fast", "model": {}}
    for item in filter(None, settings.split(",")):
        key, eq, value = item.partition("=")
        section, dot, field = key.partition(".")
        if not eq or not dot or section not in ("model", "train") or "." in field:
            raise SystemExit(f"error: --arm {text}: {item!r} is not model.KEY=VALUE or "
                             "train.KEY=VALUE")
        target = spec["model"] if section == "model" else spec
        target[field] = yaml.safe_load(value)
    return name, spec


def prepare_data(args, batch_tokens: int | None = None) -> tuple[Path, Path, Path]:
    """(params file, shards, tokenizer): given, or made once in the work folder; with
    ``batch_tokens``, the preset with steps of that many tokens, one micro-batch a step
    (training plans its batches from the same shards: no data stage re-runs), its params in
    a work folder of its own."""
    import yaml

    from stages.params import compose

    if batch_tokens is not None:
        _, shards, tokenizer = prepare_data(args)
        work = args.workdir / f"{args.preset}@{batch_tokens}"
        work.mkdir(parents=True, exist_ok=True)
        raw = yaml.safe_load(compose(REPO / "conf", args.preset, [
            *args.set, f"train.tokens_per_step={batch_tokens}", "train.max_tokens=0"]))
        params = work / "params.yaml"
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
        return params, shards, tokenizer
    work = args.workdir / args.preset
    params = work / "params.yaml"
    raw = yaml.safe_load(compose(REPO / "conf", args.preset, list(args.set)))
    if args.corpus is not None:  # the preset's corpus from its text files, not the hub
        raw["data"]["source"] = "local"
    if raw["data"]["source"] == "local":
        corpus = args.corpus or (REPO / raw["data"]["local"]["dir"]).resolve()
        if not Path(corpus).is_dir():
            raise SystemExit(f"error: the {args.preset} preset reads {corpus}, which is missing; "
                             "pass --corpus DIR (its files), --shards DIR, or --preset demo")
        raw["data"]["local"]["dir"] = str(Path(corpus).resolve())
    work.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(raw, sort_keys=False)
    if args.shards:
        params.write_text(text)
        return params, args.shards, args.tokenizer or args.shards.parent / "vocab/tokenizer.json"
    shards, tokenizer = work / "data/shards", work / "data/vocab/tokenizer.json"
    # The data stages re-run only when what they read changes (not for a model override).
    stamp = work / "data-params.yaml"
    data_text = yaml.safe_dump({k: raw.get(k) for k in ("seed", "data", "vocab", "survey",
                                                        "shard")}, sort_keys=False)
    params.write_text(text)
    if not (stamp.is_file() and stamp.read_text() == data_text and (shards / "train").is_dir()):
        stamp.unlink(missing_ok=True)
        (work / "metrics").mkdir(exist_ok=True)
        exe = Path(sys.executable).with_name("aiayn")
        for stage in ("download", "vocab", "survey", "shard"):
            print(f"data: aiayn {stage} (into {work})", flush=True)
            subprocess.run([str(exe) if exe.exists() else "aiayn", stage, "--params",
                            str(params)], cwd=work, check=True)
        stamp.write_text(data_text)
    return params, shards, tokenizer


def round_batches(params: Path, shards: Path, steps: int, skip: int) -> list[tuple]:
    """(source lengths, target lengths) of the batches of each step in [skip, skip+steps),
    in the trainers' order (one process; accumulation from the params)."""
    import numpy as np
    import yaml

    from aiayn.config import parse_params
    from aiayn.data.batching import plan_step
    from aiayn.data.sampler import ShardDataset, TokenBudgetSampler

    p = parse_params(yaml.safe_load(params.read_text()))
    plan = plan_step(p.train.tokens_per_step, 1, p.train.max_tokens)  # as the trainer's
    data = ShardDataset(shards / "train", max_tokens=plan.batch_tokens)
    accum = plan.accumulation
    sampler = TokenBudgetSampler(data.num_batches, seed=p.seed)
    out = []
    for i in range((skip + steps) * accum):
        index = next(sampler)
        if i >= skip * accum:
            b = data.batch(index)
            out.append((np.asarray((b.src != data.pad_id).sum(1)),
                        np.asarray((b.tgt_out != data.pad_id).sum(1)), b.tgt_tokens))
    return out


# =========================================================================== coordinator


def add_preset_options(ap: argparse.ArgumentParser) -> None:
    """The options of the data the trainers step through (shared with bench.train_memory)."""
    ap.add_argument("--preset", default="multi30k", help="conf/experiment preset (multi30k)")
    ap.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE",
                    help="override of the preset, as `dvc exp run -S` (repeatable)")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="the preset's corpus as text files in DIR, not from the hub")
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "aiayn-bench-train",
                    help="where the data stages write and workers keep scratch files")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--contenders", default=None,
                    help=f"comma-separated from {', '.join([*TRAINERS, *OTHERS])} and the "
                         f"arms, each with /ALLOC if wanted (default {DEFAULT}, plus main "
                         "with --baseline)")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="a contender NAME: fast with these model.*/train.* settings, e.g. "
                         "ff512:model.d_ff=512 (repeatable; name it in --contenders)")
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="git commit whose trainer runs as contender main")
    add_preset_options(ap)
    ap.add_argument("--precision", default=None, choices=("auto", "fp32", "bf16"),
                    help="train.precision for every contender (default: the preset's)")
    ap.add_argument("--shards", type=Path, default=None, help="use these shards (train/valid)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="their tokenizer.json")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (default 12)")
    ap.add_argument("--steps", type=int, default=2,
                    help="steps per contender per round (default 2)")
    ap.add_argument("--warmup", type=int, default=4,
                    help="warm-up steps per contender (default 4)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads in every worker (default: torch's)")
    ap.add_argument("--profile", default=None, metavar="CONTENDER",
                    help="also print torch.profiler tables of 3 steps of this contender")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "rounds", "steps", "threads")
    return args


@dataclass
class Contenders:
    """The contenders of a run: ``names`` in the order given, each one's name without
    /ALLOC (``core``: a trainer, an arm or matmul) and its C heap (``heap``; None: this
    process's), the trainer settings by name (``trainers``: TRAINERS and the arms), and
    each arm's params."""

    names: list[str]
    core: dict[str, str]
    heap: dict[str, str | None]
    trainers: dict[str, dict]
    arms: dict[str, dict]
    arm_params: dict


def choose_contenders(args) -> Contenders:
    """--contenders, --arm and --profile read and checked, before any data is made."""
    import yaml

    from aiayn.training.memory import allocator_library, install_hint
    from stages.params import compose

    names = (args.contenders or DEFAULT + (",main" if args.baseline else "")).split(",")
    arms = dict(parse_arm(a) for a in args.arm)
    trainers = {**TRAINERS, **arms}
    arm_params = check_arms(yaml.safe_load(compose(REPO / "conf", args.preset, list(args.set))),
                            arms)
    if args.profile and args.profile not in names:
        names.append(args.profile)
    if len(set(names)) != len(names):
        raise SystemExit(f"error: --contenders {','.join(names)}: name each contender once")
    core = {n: split_allocator(n)[0] for n in names}
    heap = {n: split_allocator(n)[1] for n in names}
    unknown = [n for n in names if core[n] not in trainers and core[n] not in OTHERS]
    if unknown:
        raise SystemExit(f"error: unknown contender(s) {', '.join(unknown)}; choose from "
                         f"{', '.join([*trainers, *OTHERS])}")
    if "main" in core.values() and not args.baseline:
        raise SystemExit("error: contender main needs --baseline REF")
    if any(core[n] == "matmul" != n for n in names):
        raise SystemExit("error: contender matmul measures the products, not a heap: no /ALLOC")
    for n in names:
        if heap[n] not in (None, "glibc") and allocator_library(heap[n]) is None:
            raise SystemExit(f"error: contender {n}: no {heap[n]} library here (e.g. "
                             f"{install_hint(heap[n])})")
    return Contenders(names, core, heap, trainers, arms, arm_params)


def prepare(args) -> tuple[Path, Path, Path]:
    """(params file, shards, tokenizer) of the run, --precision written into the params."""
    import yaml

    params, shards, tokenizer = prepare_data(args)
    if args.precision:
        raw = yaml.safe_load(params.read_text())
        raw["train"]["precision"] = args.precision
        params = params.with_name(f"params-{args.precision}.yaml")
        params.write_text(yaml.safe_dump(raw, sort_keys=False))
    return params, shards, tokenizer


def start_workers(args, c: Contenders, data: tuple, scratch: Path, threads: int,
                  matmul_dtype: str, workers: dict[str, Worker]) -> None:
    """One worker per contender (contender main's on the baseline commit's tree), each
    added to ``workers`` as it starts, so that the caller closes whatever started."""
    tree = (harness.extract_tree(args.baseline, scratch / "baseline")
            if "main" in c.core.values() else None)
    params, shards, tokenizer = data
    for n in c.names:
        spec = {"name": n, "params": str(params), "shards": str(shards),
                "tokenizer": str(tokenizer), "scratch": str(scratch), "threads": threads,
                "matmul_dtype": matmul_dtype, "train": c.trainers.get(c.core[n], {})}
        workers[n] = Worker(spec, tree if c.core[n] == "main" else None, c.heap[n])
        if c.core[n] == "main":
            print(f"{n}: {workers[n].info['aiayn']} (git {args.baseline}); params it does "
                  f"not know, dropped: {', '.join(workers[n].info['dropped_params']) or '-'}")


def round_line(replies: dict[str, dict], tokens: int) -> str:
    """A round's progress line: each trainer's target tokens/s (the round's ``tokens`` over
    its reply's wall seconds), the matmul rate, and each worker's resident memory."""
    line = "target tok/s: " + "  ".join(f"{n} {tokens / x['wall']:.0f}"
                                        for n, x in replies.items() if n != "matmul")
    if "matmul" in replies:
        line += "  matmul " + "/".join(f"{v:.0f}" for v in
                                       replies["matmul"]["gflops"].values()) + " GFLOP/s"
    rss = [f"{n} {x['rss_mib']:.0f}" for n, x in replies.items() if x.get("rss_mib") is not None]
    return line + ("  | RSS MiB: " + "  ".join(rss) if rss else "")


def run_rounds(args, c: Contenders, workers: dict[str, Worker], params: Path, shards: Path,
               cfg, cfgs: dict) -> dict:
    """Warm-up, then --rounds alternating rounds of --steps steps per contender; each
    round's batches counted (tokens, and FLOPs per softmax width and per arm's shape)."""
    from bench.flops import train_flops

    for n, w in workers.items():  # warm-up: allocator, kernels, Adam state, compilation
        t = time.perf_counter()
        w.ask(f"run {args.warmup}")
        print(f"warm-up {n}: {time.perf_counter() - t:.0f} s", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in c.names}
    tokens, flops = [], []  # the round's target tokens and model FLOPs (whole vocabulary)
    # the softmax's width per contender (model.output_vocab), each width's FLOPs per round
    spans = {n: int(w.info.get("output_vocab") or cfg.vocab_size) for n, w in workers.items()}
    span_flops: dict[int, list[float]] = {k: [] for k in sorted(set(spans.values()))}
    own_flops = {n: [] for n in cfgs}  # an arm's FLOPs, on its own shape
    for r, order in harness.rounds(c.names, args.rounds):
        batches = round_batches(params, shards, args.steps, args.warmup + r * args.steps)
        for k, x in span_flops.items():
            x.append(sum(train_flops(cfg, s, t, k) for s, t, _ in batches))
        tokens.append(sum(n for *_, n in batches))
        flops.append(sum(train_flops(cfg, s, t) for s, t, _ in batches))
        for n, x in own_flops.items():
            x.append(sum(train_flops(cfgs[n], s, t, spans[n]) for s, t, _ in batches))
        for n in order:
            runs[n].append(workers[n].ask(f"run {args.steps}"))
        print(f"round {r + 1}/{args.rounds} "
              + round_line({n: runs[n][-1] for n in c.names}, tokens[r]), flush=True)
    # each contender's FLOPs per round: an arm's on its own shape, the others' on the preset's
    n_flops = {n: own_flops[n] if n in cfgs else span_flops[spans[n]]
               for n in c.names if n != "matmul"}
    return {"runs": runs, "tokens": tokens, "flops": flops, "n_flops": n_flops, "spans": spans,
            "heaps": {n: w.info["allocator"] for n, w in workers.items()}}


# the pairs whose ratio is printed when both ran
PAIRS = (("fast", "main"), ("fast", "plain"), ("plain", "main"))


def ratio_pairs(c: Contenders, measured: list[str]) -> list[tuple[str, str]]:
    """The (numerator, denominator) pairs whose ratio is printed, of the ``measured``
    contenders: PAIRS, whatever heap each side ran on; the same contender on two heaps, in
    the order given; each arm against fast."""
    pairs = [(n, m) for a, b in PAIRS for n in measured for m in measured
             if c.core[n] == a and c.core[m] == b]
    pairs += [(n, m) for i, n in enumerate(measured) for m in measured[i + 1:]
              if c.core[n] == c.core[m]]
    pairs += [(n, "fast") for n in measured if c.core[n] in c.arms and "fast" in measured]
    return list(dict.fromkeys(pairs))


def summarise(args, c: Contenders, measured: dict) -> tuple[dict, dict | None, dict, dict]:
    """(results per contender, the matmul rates or None, ratios of tokens/s, tokens/s per
    round): medians over rounds, ratios medians of per-round ratios."""
    med = statistics.median
    runs, tokens, n_flops, spans = (measured[k] for k in ("runs", "tokens", "n_flops", "spans"))
    results, tps = {}, {}
    for n in c.names:
        if n == "matmul":
            continue
        tps[n] = [tokens[r] / x["wall"] for r, x in enumerate(runs[n])]
        results[n] = {"tokens_per_s": med(tps[n]), "output_vocab": spans[n],
                      "gflop_per_s": med(n_flops[n][r] / x["wall"] / 1e9
                                         for r, x in enumerate(runs[n])),
                      "wall_s_per_step": med(x["wall"] for x in runs[n]) / args.steps,
                      "cpu_s_per_step": med(x["cpu"] for x in runs[n]) / args.steps,
                      "page_faults_per_step": med(x["faults"] for x in runs[n]) / args.steps,
                      "tokens_per_s_rounds": tps[n],
                      "allocator": measured["heaps"][n],
                      "rss_mib_rounds": [x.get("rss_mib") for x in runs[n]],
                      **{k: runs[n][-1][k] for k in ("graphs", "graph_breaks")
                         if k in runs[n][-1]}}
    matmul = None
    if "matmul" in c.names:
        per_round = [statistics.fmean(x["gflops"].values()) for x in runs["matmul"]]
        matmul = {"gflop_per_s": med(per_round), "rounds": per_round,
                  "shapes": {k: med(x["gflops"][k] for x in runs["matmul"])
                             for k in runs["matmul"][0]["gflops"]}}
        for n, res in results.items():
            res["matmul_fraction"] = med(n_flops[n][r] / x["wall"] / 1e9 / per_round[r]
                                         for r, x in enumerate(runs[n]))
    ratios = {f"{a} / {b}": harness.ratio(tps[a], tps[b]).median
              for a, b in ratio_pairs(c, list(tps))}
    return results, matmul, ratios, tps


def print_report(args, c: Contenders, p, cfg, measured: dict, summary: tuple,
                 matmul_dtype: str, minutes: float) -> None:
    results, matmul, ratios, tps = summary
    tokens, flops, spans = measured["tokens"], measured["flops"], measured["spans"]
    width = max(len(n) for n in c.names) + 2
    print(f"\n{minutes:.1f} min")
    print(f"batches of <= {p.shard.max_tokens} tokens: "
          f"{statistics.fmean(tokens) / args.steps:.0f} non-pad target tokens and "
          f"{statistics.fmean(flops) / args.steps / 1e9:.1f} GFLOP (model FLOPs) per step")
    if any(k != cfg.vocab_size for k in spans.values()):
        print("softmax over the target side's tokens only (model.output_vocab: target), its "
              "FLOPs counted at that width: " + ", ".join(
                  f"{n} {spans[n]}" for n in c.names if spans[n] != cfg.vocab_size)
              + f" of {cfg.vocab_size} tokens")
    print("C heap of each worker: " + ", ".join(f"{n} {measured['heaps'][n]}"
                                                for n in c.names if n != "matmul"))
    head = f"{'contender':<{width}}{'target tok/s':>13}{'GFLOP/s':>9}"
    head += f"{'of matmul':>11}" if matmul else ""
    print(head + f"{'wall s/step':>13}{'CPU s/step':>12}{'faults/step':>13}"
          f"{'tok/s over rounds':>22}{'RSS MiB':>9}")
    for n, res in results.items():
        line = f"{n:<{width}}{res['tokens_per_s']:>13.0f}{res['gflop_per_s']:>9.1f}"
        line += f"{res['matmul_fraction']:>10.0%} " if matmul else ""
        line += (f"{res['wall_s_per_step']:>13.2f}{res['cpu_s_per_step']:>12.2f}"
                 f"{res['page_faults_per_step']:>13.0f}"
                 f"{min(tps[n]):>13.0f} .. {max(tps[n]):<5.0f}")
        rss = res["rss_mib_rounds"][-1]  # after the last round
        line += f"{rss:>9.0f}" if rss is not None else f"{'-':>9}"
        if res.get("graphs"):
            line += f"   compiled graphs {res['graphs']}, graph breaks {res['graph_breaks']}"
        print(line)
    if matmul:
        shapes = ", ".join(f"{k} {v:.0f}" for k, v in matmul["shapes"].items())
        kind = "bf16" if matmul_dtype == "bfloat16" else "fp32"
        print(f"{'matmul':<{width}}{'':>13}{matmul['gflop_per_s']:>9.1f}   ({kind} products: "
              f"{shapes} GFLOP/s)")
    if ratios:
        print("\nratios of target tokens/s (median over rounds of the per-round ratio):")
        for k, v in ratios.items():
            print(f"  {k:<{2 * width + 3}}{v:6.2f}x")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return {}
    import torch
    import yaml

    from aiayn.config import parse_params
    from aiayn.data.tokenizer import load_tokenizer
    from aiayn.precision import autocast_dtype
    from aiayn.training.build import model_config

    c = choose_contenders(args)
    threads = args.threads or torch.get_num_threads()
    params, shards, tokenizer = data = prepare(args)
    p = parse_params(yaml.safe_load(params.read_text()))
    vocab = load_tokenizer(tokenizer).get_vocab_size()
    cfg = model_config(p, vocab)
    # an arm's own model (its FLOPs); every other contender computes the preset's
    cfgs = {n: model_config(c.arm_params[c.core[n]], vocab) for n in c.names
            if c.core[n] in c.arms}
    amp = autocast_dtype(p.train.precision, torch.device("cpu"))
    matmul_dtype = "bfloat16" if amp == torch.bfloat16 else "float32"
    facts = {**harness.machine_facts(), "threads": threads}  # the workers' threads
    info = {**{k: facts[k] for k in ("cpu", "native_bf16", "logical_cpus", "cpu_capability",
                                     "instruction_caps", "threads", "torch", "python")},
            "preset": args.preset, "overrides": list(args.set), "arms": c.arms,
            "precision": p.train.precision, "matmul_dtype": matmul_dtype,
            "model": cfg.to_dict(),
            "contenders": c.names, "baseline": args.baseline, "rounds": args.rounds,
            "steps": args.steps, "warmup": args.warmup,
            "command": harness.command_line("bench.train_throughput", argv),
            "load_average": os.getloadavg()}
    print(f"{harness.machine_line(facts)}; load average "
          + " ".join(f"{x:.1f}" for x in info["load_average"]))
    overrides = "".join(f" -S {o}" for o in args.set)
    print(f"preset {args.preset}{overrides}: d_model {cfg.d_model}, {cfg.encoder_layers}+"
          f"{cfg.decoder_layers} layers, d_ff {cfg.d_ff}, {cfg.heads} heads, vocabulary "
          f"{cfg.vocab_size}, dropout {cfg.dropout}, batches <= {p.shard.max_tokens} tokens, "
          f"precision {p.train.precision}")

    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    workers: dict[str, Worker] = {}
    try:
        t0 = time.perf_counter()
        start_workers(args, c, data, scratch, threads, matmul_dtype, workers)
        measured = run_rounds(args, c, workers, params, shards, cfg, cfgs)
        minutes = (time.perf_counter() - t0) / 60
        if args.profile:  # after the timed rounds, so that every contender saw the same batches
            print(f"\n=== profile: {args.profile}, 3 steps ===")
            print(workers[args.profile].ask("profile 3")["profile"])
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(scratch, ignore_errors=True)

    summary = summarise(args, c, measured)
    print_report(args, c, p, cfg, measured, summary, matmul_dtype, minutes)
    results, matmul, ratios, _ = summary
    out = {"info": info, "results": results, "matmul": matmul, "ratios": ratios,
           "round_tokens": measured["tokens"], "round_flops": measured["flops"],
           "runs": measured["runs"]}
    if args.json:
        print()
    return harness.save(out, args.json, argv, facts)


if __name__ == "__main__":
    main()
