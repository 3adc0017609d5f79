"""One ``prune.ship`` run's settings (:class:`ShipConfig`), its durations, its engines and its repairs.

The engines are :mod:`eval.speed.engines`' registry: the ones whose declared layouts include the plain
(``vanilla``) one, so a new engine that runs plain checkpoints is a ship target with no change here. The repairs
the shortlist tries are the registered ones that are servable and closed-form (:func:`servable_repairs`). The heal's
options and row cut are :mod:`distill.heal`'s (``eval.bench heal-curve`` runs the same heal); ship's modules read
them here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from distill.config import DistillConfig
from distill.heal import HEAL_BATCH as HEAL_BATCH
from distill.heal import HEAL_OPTIONS as HEAL_OPTIONS
from distill.heal import HEAL_SEQ_LEN as HEAL_SEQ_LEN
from distill.heal import HealRows, heal_data_config, heal_settings
from distill.heal import heal_rows as heal_rows
from distill.launch import check_devices, per_process
from distill.local_heal import local_heal_settings
from eval.speed.engines import ENGINES, REFERENCE
from eval.speed.engines.base import options_class
from prune.data.calibration import DataConfig, names_a_file
from prune.errors import LayercutError
from prune.model.layouts import VANILLA
from prune.pipeline.config import PruneConfig
from prune.replace import METHODS, check_replacement_supported

# the fewest steps that buy 90 % of what 200 buy, chosen on the selection split (reports/ship-defaults/: SmolLM2-135M
# at drop 4, fold on blocks 12-15, the geometric-mean perplexity of its four texts 32.68 built, 30.19 after 50 steps,
# 29.60 after 100, 29.48 after 200: 100 steps buy 96 % of 200's gain in log-perplexity, 50 steps 77 %), at half the
# heal's minutes
DEFAULT_HEAL_STEPS = 100
# what a run may set of the heal's adapters (ShipConfig.heal_train: --lora-r, --lora-alpha, --lora-targets)
HEAL_TRAIN_KEYS = ("lora_r", "lora_alpha", "lora_targets")


def heal_sequences(samples: int, seq_len: int, more: int = 0) -> int:
    """Sequences the heal trains on (:class:`distill.heal.HealRows`), cut from ``samples`` calibration rows.

    The shortlist's fitting rows (:func:`prune.selection.repaired.split_rows`) and ``more`` rows of
    ``--heal-data``. Counted on placeholders of the rows' shape, so the count is the heal's own cut.
    """
    import torch

    rows = HealRows.of(torch.zeros(samples, seq_len, dtype=torch.bool),  # a byte a token
                       torch.zeros(more, seq_len, dtype=torch.bool) if more else None)
    return rows.train.shape[0]


def ship_engines() -> list[str]:
    """The registered engines that run a plain checkpoint, the reference first (``--engine``'s choices)."""
    return [name for name, engine in ENGINES.items() if VANILLA in engine.layouts]


def servable_repairs() -> list[str]:
    """The training-free repairs whose checkpoint is a plain one, best default first, and removal last."""
    ranked = sorted((m for m in METHODS.values() if m.servable and m.closed_form),
                    key=lambda m: 0 if m.default_for is None else -1)
    return [m.name for m in ranked] + ["none"]


# the share of --time-budget the shortlist may spend: building, healing and verifying take the rest
SHORTLIST_SHARE = 0.5


# a shipped checkpoint is judged at the parameter count of removing its blocks: a repair may add at most this share
# over it. fold-rotate on a tied head unties it (+vocab x hidden: +28.3M on SmolLM2-135M, as large as the original at
# drop 8), so where the head is tied ship leaves it out; prune.run --replace fold-rotate still builds it
PARAMS_TOLERANCE = 0.02


def params_cap(removal: int, target: int | None) -> int:
    """The most parameters a candidate may have: ``--target-params`` when given, else removal's count + 2 %."""
    return target if target is not None else math.floor(removal * (1 + PARAMS_TOLERANCE))


def oversize_note(params: int, removal: int, target: int | None, repair: str) -> str | None:
    """Why a candidate of ``params`` parameters, repaired by ``repair``, is not one (:func:`params_cap`), or None."""
    if params <= params_cap(removal, target):
        return None
    if target is not None:
        return f"not a candidate: {params:,} parameters, above --target-params {target:,}"
    return (f"not a candidate: {params:,} parameters, {params / removal - 1:.0%} more than removing the same blocks "
            f"({removal:,}); a shipped checkpoint adds at most {PARAMS_TOLERANCE:.0%} (prune.run --replace {repair} "
            "builds it)")


def applicable(method: str, model) -> str | None:
    """None where ``method`` can repair ``model``'s layout, else why not (its one-line refusal)."""
    try:
        check_replacement_supported(model, method)
    except LayercutError as err:
        return str(err)
    return None


@dataclass
class ShipConfig:
    """One ``prune.ship`` run.

    Attributes:
        prune: the model, its calibration and the budget (``drop``, ``target_speedup`` or ``target_params``);
            its ``select``, ``score`` and ``replace`` are what the shortlist chooses.
        out: the folder the checkpoint and its card end in (``OUT.work/`` holds every stage's output).
        engine: a registered engine that runs plain checkpoints (:func:`ship_engines`): where it is verified.
        time_budget: seconds the whole run may take (None: no limit); the plan is held against it.
        heldout: held-out text files (or datasets specs), one per domain, for the card's perplexities; none:
            the calibration source's held-out rows.
        gguf_type: the GGUF written for llama.cpp (``prune.checkpoint.gguf.OUTTYPES``).
        converter: llama.cpp's ``convert_hf_to_gguf.py`` (default: ``$LLAMA_CPP_CONVERTER``).
        no_repack: llama.cpp's checks load with its extra buffer types off from the start (without it they are turned
            off only after a check crashes: ``ship.verify``).
        verify: run the engine checks (off: the card says the checkpoint was not verified).
        speed_repeats: timed rounds of the speed check (0: none; an 8B original's GGUF for it is written once).
        prompt_len: prompt tokens of the speed check (its prefill).
        new_tokens: tokens it generates (its decode).
        threads: CPU threads passed to the engines (None: theirs).
        heal_steps: at most this many distillation steps after the build (0: no healing); with
            ``time_budget``, as many as fit in the time left.
        heal_data: more text the heal trains on beside the calibration's fitting rows (a ``--data`` spec; None:
            none), ``heal_samples`` sequences of the calibration's length; the heal is judged on the calibration's
            measuring rows either way.
        heal_train: LoRA's options in place of the heal's own (``lora_r``, ``lora_alpha``, ``lora_targets``:
            ``--lora-r``, ``--lora-alpha``, ``--lora-targets``); empty: :data:`HEAL_OPTIONS`'.
        processes: the heal trains on this many processes, launched by accelerate (DDP; over gloo on the CPU,
            one GPU each with a GPU ``--device``), splitting each step's ``HEAL_BATCH`` sequences between them:
            the weights one process trains, within float rounding (:mod:`distill.launch`).
        tasks: lm-eval tasks the verify stage scores on the original and the checkpoint, on the same rows, in
            transformers (``--tasks arc_easy,piqa``; a comma string is split); empty: none. Each one layercut knows
            the metric and chance level of (``eval.quality.task_specs.task_table``).
        limit: rows per task, as ``eval.run --limit`` takes it (a count, a fraction, ``START:END`` or a draw
            ``N~START:END``); None: every row of each task.
        data_dir: a folder laid out like ``shared/data`` the offline tasks read (None: ``$LAYERCUT_DATA``, else
            the hub).
    """

    prune: PruneConfig
    out: str
    engine: str = "llamacpp"
    time_budget: float | None = None
    heldout: list[str] = field(default_factory=list)
    gguf_type: str = "f32"
    converter: str | None = None
    no_repack: bool = False
    verify: bool = True
    speed_repeats: int = 3
    prompt_len: int = 256
    new_tokens: int = 64
    threads: int | None = None
    heal_steps: int = DEFAULT_HEAL_STEPS
    heal_data: str | None = None
    heal_samples: int = 64
    heal_train: dict = field(default_factory=dict)
    processes: int = 1
    tasks: list[str] = field(default_factory=list)
    limit: int | float | str | None = None
    data_dir: str | None = None

    def __post_init__(self):
        self.heal_train = dict(self.heal_train or {})  # this run's own: the caller's dict is never changed
        engines = ship_engines()
        if self.engine not in engines:
            raise LayercutError(f"--engine {self.engine}: choose one of {', '.join(engines)}")
        if not self.prune.removes:
            raise LayercutError("prune.ship needs a budget: pass --drop K, --target-speedup X or --target-params N")
        if self.no_repack and "no_repack" not in options_class(ENGINES[self.engine]).specs():
            readers = [name for name, engine in ENGINES.items() if "no_repack" in options_class(engine).specs()]
            raise LayercutError(f"--no-repack is a setting of {', '.join(readers)}, not of --engine {self.engine}: "
                                "drop it")
        if self.prune.unit != "block":
            raise LayercutError("prune.ship removes whole blocks: drop --unit")
        if self.time_budget is not None and not (math.isfinite(self.time_budget) and self.time_budget > 0):
            raise LayercutError(f"--time-budget must be a positive, finite duration, got {self.time_budget!r}")
        for spec in self.heldout:  # else a missing file is found by the verify stage, after the shortlist and build
            text = heldout_label(spec)[1]
            if names_a_file(text) and not Path(text).expanduser().is_file():
                raise LayercutError(f"--heldout {spec}: no file {text}: pass an existing .txt/.jsonl/.parquet file "
                                    "(or a datasets spec)")
        if self.heal_steps < 0:
            raise LayercutError(f"--heal-steps must be 0 (no healing) or more, got {self.heal_steps}")
        if self.heal_data is not None:  # the spec and the count refused here, not after the shortlist
            self.heal_data_config()
        if self.heal_train:
            self._check_heal_train()
        if self.local_heal:
            self._check_local_heal()
        per_process(DistillConfig(batch_size=HEAL_BATCH), self.processes)  # they split a step's sequences
        check_devices(self.processes, self.prune.load.device)
        if self.speed_repeats < 0:
            raise LayercutError(f"--repeats must be 0 (no speed check) or more, got {self.speed_repeats}")
        for name, value in (("--prompt-len", self.prompt_len), ("--new-tokens", self.new_tokens)):
            if value < 1:
                raise LayercutError(f"{name} must be at least 1, got {value}")
        self._check_tasks()

    def heal_data_config(self) -> DataConfig:
        """``--heal-data``'s draw (:func:`distill.heal.heal_data_config`) beside this run's calibration."""
        return heal_data_config(self.heal_data, self.heal_samples, self.prune.data)

    @property
    def work(self) -> Path:
        """``OUT.work/``: every stage's output."""
        return Path(str(self.out).rstrip("/") + ".work")

    @property
    def name(self) -> str:
        """The shipped folder's name (the GGUF is named after it)."""
        return Path(str(self.out)).resolve().name

    @property
    def gguf(self) -> bool:
        """Whether the engine serves a GGUF file (llama.cpp): the export writes one and the checks measure it."""
        return self.engine == "llamacpp"

    @property
    def no_heal(self) -> str | None:
        """Why this run heals nothing whatever its budget (the card's and the log's words), else None."""
        return "--heal-steps 0" if not self.heal_steps else None

    @property
    def no_speed(self) -> str | None:
        """Why the verify stage times nothing (``--repeats 0``; a skeleton in transformers), else None."""
        if not self.speed_repeats:
            return "--repeats 0"
        if self.prune.load.offload != "none" and self.engine == REFERENCE:
            return f"--offload {self.prune.load.offload} in transformers"
        return None

    @property
    def local_heal(self) -> bool:
        """Whether the heal runs block by block (``distill.local_heal``): under ``--offload sequential``.

        Distillation of the logits holds the whole student, its optimizer and the original's logits; a skeleton
        holds one block at a time, so each cut's pair of blocks is trained towards the original's states instead.
        """
        return self.prune.load.offload == "sequential" and bool(self.heal_steps)

    def _check_heal_train(self) -> None:
        """Refuse, in one line, LoRA options the heal cannot take (a layer name is checked once the model loads)."""
        flags = "--" + ", --".join(key.replace("_", "-") for key in self.heal_train)
        if unknown := set(self.heal_train) - set(HEAL_TRAIN_KEYS):
            raise LayercutError(f"heal_train takes lora_r, lora_alpha and lora_targets, not "
                                f"{', '.join(sorted(unknown))}: drop the others")
        if not self.heal_steps:
            raise LayercutError(f"--heal-steps 0 heals nothing, so {flags} (the heal's adapters) change nothing: "
                                "drop them, or heal")
        if self.prune.load.offload == "sequential":
            raise LayercutError(f"{flags} with --offload sequential: the heal block by block trains the two blocks "
                                "beside each cut whole, with no adapters; drop them")
        alpha = self.heal_train.get("lora_alpha")
        if alpha is not None and not (math.isfinite(alpha) and alpha > 0):
            raise LayercutError(f"--lora-alpha must be positive, got {alpha}")
        config = DistillConfig.from_dict({**HEAL_OPTIONS, **self.heal_train})  # a rank below 1: its own one line
        if "lora_targets" in self.heal_train:  # as distillation spells it (each name once): one digest a choice
            self.heal_train["lora_targets"] = config.lora_targets

    def _check_local_heal(self) -> None:
        """Refuse, in one line, what the heal block by block does not do."""
        from prune.data.sources import parse_sources

        if self.heal_data is not None and any(source.is_self for source in parse_sources(self.heal_data)):
            raise LayercutError(f"--heal-data {self.heal_data} with --offload sequential: a skeleton cannot sample "
                                "text from the model; pass a file or a dataset, or drop --heal-data")
        if self.processes > 1:
            raise LayercutError(f"--processes {self.processes} with --offload sequential: the heal block by block "
                                "trains one cut's pair of blocks at a time in this process; drop --processes")

    def _check_tasks(self) -> None:
        """Refuse, in one line, lm-eval tasks the verify stage cannot score (before any model loads)."""
        tasks = self.tasks.split(",") if isinstance(self.tasks, str) else self.tasks
        self.tasks = list(dict.fromkeys(str(task).strip() for task in tasks if str(task).strip()))
        if not self.tasks:
            given = [flag for flag, value in (("--limit", self.limit), ("--data-dir", self.data_dir))
                     if value is not None]
            if given:
                raise LayercutError(f"{' and '.join(given)} without --tasks: they choose the rows and the data of "
                                    "lm-eval tasks; pass --tasks (arc_easy,piqa) or drop them")
            return
        from eval.quality.lmeval import TASK_DIRS_ENV, check_limit, plan_tasks, resolve_data_dir, task_table

        if not self.verify:
            raise LayercutError("--tasks with --no-verify: the tasks are scored in the verify stage; drop one of them")
        if self.prune.load.offload != "none":
            raise LayercutError(f"--tasks with --offload {self.prune.load.offload}: each forward pass of a task would "
                                "read every block from disk; drop --tasks and score the shipped folder with "
                                "python -m eval.run")
        try:
            self.limit = check_limit(self.limit)
        except LayercutError as err:
            raise LayercutError(f"--limit: {err}") from None
        # an unknown name, a missing data file, or a task whose scoring needs an extra: refused in their own words
        local, registry = plan_tasks(self.tasks, resolve_data_dir(self.data_dir))  # an alias as lm-eval runs it
        table = task_table()
        unknown = [name for name in [*local, *registry] if name not in table]
        if unknown:  # lm-eval would score it for hours, and the card would have no metric of it to show
            them = "it" if len(unknown) == 1 else "them"
            raise LayercutError(f"--tasks {','.join(unknown)}: layercut knows neither the metric to quote nor the "
                                f"chance level of {them} (it knows {', '.join(sorted(table))}); add a task YAML with "
                                f"a layercut: block to a folder on ${TASK_DIRS_ENV} (eval/tasks/README.md), or score "
                                f"{them} with python -m eval.run")

    def tasks_check(self, checkpoint: str):
        """The verify stage's lm-eval tasks check of ``checkpoint`` against the original, on the same rows.

        The original's side is kept in the cache, as the fidelity check's; the planner asks the same check whether it
        is there.
        """
        from eval.bench.checks import TasksCheck

        load = self.prune.load
        return TasksCheck(original=load.model, model=checkpoint, tasks=tuple(self.tasks), limit=self.limit,
                          data_dir=self.data_dir, batch_size=self.prune.batch_size, tokenizer=load.tokenizer,
                          threads=self.threads, dtype=load.dtype, device=load.device, keep_original=True)

    def fidelity_check(self, checkpoint: str, heldout: list[str]):
        """The verify stage's generation fidelity check of ``checkpoint`` on the ``heldout`` texts.

        The original's side is kept in the cache (the same in every run of it); the planner asks the same check
        whether it is there, so both read one key.
        """
        from eval.bench.checks import FidelityCheck

        load = self.prune.load
        return FidelityCheck(original=load.model, model=checkpoint, texts=tuple(heldout_label(s) for s in heldout),
                             tokenizer=load.model, threads=self.threads, dtype=load.dtype, device=load.device,
                             keep_original=True)

    def settings(self) -> dict:
        """What the result depends on (a resumed run must match it): the model, data, budget and the engine.

        Not ``processes``: the heal on N processes trains the same rows per step to the same weights, within float
        rounding, and its checkpoints continue on any count, so a run stopped on one continues on two (and a
        shipped folder is the same run's) rather than starting over; ``threads`` is left out for the same reason.
        """
        config = self.prune
        return {"model": config.load.model, "dtype": config.load.dtype, "data": dataclasses.asdict(config.data),
                "drop": config.drop, "target_params": config.target_params, "target_speedup": config.target_speedup,
                "protect": config.protect, "batch_size": config.batch_size, "engine": self.engine,
                "heldout": list(self.heldout), "gguf_type": self.gguf_type if self.gguf else None,
                "heal_steps": self.heal_steps,
                # what the heal trains: a run healed at another LoRA rank is another run (its checkpoints differ)
                **({"heal": local_heal_settings() if self.local_heal else heal_settings(self.heal_train)}
                   if self.heal_steps else {}),
                **({"heal_data": self.heal_data, "heal_samples": self.heal_samples} if self.heal_data else {}),
                # the card's task figures: a resumed run scoring other tasks or rows would mix two runs' figures
                **({"tasks": list(self.tasks), "limit": self.limit, "data_dir": self.data_dir} if self.tasks else {})}

    def digest(self) -> str:
        """A short digest of :meth:`settings` (marks a shipped folder as this run's)."""
        return hashlib.sha256(json.dumps(self.settings(), sort_keys=True, default=str).encode()).hexdigest()[:10]


def parse_duration(text: str) -> float:
    """``30m``, ``1h``, ``90s`` or seconds -> seconds; a duration that is not positive and finite is refused."""
    units = {"s": 1, "m": 60, "h": 3600}
    value = str(text).strip().lower()
    scale = units.get(value[-1:], None)
    number = value[:-1] if scale else value
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise LayercutError(f"--time-budget {text}: give a duration such as 30m, 1h or 900s") from None
    if not (math.isfinite(seconds) and seconds > 0):
        raise LayercutError(f"--time-budget {text}: give a positive, finite duration such as 30m")
    return seconds


def duration_words(seconds: float) -> str:
    """A duration as messages say it (``38m``, ``45s``)."""
    return f"{seconds / 60:.0f}m" if seconds >= 120 else f"{seconds:.0f}s"


def heldout_label(spec: str) -> tuple[str, str]:
    """``LABEL=TEXT`` (as ``eval.compare --heldout`` takes) or a bare TEXT, labelled by its folder and name."""
    label, sep, text = spec.partition("=")
    if sep and label and "/" not in label and not Path(spec).exists():  # a label, not a path holding "="
        return label, text
    path = Path(spec)
    return (f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem), spec
