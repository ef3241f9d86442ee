"""attention: attention maps of a trained model for one sentence pair, as PNG images."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stages.common import log, single_command_app, stage


@stage
def attention(
    source: Annotated[str, typer.Argument(help="Source sentence.")],
    target: Annotated[str | None, typer.Argument(help="Target sentence; default: the model's own greedy translation.")] = None,
    model: Annotated[Path, typer.Option(help="Folder from `aiayn average`.")] = Path("data/model"),
    out: Annotated[Path, typer.Option(help="Folder for the PNG files.")] = Path("data/attention"),
) -> None:
    """Plot encoder self-attention, decoder self-attention and encoder-decoder attention,
    per layer (one PNG each) and head (one panel each), with the BPE tokens as axis labels.

    Reads: MODEL (weights, config and tokenizer from `aiayn average`); not params.yaml.
    Writes: OUT/{encoder_self,decoder_self,cross}_layer{N}.png.
    """
    import torch

    from aiayn.data.tokenizer import BOS_ID, EOS_ID, decode
    from aiayn.decoding.beam import greedy_search
    from aiayn.decoding.translation import load_translator
    from aiayn.plots import plot_attention_maps

    tr = load_translator(model, device="cpu")
    tok = tr.tokenizer
    src_ids = tok.encode(source, add_special_tokens=False).ids + [EOS_ID]
    src = torch.tensor([src_ids])
    if target is None:
        tgt_ids = greedy_search(tr.model, src)[0]
        target = decode(tok, tgt_ids)
    else:
        tgt_ids = tok.encode(target, add_special_tokens=False).ids
    tgt_in = torch.tensor([[BOS_ID] + tgt_ids])

    def label(i: int) -> str:
        return tok.decode([i], skip_special_tokens=False).replace(" ", "·") or tok.id_to_token(i)

    with torch.no_grad():
        maps = tr.model.attention_maps(src, tgt_in)
    paths = plot_attention_maps(maps, [label(i) for i in src_ids],
                                [label(i) for i in [BOS_ID] + tgt_ids], out)
    log.info("attention: %r -> %r: %d images in %s", source, target, len(paths), out)


app = single_command_app(attention, "Plot attention maps.")

if __name__ == "__main__":
    app()
