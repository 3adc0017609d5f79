"""User-facing errors: one line that says what is wrong and how to fix it."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM, what `timeout` and job schedulers send


class LayercutError(ValueError):
    """Bad input from the user. The message is one line naming the fix; CLIs exit with code 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived. A ``KeyboardInterrupt``, so every clean-up written for Ctrl-C runs for it too."""


def _raise_terminated(signum, frame) -> None:
    # A second SIGTERM (schedulers may signal every process of a job) must not cut the clean-up short:
    # the temporary folders the first one unwinds are being removed. kill -9 still stops the process.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def _default_sigterm_in_child() -> None:
    # A forked child (lm-eval's bootstrap pool, a DataLoader worker) inherits the Python handler, and its
    # parent stops it with SIGTERM (Pool.terminate). A Python handler only runs between bytecodes, so a
    # signal that lands just before the child blocks in C (a semaphore wait) is never acted on and the
    # parent waits for that child forever: a grid of lm-eval cells hung so on 2026-11-29. The default
    # action ends the child in the kernel, with no such window; the parent keeps its clean-up.
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_child)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread; the previous handler comes back after.

    Python's default for SIGTERM ends the process at once: no ``finally`` block runs, so a killed
    export would leave its hidden temporary folder beside ``--out``. Off the main thread (where a
    handler cannot be set) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cli_entry(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a CLI ``main``: a ``LayercutError`` prints one line and returns 2; Ctrl-C returns 130, SIGTERM 143.

    Only errors we raised on purpose are turned into one-liners; anything else is a bug and keeps
    its traceback. Ctrl-C and SIGTERM unwind the stack as an exception, so context managers remove
    their temporary folders, then print one line (``interrupted`` / ``terminated``).
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        try:
            with sigterm_raises():
                return main(argv) or 0
        except LayercutError as err:
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except Terminated:  # before KeyboardInterrupt: it is one
            print("terminated", file=sys.stderr)
            return EXIT_TERMINATED
        except KeyboardInterrupt:  # Ctrl-C: temporary folders are removed on the way out, no half checkpoint stays
            print("interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED

    return wrapper
