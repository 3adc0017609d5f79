"""Run lm-evaluation-harness tasks on an in-memory model or a checkpoint folder, from the hub or local files.

    from eval.quality.lmeval import run_lm_eval
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
accuracy of a random guess, whether its prompts go through the chat template, a generating task's token
budget) is one :class:`TaskSpec` in :func:`task_table`, read from the
``metadata: {layercut: ...}`` block of its YAML; tasks with no YAML here are :data:`HUB_TASKS`. Adding an
offline task is adding its YAML.

The task table and data folder are :mod:`eval.quality.task_specs`, the rows a ``limit`` reads :mod:`eval.quality.rows`;
both are re-exported here, so ``from eval.quality.lmeval import task_table, task_rows`` keeps working.

``ifeval`` generates (greedily, 256 tokens unless ``max_gen_toks`` says otherwise) through the model's chat
template, in a ``simple_evaluate`` call of its own, and needs the ``ifeval`` extra and NLTK's punkt_tab data,
checked first (:mod:`eval.quality.needs.ifeval`).

Tested with lm-eval :data:`LM_EVAL_TESTED` (the task registry and ``custom_dataset`` hooks change
between minor versions).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from eval.quality.rows import TASK_SEED, check_limit, describe_rows, row_draw, row_range, task_rows
from eval.quality.task_specs import (
    DATA_DIR_ENV,
    HUB_TASKS,
    OFFLINE_ALIASES,
    TASK_DIRS_ENV,
    TASKS_DIR,
    TaskSpec,
    chance_level,
    check_task_needs,
    check_token_budget,
    local_data_files,
    offline_names,
    offline_tasks,
    primary_metric,
    read_task_spec,
    resolve_data_dir,
    task_dirs,
    task_table,
    task_yaml_files,
    unknown_task_error,
)
from prune.errors import LayercutError

__all__ = [
    "DATA_DIR_ENV",
    "HUB_TASKS",
    "LM_EVAL_TESTED",
    "OFFLINE_ALIASES",
    "TASKS_DIR",
    "TASK_DIRS_ENV",
    "TASK_SEED",
    "TaskSpec",
    "answered_prompts",
    "chance_level",
    "check_chat_template",
    "check_limit",
    "check_registry_data",
    "clean_metrics",
    "describe_rows",
    "hub_offline",
    "local_data_files",
    "local_tasks",
    "offline_tasks",
    "plan_tasks",
    "primary_metric",
    "read_task_spec",
    "resolve_data_dir",
    "row_draw",
    "row_range",
    "run_lm_eval",
    "task_dirs",
    "task_rows",
    "task_table",
    "task_yaml_files",
    "wrap_model",
]

logger = logging.getLogger(__name__)

LM_EVAL_TESTED = ">=0.4.13,<0.5"
_LM_EVAL_TESTED_MIN = (0, 4, 13)
_LM_EVAL_TESTED_BELOW = (0, 5)

_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


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
        LayercutError: no tasks, an unknown name, a missing local file, or what a task's scoring imports is
            missing (:func:`eval.quality.needs.ifeval.check_ifeval_ready`).
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
            raise unknown_task_error(name)
    check_task_needs([*local, *registry])  # before lm-eval imports a task's scoring code (ifeval's downloads)
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
        offline = offline_names()
        raise LayercutError(
            f"lm-eval task(s) {', '.join(names)}: their data could not be read ({type(err).__name__}: {cause}); "
            f"they come from the Hugging Face hub: run once online (then they are cached), or use the tasks "
            f"that run from --data-dir ({offline})"
        ) from None


def _check_options(limit: int | float | str | None, batch_size: int, num_fewshot: int | None,
                   max_gen_toks: int | None = None) -> Any:
    """Validate the options; return ``limit`` as lm-eval reads it (:func:`check_limit`).

    A range of rows (``"START:END"``) or a draw (``"N~START:END"``) is returned as it came: :func:`_evaluate`
    turns it into each task's row indices once it knows how many rows the task has.
    """
    limit = check_limit(limit)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise LayercutError(f"batch_size must be a positive integer, got {batch_size!r}")
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise LayercutError(f"num_fewshot must be a non-negative integer, got {num_fewshot!r}")
    try:
        check_token_budget(max_gen_toks)
    except ValueError as err:
        raise LayercutError(str(err)) from None
    return limit


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
        from prune.checkpoint.save_load import load  # the one loader: a checkpoint with replacement maps keeps them

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
    check_task_needs(list(names))
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


def _evaluate(lm, names: list[str], task_manager, *, limit, num_fewshot, seed, chat: bool = False,
              max_gen_toks: int | None = None,
              rows: dict[str, list[float]] | None = None) -> dict[str, dict[str, float]]:
    """One ``simple_evaluate`` call: ``chat`` and ``max_gen_toks`` apply to every task of it (lm-eval's rule)."""
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
            fewshot_random_seed=seed, apply_chat_template=chat,
            gen_kwargs=None if max_gen_toks is None else {"max_gen_toks": max_gen_toks},
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
    return {task: clean_metrics(raw) | _budget_ran(out.get("configs", {}).get(task))
            for task, raw in out["results"].items()}


def _budget_ran(config: dict[str, Any] | None) -> dict[str, int]:
    """``{"max_gen_toks": N}`` for a task that generated (the budget it ran with, so a figure says it); else ``{}``."""
    if not config or config.get("output_type") != "generate_until":
        return {}
    budget = (config.get("generation_kwargs") or {}).get("max_gen_toks")
    return {"max_gen_toks": int(budget)} if isinstance(budget, (int, float)) else {}


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
    max_gen_toks: int | None = None,
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
        max_gen_toks: Tokens a generating task (``ifeval``) may write per row, greedily; ``None``: each task's
            own budget (:attr:`TaskSpec.max_gen_toks`, 256 for ifeval, below lm-eval's 1280 so a CPU can run
            it; a registry task layercut has no spec for keeps lm-eval's).

    Returns:
        ``{task: {metric: value}}`` with lm-eval's metric names without the ``,none`` suffix, e.g.
        ``{"piqa": {"acc": .., "acc_stderr": .., "acc_norm": .., "acc_norm_stderr": ..}}``; a task that
        generates also has ``max_gen_toks``, the budget it ran with. Groups that lm-eval aggregates appear
        under their own name. Tasks whose spec says ``chat`` ran with the model's chat template.

    Raises:
        LayercutError: bad options, an unknown task, a missing data folder or file, a missing model folder,
            missing packages or data for a task's scoring, or a chat task on a tokenizer without a chat template.
    """
    limit = _check_options(limit, batch_size, num_fewshot, max_gen_toks)
    _check_lm_eval_version()
    root = resolve_data_dir(data_dir)
    local, registry = plan_tasks(tasks, root)
    if root is not None and num_fewshot:
        logger.warning("offline tasks have no train split: few-shot examples come from the evaluated split")
    lm = wrap_model(model, tokenizer, batch_size)
    return _evaluate_planned(lm, local, registry, root, limit=limit, num_fewshot=num_fewshot, seed=seed, rows=rows,
                             max_gen_toks=max_gen_toks)


def check_chat_template(tokenizer: Any, names: Sequence[str]) -> None:
    """Refuse, in one line, to run a task whose spec says ``chat`` with a tokenizer that has no chat template.

    lm-eval would fail deep in the run, or (with a template-less tokenizer it cannot tell) score raw prompts
    under the task's name; a base model's IFEval figure without a template is not the figure the task means.

    Raises:
        LayercutError: a chat task and a tokenizer without ``chat_template``.
    """
    table = task_table()
    chat = [name for name in names if name in table and table[name].chat]
    if chat and not getattr(tokenizer, "chat_template", None):
        raise LayercutError(
            f"{', '.join(chat)} runs its prompts through the model's chat template, and this tokenizer has none; "
            f"evaluate an instruct/chat model, pass the tokenizer of its instruct version (--tokenizer / tokenizer=), "
            f"or set tokenizer.chat_template"
        )


def _run_settings(names: Sequence[str], max_gen_toks: int | None) -> dict[tuple[bool, int | None], list[str]]:
    """Tasks grouped by what lm-eval sets per ``simple_evaluate`` call: the chat template and the token budget.

    A task's budget is ``max_gen_toks`` when given, else its spec's (``None``, lm-eval's own, for a task with
    none); the budget only reaches tasks that generate, so tasks that score given answers share any group's.
    """
    table = task_table()
    groups: dict[tuple[bool, int | None], list[str]] = {}
    for name in names:
        spec = table[name] if name in table else None
        budget = max_gen_toks if max_gen_toks is not None else spec.max_gen_toks if spec else None
        groups.setdefault((bool(spec and spec.chat), budget), []).append(name)
    return groups


def _evaluate_planned(lm, local: list[str], registry: list[str], root: Path | None,
                      **kwargs: Any) -> dict[str, dict[str, float]]:
    """Run :func:`plan_tasks`' two lists: the local tasks with the hub shut, then the registry's.

    With a data folder the registry tasks run offline too: a run given local data reads no network, so a
    registry task's data must already be in the hub cache (what :func:`check_registry_data` checks). Each list
    runs as one ``simple_evaluate`` call per chat setting and token budget (:func:`_run_settings`).
    """
    max_gen_toks = kwargs.pop("max_gen_toks", None)
    check_chat_template(lm.tokenizer, [*local, *registry])
    results: dict[str, dict[str, float]] = {}
    if local:
        logger.info("running %s from local files in %s", ", ".join(local), root)
        manager = _local_task_manager(root)
        with hub_offline():
            for (chat, budget), names in _run_settings(local, max_gen_toks).items():
                results.update(_evaluate(lm, names, manager, chat=chat, max_gen_toks=budget, **kwargs))
    if registry:
        logger.info("running %s from lm-eval's registry%s", ", ".join(registry), " (offline)" if root else "")
        with hub_offline() if root is not None else nullcontext():
            for (chat, budget), names in _run_settings(registry, max_gen_toks).items():
                results.update(_evaluate(lm, names, _registry(), chat=chat, max_gen_toks=budget, **kwargs))
    return results
