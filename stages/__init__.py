"""The pipeline's stages: thin Typer commands over the ``aiayn`` library.

Each module is one DVC stage (see dvc.yaml). It parses arguments, loads and validates
``params.yaml`` once, resolves paths, then calls plain library functions with typed values.
"""
