"""``python -m eval.lens ...``: the lens CLI, :mod:`eval.lens.run`."""

from eval.lens.run import console_main

if __name__ == "__main__":
    console_main()
