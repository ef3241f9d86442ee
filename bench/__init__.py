"""The benchmarks: one script per question, run from the repository root as modules,
``.venv/bin/python -m bench.<name> --help``. What they share (arguments, machine facts,
alternating rounds, the JSON record, a baseline commit's tree) is ``bench.harness``;
bench/README.md lists the scripts and their results."""
