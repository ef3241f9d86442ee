"""Everything a training run is made of, built once and in one place: the device and
precision, the model, the optimizer and schedule, the criterion, the data planned for the
process count, the batch loader, the checkpoint folder's run store, and the resumed state
(:func:`build_trainer`). The loop itself is :class:`aiayn.training.loop.Trainer`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aiayn.config import Params
from aiayn.data.batching import StepPlan, plan_step
from aiayn.data.sampler import BatchLoader, PrefetchLoader, ShardDataset, TokenBudgetSampler
from aiayn.data.shards import check_tokenizer
from aiayn.data.subword import SubwordSplitter, split_closure
from aiayn.errors import AiaynError, DataError, ParamsError
from aiayn.fast import KernelConfig, avoid_cudnn_attention
from aiayn.fast import apply as apply_kernels
from aiayn.model import Transformer, TransformerConfig
from aiayn.precision import autocast_dtype, slow_bf16_warning
from aiayn.training import distributed
from aiayn.training.distributed import World
from aiayn.training.loop import RunState, Trainer, TrainingListener, TrainPaths
from aiayn.training.memory import HeapTrimmer, loaded_allocator
from aiayn.training.objective import make_criterion, make_optimizer
from aiayn.training.resume import restore
from aiayn.training.run_log import RunLog
from aiayn.training.run_store import RunStore, run_identity
from aiayn.training.schedule import deep_post_ln_warning, schedule_at

log = logging.getLogger("aiayn")


def model_config(p: Params, vocab_size: int) -> TransformerConfig:
    """The model ``p`` describes (``model.*`` and ``train``'s two extra dropouts), for a
    vocabulary of ``vocab_size`` tokens (the tokenizer's). It lives here, not on ``Params``:
    the params schema stays free of the model, so that a stage reading params does not
    depend on the model's code (tests/test_dvc_deps.py)."""
    m = p.model
    return TransformerConfig(
        vocab_size=vocab_size, d_model=m.d_model, heads=m.heads,
        encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers, d_ff=m.d_ff,
        dropout=m.dropout, attention_dropout=p.train.attention_dropout,
        activation_dropout=p.train.activation_dropout, norm=m.norm,
        max_positions=m.max_positions, output_vocab=m.output_vocab, d_k=m.d_k, d_v=m.d_v,
        positions=m.positions, position_init_std=m.position_init_std)


def device_kind(choice: str) -> str:
    """'cuda' or 'cpu': where ``train.device`` ``choice`` trains on this machine (no side
    effects: the allocator is chosen from it before the process sets a device up)."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise AiaynError("train.device is 'cuda' but no GPU is visible; set train.device: "
                             "auto or cpu")
        return "cuda"
    return "cpu"


def pick_device(choice: str, world: World) -> torch.device:
    if device_kind(choice) == "cuda":
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def open_training_data(shards: Path, plan: StepPlan) -> tuple[ShardDataset, ShardDataset]:
    """The train and valid splits with batches planned for ``plan`` (aiayn.data.batching): each
    process's micro-batches hold at most ``plan.batch_tokens`` tokens per side, validation's
    too (a process's memory is sized for that). A budget too small for the longest stored
    pair is a ParamsError naming the settings that fix it."""
    opened = []
    for split in ("train", "valid"):
        data = ShardDataset(shards / split)
        try:
            data.replan(plan.batch_tokens)  # a ValueError where the longest pair does not fit
        except ValueError:
            raise ParamsError(
                f"train: {plan.describe()}: a micro-batch of {plan.batch_tokens:,} tokens "
                f"cannot hold the longest {split} pair of {shards / split} "
                f"({data.longest_pair()} tokens on one side, with its special token); raise "
                "train.tokens_per_step or train.max_tokens, train on fewer processes, or "
                "lower shard.max_len and re-run the shard stage") from None
        opened.append(data)
    return opened[0], opened[1]


def check_vocab(datasets: dict[str, ShardDataset], shards: Path, vocab_size: int) -> None:
    for name, ds in datasets.items():
        if int(ds.meta["vocab_size"]) != vocab_size:
            raise DataError(
                f"{shards / name}/meta.json: shards were made with a vocabulary of "
                f"{ds.meta['vocab_size']} tokens, the tokenizer has {vocab_size}; re-run "
                "`aiayn survey` and `aiayn shard` (or `dvc repro`)")


def target_vocabulary(datasets: list[ShardDataset], pad_id: int, bos_id: int,
                      parents: np.ndarray | None = None) -> np.ndarray:
    """The token ids that ``model.output_vocab: target`` lets the softmax span, ascending:
    every token of the target side of ``datasets`` but BOS (never predicted), with
    ``parents`` (train.subword_split) every token splitting them can yield, and the padding
    id (a column that is never a label, as in the whole-vocabulary softmax)."""
    seen = np.zeros(int(datasets[0].meta["vocab_size"]), dtype=bool)
    for ds in datasets:
        seen |= ds.token_counts("tgt") > 0
    seen[bos_id] = False
    if parents is not None:
        seen = split_closure(seen, parents)
        seen[bos_id] = False
    seen[pad_id] = True
    return np.flatnonzero(seen)


def make_splitter(p: Params, merges: np.ndarray | None, vocab_size: int,
                  max_len: int) -> SubwordSplitter | None:
    """train.subword_split's re-segmentation of training batches (aiayn/data/subword.py)."""
    if p.train.subword_split == 0:
        return None
    if merges is None or merges.shape != (vocab_size, 2):
        raise ValueError("train.subword_split needs the tokenizer's merges "
                         "(aiayn.data.subword.merge_parents) for all "
                         f"{vocab_size} tokens, got "
                         f"{None if merges is None else list(merges.shape)}")
    return SubwordSplitter(merges, p.train.subword_split, p.seed, max_len=max_len)


def build_trainer(p: Params, vocab_size: int, tokenizer_sha256: str, paths: TrainPaths,
                  world: World, *, progress: bool = True,
                  valid_bleu: Callable[..., float] | None = None,
                  merges: np.ndarray | None = None,
                  listeners: list[TrainingListener] | None = None,
                  run_files: tuple[str, ...] = ()) -> Trainer:
    """The run of ``p`` in ``paths.checkpoints``, resumed from its last checkpoint if it has
    one (aiayn.training.run_store decides which run goes on). ``valid_bleu(model, device, amp_dtype)
    -> score``: rank 0's validation BLEU (aiayn.decoding.translation.ValidationBleu); ``merges``
    (aiayn.data.subword.merge_parents) is needed by train.subword_split; ``listeners`` hear the
    loop's log rows and checkpoints; ``run_files``: files beside the checkpoints that belong
    to the run (a tracker's), moved aside with it. The order of what is built keeps the
    random streams of a run made before this function existed."""
    t = p.train
    device = pick_device(t.device, world)
    distributed.init(world, device)
    amp_dtype = autocast_dtype(t.precision, device)
    if (warning := slow_bf16_warning(t.precision, device, "train.precision")) and world.is_main:
        log.warning(warning)
    cfg = model_config(p, vocab_size)
    fast = t.kernels == "fast"
    torch.manual_seed(p.seed)  # identical initial weights on every rank
    model = Transformer(cfg).to(device)
    # cuDNN's attention plans anew for every batch shape: out on CUDA, whatever the kernels
    # (a process-wide switch, named here rather than hidden in picking the device)
    avoid_cudnn_attention(device)
    kernel_config = KernelConfig()
    if fast:  # the fast kernels (aiayn/fast), their C++ part built here, before the clock
        apply_kernels(model, kernel_config)
    optimizer, scheduler = make_optimizer(model, t.adam_betas, t.adam_eps, p.model.d_model,
                                          t.warmup_steps, t.lr_scale, fused=fast)
    if world.is_main and (warning := deep_post_ln_warning(p.model, t)):
        log.warning(warning)
    # fp16's dynamic loss scaling (train.precision: fp16): the loss is multiplied before
    # backward so that small gradients stay representable, the gradients divided back before
    # clipping and Adam, and a step whose gradients overflowed is skipped while the scale
    # halves. Off (a no-op) in every other precision.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    plan = plan_step(t.tokens_per_step, world.size, t.max_tokens)
    train_data, valid_data = open_training_data(paths.shards, plan)
    check_vocab({"train": train_data, "valid": valid_data}, paths.shards, vocab_size)
    check_tokenizer(paths.shards, tokenizer_sha256)
    identity = run_identity(p, cfg, tokenizer_sha256, paths.shards)
    store = RunStore(paths.checkpoints, world, device, identity,
                     schedule=functools.partial(schedule_at, t),
                     end={"steps": t.steps, "max_minutes": t.max_minutes}, run_files=run_files)
    if world.is_main:  # the weights and Adam's two moments
        store.check_room(3 * sum(q.numel() * q.element_size() for q in model.parameters()),
                         t.keep_checkpoints)
    sampler = TokenBudgetSampler(train_data.num_batches, world.rank, world.size, seed=p.seed)
    splitter = make_splitter(p, merges, vocab_size, cfg.max_positions)
    loader = PrefetchLoader(BatchLoader(train_data, sampler, splitter=splitter),
                            pin_memory=device.type == "cuda")
    if cfg.output_vocab == "target":  # saved with the weights: resuming restores it
        model.set_output_vocab(torch.from_numpy(target_vocabulary(
            [train_data, valid_data], cfg.pad_id, int(train_data.meta["bos_id"]),
            splitter.parents if splitter is not None else None)))
    # Varied batch shapes fragment glibc's heap on CPU; trimming keeps RSS flat (tcmalloc and
    # jemalloc, train.allocator, keep their own heaps).
    allocator = loaded_allocator()
    heap = HeapTrimmer(enabled=device.type == "cpu" and allocator == "glibc")

    state, run_log = RunState(), RunLog()
    if (found := store.resume_point()) is not None:
        path, ckpt = found
        state, run_log = restore(ckpt, path, model=model, optimizer=optimizer,
                                 scheduler=scheduler, scaler=scaler, loader=loader,
                                 train_data=train_data, plan=plan, world=world, seed=p.seed)
    criterion = make_criterion(kernels=t.kernels, label_smoothing=t.label_smoothing,
                               rdrop=t.rdrop, rdrop_fraction=t.rdrop_fraction,
                               pad_id=cfg.pad_id, embedding=model.embedding.weight,
                               amp_dtype=amp_dtype, output=model.output_vocab(),
                               config=kernel_config)
    # Dropout differs between ranks; the seed offset keeps it reproducible per rank.
    if found is None:
        torch.manual_seed(p.seed + 1 + world.rank)
    net: nn.Module = model
    if world.distributed:
        net = nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None)
    if t.compile:
        # After DDP, so that Dynamo splits the graph at DDP's gradient buckets and the
        # all-reduce of one overlaps the backward of the next. Shapes become symbolic after
        # the first new batch shape: 2 graphs whatever the number of shapes.
        net = torch.compile(net)
    return Trainer(p=p, paths=paths, world=world, device=device, model=model, net=net,
                   optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                   criterion=criterion, amp_dtype=amp_dtype, plan=plan, train_data=train_data,
                   valid_data=valid_data, loader=loader, store=store,
                   checkpoint_meta={"model_config": cfg.to_dict(), "vocab_size": vocab_size,
                                    "tokenizer_sha256": tokenizer_sha256,
                                    "identity": identity},
                   heap=heap, allocator=allocator, valid_bleu=valid_bleu,
                   listeners=list(listeners or []), progress=progress, state=state,
                   log=run_log)
