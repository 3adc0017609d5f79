"""``python -m ship``: the same command as ``python -m prune.ship``."""

from ship.cli import console_main

if __name__ == "__main__":
    console_main()
