"""Training-step throughput on CPU: the trainer's own step, side by side with its rivals.

Usage (from the repository root)::

    .venv/bin/python -m bench.train_throughput --baseline 9852772        # fast, plain, main
    .venv/bin/python -m bench.train_throughput --contenders fast,fast+compile --rounds 3
    .venv/bin/python -m bench.train_throughput --contenders fast+drop,nn+drop
    .venv/bin/python -m bench.train_throughput --profile fast                # where time goes
    .venv/bin/python -m bench.train_throughput --contenders fast -S model.d_model=128  # a recipe
    .venv/bin/python -m bench.train_throughput --contenders fast,fast@2048           # batch size
    .venv/bin/python -m bench.train_throughput --contenders fast,ff512 \
        --arm ff512:model.d_ff=512                                       # model shapes
    .venv/bin/python -m bench.train_throughput --baseline f86d62d \
        --contenders fast/tcmalloc,fast/glibc,main/glibc --steps 6 --rounds 40  # C heaps
    .venv/bin/python -m bench.train_throughput --help

What runs
---------
Every contender but ``nn``/``nn+drop``/``matmul`` is the real ``aiayn.training.loop.Trainer`` of
a source tree, built from one params file (the ``--preset``, ``multi30k`` by default:
d_model 256, 3+3 layers, d_ff 1024, 4 heads, 8k BPE, batches of <= 4096 tokens, dropout
0.1, post-LN) on one set of shards, and timed through ``Trainer.train_step`` as ``fit``
calls it: forward, loss, backward, (clipping,) Adam, with the loop's per-step heap trim and,
in trees that defer it, the read-back of the loss sums at logging steps. Checkpoints and
logs are not made; validation runs only in the contenders ``--validate`` names (below), and
is never timed.

* ``fast``  - this tree, ``train.kernels: fast`` (the default: aiayn/fast/);
* ``plain`` - this tree, ``train.kernels: plain`` (torch's own operators);
* ``fast+compile`` - ``fast`` with ``train.compile: true``; the script counts Dynamo's
  compiled graphs (one static and one dynamic-shape graph is the minimum after a second
  batch shape) and graph breaks;
* ``main``  - the tree of ``--baseline REF`` (a git commit, extracted with ``git archive``
  into a temporary folder; params its schema does not know are dropped), the code before
  a change: measures the change side by side;
* ``fast+shared``, ``fast+target`` - ``fast`` with ``model.output_vocab`` ``shared`` (the
  softmax over the whole shared vocabulary, as the paper) or ``target`` (over the tokens of
  the target side only); one of them is ``fast`` itself, as the preset says. Each
  contender's FLOPs count the softmax it computes;
* ``fast+drop`` - ``fast`` with attention and activation dropout 0.1, the dropout
  placement of ``torch.nn.Transformer(dropout=0.1)``;
* ``nn``, ``nn+drop`` - ``torch.nn.Transformer(batch_first=True, norm_first=False)`` of the
  same sizes inside our embedding, positions and tied projection (the very same methods),
  with its two extra stack LayerNorms removed so that both compute one network, key-padding
  masks and a causal mask; the loss ``F.cross_entropy(label_smoothing=0.1, ignore_index=pad,
  reduction="sum")`` on full logits, Adam with torch's defaults; ``nn`` has the paper's
  dropout placement (residual and embedding only: its attention and activation dropout set
  to 0, as ``fast``), ``nn+drop`` torch's (0.1 on attention probabilities and FFN
  activations too, as ``fast+drop``). Same batches, in the same order, as the trainers;
* ``NAME@N`` - any trainer contender above with steps of ``N`` tokens in one micro-batch:
  ``train.tokens_per_step`` ``N`` and ``train.max_tokens`` 0, over the same shards (training
  plans its batches from them), e.g. ``fast@2048`` against ``fast``: what a batch size
  costs or buys in tokens/s, side by side. Such a contender takes its own batches (the
  same sampler seed over its own plan), so its tokens and FLOPs per round are counted on
  its own batches. A baseline tree from before training planned its own batches takes the
  shards' batches instead (the preset's ``shard.max_tokens``);
* ``NAME/ALLOC`` - any contender above (``main``, ``fast@2048`` included) in a worker on C
  heap ``ALLOC``: ``glibc``, ``tcmalloc`` or ``jemalloc``, preloaded as ``aiayn train``
  re-launches itself (``aiayn.training.memory.allocator_env``; e.g. ``fast/tcmalloc,main/glibc``:
  today's trainer as ``train.allocator: auto`` runs it where tcmalloc is installed, against
  a baseline commit on glibc). The worker's heap is read back from its memory map and the
  run stops if the library did not load. Without a suffix a worker keeps this process's
  heap (whatever LD_PRELOAD says); the heap each ran on is printed and recorded. Trees
  whose trainer knows ``train.allocator`` trim glibc's heap only on glibc; older trees
  always trim, as they did. Short turns do not reach the slowdown a fragmenting heap
  brings over the first few hundred steps: take longer ones (``--steps 6 --rounds 50``);
* ``--arm NAME:KEY=VALUE,...`` - a contender ``NAME``: ``fast`` with these ``model.*`` and
  ``train.*`` settings, e.g. ``--arm enc4dec2:model.encoder_layers=4,model.decoder_layers=2``
  (repeatable; list ``NAME`` in ``--contenders``). Same batches as ``fast``; its FLOPs are
  counted for its own shape. What a shape costs per step, side by side: the step counts
  that give each shape the same training time (a recipe screen on a GPU that stands for a
  CPU's hour, ``bench/gpu_session.sh``);
* ``--validate NAME,...`` - these trainer contenders also validate as the trainer's loop
  does: the valid loss every ``train.valid_every`` steps and greedy valid BLEU (the
  trainer's own hook over the raw valid split) every ``train.valid_bleu_every``, warm-up
  steps counted. The passes' wall and CPU time and page faults are left out of the round's
  figures and reported beside them, so the figures say what a training step costs *after*
  such passes (a heap they fragmented, caches they evicted): e.g. ``--arm valid:
  --contenders fast,valid --validate valid -S train.valid_every=100 -S
  train.valid_bleu_every=100`` (``valid`` is ``fast`` under another name). Validation
  takes no random numbers, so both train the same weights on the same batches. Each
  worker's resident memory after every round is recorded too (``RSS MiB``: after the
  last);
* ``matmul`` - the machine's matmul rate in the same run, in the precision the trainers
  compute in (fp32, or bf16 where ``train.precision`` resolves to bf16 autocast): products
  of 2048x2048x2048 and 4096x256x1024 into preallocated outputs; reported as GFLOP/s, the
  mean of the two is the denominator of "fraction of the matmul rate".

Protocol
--------
Each contender lives in its own worker process (its own allocator, thread pool and
imports: a setting one tree makes cannot help or hurt another), all started before timing,
each warmed up for ``--warmup`` steps. Then ``--rounds`` rounds: in each, every contender in
turn runs ``--steps`` steps (the order rotates by one per round) while the others wait
idle; all trainers take the same batches in a round (one sampler seed). The machine may be
shared: only figures taken side by side mean anything, so each ratio is the median over
rounds of the per-round ratio, and absolute figures are medians over rounds. CPU seconds
per step (all threads) are reported beside wall seconds: their gap is time lost to other
processes.

FLOPs: counted analytically by ``bench.flops`` (weight matmuls, attention, the tied
projection over the tokens the contender's softmax spans; real tokens only); achieved
GFLOP/s = the FLOPs of the round's batches / its wall time.

Data: ``--shards`` (and ``--tokenizer``) if given; otherwise the preset's data stages are run
once into ``--workdir`` (``aiayn download/vocab/survey/shard``; the ``multi30k`` preset
streams its corpus from the hub, or with ``--corpus DIR`` reads it from the text files there,
as ``data.source: local``; ``demo`` needs nothing) and reused by later runs.
"""

from __future__ import annotations

import argparse
import contextlib
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
    "fast+compile": {"kernels": "fast", "compile": True},
    "fast+drop": {"kernels": "fast", "attention_dropout": 0.1, "activation_dropout": 0.1},
    "fast+shared": {"kernels": "fast", "model": {"output_vocab": "shared"}},
    "fast+target": {"kernels": "fast", "model": {"output_vocab": "target"}},
    "main": {},
}
OTHERS = ("nn", "nn+drop", "matmul")
DEFAULT = "fast,plain,nn,matmul"
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
        # --validate: the trainer's valid BLEU hook, over the raw valid split beside the shards
        hook = None
        self.validating = spec.get("validate", False)
        if self.validating and p.train.valid_bleu_every:
            try:
                from aiayn.decoding.translation import ValidationBleu
            except ImportError:  # a baseline tree from before aiayn.decoding: the flat layout
                from aiayn.translation import ValidationBleu

            hook = ValidationBleu.from_params(p, Path(spec["raw"]), load_tokenizer(tok))
        self.trainer = make_trainer(p, load_tokenizer(tok).get_vocab_size(), file_sha256(tok),
                                    paths, World(), progress=False,
                                    **({"valid_bleu": hook} if hook else {}))
        self.valid_every, self.bleu_every = p.train.valid_every, p.train.valid_bleu_every
        self.paused = Paused()
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
        validate, bleu = validation_due(t.state.step, self.valid_every, self.bleu_every)
        if self.validating and validate:
            with self.paused.measure(bleu):  # as fit: the valid loss, then greedy BLEU
                t.validate()
                if bleu:
                    t.valid_bleu(t.model, t.device, t.amp_dtype)

    def extra(self) -> dict:
        try:
            from torch._dynamo.utils import counters
        except ImportError:
            return {}
        return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(counters["graph_break"].values()))}


class TorchNNWorker:
    """torch.nn.Transformer of the preset's sizes, on the trainer's batches in its order."""

    def __init__(self, spec: dict):
        import torch
        import torch.nn.functional as F
        import yaml
        from torch import nn

        from aiayn.config import parse_params
        from aiayn.data.batching import plan_step
        from aiayn.data.sampler import BatchLoader, ShardDataset, TokenBudgetSampler
        from aiayn.data.tokenizer import load_tokenizer
        from aiayn.model import Transformer, sinusoidal_positions
        from aiayn.precision import autocast_dtype
        from aiayn.training.build import model_config

        p = parse_params(yaml.safe_load(Path(spec["params"]).read_text()), spec["params"])
        cfg = model_config(p, load_tokenizer(Path(spec["tokenizer"])).get_vocab_size())
        drop_everywhere = spec["core"] == "nn+drop"
        if (cfg.key_size, cfg.value_size) != (cfg.d_model // cfg.heads,) * 2 or (
                cfg.positions != "sinusoidal"):
            raise SystemExit(
                f"error: contender {spec['name']}: torch.nn.Transformer has heads of "
                f"d_model / heads = {cfg.d_model // cfg.heads} and sinusoidal positions only; "
                f"this model has d_k {cfg.key_size}, d_v {cfg.value_size} and {cfg.positions} "
                "positions (Table 3's rows): leave nn and nn+drop out of --contenders")

        class TorchTransformer(nn.Module):
            embed = Transformer.embed  # the very same input and output code as ours
            logits = Transformer.logits
            output_bias = None  # the whole shared vocabulary, whatever the preset says

            def __init__(self):
                super().__init__()
                self.cfg = cfg
                self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model,
                                              padding_idx=cfg.pad_id)
                self.embed_dropout = nn.Dropout(cfg.dropout)
                self.register_buffer("positions", sinusoidal_positions(
                    cfg.max_positions, cfg.d_model), persistent=False)
                self.stack = nn.Transformer(
                    d_model=cfg.d_model, nhead=cfg.heads, num_encoder_layers=cfg.encoder_layers,
                    num_decoder_layers=cfg.decoder_layers, dim_feedforward=cfg.d_ff,
                    dropout=cfg.dropout, batch_first=True, norm_first=False)
                # Post-LN stacks end in a sub-layer LayerNorm; nn.Transformer adds one more.
                self.stack.encoder.norm = None
                self.stack.decoder.norm = None
                if not drop_everywhere:  # the paper's placement: residual + embedding only
                    for layer in [*self.stack.encoder.layers, *self.stack.decoder.layers]:
                        layer.dropout = nn.Identity()  # the FFN activation's dropout
                        for attn in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                            if attn is not None:
                                attn.dropout = 0.0
                nn.init.normal_(self.embedding.weight, mean=0.0, std=cfg.d_model ** -0.5)
                with torch.no_grad():
                    self.embedding.weight[cfg.pad_id].zero_()
                for name, q in self.stack.named_parameters():
                    if q.dim() > 1:
                        nn.init.xavier_uniform_(q)
                    elif "norm" not in name:
                        nn.init.zeros_(q)

            def forward(self, src, tgt_in):
                src_pad, tgt_pad = src == cfg.pad_id, tgt_in == cfg.pad_id
                t = tgt_in.shape[1]
                causal = torch.ones(t, t, dtype=torch.bool).triu(1)  # True: masked
                y = self.stack(self.embed(src), self.embed(tgt_in), tgt_mask=causal,
                               src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad,
                               memory_key_padding_mask=src_pad, tgt_is_causal=True)
                return self.logits(y)

        torch.manual_seed(p.seed)
        self.model = TorchTransformer().train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4,
                                    betas=tuple(p.train.adam_betas), eps=p.train.adam_eps)
        # the trainer's micro-batches (one process), one a step
        plan = plan_step(p.train.tokens_per_step, 1, p.train.max_tokens)
        data = ShardDataset(Path(spec["shards"]) / "train", max_tokens=plan.batch_tokens)
        self.it = iter(BatchLoader(data, TokenBudgetSampler(data.num_batches, seed=p.seed)))
        self.amp = autocast_dtype(p.train.precision, torch.device("cpu"))
        self.eps, self.pad, self.V = p.train.label_smoothing, cfg.pad_id, cfg.vocab_size
        self.torch, self.F = torch, F
        self.info = {"precision": p.train.precision}

    def step(self) -> None:
        torch, F = self.torch, self.F
        b = next(self.it)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=self.amp or torch.float32, enabled=self.amp is not None):
            logits = self.model(b.src, b.tgt_in)
        loss = F.cross_entropy(logits.float().view(-1, self.V), b.tgt_out.view(-1),
                               ignore_index=self.pad, label_smoothing=self.eps,
                               reduction="sum") / b.tgt_tokens
        loss.backward()
        self.opt.step()
        loss.item()

    def extra(self) -> dict:
        return {}


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


def validation_due(step: int, valid_every: int, bleu_every: int) -> tuple[bool, bool]:
    """(validate, with valid BLEU) after training step ``step``, as the trainer's loop
    decides between steps (a BLEU step validates too; the run's last step aside)."""
    bleu = bool(bleu_every) and step % bleu_every == 0
    return step % valid_every == 0 or bleu, bleu


class Paused:
    """What a worker's validation passes took (wall and CPU seconds, page faults), kept
    out of the step's figures; counted per round (``take``)."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self.faults = self.passes = self.bleu_passes = 0

    @contextlib.contextmanager
    def measure(self, bleu: bool):
        import resource

        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.wall += time.perf_counter() - wall
            self.cpu += time.process_time() - cpu
            self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            self.passes += 1
            self.bleu_passes += bleu

    def take(self) -> dict:
        """This round's totals, and a fresh count for the next."""
        out = {"wall": self.wall, "cpu": self.cpu, "faults": self.faults,
               "passes": self.passes, "bleu_passes": self.bleu_passes}
        self.__init__()
        return out


def timed_run(worker, n: int) -> dict:
    """``n`` steps of ``worker``: wall and CPU seconds and page faults, less whatever its
    validation passes took (``worker.paused``, where it has one), and the resident memory
    after them."""
    import resource

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        worker.step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    out = {"wall": wall, "cpu": cpu, "faults": faults}
    paused = getattr(worker, "paused", None)
    if paused is not None:
        p = paused.take()
        out = {k: v - p[k] for k, v in out.items()}
        if p["passes"]:
            out["validation"] = p
    return {**out, "rss_mib": harness.rss_mib(), **worker.extra()}


def worker_main(spec: dict) -> None:
    """Serve 'run N' requests on stdin with one JSON line each on stdout."""
    import torch

    torch.set_num_threads(spec["threads"])
    name = spec["name"]
    cls = (MatmulWorker if name == "matmul" else TorchNNWorker if name.startswith("nn")
           else TrainerWorker)
    worker = cls(spec)
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
        if cmd == "onednn":
            print(json.dumps(onednn_census(worker.step, n, out)), file=out, flush=True)
            continue
        print(json.dumps(timed_run(worker, n)), file=out, flush=True)


def onednn_census(step, n: int, out) -> dict:
    """Run ``step`` ``n`` times with oneDNN's verbose log of primitive creation on, and
    count per step the primitives it built (cache misses: a shape met for the first time,
    JIT-compiled), reused (cache hits) and ran, and the distinct problems it ran in all
    ``n`` steps (kind, implementation, layouts and shapes). The log is oneDNN's own printf
    to fd 1, the protocol stream here, so fd 1 points at a scratch file meanwhile; ``out``
    (the stream on fd 1) is flushed before."""
    import ctypes
    import tempfile

    import torch

    out.flush()
    libc = ctypes.CDLL(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
                for _ in range(n):
                    step()
        finally:
            libc.fflush(None)  # oneDNN's lines still in C's stdout buffer
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        built = reused = ran = 0
        problems = set()
        for line in log:
            f = line.rstrip("\n").split(",")
            if len(f) < 12 or f[0] != "onednn_verbose" or f[2] != "primitive":
                continue
            if f[3] == "create:cache_miss":
                built += 1
            elif f[3] == "create:cache_hit":
                reused += 1
            elif f[3] == "exec":
                ran += 1
                problems.add(tuple(f[5:12]))
    return {"built": built / n, "reused": reused / n, "ran": ran / n,
            "distinct": len(problems), "steps": n}


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


def split_contender(name: str, trainers: dict = TRAINERS) -> tuple[str, int | None]:
    """``fast@2048`` -> ("fast", 2048); ``fast`` -> ("fast", None)."""
    base, at, tokens = name.partition("@")
    if not at:
        return name, None
    if base not in trainers or not tokens.isdigit() or int(tokens) < 16:
        raise SystemExit(f"error: contender {name}: NAME@N needs a trainer contender "
                         f"({', '.join(trainers)}) and a batch size N >= 16 in tokens, "
                         "e.g. fast@2048")
    return base, int(tokens)


def parse_arm(text: str) -> tuple[str, dict]:
    """``ff512:model.d_ff=512,train.x=y`` -> ("ff512", {"kernels": "fast", "model":
    {"d_ff": 512}, "x": y}): a trainer contender's overrides (values parsed as YAML)."""
    import yaml

    name, colon, settings = text.partition(":")
    if not colon or not name or name in TRAINERS or name in OTHERS or "@" in name:
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--contenders", default=None,
                    help=f"comma-separated from {', '.join([*TRAINERS, *OTHERS])} (default "
                         f"{DEFAULT}, plus main with --baseline); a trainer contender with "
                         "@N (e.g. fast@2048) runs batches of N tokens")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="a contender NAME: fast with these model.*/train.* settings, e.g. "
                         "enc4dec2:model.encoder_layers=4,model.decoder_layers=2 (repeatable; "
                         "name it in --contenders)")
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="git commit whose trainer runs as contender 'main' (e.g. 9852772)")
    ap.add_argument("--preset", default="multi30k", help="conf/experiment preset (multi30k)")
    ap.add_argument("--set", "-S", action="append", default=[], metavar="KEY=VALUE",
                    help="Hydra override of the preset for every contender, as `dvc exp run "
                         "-S`: e.g. -S model.d_model=128 -S model.d_ff=256 (repeatable; data "
                         "params re-run the data stages into the work folder)")
    ap.add_argument("--precision", default=None, choices=("auto", "fp32", "bf16"),
                    help="train.precision for every contender (default: the preset's, auto)")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="the preset's corpus as text files in DIR (data.source: local), "
                         "not from the hub")
    ap.add_argument("--shards", type=Path, default=None, help="use these shards (train/valid)")
    ap.add_argument("--tokenizer", type=Path, default=None, help="their tokenizer.json")
    ap.add_argument("--workdir", type=Path,
                    default=Path(tempfile.gettempdir()) / "aiayn-bench-train",
                    help="where the data stages write and workers keep scratch files")
    ap.add_argument("--rounds", type=int, default=12, help="measured rounds (default 12)")
    ap.add_argument("--steps", type=int, default=2,
                    help="steps per contender per round (default 2: short turns, so that "
                         "the machine's drift hits every contender alike)")
    ap.add_argument("--warmup", type=int, default=4,
                    help="warm-up steps per contender (default 4; compile adds its own)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads in every worker (default: torch's default)")
    ap.add_argument("--profile", default=None, metavar="CONTENDER",
                    help="also print torch.profiler tables of 3 steps of this contender (by "
                         "operator, then by operator and input shapes)")
    ap.add_argument("--primitives", type=int, default=0, metavar="STEPS",
                    help="after the rounds, run STEPS more steps of every trainer contender "
                         "with oneDNN's creation log on and print, per step, the primitives "
                         "oneDNN built (new shapes, JIT-compiled), reused and ran: the "
                         "CPU's count of shapes met anew (default 0: off)")
    ap.add_argument("--validate", default="", metavar="CONTENDERS",
                    help="comma-separated trainer contenders that also validate as training "
                         "does: the valid loss every train.valid_every steps and greedy valid "
                         "BLEU every train.valid_bleu_every (warm-up steps counted), untimed, "
                         "e.g. --arm valid: --contenders fast,valid --validate valid: what "
                         "a step costs after validation passes, side by side with one that "
                         "never validates (default: none validates)")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "rounds", "steps", "threads")
    return args


@dataclass
class Contenders:
    """The contenders of a run: ``names`` in the order given, each one's trainer contender
    without @N and /ALLOC (``base``), its batch tokens (``variant``; None: the preset's),
    its name without /ALLOC (``core``) and its C heap (``heap``; None: this process's), the
    trainer settings by name (``trainers``: TRAINERS and the arms), each arm's params, and
    the contenders that validate (``validating``, from --validate)."""

    names: list[str]
    base: dict[str, str]
    variant: dict[str, int | None]
    trainers: dict[str, dict]
    arms: dict[str, dict]
    arm_params: dict
    core: dict[str, str]
    heap: dict[str, str | None]
    validating: list[str]


def choose_contenders(args) -> Contenders:
    """--contenders, --arm and --profile read and checked, before any data is made."""
    import yaml

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
    base = {n: split_contender(core[n], trainers)[0] for n in names}
    variant = {n: split_contender(core[n], trainers)[1] for n in names}
    unknown = [n for n in names if base[n] not in trainers and core[n] not in OTHERS]
    if unknown:
        raise SystemExit(f"error: unknown contender(s) {', '.join(unknown)}; choose from "
                         f"{', '.join([*trainers, *OTHERS])}")
    if "main" in base.values() and not args.baseline:
        raise SystemExit("error: contender main needs --baseline REF")
    if any(core[n] == "matmul" != n for n in names):
        raise SystemExit("error: contender matmul measures the products, not a heap: no /ALLOC")
    validating = [n for n in args.validate.split(",") if n]
    if bad := [n for n in validating if n not in names or core[n] in OTHERS]:
        raise SystemExit(f"error: --validate {bad[0]}: name trainer contenders of --contenders "
                         f"({','.join(n for n in names if core[n] not in OTHERS)})")
    from aiayn.training.memory import allocator_library, install_hint
    for n in names:
        if heap[n] not in (None, "glibc") and allocator_library(heap[n]) is None:
            raise SystemExit(f"error: contender {n}: no {heap[n]} library here (e.g. "
                             f"{install_hint(heap[n])})")
    return Contenders(names, base, variant, trainers, arms, arm_params, core, heap,
                      validating)


def prepare_variants(args, c: Contenders) -> dict:
    """Batch tokens (None: the preset's) -> (params file, shards, tokenizer), for the batch
    sizes some contender uses, the preset's first; --precision written into the params."""
    import yaml

    data = {}
    for v in sorted(set(c.variant.values()), key=lambda v: (v is not None, v or 0)):
        params, shards, tokenizer = prepare_data(args, v)
        if args.precision:
            raw = yaml.safe_load(params.read_text())
            raw["train"]["precision"] = args.precision
            params = params.with_name(f"params-{args.precision}.yaml")
            params.write_text(yaml.safe_dump(raw, sort_keys=False))
        data[v] = (params, shards, tokenizer)
    return data


def start_workers(args, c: Contenders, data: dict, scratch: Path, threads: int,
                  matmul_dtype: str, workers: dict[str, Worker]) -> None:
    """One worker per contender (contender main's on the baseline commit's tree), each
    added to ``workers`` as it starts, so that the caller closes whatever started."""
    tree = (harness.extract_tree(args.baseline, scratch / "baseline")
            if "main" in c.base.values() else None)
    for n in c.names:
        n_params, n_shards, n_tokenizer = data[c.variant[n]]
        spec = {"name": n, "core": c.core[n], "params": str(n_params), "shards": str(n_shards),
                "tokenizer": str(n_tokenizer), "scratch": str(scratch), "threads": threads,
                "matmul_dtype": matmul_dtype, "train": c.trainers.get(c.base[n], {}),
                "validate": n in c.validating,
                "raw": str(Path(n_shards).parent / "raw")}  # the download stage's folder
        if spec["validate"] and not (Path(spec["raw"]) / "valid.parquet").is_file():
            raise SystemExit(f"error: --validate {n}: valid BLEU reads the raw valid split, "
                             f"{spec['raw']}/valid.parquet, which is missing: leave out "
                             "--shards (the data stages then make both), or give shards whose "
                             "folder has raw/ beside them")
        workers[n] = Worker(spec, tree if c.base[n] == "main" else None, c.heap[n])
        if c.base[n] == "main":
            print(f"{n}: {workers[n].info['aiayn']} (git {args.baseline}); params it does "
                  f"not know, dropped: {', '.join(workers[n].info['dropped_params']) or '-'}")


def round_line(replies: dict[str, dict], tokens: dict[str, int]) -> str:
    """A round's progress line: each trainer's target tokens/s (``tokens`` over its reply's
    wall seconds), the matmul rate, and each worker's resident memory after the round."""
    line = "target tok/s: " + "  ".join(f"{n} {tokens[n] / replies[n]['wall']:.0f}"
                                        for n in replies if n != "matmul")
    if "matmul" in replies:
        line += "  matmul " + "/".join(f"{v:.0f}" for v in
                                       replies["matmul"]["gflops"].values()) + " GFLOP/s"
    rss = [f"{n} {x['rss_mib']:.0f}" for n, x in replies.items() if x.get("rss_mib") is not None]
    return line + ("  | RSS MiB: " + "  ".join(rss) if rss else "")


def run_rounds(args, c: Contenders, workers: dict[str, Worker], data: dict, cfg,
               cfgs: dict) -> dict:
    """Warm-up, then --rounds alternating rounds of --steps steps per contender; each
    round's batches counted (tokens, FLOPs per softmax width and per arm's own shape)."""
    from bench.flops import train_flops

    for n, w in workers.items():  # warm-up: allocator, kernels, Adam state, compilation
        t = time.perf_counter()
        w.ask(f"run {args.warmup}")
        print(f"warm-up {n}: {time.perf_counter() - t:.0f} s", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in c.names}
    flops = {v: [] for v in data}  # per batch size: the round's model FLOPs and tokens
    tokens = {v: [] for v in data}
    # the softmax's width per contender (model.output_vocab), and per batch size and width
    # the round's FLOPs
    spans = {n: int(w.info.get("output_vocab") or cfg.vocab_size) for n, w in workers.items()}
    widths = sorted(set(spans.values()))
    span_flops = {(v, k): [] for v in data for k in widths}
    own_flops = {n: [] for n in cfgs}  # an arm's FLOPs, on its own shape
    for r, order in harness.rounds(c.names, args.rounds):
        for v, (v_params, v_shards, _) in data.items():
            batches = round_batches(v_params, v_shards, args.steps,
                                    args.warmup + r * args.steps)
            flops[v].append(sum(train_flops(cfg, s, t) for s, t, _ in batches))
            for k in widths:
                span_flops[v, k].append(sum(train_flops(cfg, s, t, k) for s, t, _ in batches))
            tokens[v].append(sum(n for *_, n in batches))
            for n in cfgs:
                if c.variant[n] == v:
                    own_flops[n].append(sum(train_flops(cfgs[n], s, t, spans[n])
                                            for s, t, _ in batches))
        for n in order:
            runs[n].append(workers[n].ask(f"run {args.steps}"))
        last = {n: runs[n][-1] for n in c.names}
        print(f"round {r + 1}/{args.rounds} "
              + round_line(last, {n: tokens[c.variant[n]][r] for n in c.names if n != "matmul"}),
              flush=True)
    # each contender's FLOPs per round: an arm's on its own shape, the others' on the preset's
    n_flops = {n: own_flops[n] if n in cfgs else span_flops[c.variant[n], spans[n]]
               for n in c.names if n != "matmul"}
    return {"runs": runs, "tokens": tokens, "flops": flops, "n_flops": n_flops, "spans": spans,
            "heaps": {n: w.info["allocator"] for n, w in workers.items()}}


# the pairs whose ratio is printed when both ran
PAIRS = (("fast", "main"), ("fast", "plain"), ("plain", "main"), ("fast", "nn"),
         ("fast+drop", "nn+drop"), ("fast+compile", "fast"), ("fast+compile", "main"),
         ("fast+drop", "fast"), ("nn+drop", "nn"), ("fast+target", "fast+shared"),
         ("fast+shared", "main"), ("fast+shared", "nn"), ("fast+target", "main"))


def ratio_pairs(c: Contenders, measured: list[str]) -> list[tuple[str, str]]:
    """The (numerator, denominator) pairs whose ratio is printed, of the ``measured``
    contenders: PAIRS, whatever heap each side ran on; the same contender on two heaps, in
    the order given; each batch size against the preset's; each arm against fast."""
    pairs = [(n, m) for a, b in PAIRS for n in measured for m in measured
             if c.core[n] == a and c.core[m] == b]
    pairs += [(n, m) for i, n in enumerate(measured) for m in measured[i + 1:]
              if c.core[n] == c.core[m]]
    pairs += [(n, c.base[n]) for n in measured  # each batch size against the preset's
              if c.variant[n] is not None and c.base[n] in measured]
    pairs += [(n, "fast") for n in measured if c.base[n] in c.arms and "fast" in measured]
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
        n_tokens = tokens[c.variant[n]]
        tps[n] = [n_tokens[r] / x["wall"] for r, x in enumerate(runs[n])]
        results[n] = {"tokens_per_s": med(tps[n]), "batch_tokens": c.variant[n],
                      "output_vocab": spans[n],
                      "gflop_per_s": med(n_flops[n][r] / x["wall"] / 1e9
                                         for r, x in enumerate(runs[n])),
                      "wall_s_per_step": med(x["wall"] for x in runs[n]) / args.steps,
                      "cpu_s_per_step": med(x["cpu"] for x in runs[n]) / args.steps,
                      "page_faults_per_step": med(x["faults"] for x in runs[n]) / args.steps,
                      "tokens_per_s_rounds": tps[n],
                      "allocator": measured["heaps"][n],
                      "rss_mib_rounds": [x.get("rss_mib") for x in runs[n]],
                      "validation": {k: sum(x.get("validation", {}).get(k, 0) for x in runs[n])
                                     for k in ("passes", "bleu_passes", "wall")},
                      **({"onednn": measured["onednn"][n]} if "onednn" in measured else {}),
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
    for v in tokens:
        print(f"batches of <= {v or p.shard.max_tokens} tokens: "
              f"{statistics.fmean(tokens[v]) / args.steps:.0f} non-pad target tokens and "
              f"{statistics.fmean(flops[v]) / args.steps / 1e9:.1f} GFLOP (model FLOPs) per step")
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
    for n, res in results.items():
        v = res["validation"]
        if v["passes"]:
            print(f"  {n}: {v['passes']} validation passes ({v['bleu_passes']} with valid BLEU) "
                  f"in the rounds, {v['wall']:.0f} s, left out of its figures")
    if matmul:
        shapes = ", ".join(f"{k} {v:.0f}" for k, v in matmul["shapes"].items())
        kind = "bf16" if matmul_dtype == "bfloat16" else "fp32"
        print(f"{'matmul':<{width}}{'':>13}{matmul['gflop_per_s']:>9.1f}   ({kind} products: "
              f"{shapes} GFLOP/s)")
    if "onednn" in measured:
        steps = next(iter(measured["onednn"].values()))["steps"]
        print(f"\noneDNN primitives per step ({steps} steps after the rounds, creation log on):")
        print(f"{'contender':<{width}}{'built':>8}{'reused':>8}{'ran':>8}"
              f"{f'distinct in {steps} steps':>22}")
        for n, x in measured["onednn"].items():
            print(f"{n:<{width}}{x['built']:>8.1f}{x['reused']:>8.1f}{x['ran']:>8.1f}"
                  f"{x['distinct']:>22}")
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
    data = prepare_variants(args, c)
    params, shards, tokenizer = data[next(iter(data))]  # one model config in each
    p = parse_params(yaml.safe_load(params.read_text()))
    vocab = load_tokenizer(tokenizer).get_vocab_size()
    cfg = model_config(p, vocab)
    # an arm's own model (its FLOPs); every other contender computes the preset's
    cfgs = {n: model_config(c.arm_params[c.base[n]], vocab) for n in c.names
            if c.base[n] in c.arms}
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
        measured = run_rounds(args, c, workers, data, cfg, cfgs)
        minutes = (time.perf_counter() - t0) / 60
        if args.profile:  # after the timed rounds, so that every contender saw the same batches
            print(f"\n=== profile: {args.profile}, 3 steps ===")
            print(workers[args.profile].ask("profile 3")["profile"])
        if args.primitives:  # after the timed rounds, as the profile
            measured["onednn"] = {n: w.ask(f"onednn {args.primitives}")
                                  for n, w in workers.items() if n != "matmul"}
    finally:
        for w in workers.values():
            w.close()
        shutil.rmtree(scratch, ignore_errors=True)

    summary = summarise(args, c, measured)
    print_report(args, c, p, cfg, measured, summary, matmul_dtype, minutes)
    results, matmul, ratios, _ = summary
    tokens, flops = measured["tokens"], measured["flops"]
    out = {"info": info, "results": results, "matmul": matmul, "ratios": ratios,
           "round_tokens": {"preset" if v is None else str(v): x for v, x in tokens.items()},
           "round_flops": {"preset" if v is None else str(v): x for v, x in flops.items()},
           "runs": measured["runs"]}
    if args.json:
        print()
    return harness.save(out, args.json, argv, facts)


if __name__ == "__main__":
    main()
