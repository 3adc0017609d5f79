"""The verify stage: the file that ships, in its engine, against transformers on the same token ids, and its speed.

For every held-out text: the original and the slim checkpoint in transformers, and the shipped file in the
engine (the GGUF of ``--gguf-type`` for llama.cpp, the folder for vLLM): perplexity and greedy ids. The
original's rows are measured once per model, text and library versions, then read from the cache. Then what the
checkpoint writes after prompts cut from those texts, judged by the original (generation fidelity, in
transformers: multiple choice and perplexity hide what shows when a model writes), and the shipped file's speed
against the original's in the engine; with ``--tasks``, lm-eval's tasks on the original and the checkpoint on the
same rows, in transformers. The engines run in processes of their own
(:func:`eval.bench.checks.run_in_child`): their memory and their failures stay theirs. Each check's figures
are kept in ``OUT.work/verify/`` as it ends, so a stopped run measures only what is left.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from eval.bench.checks import CheckCrashed, ServingCheck, SpeedCheck, run_in_child
from eval.speed.engines import REFERENCE, get_engine
from eval.speed.engines.base import options_class
from prune.atomic import write_file_atomic
from prune.checkpoint.write import portable
from prune.errors import CRASH_SIGNALS
from ship.config import ShipConfig, heldout_label
from ship.work import StageResult, write_json_atomic

ORIGINAL, SLIM, SHIPPED = "original", "slim", "shipped"
# beside a check's figures (serving.no-repack.txt): why it loaded the engine's files with its extra buffer types off
NO_REPACK = ".no-repack.txt"
CHECK_WORDS = {"ServingCheck": "the serving check", "SpeedCheck": "the speed check"}


@dataclass(kw_only=True)
class Verified(StageResult):
    """``verify.json``: per held-out text the serving rows, the speed comparison, and which file each measured."""

    domains: dict
    speed: dict
    heldout: list
    files: dict = field(default_factory=dict)
    fidelity: dict = field(default_factory=dict)  # FidelityCheck's figures, or {"skipped": why}
    tasks: dict = field(default_factory=dict)  # TasksCheck's figures (--tasks); empty: none asked
    # each check's wall seconds, its fresh process included (None: kept by an earlier run, or skipped)
    check_seconds: dict = field(default_factory=dict)


def shipped_file(config: ShipConfig, checkpoint: Path, gguf: Path | None) -> Path:
    """What the user serves: the GGUF for llama.cpp, else the checkpoint folder."""
    return gguf if config.gguf and gguf is not None else checkpoint


def verify(config: ShipConfig, checkpoint: Path, gguf: Path | None, heldout: list[str], folder: Path,
           say=print) -> Verified:
    """Measure the shipped file in its engine and the checkpoint in transformers on every held-out text.

    ``heldout``: the texts (``LABEL=TEXT`` or a path); ``folder``: where each check's figures are kept.
    """
    folder.mkdir(parents=True, exist_ok=True)
    served = shipped_file(config, checkpoint, gguf)
    repack = _Repack(config, folder)
    models = [(ORIGINAL, config.prune.load.model, REFERENCE), (SLIM, str(checkpoint), REFERENCE)]
    if config.engine != REFERENCE:
        models.append((SHIPPED, str(served), config.engine))
    texts = tuple(heldout_label(spec) for spec in heldout)
    data, load = config.prune.data, config.prune.load
    tokens = max(data.heldout_samples, 1) * data.seq_len if not config.heldout else 4096
    # the checks load the models as the run did (--dtype, --device): a bf16 run on a GPU is verified there
    serving = ServingCheck(models=tuple(models), texts=texts, tokenizer=load.model, seq_len=data.seq_len,
                           tokens=tokens, threads=config.threads, converter=config.converter,
                           kept=(ORIGINAL,),  # the original's rows are the same in every run of it: kept in the cache
                           dtype=load.dtype, device=load.device, offload=load.offload, no_repack=repack.off)
    seconds: dict = {}
    domains = _kept(folder / "serving.json", lambda: repack.run(serving, folder / "serving.log", say),
                    lambda: say(f"verifying: {len(texts)} held-out text(s), the original and the checkpoint in "
                                f"transformers" + (f", {served.name} in {config.engine}"
                                                   if config.engine != REFERENCE else "")), seconds)
    if load.offload != "none":
        # a greedy token through a skeleton reads every block from the checkpoint again
        say(f"verifying: no generation fidelity: --offload {load.offload} decodes each token from disk")
        fidelity = {"skipped": f"--offload {load.offload}"}
        seconds["fidelity"] = None
    else:
        check = config.fidelity_check(str(checkpoint), heldout)
        fidelity = _kept(folder / "fidelity.json", lambda: run_in_child(check, folder / "fidelity.log"),
                         lambda: say(f"verifying: what the checkpoint writes after {check.prompts} held-out "
                                     f"prompts, judged by the original in transformers"), seconds)
    tasks = _tasks(config, checkpoint, folder, say, seconds) if config.tasks else {}
    speed = SpeedCheck(baseline=config.prune.load.model, model=str(served), engine=config.engine,
                       repeats=config.speed_repeats, prompt_len=config.prompt_len, new_tokens=config.new_tokens,
                       threads=config.threads, converter=config.converter, dtype=load.dtype, device=load.device,
                       # the original in llama.cpp as the file that ships, quantized the same way: the depth's ratio
                       gguf_type=config.gguf_type if config.gguf else None,
                       no_repack=repack.off)  # a crash in the serving check turns them off for it too
    if config.no_speed:
        # transformers block by block would time its reads of every block from the checkpoint, not the model
        say(f"verifying: no speed check: {config.no_speed}" + (
            " reads each block from disk (time it in a serving engine: --engine llamacpp or vllm)"
            if config.speed_repeats else ""))
        timed = {"skipped": config.no_speed}
        seconds["speed"] = None
    else:
        timed = _kept(folder / "speed.json", lambda: repack.run(speed, folder / "speed.log", say),
                      lambda: say(f"verifying: the speed of {served.name} against {config.prune.load.model} in "
                                  f"{config.engine}"), seconds)
    measured_off = repack.measured()
    files = {SHIPPED: served.relative_to(checkpoint).as_posix() if served != checkpoint else ".",
             "engine": config.engine, "gguf_type": config.gguf_type if config.gguf else None,
             **({"no_repack": measured_off} if measured_off else {})}
    return Verified(domains=domains, speed=timed, heldout=[portable(text) for _, text in texts], files=files,
                    fidelity=fidelity, tasks=tasks, check_seconds=seconds)


def _tasks(config: ShipConfig, checkpoint: Path, folder: Path, say, seconds: dict) -> dict:
    """``--tasks`` scored on the original and the checkpoint in transformers (``tasks.json``, kept as the others)."""
    from eval.quality.lmeval import describe_rows

    check = config.tasks_check(str(checkpoint))
    rows = f"{check.limit} rows each" if isinstance(check.limit, int) else describe_rows(check.limit)
    return _kept(folder / "tasks.json", lambda: run_in_child(check, folder / "tasks.log"),
                 lambda: say(f"verifying: lm-eval tasks {', '.join(check.tasks)} ({rows}) on the original and the "
                             "checkpoint in transformers"), seconds)


@dataclass
class _Repack:
    """Whether the engine's checks load its files with its extra buffer types off, and why (``why``; None: on).

    Off with ``--no-repack``, or once a check crashed with them on: that check runs again with them off, and so do
    the checks after it, in this run and a resumed one. Each check measured with them off keeps why beside its
    figures, so the card names the checks it holds for.
    """

    config: ShipConfig
    folder: Path
    why: str | None = None

    def __post_init__(self):
        if self.config.no_repack:
            self.why = "--no-repack"
        else:  # a crash an earlier run of the same verify had
            crashes = [why for why in self.measured().values() if why != "--no-repack"]
            self.why = crashes[0] if crashes else None

    @property
    def off(self) -> bool:
        return self.why is not None

    def measured(self) -> dict[str, str]:
        """Check -> why, for each check whose kept figures were measured with them off."""
        return {path.name.removesuffix(NO_REPACK): path.read_text(encoding="utf-8").strip()
                for path in sorted(self.folder.glob(f"*{NO_REPACK}"))}

    def run(self, check: ServingCheck | SpeedCheck, log: Path, say) -> dict:
        """``run_in_child(check)``, once more with them off where a crash in native code ended it with them on.

        A build of llama.cpp may crash (SIGSEGV) loading any model on some CPUs while it repacks the weights for
        them.
        """
        ran_off = check.no_repack
        try:
            figures = run_in_child(check, log)
        except CheckCrashed as err:
            engine = get_engine(self.config.engine)
            if check.no_repack or err.signal not in CRASH_SIGNALS or "no_repack" not in options_class(engine).specs():
                raise  # SIGKILL or SIGTERM: out of memory or stopped, which its extra buffers do not cause
            words = CHECK_WORDS[type(check).__name__]
            crashed = log.with_name(f"{log.stem}.crashed{log.suffix}")
            if log.is_file():  # the crash's log kept beside the second try's
                log.replace(crashed)
            say(f"verifying: {words} crashed ({err.signal}) in {engine.display}; checking again with its extra "
                f"buffer types off (--no-repack; the crash's log: {crashed})")
            figures = run_in_child(dataclasses.replace(check, no_repack=True), log)
            self.why, ran_off = f"{words} crashed ({err.signal}) with them on", True
        kept = self.folder / f"{log.stem}{NO_REPACK}"
        if ran_off:
            why = self.why or "--no-repack"
            write_file_atomic(kept, lambda staging: staging.write_text(why, encoding="utf-8"))
        else:
            kept.unlink(missing_ok=True)
        return figures


def _kept(path: Path, measure, announce, seconds: dict) -> dict:
    """The figures kept in ``path`` by an earlier run, else measured now (``announce``-d first) and kept.

    ``seconds[path.stem]``: how long the measuring took, None where the figures were kept.
    """
    seconds[path.stem] = None
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:  # a damaged check's figures are measured again
            path.unlink()
    announce()
    began = time.perf_counter()
    figures = measure()
    seconds[path.stem] = round(time.perf_counter() - began, 2)
    write_json_atomic(path, figures)
    return figures
