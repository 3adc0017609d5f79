"""``python -m eval.bench``: benchmarks of slimmed models, one subcommand a module."""
