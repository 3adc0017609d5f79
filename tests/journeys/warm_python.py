"""A Python with torch and transformers already imported, that forks a fresh child for each command it is sent.

Each command of the fault journeys ran as a new ``python``, paying torch's, transformers' and the llama modelling
code's import (8 s of CPU on 2 cores) before any work; a child forked from this server starts with those modules
imported and nothing else done: no model built, no layercut module imported, no thread pool started, the
environment and working folder its own. It is still a process of its own: ``kill -9`` ends it alone, with no
``finally``, handler or atexit hook run, and the exit code reads as :mod:`subprocess` gives it (``-9``).

The server reads one JSON request a line on stdin, ``{"argv", "env", "cwd", "stdout", "stderr", "timeout"}``, where
argv is what follows ``python`` (``["-m", module, ...]`` or ``[script, ...]``), and answers with the child's exit code.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# the modules every command here imports first and that cost most of its start; layercut's own are left to the child
PRELOAD = ("torch", "transformers", "safetensors.torch", "transformers.models.llama.modeling_llama")

SERVER = """
import json, os, runpy, signal, sys
for name in {preload!r}:
    __import__(name)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: the command's own environment, folder, streams and arguments, then python's own exit
        signal.alarm(request["timeout"])  # SIGALRM ends a hung command as subprocess.run's timeout would
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        streams = ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write), (2, request["stderr"], write))
        for fd, path, flags in streams:
            os.dup2(os.open(path, flags, 0o644), fd)
        argv, sys.path[:] = request["argv"], [p for p in sys.path if p]  # not the server's '' (its own folder)
        if argv[0] == "-m":  # python -m MODULE: the working folder first on the path
            sys.argv, sys.path[:0] = argv[1:], [os.getcwd()]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT: the script's folder first
            sys.argv, sys.path[:0] = argv, [os.path.dirname(os.path.abspath(argv[0]))]
            runpy.run_path(argv[0], run_name="__main__")
        sys.exit(0)  # SystemExit or an error raised above ends the child as it ends python: atexit, threads, flush
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


class WarmPython:
    """A server started once; :meth:`run` is :func:`subprocess.run` of ``[sys.executable, *argv]`` for one command."""

    def __init__(self, env: dict[str, str]):
        self._lock, self._streams = threading.Lock(), Path(tempfile.mkdtemp(prefix="warm-python-"))
        self._server = subprocess.Popen([sys.executable, "-c", SERVER.format(preload=PRELOAD)], env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, argv: list, *, cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
        """Runs ``python ARGV`` in ``cwd`` in a forked child, ended by SIGALRM after ``timeout`` seconds."""
        out, err = self._streams / "stdout", self._streams / "stderr"  # outside cwd: the command sees only its own
        request = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        with self._lock:
            self._server.stdin.write(json.dumps(request) + "\n")
            self._server.stdin.flush()
            answer = self._server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the warm Python server stopped (exit code {self._server.poll()})")
        code = json.loads(answer)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(timeout=60)
        shutil.rmtree(self._streams, ignore_errors=True)
