"""``python -m prune.ship``: the command users were first shown, kept as an alias of :mod:`ship.cli`.

    python -m prune.ship --model smollm2-135m --drop 8 --engine llamacpp --out slim8/

``prune.ship`` lives on its own floor above ``eval`` and ``distill`` (the top-level ``ship`` package); this
module only forwards to its command, the one import from ``prune`` upwards, declared in ``pyproject.toml``.
"""

from ship.cli import build_parser, config_from_args, console_main, main

__all__ = ["build_parser", "config_from_args", "console_main", "main"]

if __name__ == "__main__":
    console_main()
