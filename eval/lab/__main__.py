"""``python -m eval.lab``: the diagnostics' command line (``eval/lab/cli.py``)."""

from eval.lab.cli import console_main

if __name__ == "__main__":
    console_main()
