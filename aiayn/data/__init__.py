"""Data: from a parallel corpus to the batches training reads.

- ``corpus``: the corpus sources (hub, local files, toy), cleaning and the raw split files;
- ``toy``: the built-in synthetic English-German task;
- ``tokenizer``: the shared byte-level BPE vocabulary, encoding and decoding;
- ``survey``: the token lengths of every pair, and the token ids that shards pack;
- ``shards``: token-budget batches planned from those lengths, stored as memory-mapped shards;
- ``batching``: how an optimizer step's token budget becomes micro-batches;
- ``sampler``: the shards read back as padded batches, and which batch each rank takes;
- ``subword``: training batches re-segmented at random (a subword regulariser).
"""
