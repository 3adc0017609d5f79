"""SIGTERM (what `timeout` and job schedulers send) ends a CLI as Ctrl-C does: temp folders removed, one line, 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prune.errors import EXIT_TERMINATED, Terminated, cli_entry, sigterm_raises

REPO = Path(__file__).resolve().parents[2]

# A CLI that stages an export as prune.run does and stops in the middle of writing it.
EXPORT_SCRIPT = textwrap.dedent("""
    import sys, time
    from prune.errors import cli_entry
    from prune.atomic import atomic_directory

    @cli_entry
    def main(argv):
        with atomic_directory(argv[0]) as staging:
            (staging / "model.safetensors").write_bytes(b"0" * 4096)
            print("writing", flush=True)
            time.sleep(120)

    raise SystemExit(main(sys.argv[1:]))
""")

# prune.run itself on the tiny model, paused inside the export (its staging folder holds the weights
# and the profile plot is being drawn).
PRUNE_SCRIPT = textwrap.dedent("""
    import sys, time
    import prune.pipeline.runner
    from prune.run import main

    real_plot = prune.pipeline.runner.plot_linearity_profile

    def plot_then_wait(*args, **kwargs):
        real_plot(*args, **kwargs)
        print("writing", flush=True)
        time.sleep(120)

    prune.pipeline.runner.plot_linearity_profile = plot_then_wait
    raise SystemExit(main(sys.argv[1:]))
""")


def terminate_while_writing(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Start ``argv``, wait for its ``writing`` line, send SIGTERM; the finished process."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", (line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_sigterm_during_an_export_removes_the_staging_folder_and_exits_143(tmp_path):
    out = tmp_path / "term"
    done = terminate_while_writing([sys.executable, "-c", EXPORT_SCRIPT, str(out)], tmp_path)
    assert done.returncode == EXIT_TERMINATED, done.stderr
    assert done.stderr.strip() == "terminated"
    assert leftovers(tmp_path) == [] and not out.exists()


def test_sigterm_during_prune_run_export_leaves_nothing_beside_out(tiny_folder, sample_text, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(sample_text)
    out = tmp_path / "slim"
    argv = [sys.executable, "-c", PRUNE_SCRIPT, "--model", str(tiny_folder), "--data", str(text), "--samples", "8",
            "--seq-len", "32", "--heldout-samples", "0", "--drop", "1", "--out", str(out), "--threads", "1"]
    done = terminate_while_writing(argv, tmp_path)
    assert done.returncode == EXIT_TERMINATED, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "terminated" and "Traceback" not in done.stderr
    assert leftovers(tmp_path) == [] and not out.exists()


def test_the_handler_is_restored_and_sigterm_unwinds_like_ctrl_c():
    before = signal.getsignal(signal.SIGTERM)
    cleaned = []

    @cli_entry
    def main(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as soon as kill returns
        finally:
            cleaned.append(True)

    assert main([]) == EXIT_TERMINATED and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before
    assert issubclass(Terminated, KeyboardInterrupt)  # every Ctrl-C clean-up runs for SIGTERM too
    with pytest.raises(Terminated), sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_forked_child_gets_the_default_sigterm_so_its_parent_can_stop_it():
    # multiprocessing's Pool.terminate (lm-eval's bootstrap) stops its workers with SIGTERM; with the parent's
    # Python handler a worker blocked on a semaphore could miss it and the parent waited forever.
    with sigterm_raises():
        ours = signal.getsignal(signal.SIGTERM)
        pid = os.fork()
        if pid == 0:  # the child: report the handler it inherited, leave at once
            os._exit(0 if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert signal.getsignal(signal.SIGTERM) is ours  # the parent keeps its clean-up


def test_a_crash_inside_a_native_library_names_the_python_step_it_was_in():
    """llama.cpp or a CUDA library crashing ends the run by a signal; the CLI prints the Python stack it was in."""
    script = textwrap.dedent("""
        import ctypes, sys
        from prune.errors import cli_entry

        def quantize_the_gguf():
            ctypes.string_at(0)  # a read of address 0, as a native library's crash

        @cli_entry
        def main(argv):
            quantize_the_gguf()

        raise SystemExit(main(sys.argv[1:]))
    """)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONFAULTHANDLER"}  # the CLI's doing alone
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=60)
    assert done.returncode == -signal.SIGSEGV
    assert "Segmentation fault" in done.stderr and "quantize_the_gguf" in done.stderr, done.stderr
