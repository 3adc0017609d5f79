"""The offline task table: what layercut knows of each lm-eval task, and where its local files lie.

    from eval.quality.task_specs import task_table, local_data_files
    task_table()["piqa"].chance                   # 0.5: two choices a row
    local_data_files("piqa", "../shared/data")    # the files it reads, checked to exist

An offline task's :class:`TaskSpec` is the ``metadata: {layercut: ...}`` block of its YAML in
:data:`TASKS_DIR` (and the folders in ``$LAYERCUT_TASKS``); tasks with no YAML here are :data:`HUB_TASKS`.
Nothing here imports lm-eval: reading the table costs a YAML parse, not lm-eval's registry.
:mod:`eval.quality.lmeval` re-exports every public name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prune.errors import LayercutError
from prune.registry import Registry

DATA_DIR_ENV = "LAYERCUT_DATA"
TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"

TASK_DIRS_ENV = "LAYERCUT_TASKS"  # more folders of offline task YAMLs, separated like $PATH
# names users type that mean a different task offline
OFFLINE_ALIASES: dict[str, str] = {"lambada": "lambada_openai"}


def check_token_budget(max_gen_toks: Any) -> None:
    """Raise ``ValueError`` unless ``max_gen_toks`` is ``None`` (each task's own) or a positive whole number."""
    if max_gen_toks is not None and (isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int)
                                     or max_gen_toks < 1):
        raise ValueError(f"max_gen_toks must be a positive whole number of tokens, got {max_gen_toks!r}")


@dataclass(frozen=True)
class TaskSpec:
    """What layercut knows of one lm-eval task beyond what lm-eval computes.

    An offline task's spec is the ``metadata: {layercut: ...}`` block of its YAML in :data:`TASKS_DIR`
    (lm-eval passes the metadata on to the ``custom_dataset`` loader and otherwise only reads its
    ``version``, so the block changes no number lm-eval computes).

    Attributes:
        name: lm-eval's task name.
        primary_metric: The metric to quote, a key of :func:`eval.quality.lmeval.run_lm_eval`'s task dicts (``acc_norm``
            where the length-normalised score is the convention).
        chance: Accuracy of a random guess: 1 / the choices a row offers, 0 for an open answer.
        files: The files the task reads, relative to the data folder; empty for a task only lm-eval's
            registry runs (its data from the hub).
        source: The YAML the spec was read from; ``None`` for :data:`HUB_TASKS`.
        chat: Whether the prompts go through the model's chat template (``chat: true`` in the block). lm-eval
            applies a template to every task of a run, so :func:`eval.quality.lmeval.run_lm_eval` runs these
            tasks in a run of their own.
        max_gen_toks: The token budget of a task that generates (``generation_kwargs.max_gen_toks`` of its
            lm-eval config, which the block does not repeat); ``None`` for a task that scores given answers.
        needs: What its scoring code needs besides lm-eval (``needs: [ifeval]``), each a check of
            :data:`eval.quality.needs.TASK_NEEDS` run before lm-eval imports that code.
    """

    name: str
    primary_metric: str
    chance: float
    files: tuple[str, ...] = ()
    source: Path | None = None
    chat: bool = False
    max_gen_toks: int | None = None
    needs: tuple[str, ...] = ()

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
        if not isinstance(self.needs, tuple) or not all(isinstance(need, str) for need in self.needs):
            raise ValueError(f"needs must be a list of names, e.g. [ifeval], got {self.needs!r}")
        if not isinstance(self.chat, bool):
            raise ValueError(f"chat must be true or false (whether prompts go through the chat template), got "
                             f"{self.chat!r}")
        check_token_budget(self.max_gen_toks)

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


def task_yaml_files(path: str | Path, seen: frozenset[Path] = frozenset()) -> list[Path]:
    """A task YAML and every YAML it includes, as lm-eval merges them: what its prompts, metrics and budget come from.

    A cache of a task's scores keys on these (arc_challenge's prompts are arc_easy.yaml's, which it includes).
    """
    path = Path(path).resolve()
    if path in seen:  # read_task_spec refused the cycle when the table was built
        return []
    config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)
    includes = config.get("include", []) if isinstance(config, dict) else []
    files = [path]
    for include in includes if isinstance(includes, list) else [includes]:
        files += task_yaml_files(path.parent / include, seen | {path})
    return list(dict.fromkeys(files))


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
                        tuple(files) if isinstance(files, list) else files, path, block.get("chat", False),
                        needs=tuple(block["needs"]) if isinstance(block.get("needs"), list) else block.get("needs", ()))
    except ValueError as err:
        raise LayercutError(f"{path}: metadata.layercut.{err}") from None
    try:
        spec = dataclasses.replace(spec, max_gen_toks=_token_budget(config))
    except ValueError as err:
        raise LayercutError(f"{path}: generation_kwargs.{err}") from None
    metrics = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)]
    if metrics and spec.primary_metric not in metrics:
        raise LayercutError(f"{path}: primary_metric {spec.primary_metric!r} is not in the task's metric_list "
                            f"({', '.join(map(str, metrics))}); name one of them")
    return spec


def _token_budget(config: dict[str, Any]) -> int | None:
    """A generating task's ``generation_kwargs.max_gen_toks``; ``None`` for another task or no budget set."""
    if config.get("output_type") != "generate_until":
        return None
    kwargs = config.get("generation_kwargs")
    return kwargs.get("max_gen_toks") if isinstance(kwargs, dict) else None


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


def primary_metric(task: str) -> str:
    """Return the metric to quote for ``task``: its :class:`TaskSpec`'s, ``acc`` for a task not in :func:`task_table`.

    Args:
        task: A standard lm-eval task name.

    Returns:
        A key of the task dicts :func:`eval.quality.lmeval.run_lm_eval` returns (``acc_norm`` for ARC and HellaSwag).
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


def offline_names() -> str:
    """The offline tasks and the aliases that run them, comma-separated, for error messages."""
    return ", ".join([*sorted(offline_tasks()), *sorted(OFFLINE_ALIASES)])


def _offline_spec(name: str) -> TaskSpec:
    table = task_table()
    if name not in table or not table[name].offline:
        raise unknown_task_error(name)
    return table[name]


def unknown_task_error(name: str) -> LayercutError:
    """The error for a task name that is neither offline nor in lm-eval's registry; it lists the offline ones."""
    known = offline_names()
    return LayercutError(
        f"unknown task {name!r}: not an offline task ({known}) nor in lm-eval's registry; "
        f"`lm-eval ls tasks` lists lm-eval's tasks (`lm-eval --tasks list` before 0.4.10)"
    )


def check_task_needs(names: Sequence[str]) -> None:
    """Run the check of every need (:mod:`eval.quality.needs`) of the tasks ``names`` (none for a name unknown)."""
    from eval.quality.needs import TASK_NEEDS  # its checks import task_specs

    table = task_table()
    for name in dict.fromkeys(names):
        for need in table[name].needs if name in table else ():
            TASK_NEEDS.get(need)()
