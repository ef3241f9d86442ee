"""aiayn: the Transformer of "Attention Is All You Need" as a reproducible pipeline."""

__version__ = "0.1.0"
