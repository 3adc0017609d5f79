"""A distillation launched on several processes by accelerate's own launcher, from a student on disk.

:class:`distill.step.DistillStep` with ``processes=N`` (``prune.ship --processes N``) writes the teacher's cache
first, in its own process, then starts ``accelerate launch --multi_gpu --num_processes N -m distill.worker JOB``
(:func:`train_on_processes`). Every process loads the student from its folder and reads the cache; none loads
the teacher. Data parallel: accelerate's DDP, over gloo on the CPU (``distill.processes``), one GPU a process
otherwise. FSDP is not offered: the heal trains LoRA, which ``distill.sharded`` keeps replicated.

The processes split each step's ``batch_size`` sequences between them (``batch_size / N`` each, the same
``grad_accum``): ``distill.batches`` gives the step the same rows, the mean over them is the same loss, DDP
averages the gradients, so the weights are one process's within float rounding. The main process writes the
trained (merged) weights and the run's report into the work folder; the caller reads them back. Checkpoints
are the work folder's as ever: a run stopped on N processes continues on any count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from distill.config import DistillConfig
from distill.layout import Layout
from prune.atomic import write_file_atomic
from prune.errors import LayercutError

logger = logging.getLogger(__name__)

JOB_FILE = "launch.json"  # what every process reads
TRAINED_FILE = "trained.safetensors"  # the main process's trained student, LoRA merged
RESULT_FILE = "launched.json"  # its report
LAUNCH_FORMAT = 1  # bumped when what the job file holds changes
PR_SET_PDEATHSIG = 1  # prctl's option: the signal a process gets when its parent dies (linux/prctl.h)
STOP_SECONDS = 30  # after a Ctrl-C or SIGTERM, how long the processes have to stop before they are killed


@dataclass
class LaunchJob:
    """What each launched process needs to train the same student as one process would.

    Attributes:
        student: the student's folder (``prune.load`` reads it in every process).
        dtype: the dtype it is loaded in.
        device: ``cpu``: every process on the CPU (gloo); else one GPU a process (``cuda:LOCAL_RANK``).
        config: the one-process run's options; each process takes ``batch_size / processes`` of a step's sequences.
        layout: the student's layout (the teacher's states its blocks stand for).
        cache_key: the key of the teacher cache in ``work`` that every process reads (written before the launch).
        work: the run's work folder: checkpoints, the log, the cache, the job and the trained weights.
        resume: continue from the work folder's latest checkpoint.
        processes: how many processes.
    """

    student: str
    dtype: str
    device: str
    config: DistillConfig
    layout: Layout
    cache_key: str
    work: str
    resume: bool
    processes: int

    def __post_init__(self):
        per_process(self.config, self.processes)  # refused before anything starts

    @property
    def on_cpu(self) -> bool:
        """Whether the processes run on the CPU (over gloo)."""
        return self.device == "cpu"

    def to_json(self) -> dict:
        """The job file's contents."""
        return {"format": LAUNCH_FORMAT, **dataclasses.asdict(self), "config": self.config.to_dict()}

    @classmethod
    def from_json(cls, data: dict) -> LaunchJob:
        """The job of a job file written by :meth:`to_json` (of this format)."""
        if data.get("format") != LAUNCH_FORMAT:
            raise LayercutError(f"{JOB_FILE} of format {data.get('format')}, this layercut writes {LAUNCH_FORMAT}: "
                                "run the command again")
        values = {k: v for k, v in data.items() if k != "format"}
        return cls(**{**values, "config": DistillConfig.from_dict(values["config"])})


def per_process(config: DistillConfig, processes: int) -> DistillConfig:
    """``config`` for one of ``processes`` processes: its share of each micro-batch's sequences.

    Raises:
        LayercutError: ``processes`` does not divide ``batch_size`` (the processes could not draw a step's rows).
    """
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise LayercutError(f"--processes must be a positive integer, got {processes!r}")
    if config.batch_size % processes:
        shares = ", ".join(str(n) for n in range(1, config.batch_size + 1) if config.batch_size % n == 0)
        raise LayercutError(f"--processes {processes}: the {config.batch_size} sequences of a step are split evenly "
                            f"between the processes: give one of {shares}")
    return dataclasses.replace(config, batch_size=config.batch_size // processes)


def check_devices(processes: int, device: str) -> None:
    """Refuse, in one line, more processes than GPUs when the model is on a GPU (one GPU a process)."""
    if processes > 1 and device != "cpu" and torch.cuda.device_count() < processes:
        raise LayercutError(f"--processes {processes} with --device {device}: one GPU a process, and "
                            f"{torch.cuda.device_count()} are visible: give at most that many, or --device cpu")


def train_on_processes(job: LaunchJob, precision: str) -> tuple[dict, Path | None]:
    """Launch ``job`` on its processes and wait; (the main process's report, its training log).

    ``precision``: the autocast of the one-process run (``no`` on the CPU). The trained weights are left in
    ``work/TRAINED_FILE`` for :func:`load_trained`.

    Raises:
        LayercutError: a process failed (its own message is above, on stderr).
    """
    work = Path(job.work)
    work.mkdir(parents=True, exist_ok=True)
    for name in (TRAINED_FILE, RESULT_FILE):  # never read back what an earlier, stopped launch left
        (work / name).unlink(missing_ok=True)
    path = work / JOB_FILE
    write_file_atomic(path, lambda staging: staging.write_text(json.dumps(job.to_json(), indent=1), encoding="utf-8"))
    threads = max(1, torch.get_num_threads() // job.processes)  # the processes share this process's threads
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
               str(job.processes), "--num_machines", "1", "--mixed_precision", precision if not job.on_cpu else "no",
               "--dynamo_backend", "no", "--main_process_port", "0", "--num_cpu_threads_per_process", str(threads),
               "-m", "distill.worker", str(path)]
    env = dict(os.environ)
    if job.on_cpu:  # a GPU in view would make accelerate choose NCCL for a student on the CPU
        env["CUDA_VISIBLE_DEVICES"] = ""
    logger.info("training on %d processes (%s)", job.processes, "gloo, the CPU" if job.on_cpu else "one GPU each")
    code = _run_group(command, env)
    if code != 0 or not (work / RESULT_FILE).is_file():
        raise LayercutError(f"the distillation's {job.processes} processes stopped (exit {code}): their message is "
                            "above; the same command continues from the latest checkpoint")
    result = json.loads((work / RESULT_FILE).read_text(encoding="utf-8"))
    return result["report"], Path(result["log"]) if result.get("log") else None


def _run_group(command: list[str], env: dict) -> int:
    """Run ``command`` in a process group of its own; a Ctrl-C or SIGTERM here stops the whole group too.

    The launcher is also told to stop when this process dies without a word (``kill -9``): else its processes
    would train on, and a rerun would launch a second set on the same work folder.
    """
    child = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_stop_with_parent)
    try:
        return child.wait()
    except BaseException:
        _stop(child)
        raise


def _stop_with_parent() -> None:
    """In the launcher before it starts (Linux): SIGTERM when its parent dies; it then stops its processes."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM the launcher's group (its processes save nothing half-written), SIGKILL it if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=STOP_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def load_trained(model: torch.nn.Module, work: str | Path) -> None:
    """Put the launched run's trained weights (``work/TRAINED_FILE``) into ``model``, the same student."""
    from safetensors.torch import load_file

    state = load_file(str(Path(work) / TRAINED_FILE))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_model writes a tied tensor once: a key left out must share its storage with one that was read
    tensors = model.state_dict()
    read = {tensors[key].data_ptr() for key in state}
    untied = [key for key in missing if tensors[key].data_ptr() not in read]
    if unexpected or untied:
        raise LayercutError(f"{TRAINED_FILE} does not hold this student's weights ({(unexpected or untied)[0]}): "
                            "run the command again")


def train_launched(path: Path) -> None:
    """One launched process: load the student, read the cache, train its share; the main process writes back.

    ``distill.worker`` calls it in every process ``accelerate launch`` started.
    """
    from safetensors.torch import save_model

    from distill.processes import process_state
    from distill.teacher_cache import cache_folder, open_cache
    from distill.train import distill
    from prune.checkpoint.save_load import load

    job = LaunchJob.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
    state = process_state()
    if state.num_processes != job.processes:
        raise LayercutError(f"{path} is a job for {job.processes} processes, launched on {state.num_processes}")
    work = Path(job.work)
    device = job.device if job.on_cpu else f"cuda:{state.local_process_index}"
    student = load(job.student, dtype=job.dtype, device=device)
    cache = open_cache(cache_folder(work), key=job.cache_key)
    if cache is None:
        raise LayercutError(f"the teacher cache in {cache_folder(work)} is missing or another run's: run the command "
                            "again (it writes the cache before launching)")
    result = distill(student.model, None, student.tokenizer, per_process(job.config, job.processes), out=work,
                     resume=job.resume, layout=job.layout, teacher_cache=cache)
    if state.is_main_process:
        write_file_atomic(work / TRAINED_FILE,
                          lambda staging: save_model(student.model, str(staging), force_contiguous=True))
        # the report of the whole run (the one-process options), and the processes that ran it
        report = {**result.report(job.config), "processes": state.num_processes}
        result_json = {"report": report, "log": str(result.log_path) if result.log_path else None}
        write_file_atomic(work / RESULT_FILE,
                          lambda staging: staging.write_text(json.dumps(result_json), encoding="utf-8"))
    state.wait_for_everyone()
