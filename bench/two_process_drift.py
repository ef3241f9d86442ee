"""Do identical multi-process training runs stay identical? Where does one first part?

Usage (from the repository root)::

    .venv/bin/python -m bench.two_process_drift                      # 20 runs of 240 steps
    .venv/bin/python -m bench.two_process_drift --runs 30 --env AIAYN_CPU_EXTENSION=0
    .venv/bin/python -m bench.two_process_drift --set model.norm=pre --steps 120
    .venv/bin/python -m bench.two_process_drift --help

Runs the train stage under ``torchrun --standalone --nproc-per-node N`` (gloo on CPU,
``OMP_NUM_THREADS=1`` as the cluster tests run it) ``--runs`` times from the same seed, on
the demo preset at the tests' toy size (its data stages run once into ``--workdir``). Each
process records a digest (MD5 of the bytes) of, at every step: its batch's tensors, its
loss, each parameter's gradient as backward left it (before DDP's all-reduce), each
parameter's reduced gradient, and each parameter after the optimizer's step. Every run is
compared with the first; the first record in which one differs says where it parted:

- ``input``: the batch (the data path);
- ``loss``: the forward pass, on the same batch and weights;
- ``local``: the backward pass, after an identical forward;
- ``reduced``: the all-reduce, after identical local gradients;
- ``param``: the optimizer, after identical gradients.

With ``--kernels``, every call into the C++ CPU kernels (aiayn/csrc/cpu_kernels.cpp) is
recorded too, in the order of the calls: ``kernel-in`` (each tensor argument before the
call) and ``kernel-out`` (each tensor returned, and each tensor argument again after it, for
the kernels that write in place). A run that parts at a ``kernel-out`` after identical
``kernel-in`` records gave one kernel call the same inputs and got different outputs; one
that parts at a ``kernel-in`` was handed different inputs by PyTorch's own ops in between.

The cluster tests (tests/test_cluster.py) compare such runs bit for bit; a drift seen here
makes them fail at random. The printed table and ``--json`` name the machine.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench import harness

# The demo preset at the size of the tests' toy workspace (tests/conftest.py, TINY_PARAMS):
# a run of 240 steps takes ~15 s per process pair on 2 cores.
TOY = ["data.toy.train_pairs=400", "data.toy.valid_pairs=40", "data.toy.test_pairs=40",
       "data.toy.max_words=12", "vocab.vocab_size=400", "vocab.min_frequency=2",
       "shard.max_tokens=160", "shard.max_len=48", "model.d_model=32", "model.heads=4",
       "model.encoder_layers=1", "model.decoder_layers=1", "model.d_ff=64",
       "model.dropout=0.1", "model.max_positions=64", "train.tokens_per_step=320",
       "train.warmup_steps=4", "train.lr_scale=1.0", "train.checkpoint_every_minutes=0"]
KINDS = ("input", "loss", "local", "reduced", "param")  # recorded in every run
KERNEL_KINDS = ("kernel-in", "kernel-out")  # and these with --kernels
WORKER = "worker"  # argv[1] of a process that torchrun starts


@dataclass(frozen=True)
class Record:
    """One digest: at ``step`` (1-based), on ``rank``, of ``kind`` (KINDS, KERNEL_KINDS)
    ``name``."""
    step: int
    rank: int
    kind: str
    name: str
    digest: str

    def where(self) -> str:
        return f"step {self.step}, rank {self.rank}: {self.kind} {self.name}"


def digest(tensor) -> str:
    """The MD5 of a tensor's bytes (first 12 hex digits): equal iff bit for bit equal. Any
    dtype, bf16 included (its bytes, not a NumPy array of it, which NumPy cannot hold)."""
    import torch

    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.md5(raw.numpy().tobytes()).hexdigest()[:12]


def read_records(path: Path) -> list[Record]:
    """A worker's records, in the order it wrote them."""
    out = []
    for line in path.read_text().splitlines():
        step, rank, kind, name, value = line.split("\t")
        out.append(Record(int(step), int(rank), kind, name, value))
    return out


def first_parting(a: list[Record], b: list[Record]) -> Record | None:
    """The first of ``b``'s records that differs from ``a``'s at the same place (or that
    ``a`` lacks), as ``b`` has it; None where ``b`` is ``a``, record for record."""
    for x, y in zip(a, b, strict=False):
        if x != y:
            return y
    if len(a) != len(b):
        longer = a if len(a) > len(b) else b
        return longer[min(len(a), len(b))]
    return None


def earliest(partings: list[Record]) -> Record | None:
    """Of the ranks' first partings, the one at the earliest step (then the lowest rank)."""
    return min(partings, key=lambda r: (r.step, r.rank), default=None)


# =========================================================================== the worker


def worker(argv: list[str]) -> None:
    """Under torchrun: the train stage with ``argv``, recording digests into the file named
    by $AIAYN_DRIFT_RECORDS, one per rank (suffix ``.RANK``)."""
    import torch

    import aiayn.trainer as trainer_module

    rank = int(os.environ.get("RANK", "0"))
    out = open(f"{os.environ['AIAYN_DRIFT_RECORDS']}.{rank}", "w", buffering=1)  # noqa: SIM115
    now = {"step": 0}

    def write(kind: str, name: str, tensor: torch.Tensor) -> None:
        out.write(f"{now['step']}\t{rank}\t{kind}\t{name}\t{digest(tensor)}\n")

    forward_loss = trainer_module.Trainer._forward_loss
    train_step = trainer_module.Trainer.train_step

    def recorded_forward_loss(self, batch):
        for key, value in vars(batch).items():
            if isinstance(value, torch.Tensor):
                write("input", key, value)
        result = forward_loss(self, batch)
        write("loss", "loss", result[0])
        return result

    def recorded_train_step(self, batches):
        if not getattr(self, "_drift_hooked", False):
            self._drift_hooked = True
            named = list(self.model.named_parameters())
            for name, p in named:  # after accumulation, before DDP's hook copies it out
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: write("local", name, p.grad))
            step = self.optimizer.step

            def recorded_step(*args, **kwargs):
                for name, p in named:
                    if p.grad is not None:
                        write("reduced", name, p.grad)
                result = step(*args, **kwargs)
                for name, p in named:
                    write("param", name, p)
                return result

            self.optimizer.step = recorded_step
        now["step"] = self.state.step + 1
        return train_step(self, batches)

    if os.environ.get("AIAYN_DRIFT_KERNELS") == "1":
        record_kernels(write)
    trainer_module.Trainer._forward_loss = recorded_forward_loss
    trainer_module.Trainer.train_step = recorded_train_step
    sys.argv = ["stages.train", *argv]
    try:
        runpy.run_module("stages.train", run_name="__main__")
    finally:
        out.close()


def record_kernels(write) -> None:
    """Wrap the C++ extension's functions so that each call writes its tensor arguments
    (``kernel-in``) and, after it, its results and its arguments again (``kernel-out``)."""
    import torch

    from aiayn import kernels

    module = kernels.cpu_extension()
    if module is None:
        raise SystemExit("error: --kernels needs the C++ extension, which did not build "
                         f"(or {kernels.EXTENSION_ENV}=0)")
    calls = {"n": 0}
    # arguments that a kernel only writes (their contents before the call are garbage)
    written = {"label_smoothed_softmax_": {3, 4}, "attention_backward": {12, 13, 14}}

    def wrapped(name, fn):
        def call(*args):
            calls["n"] += 1
            tag = f"{name}#{calls['n']}"
            tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            for i, a in tensors:
                if i not in written.get(name, ()):
                    write("kernel-in", f"{tag}.arg{i}", a)
            result = fn(*args)
            for i, r in enumerate(result if isinstance(result, (list, tuple)) else [result]):
                if isinstance(r, torch.Tensor):
                    write("kernel-out", f"{tag}.result{i}", r)
            for i, a in tensors:
                write("kernel-out", f"{tag}.arg{i}", a)
            return result
        return call

    class Recorded:
        def __getattr__(self, name):
            return wrapped(name, getattr(module, name))

    kernels._extension = Recorded()


# =========================================================================== the runs


def one_run(run: Path, nproc: int, env: dict, args: list[str]) -> dict[int, list[Record]]:
    """One torchrun of the recorded train stage into ``run``: each rank's records."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "bench.two_process_drift", WORKER, *args]
    with (run / "torchrun.log").open("w") as log:
        done = subprocess.run(cmd, env={**env, "AIAYN_DRIFT_RECORDS": str(run / "records")},
                              stdout=log, stderr=subprocess.STDOUT, cwd=harness.REPO)
    if done.returncode != 0:
        tail = (run / "torchrun.log").read_text()[-3000:]
        raise SystemExit(f"error: the run in {run} failed (exit {done.returncode}):\n{tail}")
    return {r: read_records(run / f"records.{r}") for r in range(nproc)}


def parse_env(parser: argparse.ArgumentParser, items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--env {item!r}: give NAME=VALUE, e.g. AIAYN_CPU_EXTENSION=0")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__doc__, epilog=True)
    ap.add_argument("--runs", type=int, default=20, help="runs, each compared with the first "
                    "(default 20)")
    ap.add_argument("--steps", type=int, default=240, help="steps per run (default 240, the "
                    "cluster tests')")
    ap.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in every run's environment, e.g. AIAYN_CPU_EXTENSION=0 "
                    "(repeatable)")
    ap.add_argument("--kernels", action="store_true",
                    help="also record every C++ kernel call's inputs and outputs "
                    "(kernel-in, kernel-out), to name the call where a run first parts")
    ap.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE",
                    help="Hydra override of the toy-sized demo preset (repeatable)")
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "aiayn-bench-drift")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "runs", "steps", "nproc")
    extra_env = parse_env(ap, args.env)

    from bench.train_throughput import prepare_data

    data = argparse.Namespace(
        preset="demo", workdir=args.workdir, corpus=None, shards=None, tokenizer=None,
        set=[*TOY, f"train.steps={args.steps}", f"train.log_every={min(20, args.steps)}",
             f"train.valid_every={args.steps}", f"train.checkpoint_every_steps={args.steps}",
             *args.set])
    params, shards, tokenizer = prepare_data(data)
    raw = shards.parent / "raw"
    env = {**harness.child_env(), "OMP_NUM_THREADS": "1", **extra_env,
           **({"AIAYN_DRIFT_KERNELS": "1"} if args.kernels else {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    print(harness.machine_line())
    print(f"{args.runs} runs of {args.steps} steps, {args.nproc} processes, the toy-sized demo "
          f"preset{' with ' + ' '.join(args.set) if args.set else ''}"
          f"{'; env ' + ' '.join(args.env) if args.env else ''}", flush=True)
    runs_dir = Path(tempfile.mkdtemp(prefix="runs-", dir=args.workdir))
    rows = []
    try:
        first = None
        for i in range(1, args.runs + 1):
            run = runs_dir / f"run{i}"
            records = one_run(run, args.nproc, env,
                              harness.train_stage_args(params, run, shards=shards,
                                                       tokenizer=tokenizer, raw=raw))
            if first is None:
                first = records
                steps = max((r.step for r in records[0]), default=0)
                print(f"run 1: the reference ({sum(map(len, records.values()))} records, "
                      f"{steps} steps)", flush=True)
                continue
            parted = earliest([p for rank in first if (p := first_parting(
                first[rank], records.get(rank, []))) is not None])
            rows.append({"run": i, "parted": parted is not None,
                         **({"step": parted.step, "rank": parted.rank, "kind": parted.kind,
                             "name": parted.name} if parted else {})})
            print(f"run {i}: " + (f"parts at {parted.where()}" if parted else "the same"),
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(runs_dir, ignore_errors=True)
    parted_runs = [r for r in rows if r["parted"]]
    print(f"{len(parted_runs)} of {len(rows)} runs parted from run 1")
    return harness.save({"runs": args.runs, "steps": args.steps, "nproc": args.nproc,
                         "kernels": args.kernels,
                         "env": extra_env, "set": args.set, "compared": rows,
                         "parted": len(parted_runs)}, args.json)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER:
        worker(sys.argv[2:])
    else:
        main()
