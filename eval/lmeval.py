"""Run lm-evaluation-harness tasks on an in-memory model or a checkpoint folder, from the hub or local files.

    from eval.lmeval import run_lm_eval
    scores = run_lm_eval(model, tokenizer, ["arc_easy", "piqa"], data_dir="../shared/data", limit=200)
    scores["arc_easy"]["acc_norm"]

Two ways to get the data, same task names:

* No data folder (``data_dir=None`` and ``$LAYERCUT_DATA`` unset): every name goes to lm-eval's own
  registry untouched, and its datasets come from the Hugging Face hub.
* A data folder laid out like layercut's ``shared/data``: the standard names in :func:`offline_tasks`
  run from those files through the task YAMLs in ``eval/tasks/`` (and the folders in ``$LAYERCUT_TASKS``).
  They keep the standard names, prompts, targets, choices and metrics (the readers rebuild the hub's rows,
  then lm-eval's own templates and functions make the requests), and nothing touches the network.
  ``lambada`` (in lm-eval, lambada_openai plus lambada_standard) runs as ``lambada_openai``, the only
  version we have on disk. Any other name still goes to lm-eval's registry.

The same YAMLs work with lm-eval's own command line:
``lm-eval run --include_path eval/tasks --metadata '{"data_dir": "../shared/data"}' --tasks piqa ...``.

What layercut knows of a task besides lm-eval's config (the files it reads, the metric to quote, the
accuracy of a random guess) is one :class:`TaskSpec` in :func:`task_table`, read from the
``metadata: {layercut: ...}`` block of its YAML; tasks with no YAML here are :data:`HUB_TASKS`. Adding an
offline task is adding its YAML.

Tested with lm-eval :data:`LM_EVAL_TESTED` (the task registry and ``custom_dataset`` hooks change
between minor versions).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import yaml

from prune.errors import LayercutError
from prune.registry import Registry

logger = logging.getLogger(__name__)

LM_EVAL_TESTED = ">=0.4.13,<0.5"
_LM_EVAL_TESTED_MIN = (0, 4, 13)
_LM_EVAL_TESTED_BELOW = (0, 5)
DATA_DIR_ENV = "LAYERCUT_DATA"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"

TASK_DIRS_ENV = "LAYERCUT_TASKS"  # more folders of offline task YAMLs, separated like $PATH
# names users type that mean a different task offline
OFFLINE_ALIASES: dict[str, str] = {"lambada": "lambada_openai"}


@dataclass(frozen=True)
class TaskSpec:
    """What layercut knows of one lm-eval task beyond what lm-eval computes.

    An offline task's spec is the ``metadata: {layercut: ...}`` block of its YAML in :data:`TASKS_DIR`
    (lm-eval passes the metadata on to the ``custom_dataset`` loader and otherwise only reads its
    ``version``, so the block changes no number lm-eval computes).

    Attributes:
        name: lm-eval's task name.
        primary_metric: The metric to quote, a key of :func:`run_lm_eval`'s per-task dicts (``acc_norm``
            where the length-normalised score is the convention).
        chance: Accuracy of a random guess: 1 / the choices a row offers, 0 for an open answer.
        files: The files the task reads, relative to the data folder; empty for a task only lm-eval's
            registry runs (its data from the hub).
        source: The YAML the spec was read from; ``None`` for :data:`HUB_TASKS`.
    """

    name: str
    primary_metric: str
    chance: float
    files: tuple[str, ...] = ()
    source: Path | None = None

    def __post_init__(self):
        if not isinstance(self.primary_metric, str) or not self.primary_metric:
            raise ValueError(f"primary_metric must name a metric of the task (acc, acc_norm), "
                             f"got {self.primary_metric!r}")
        if isinstance(self.chance, bool) or not isinstance(self.chance, (int, float)) or not 0 <= self.chance < 1:
            raise ValueError(f"chance must be a number in [0, 1), 1 / the choices a row offers (0 for an open "
                             f"answer), got {self.chance!r}")
        if not isinstance(self.files, tuple) or not all(isinstance(f, str) and f and not Path(f).is_absolute()
                                                        for f in self.files):
            raise ValueError(f"files must be paths relative to the data folder, e.g. [piqa/valid.jsonl], got "
                             f"{self.files!r}")

    @property
    def offline(self) -> bool:
        """Whether the task runs from local files (it has a YAML here)."""
        return bool(self.files)


# Tasks that only lm-eval's registry runs (their data from the hub): no YAML here says what layercut needs.
HUB_TASKS: tuple[TaskSpec, ...] = (
    TaskSpec("openbookqa", "acc", 0.25),
    TaskSpec("sciq", "acc", 0.25),
    TaskSpec("copa", "acc", 0.5),
    TaskSpec("mmlu", "acc", 0.25),
    TaskSpec("lambada_standard", "acc", 0.0),
    TaskSpec("lambada", "acc", 0.0),  # lm-eval's group: lambada_openai + lambada_standard
)


class _TaskYamlLoader(yaml.SafeLoader):
    """lm-eval's task YAML read as data: a ``!function`` tag stays the name it gives, nothing is imported."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _read_task_yaml(path: Path, seen: frozenset[Path] = frozenset()) -> dict[str, Any]:
    """One task YAML with its ``include`` merged as lm-eval merges it: shallowly, the including file's keys win."""
    if path in seen:
        raise LayercutError(f"{path}: includes itself; remove the include cycle")
    try:
        config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)  # a SafeLoader: data only
    except yaml.YAMLError as err:
        raise LayercutError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise LayercutError(f"{path}: a task YAML is a mapping (task: ..., metadata: ...)")
    includes = config.pop("include", [])
    merged: dict[str, Any] = {}
    for include in includes if isinstance(includes, list) else [includes]:
        merged.update(_read_task_yaml((path.parent / include).resolve(), seen | {path}))
    return merged | config


def read_task_spec(path: str | Path) -> TaskSpec | None:
    """The :class:`TaskSpec` that an offline task's YAML carries under ``metadata: {layercut: ...}``.

    Args:
        path: A YAML in lm-eval's task format.

    Returns:
        The spec, or ``None`` for a YAML that defines no task (a group).

    Raises:
        LayercutError: the block is missing or malformed, or names a metric the task does not compute.
    """
    path = Path(path).resolve()
    config = _read_task_yaml(path)
    if "task" not in config:
        return None
    metadata = config.get("metadata")
    block = metadata.get("layercut") if isinstance(metadata, dict) else None
    if not isinstance(block, dict) or not {"files", "primary_metric", "chance"} <= set(block):
        raise LayercutError(f"{path}: an offline task says what layercut needs under metadata: {{layercut: {{files: "
                            f"[...], primary_metric: acc, chance: 0.25}}}} (see {TASKS_DIR / 'README.md'})")
    files = block["files"]
    try:
        spec = TaskSpec(str(config["task"]), block["primary_metric"], block["chance"],
                        tuple(files) if isinstance(files, list) else files, path)
    except ValueError as err:
        raise LayercutError(f"{path}: metadata.layercut.{err}") from None
    metrics = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)]
    if metrics and spec.primary_metric not in metrics:
        raise LayercutError(f"{path}: primary_metric {spec.primary_metric!r} is not in the task's metric_list "
                            f"({', '.join(map(str, metrics))}); name one of them")
    return spec


def task_dirs() -> tuple[Path, ...]:
    """The folders of offline task YAMLs: :data:`TASKS_DIR`, then those in ``$LAYERCUT_TASKS``.

    Raises:
        LayercutError: a folder in ``$LAYERCUT_TASKS`` does not exist.
    """
    extra = [Path(p).expanduser().resolve() for p in os.environ.get(TASK_DIRS_ENV, "").split(os.pathsep) if p.strip()]
    for folder in extra:
        if not folder.is_dir():
            raise LayercutError(f"task folder {folder} (${TASK_DIRS_ENV}) does not exist; list folders of task YAMLs "
                                f"separated by {os.pathsep!r}")
    return tuple(dict.fromkeys([TASKS_DIR, *extra]))


def task_table(dirs: Sequence[str | Path] | None = None) -> Registry[TaskSpec]:
    """Every task layercut knows: the offline tasks of ``dirs``' YAMLs, then :data:`HUB_TASKS`.

    Args:
        dirs: Folders of task YAMLs; ``None``: :func:`task_dirs`.

    Returns:
        The table (read once per set of folders): ``task_table()["piqa"].chance``.

    Raises:
        LayercutError: a YAML without its layercut block, or two YAMLs for one task.
    """
    folders = task_dirs() if dirs is None else tuple(Path(d).expanduser().resolve() for d in dirs)
    return _build_table(folders)


@functools.lru_cache(maxsize=8)
def _build_table(dirs: tuple[Path, ...]) -> Registry[TaskSpec]:
    table: Registry[TaskSpec] = Registry("task", "--tasks")
    specs = [read_task_spec(path) for folder in dirs for path in sorted(folder.rglob("*.yaml"))]
    for spec in filter(None, specs):
        if spec.name in table:
            raise LayercutError(f"task {spec.name!r} is defined twice, in {table[spec.name].source} and {spec.source}; "
                                f"rename or remove one")
        table.register(spec.name, spec)
    for spec in HUB_TASKS:
        if spec.name not in table:  # a YAML that runs a hub task offline says what layercut needs itself
            table.register(spec.name, spec)
    return table


def offline_tasks() -> list[str]:
    """The names of the tasks that run from local files (those with a YAML in :func:`task_dirs`)."""
    return [name for name, spec in task_table().items() if spec.offline]


def chance_level(task: str) -> float | None:
    """Accuracy of a random guess on ``task`` (1 / its choices, 0 for an open answer); ``None`` when unknown."""
    table = task_table()
    return table[task].chance if task in table else None


_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


# Seeds lm-eval's samplers and which rows a draw N~START:END picks: a draw is the same rows every run.
TASK_SEED = 1234


def primary_metric(task: str) -> str:
    """Return the metric to quote for ``task``: its :class:`TaskSpec`'s, ``acc`` for a task not in :func:`task_table`.

    Args:
        task: A standard lm-eval task name.

    Returns:
        A key of the per-task dicts that :func:`run_lm_eval` returns (``acc_norm`` for ARC and HellaSwag).
    """
    table = task_table()
    return table[task].primary_metric if task in table else "acc"


def resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    """Return the local data folder: ``data_dir``, else ``$LAYERCUT_DATA``, else ``None`` (use the hub).

    Args:
        data_dir: A folder laid out like layercut's ``shared/data``, or ``None``.

    Returns:
        The folder as an absolute path, or ``None`` when neither is set.

    Raises:
        LayercutError: the folder given does not exist.
    """
    chosen = data_dir if data_dir not in (None, "") else os.environ.get(DATA_DIR_ENV) or None
    if chosen is None:
        return None
    path = Path(chosen).expanduser()
    if not path.is_dir():
        source = "--data-dir" if data_dir not in (None, "") else f"${DATA_DIR_ENV}"
        raise LayercutError(
            f"data folder {path} ({source}) does not exist; point it at a folder laid out like shared/data"
        )
    return path.resolve()


def local_data_files(task: str, data_dir: str | Path | None, files: Sequence[str] | None = None) -> list[Path]:
    """Return the local files ``task`` reads, checked to exist.

    Args:
        task: An offline task (:func:`offline_tasks`).
        data_dir: The data folder; ``None`` falls back to ``$LAYERCUT_DATA``.
        files: The task's files relative to the folder, when the caller has them (a loader in
            ``local_docs.py`` gets them from the task's metadata); ``None`` reads them from :func:`task_table`.

    Returns:
        Absolute paths in the order of the task's ``files``.

    Raises:
        LayercutError: not an offline task, no folder given, or a file is missing (the message names the file
            and the folder).
    """
    if files is None:
        files = _offline_spec(task).files
    root = resolve_data_dir(data_dir)
    if root is None:
        raise LayercutError(
            f"{task}: no local data folder given; pass --data-dir or set {DATA_DIR_ENV} "
            f"(lm-eval command line: --metadata '{{\"data_dir\": \"/path\"}}')"
        )
    paths = [root / rel for rel in files]
    for rel, path in zip(files, paths, strict=True):
        if not path.is_file():
            raise LayercutError(
                f"{task}: local data file {rel} not found in {root}; point --data-dir or "
                f"{DATA_DIR_ENV} at a folder laid out like shared/data (or drop --data-dir to use the hub)"
            )
    return paths


@functools.lru_cache(maxsize=1)
def _registry():
    """lm-eval's task registry (indexing its thousands of YAMLs takes seconds, so once per process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def _local_task_manager(root: Path):
    """Index our YAMLs only, so they do not clash with lm-eval's built-in tasks of the same names."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(d) for d in task_dirs()], include_defaults=False,
                       metadata={"data_dir": str(root)})


def _offline_names() -> str:
    return ", ".join([*sorted(offline_tasks()), *sorted(OFFLINE_ALIASES)])


def _offline_spec(name: str) -> TaskSpec:
    table = task_table()
    if name not in table or not table[name].offline:
        raise _unknown_task(name)
    return table[name]


def _unknown_task(name: str) -> LayercutError:
    known = _offline_names()
    return LayercutError(
        f"unknown task {name!r}: not an offline task ({known}) nor in lm-eval's registry; "
        f"`lm-eval ls tasks` lists lm-eval's tasks (`lm-eval --tasks list` before 0.4.10)"
    )


def _task_names(tasks: Sequence[str] | str) -> list[str]:
    """Task names in order, without repeats; a single string may hold a comma-separated list."""
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = list(dict.fromkeys(str(t).strip() for t in items if str(t).strip()))
    if not names:
        raise LayercutError("no tasks given; name at least one, e.g. --tasks arc_easy,piqa")
    return names


def plan_tasks(tasks: Sequence[str] | str, data_dir: Path | None) -> tuple[list[str], list[str]]:
    """Split task names into those run from local files and those passed to lm-eval's registry.

    Args:
        tasks: Task names (standard lm-eval names, or ``lambada``).
        data_dir: The resolved data folder, or ``None`` for the hub.

    Returns:
        ``(local, registry)``: standard names to run from ``data_dir`` (their files checked), and the rest.

    Raises:
        LayercutError: no tasks, an unknown name, or a missing local file.
    """
    local: list[str] = []
    registry: list[str] = []
    for name in _task_names(tasks):
        if data_dir is not None and name in OFFLINE_ALIASES:
            logger.info(
                "offline, %r runs %s only: lm-eval's %r group also has lambada_standard, which has no local file",
                name, OFFLINE_ALIASES[name], name,
            )
            name = OFFLINE_ALIASES[name]
        if data_dir is not None and name in offline_tasks():
            local_data_files(name, data_dir)
            local.append(name)
        elif name in _registry().all_tasks:
            registry.append(name)
        else:
            raise _unknown_task(name)
    return list(dict.fromkeys(local)), registry


def check_registry_data(names: Sequence[str]) -> None:
    """Build lm-eval's tasks (which reads their data) before any model is loaded; one line when that fails.

    The data of registry tasks comes from the Hugging Face hub (cached after the first run): offline or
    unreachable, datasets fails deep inside lm-eval, after the model is loaded. Building the tasks
    here fails first, and the data read now is what the run reads from the cache later.
    """
    if not names:
        return
    try:
        with _quiet_lm_eval():
            _registry().load_task_or_group(list(names))
    except Exception as err:  # datasets / hub raise many types (ConnectionError, OSError, ValueError, ...)
        cause = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
        offline = _offline_names()
        raise LayercutError(
            f"lm-eval task(s) {', '.join(names)}: their data could not be read ({type(err).__name__}: {cause}); "
            f"they come from the Hugging Face hub: run once online (then they are cached), or use the tasks "
            f"that run from --data-dir ({offline})"
        ) from None


def _split_draw(limit: Any) -> tuple[str, str | None] | None:
    """``limit``'s range and its draw (``"N~START:END"``: N of those rows at random), or ``None`` for a count."""
    if not isinstance(limit, str) or (":" not in limit and "~" not in limit):
        return None
    draw, _, rows = limit.rpartition("~")
    return rows, (draw if "~" in limit else None)


def row_range(limit: Any) -> slice | None:
    """``limit``'s range of rows as a slice, else ``None`` (a count or fraction).

    ``"START:END"`` has Python's slice bounds; a draw ``"N~START:END"`` is taken from that range.

    A range scores rows a count cannot reach: ``"-500:"`` is each task's last 500 rows, so defaults can be
    chosen on rows that a report on ``--limit 1000`` (the first 1,000) never reads.
    """
    split = _split_draw(limit)
    if split is None:
        return None
    bounds = split[0].split(":")
    try:
        if len(bounds) != 2:
            raise ValueError
        start, stop = (int(b) if b.strip() else None for b in bounds)
    except ValueError:
        raise LayercutError(
            f"a range of rows is START:END in whole numbers (-500: is the last 500), got {limit!r}"
        ) from None
    return slice(start, stop)


def row_draw(limit: Any) -> int | None:
    """How many rows ``"N~START:END"`` draws at random from its range; ``None`` for a plain range or count.

    The tail of a task is not a sample of it (HellaSwag's last rows are all WikiHow, its first none), so a
    split to choose defaults on is drawn across the rows a report does not read: ``"1000~1000:"``.
    """
    split = _split_draw(limit)
    if split is None or split[1] is None:
        return None
    row_range(limit)
    try:
        count = int(split[1])
        if count < 1:
            raise ValueError
    except ValueError:
        raise LayercutError(f"a draw of rows is N~START:END with N a positive whole number (1000~1000: is 1,000 "
                            f"rows drawn at random from row 1000 on), got {limit!r}") from None
    return count


def describe_rows(limit: Any) -> str:
    """Which rows of each task ``limit`` reads, in words: a selection run and a report read different rows."""
    if limit is None:
        return "every row of each task"
    draw = row_draw(limit)
    if draw is not None:
        return (f"{draw:,} rows of each task drawn at random, seed {TASK_SEED}, from its rows {_split_draw(limit)[0]} "
                "as Python slices them")
    if row_range(limit) is not None:
        return f"rows {limit} of each task, as Python slices them"
    return f"the first {limit:,} rows of each task" if limit >= 1 else f"the first {limit:.0%} of each task"


def _check_options(limit: int | float | str | None, batch_size: int, num_fewshot: int | None) -> Any:
    """Validate the options; return ``limit`` as lm-eval reads it (a float below 1 is a fraction, else rows).

    A range of rows (``"START:END"``) or a draw (``"N~START:END"``) is returned as it came: :func:`_evaluate`
    turns it into each task's row indices once it knows how many rows the task has.
    """
    row_draw(limit)
    if limit is not None and row_range(limit) is None:
        whole = isinstance(limit, int) or (isinstance(limit, float) and limit.is_integer())
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0 or (limit >= 1 and not whole):
            raise LayercutError(f"limit must be a number of rows, a fraction in (0, 1), a range of rows START:END "
                                f"or a draw N~START:END, got {limit!r}")
        limit = limit if limit < 1 else int(limit)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise LayercutError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise LayercutError(f"num_fewshot must be a non-negative integer, got {num_fewshot!r}")
    return limit


def task_rows(limit: Any, total: int, name: str = "the task", seed: int = TASK_SEED) -> list[int]:
    """The indices of the rows ``limit`` reads from a task of ``total`` rows, as :func:`run_lm_eval` reads them.

    ``None`` is every row, a count the first rows, a fraction that share of the first rows (rounded up, as
    lm-eval does), a range ``START:END`` Python's slice of them and a draw ``N~START:END``
    ``sorted(random.Random(seed).sample(range(total)[START:END], N))``. Scripts that pair a results file's
    per-row answers with the task's rows call this rather than rebuild the rule.
    """
    rows, span = list(range(total)), row_range(limit)
    if span is None:
        limit = _check_options(limit, 1, None)
        if limit is None:
            return rows
        return rows[:math.ceil(total * limit) if limit < 1 else limit]
    picked, draw = rows[span], row_draw(limit)
    if not picked:
        raise LayercutError(f"rows {_split_draw(limit)[0]} of {name} are none of its {total} rows: pick a range "
                            f"inside 0:{total}")
    if draw is None:
        return picked
    if draw > len(picked):
        raise LayercutError(f"{limit} draws {draw} rows from {len(picked)} of {name}: draw fewer or widen the range")
    return sorted(random.Random(seed).sample(picked, draw))


def _rows_in(tasks: dict[str, Any], rows: str, seed: int) -> dict[str, list[int]]:
    """Each task's row indices in ``rows`` (:func:`task_rows`), on the split it evaluates (test, else validation)."""
    return {name: task_rows(rows, len(task.eval_docs), name, seed) for name, task in tasks.items()}


def _load_once(task_manager, names: Sequence[str]) -> tuple[dict[str, Any], list]:
    """The leaf tasks of ``names``, and what to hand ``simple_evaluate`` so that it does not load them again.

    ``simple_evaluate`` takes built tasks and groups as well as names; a name that is neither (a tag) is
    handed on as it is, and loaded again there.
    """
    with _quiet_lm_eval():
        loaded = task_manager.load(list(names))
    built = [loaded["groups"][name] if name in loaded["groups"] else loaded["tasks"].get(name) for name in names]
    return dict(loaded["tasks"]), built if all(item is not None for item in built) else list(names)


def _check_lm_eval_version() -> None:
    try:
        found = metadata.version("lm_eval")
    except metadata.PackageNotFoundError as err:
        raise LayercutError(f"lm-eval is not installed; pip install 'lm-eval{LM_EVAL_TESTED}'") from err
    parts = tuple(int(p) for p in found.split(".")[:3] if p.isdigit())
    if not _LM_EVAL_TESTED_MIN <= parts < _LM_EVAL_TESTED_BELOW:
        logger.warning("lm-eval %s found; layercut's task bridge is tested with lm-eval%s", found, LM_EVAL_TESTED)


def wrap_model(model: Any, tokenizer: Any, batch_size: int = 8):
    """Wrap an in-memory model in lm-eval's ``HFLM``, or load one from a ``save_pretrained`` folder.

    Args:
        model: A ``PreTrainedModel`` (used as is, on whatever devices it sits) or a checkpoint folder
            (opened with ``prune.load``).
        tokenizer: Its tokenizer; for a folder, ``None`` loads the folder's own.
        batch_size: Requests per forward pass.

    Returns:
        The ``HFLM`` wrapper.

    Raises:
        LayercutError: an in-memory model without a tokenizer, or a folder that does not exist.
    """
    from lm_eval.models.huggingface import HFLM

    if isinstance(model, (str, Path)):
        folder = Path(model).expanduser()
        if not folder.is_dir():
            raise LayercutError(f"model folder {folder} not found; pass a save_pretrained folder or a loaded model")
        from prune.checkpoint import load  # the one loader: a checkpoint with replacement maps keeps them

        loaded = load(str(folder), device="cuda" if torch.cuda.is_available() else "cpu")
        return HFLM(pretrained=loaded.model, tokenizer=tokenizer or loaded.tokenizer, batch_size=batch_size)
    if tokenizer is None:
        raise LayercutError("an in-memory model needs its tokenizer; pass tokenizer= (load_model returns both)")
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


@contextmanager
def hub_offline() -> Iterator[None]:
    """Forbid hub access for the duration, then restore the previous settings.

    ``datasets`` and ``huggingface_hub`` read the environment once at import, so their flags are set too.
    """
    import datasets.config
    import huggingface_hub.constants

    saved_env = {key: os.environ.get(key) for key in _OFFLINE_ENV}
    flags = [(datasets.config, "HF_DATASETS_OFFLINE"), (datasets.config, "HF_HUB_OFFLINE"),
             (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    saved_flags = [(module, attr, getattr(module, attr)) for module, attr in flags if hasattr(module, attr)]
    try:
        os.environ.update(dict.fromkeys(_OFFLINE_ENV, "1"))
        for module, attr, _ in saved_flags:
            setattr(module, attr, True)
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for module, attr, value in saved_flags:
            setattr(module, attr, value)


def _metric_value(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return math.nan if value == "N/A" else None  # lm-eval writes "N/A" for a stderr it cannot estimate


def clean_metrics(raw: dict[str, Any]) -> dict[str, float]:
    """lm-eval's per-task result dict with the ``,none`` filter suffix dropped and only numbers kept.

    Args:
        raw: One entry of ``simple_evaluate(...)["results"]``, e.g. ``{"acc,none": 0.5, "alias": "piqa"}``.

    Returns:
        ``{"acc": 0.5, "acc_stderr": ..., ...}``; metrics under another filter keep ``"name,filter"``.
    """
    out: dict[str, float] = {}
    for key, value in raw.items():
        metric, _, filter_name = key.partition(",")
        number = _metric_value(value)
        if number is not None and metric != "alias":
            out[metric if filter_name in ("", "none") else key] = number
    return out


class _DropCustomDatasetNotice(logging.Filter):
    """Drop lm-eval's per-task advice on ``custom_dataset`` kwargs: we pass ``data_dir`` ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def local_tasks(names: Sequence[str], data_dir: str | Path | None) -> dict[str, Any]:
    """Build lm-eval ``Task`` objects for offline tasks, reading their rows from ``data_dir``.

    Args:
        names: Offline tasks (:func:`offline_tasks`).
        data_dir: The data folder (``None``: ``$LAYERCUT_DATA``).

    Returns:
        ``{name: Task}``, ready for ``lm_eval.evaluator.simple_evaluate(tasks=[...])``.

    Raises:
        LayercutError: an unknown offline task, or a missing folder or file.
    """
    for name in names:
        local_data_files(name, data_dir)
    return _load_tasks(_local_task_manager(resolve_data_dir(data_dir)), names)


def _load_tasks(task_manager, names: Sequence[str]) -> dict[str, Any]:
    return _load_once(task_manager, names)[0]


def answered_prompts(task) -> list[str]:
    """Every evaluation row of an lm-eval ``task``: its prompt followed by its right answer, as one text.

    The answer is joined the way lm-eval scores it: a multiple-choice option after the task's target
    delimiter, any other target as it is. Rows come in the task's order (test split, else validation).
    """
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    texts = []
    for doc in docs:
        target = task.doc_to_target(doc)
        if task.OUTPUT_TYPE == "multiple_choice":
            target = task.config.target_delimiter + task.doc_to_choice(doc)[target]
        texts.append(task.doc_to_text(doc) + target)
    return texts


@contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    task_logger = logging.getLogger("lm_eval.api.task")
    notice = _DropCustomDatasetNotice()
    task_logger.addFilter(notice)
    try:
        yield
    finally:
        task_logger.removeFilter(notice)


def _evaluate(lm, names: list[str], task_manager, *, limit, num_fewshot, seed,
              rows: dict[str, list[float]] | None = None) -> dict[str, dict[str, float]]:
    from lm_eval import evaluator

    indices, specs = None, list(names)
    if row_range(limit) is not None:  # the rows are counted on the tasks simple_evaluate then runs
        leaves, specs = _load_once(task_manager, names)
        indices, limit = _rows_in(leaves, limit, seed), None
    start = time.perf_counter()
    with _quiet_lm_eval():
        out = evaluator.simple_evaluate(
            model=lm, tasks=specs, task_manager=task_manager, limit=limit, samples=indices, num_fewshot=num_fewshot,
            log_samples=rows is not None, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    logger.info("lm-eval %s done in %.1f s", ",".join(names), time.perf_counter() - start)
    if out is None:  # non-zero rank of a distributed run: rank 0 reports
        return {}
    if rows is not None:
        for task, samples in (out.get("samples") or {}).items():
            metric = primary_metric(task)
            kept = sorted((s for s in samples if s.get("filter", "none") == "none" and metric in s),
                          key=lambda s: s["doc_id"])
            rows[task] = [float(s[metric]) for s in kept]
    return {task: clean_metrics(raw) for task, raw in out["results"].items()}


def run_lm_eval(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    data_dir: str | Path | None = None,
    limit: int | float | str | None = None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
    seed: int = TASK_SEED,
    rows: dict[str, list[float]] | None = None,
) -> dict[str, dict[str, float]]:
    """Evaluate ``model`` on lm-eval tasks, from local files when a data folder is given.

    Args:
        model: An in-memory ``PreTrainedModel``, or a ``save_pretrained`` folder.
        tokenizer: The model's tokenizer (``None`` with a folder loads the folder's own).
        tasks: Standard lm-eval task names (``lambada`` runs ``lambada_openai`` offline).
        data_dir: Folder laid out like ``shared/data``; ``None`` falls back to ``$LAYERCUT_DATA``, and
            without either the tasks come from lm-eval's registry and the hub.
        limit: Rows per task (a whole number), a fraction of each task (a float in (0, 1)), or a range of
            rows (``"START:END"``, Python's slice bounds: ``"-500:"`` is each task's last 500), or a draw of N
            rows at random from a range (``"1000~1000:"``: 1,000 rows drawn with ``seed`` from row 1000 on);
            ``None``: all.
        batch_size: Requests per forward pass.
        num_fewshot: Few-shot examples (``None``: each task's default, 0 for these). Offline there is
            no train split, so they are drawn from the evaluated split (never the row itself).
        seed: Seed for Python, NumPy, torch and the few-shot sampler.
        rows: A dict to fill with each task's primary metric row by row (in row order), for paired
            comparisons: two models scored on the same rows differ by far less noise than their
            separate standard errors suggest.

    Returns:
        ``{task: {metric: value}}`` with lm-eval's metric names without the ``,none`` suffix, e.g.
        ``{"piqa": {"acc": .., "acc_stderr": .., "acc_norm": .., "acc_norm_stderr": ..}}``. Groups that
        lm-eval aggregates appear under their own name.

    Raises:
        LayercutError: bad options, an unknown task, a missing data folder or file, or a missing model folder.
    """
    limit = _check_options(limit, batch_size, num_fewshot)
    _check_lm_eval_version()
    root = resolve_data_dir(data_dir)
    local, registry = plan_tasks(tasks, root)
    if root is not None and num_fewshot:
        logger.warning("offline tasks have no train split: few-shot examples come from the evaluated split")
    lm = wrap_model(model, tokenizer, batch_size)
    kwargs = dict(limit=limit, num_fewshot=num_fewshot, seed=seed, rows=rows)
    results: dict[str, dict[str, float]] = {}
    if local:
        logger.info("running %s from local files in %s", ", ".join(local), root)
        with hub_offline():
            results.update(_evaluate(lm, local, _local_task_manager(root), **kwargs))
    if registry:
        logger.info("running %s from lm-eval's registry%s", ", ".join(registry), " (offline)" if root else "")
        with hub_offline() if root is not None else nullcontext():
            results.update(_evaluate(lm, registry, _registry(), **kwargs))
    return results
