"""What incremental decoding carries between steps (:meth:`aiayn.model.Transformer.start`,
``decode_step``): the encoder's output and mask, and each decoder layer's cache (its
self-attention's keys and values, "k" and "v", grown by a position per step; its
cross-attention's, "cross", computed once). Beam search reorders it as hypotheses survive
(:mod:`aiayn.decoding.beam`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class DecoderState:
    """What decoding carries between steps: encoder output, mask and per-layer caches."""

    memory: Tensor  # (N, S, d): one row per source
    src_mask: Tensor  # (N, 1, 1, S) bool
    caches: list[dict] = field(default_factory=list)
    position: int = 0
    # Decoder rows per source: rows g*r .. g*r + g - 1 read source r (beam search's g
    # hypotheses of one sentence). The source side (memory, mask, cross-attention keys and
    # values) is kept once per source, not copied per row and reordered with the beams.
    group: int = 1

    def reorder(self, index: Tensor, sources: Tensor | None = None) -> DecoderState:
        """Select decoder rows ``index`` (beam search keeps the survivors): the
        self-attention caches. ``sources``: the sources kept, in order (the memory, the mask
        and the cross-attention caches); with ``group`` 1 they are the rows themselves, by
        default. With a larger group and no ``sources`` the sources stay as they are, and
        ``index`` must keep each row among its own source's rows."""
        if sources is None and self.group == 1:
            sources = index

        def pick(v: Tensor | tuple, i: Tensor | None) -> Tensor | tuple:
            if i is None:
                return v
            return tuple(t.index_select(0, i) for t in v) if isinstance(v, tuple) \
                else v.index_select(0, i)
        caches = [{k: pick(v, sources if k == "cross" else index) for k, v in c.items()}
                  for c in self.caches]
        return DecoderState(pick(self.memory, sources), pick(self.src_mask, sources), caches,
                            self.position, self.group)
