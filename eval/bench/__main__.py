"""``python -m eval.bench``."""

from eval.bench.cli import console_main

console_main()
