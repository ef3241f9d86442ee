"""Decoding: a trained model's translations and their scores.

- ``beam``: batched beam search and greedy search (Section 6.1), the length penalty;
- ``translation``: text in, text out: a model and its tokenizer decoding a file in batches;
- ``scoring``: BLEU and chrF of detokenized translations against the raw references.
"""
