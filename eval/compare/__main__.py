"""``python -m eval.compare``: the comparison's command line (``eval/compare/cli.py``)."""

from eval.compare.cli import console_main

if __name__ == "__main__":
    console_main()
