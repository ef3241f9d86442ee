"""Pictures: attention maps (one PNG per kind and layer, one panel per head)."""

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
