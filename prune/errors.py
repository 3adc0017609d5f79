"""User-facing errors: one line that says what is wrong and how to fix it."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class LayercutError(ValueError):
    """Bad input from the user. The message is one line naming the fix; CLIs exit with code 2."""


def cli_entry(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a CLI ``main`` so a ``LayercutError`` prints one line and returns exit code 2 (Ctrl-C: 130).

    Only errors we raised on purpose are turned into one-liners; anything else is a bug and keeps
    its traceback.
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        try:
            return main(argv) or 0
        except LayercutError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except KeyboardInterrupt:  # Ctrl-C: temporary folders are removed on the way out, no half checkpoint stays
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return wrapper
