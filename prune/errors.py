"""User-facing errors: one line that says what is wrong and how to fix it."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

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


# signals a crash inside native code ends a process by (not a request to stop, nor the kernel out of memory)
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT", "SIGFPE"})


def signal_name(returncode: int) -> str:
    """The name of the signal a child process ended by (its negative ``returncode``)."""
    try:
        return signal.Signals(-returncode).name
    except ValueError:  # a real-time signal has no name
        return f"signal {-returncode}"


def ended_by(returncode: int) -> str:
    """:func:`signal_name`, with what SIGKILL means."""
    name = signal_name(returncode)
    return f"{name} (out of memory, or stopped)" if name == "SIGKILL" else name


_CRASH_STREAM = None


def show_native_crashes() -> None:
    """A crash inside a native library (llama.cpp, a CUDA kernel, bitsandbytes) prints the Python stack it was in.

    Without it a segmentation fault ends the run with no word of which step or file it was in.
    """
    import faulthandler

    global _CRASH_STREAM
    if faulthandler.is_enabled():  # pytest, or python -X faulthandler, holds it already
        return
    try:
        # a copy of stderr's descriptor: llama-cpp-python points descriptor 2 at /dev/null while it loads a model
        # (verbose=False), which is where a crash of that load would write its stack
        stream = os.fdopen(os.dup(sys.stderr.fileno()), "w")
        faulthandler.enable(file=stream)
        _CRASH_STREAM = stream  # open for as long as the handler may write to it
    except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr, or one with no descriptor (an
        # embedding host, pythonw)
        pass


def cli_entry(main: Callable[..., int | None]) -> Callable[..., int]:
    """Wrap a CLI ``main``: a ``LayercutError`` prints one line and returns 2; Ctrl-C returns 130, SIGTERM 143.

    Only errors we raised on purpose are turned into one-liners; anything else is a bug and keeps
    its traceback. Ctrl-C and SIGTERM unwind the stack as an exception, so context managers remove
    their temporary folders, then print one line (``interrupted`` / ``terminated``).
    """

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        show_native_crashes()
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


class CommandParser(argparse.ArgumentParser):
    """The argument parser of every layercut command: a bad flag or value is one line and exit 2, as any refusal.

    argparse prints the whole usage (dozens of flags) above its message, and that message is then hard to find; here
    it stands alone, with a pointer to ``--help``. A value that starts with ``-`` and is not a number
    (``--time-budget -5m``) reads as a flag to argparse, which then says the option "expected one argument": the
    line names the value instead and asks for a positive one (a negative number of the form ``-5`` is a value to
    argparse, and the option's own check refuses it). Subcommands' parsers (``add_subparsers``) are of this class.
    """

    def parse_known_args(self, args=None, namespace=None):
        """As argparse's, keeping the words parsed so that :meth:`error` can name a value it took for a flag."""
        self._words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` on one line and exit with code 2 (bad input)."""
        message = " ".join((self._dash_value(message) or message).split())
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _dash_value(self, message: str) -> str | None:
        """For "expected one argument" before a word that starts with '-' but is no flag: what the user meant."""
        match = re.fullmatch(r"argument (\S+): expected one argument", message)
        if match is None:
            return None
        names = match.group(1).split("/")
        words = getattr(self, "_words", [])
        at = next((i for i, word in enumerate(words) if word in names), None)
        if at is None or at + 1 >= len(words):
            return None
        value = words[at + 1]
        if not value.startswith("-") or value in self._option_string_actions:
            return None
        flag = names[-1]
        if not re.match(r"-[\d.]", value):  # a word that merely starts with '-' (a file name): it can be passed
            return f"argument {flag}: {value} reads as a flag, not as its value: write {flag}={value}"
        action = self._option_string_actions[flag]
        noun = action.metavar.lower() if isinstance(action.metavar, str) else "value"
        example = re.search(r"\((\d[^(),;]*)", action.help or "")  # "(30m, 1h)" in the help: 30m
        such = f" such as {example.group(1).strip()}" if example else ""
        return f"argument {flag}: {value} is not a value it takes: give a positive {noun}{such}"
