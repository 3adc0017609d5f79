"""Benchmarks of slimmed models against their original.

    python -m eval.bench --help                     # every registered subcommand, one line each
    python -m eval.bench speed --engine llamacpp --model slim/ --baseline dense/ --threads 2 [--out bench/]
    python -m eval.bench serving --model dense=smollm2-135m --model slim=slim/ --heldout ptb.txt [--out serving/]

Each subcommand is a module of :mod:`eval.bench` that registers itself in ``eval.bench.registry.SUBCOMMANDS``
(name -> its options dataclass, its run); this module imports every module of the package, derives one
sub-parser per registered subcommand from its options and hands ``run`` the options object the flags build
(each module's docstring shows its command). A new subcommand is one module here: its options dataclass, its
run, one ``register_subcommand`` call (plus its test).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil

import eval.bench
from eval.bench.registry import SUBCOMMANDS, Subcommand, register_subcommand
from prune.errors import CommandParser, cli_entry

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "console_main", "discover_subcommands", "main",
           "register_subcommand"]

logger = logging.getLogger(__name__)

NOT_SUBCOMMANDS = {"checks", "cli", "output", "registry"}  # modules of eval.bench that register no subcommand


def discover_subcommands() -> list[str]:
    """Import every module of :mod:`eval.bench` (each registers its subcommand); the registered names."""
    for info in pkgutil.iter_modules(eval.bench.__path__):
        if info.name not in NOT_SUBCOMMANDS and not info.name.startswith("_"):  # not __main__
            importlib.import_module(f"eval.bench.{info.name}")
    return SUBCOMMANDS.names()


discover_subcommands()


def build_parser() -> argparse.ArgumentParser:
    """Build the ``eval.bench`` parser with one sub-parser per registered subcommand."""
    parser = CommandParser(prog="python -m eval.bench", description=__doc__.split("\n\n")[0])
    # by name: the registry's order is the order its modules were first imported, which callers decide
    names = sorted(SUBCOMMANDS.names())
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(names) + "}")
    for name in names:
        command = SUBCOMMANDS[name]
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run one ``eval.bench`` subcommand."""
    args = build_parser().parse_args(argv)
    command = SUBCOMMANDS[args.command]
    return command.run(command.parse(args))


def console_main() -> None:
    """Entry point of the ``layercut-bench`` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
