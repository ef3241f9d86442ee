"""Experiments: runs of the pipeline as DVC keeps them, and the paper's Table 3 built from them.

- ``dvc_exps``: DVC's experiments as its Python API lists them, with their files as their
  commits hold them;
- ``table3``: Table 3's rows as experiments on the current params, and their results.
"""
