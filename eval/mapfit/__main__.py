"""``python -m eval.mapfit``: the command line (``eval/mapfit/cli.py``)."""

from eval.mapfit.cli import console_main

if __name__ == "__main__":
    console_main()
