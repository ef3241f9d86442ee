"""Pictures: training curves (one PNG, three panels) and attention maps (one PNG per kind and
layer, one panel per head)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from aiayn.io import atomic_path

KIND_TITLES = {"encoder_self": "encoder self-attention", "decoder_self": "decoder self-attention",
               "cross": "encoder-decoder attention"}


def plot_attention_layer(weights: np.ndarray, query_tokens: list[str], key_tokens: list[str],
                         title: str, path: Path) -> None:
    """weights: (heads, queries, keys) → a grid of heatmaps, tokens as axis labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = weights.shape[0]
    cols = min(heads, 4)
    rows = math.ceil(heads / cols)
    cell = max(2.2, 0.22 * max(len(key_tokens), len(query_tokens)))
    fig, axes = plt.subplots(rows, cols, figsize=(cols * cell + 1, rows * cell + 0.8),
                             squeeze=False, dpi=110)
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {h + 1}", fontsize=8)
        ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=6)
        ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def plot_attention_maps(maps: dict[str, list], src_tokens: list[str], tgt_tokens: list[str],
                        out_dir: Path) -> list[Path]:
    """Every layer of every kind of attention for one sentence pair (batch row 0).

    ``tgt_tokens`` label the decoder's input positions (BOS + target).
    """
    written = []
    for kind, layers in maps.items():
        queries = src_tokens if kind == "encoder_self" else tgt_tokens
        keys = tgt_tokens if kind == "decoder_self" else src_tokens
        for layer, w in enumerate(layers, start=1):
            path = out_dir / f"{kind}_layer{layer}.png"
            plot_attention_layer(w[0].float().cpu().numpy(), queries, keys,
                                 f"{KIND_TITLES[kind]}, layer {layer}", path)
            written.append(path)
    return written


def plot_training_curves(train_log: Path, valid_log: Path, path: Path) -> None:
    """The train stage's TSV logs → one PNG: loss (train and valid, label-smoothed and NLL),
    validation sacreBLEU (when measured), learning rate, and target tokens per second, each
    against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    train = pd.read_csv(train_log, sep="\t")
    valid = pd.read_csv(valid_log, sep="\t")
    bleu = valid.dropna(subset=["valid_bleu"]) if "valid_bleu" in valid else valid.iloc[:0]
    panels = 4 if len(bleu) else 3
    fig, axes = plt.subplots(1, panels, figsize=(4.7 * panels, 3.8), dpi=100)
    loss_ax, *_, lr_ax, speed_ax = axes
    if len(bleu):
        bleu_ax = axes[1]
        bleu_ax.plot(bleu["step"], bleu["valid_bleu"], "o-", color="tab:red")
        best = bleu.loc[bleu["valid_bleu"].idxmax()]
        # marked, and named in a legend inside the panel (a label above the highest point left
        # the panel; a fixed corner covered the points of a run whose BLEU fell at the end)
        bleu_ax.plot(best["step"], best["valid_bleu"], "*", color="black", markersize=10,
                     label=f"best {best['valid_bleu']:.2f} (step {int(best['step'])})")
        bleu_ax.legend(fontsize=8, loc="best")  # where it covers the fewest points
        bleu_ax.set(title="validation sacreBLEU", xlabel="step")
        bleu_ax.grid(alpha=0.3)
    if len(train):
        dot = {"marker": "o"} if len(train) == 1 else {}  # a line of one point draws nothing
        loss_ax.plot(train["step"], train["loss"], label="train loss", color="tab:blue", **dot)
        loss_ax.plot(train["step"], train["nll"], label="train NLL", color="tab:blue", ls="--",
                     **dot)
        lr_ax.plot(train["step"], train["lr"], color="tab:green", **dot)
        speed_ax.plot(train["step"], train["tokens_per_s"], color="tab:purple", **dot)
    if len(valid):
        loss_ax.plot(valid["step"], valid["valid_loss"], "o-", label="valid loss",
                     color="tab:orange")
        loss_ax.plot(valid["step"], valid["valid_nll"], "o--", label="valid NLL",
                     color="tab:orange")
    loss_ax.set(title="loss per target token", xlabel="step", ylabel="nats")
    if len(train) or len(valid):  # a run stopped before its first log row has no curves yet
        loss_ax.legend(fontsize=8)
    lr_ax.set(title="learning rate", xlabel="step")
    speed_ax.set(title="training target tokens / s (no validation)", xlabel="step")
    for ax in (loss_ax, lr_ax, speed_ax):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def axis_cap(values: list[float], spread: float = 20.0) -> float | None:
    """A symmetric axis limit that keeps bars readable beside an outlier (a row that did
    not train changes perplexity by +100,000%): 1.15 times the largest |value| within
    ``spread`` times the median nonzero |value|; None where nothing lies beyond that."""
    sizes = sorted(abs(v) for v in values if v)
    if not sizes:
        return None
    median = sizes[len(sizes) // 2]
    kept = [v for v in sizes if v <= spread * median]
    return None if len(kept) == len(sizes) else 1.15 * kept[-1]


def plot_table3_changes(changes: list, base: str, path: Path) -> None:
    """Table 3 as a picture (``aiayn.experiments.table3.changes_from_base``): for each row, the
    change from the base in dev BLEU (points) and in dev perplexity (%), ours beside the paper's,
    one bar pair per row in the paper's order; a row not run has the paper's bar alone, one
    that is the base on our params (``same_as_base``) says so beside its zero; an outlier
    (:func:`axis_cap`) is cut at the axis's end and labelled with its value.
    ``base`` says what our base row scored, for the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c.name for c in changes]
    y = np.arange(len(changes))
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.36 * len(changes) + 1.8), dpi=100,
                             sharey=True)
    panels = ((axes[0], "bleu", "paper_bleu", 1.0, "dev BLEU − base's (points)"),
              (axes[1], "ppl", "paper_ppl", 100.0, "dev perplexity / base's − 1 (%)"))
    for ax, ours_key, paper_key, scale, title in panels:
        paper = [getattr(c, paper_key) * scale for c in changes]
        ours = [getattr(c, ours_key) for c in changes]
        ran = [i for i, v in enumerate(ours) if v is not None]
        cap = axis_cap(paper + [ours[i] * scale for i in ran])
        limit = math.inf if cap is None else cap

        def clip(v: float, limit: float = limit) -> float:
            return max(-limit, min(limit, v))

        ax.barh(y - 0.2, [clip(v) for v in paper], height=0.4, color="0.7",
                label="paper (WMT14 newstest2013)")
        ax.barh(y[ran] + 0.2, [clip(ours[i] * scale) for i in ran], height=0.4,
                color="tab:blue", label="ours")
        for i in ran:  # a bar beyond the axis is cut at its end and says its value
            if clip(v := ours[i] * scale) != v:
                unit = "%" if scale == 100.0 else ""
                ax.text(clip(v), y[i] + 0.2, f"{v:+,.0f}{unit} " if v > 0 else f" {v:+,.1f}{unit}",
                        va="center", ha="right" if v > 0 else "left", fontsize=7,
                        color="white", fontweight="bold")
        if cap is not None:
            ax.set_xlim(-cap, cap)
        for i, v in enumerate(ours):
            if v is None or changes[i].same_as_base:
                ax.text(0, y[i] + 0.2, " not run" if v is None else " = base", va="center",
                        fontsize=7, color="0.4")
        ax.axvline(0, color="black", lw=0.8)
        for i in range(1, len(changes)):  # a line between the paper's groups
            if changes[i].group != changes[i - 1].group:
                ax.axhline(i - 0.5, color="0.6", lw=0.6, ls=":")
        ax.set(title=title)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()  # the paper's order, top to bottom
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"Table 3: each row against the base row (ours: {base})", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
