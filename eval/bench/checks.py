"""Engine checks as typed requests, each run in a process of its own: what ``prune.ship`` verifies a checkpoint with.

    from eval.bench.checks import ServingCheck, run_in_child
    figures = run_in_child(ServingCheck(models=(("slim", "slim/", "llamacpp"),), texts=(("ptb", "ptb.txt"),),
                                        tokenizer="slim/"), log=Path("verify/serving.log"))

A :class:`ServingCheck` scores every (model, engine) pair on the same token ids of each held-out text, each
model loaded once per engine for all the texts (``eval.bench serving``'s scoring); the rows of the models it
names in ``kept`` (the original, the same in every run) are read from the cache when an earlier check measured
the same files on the same token ids with the same engine and libraries (:func:`kept_row_path`); a :class:`SpeedCheck`
times a model against its original in one engine (``eval.bench speed``'s); a :class:`FidelityCheck` has the
original judge what the model writes (``eval.quality.fidelity``), the original's side read from the cache likewise
(``keep_original``); a :class:`TasksCheck` scores lm-eval tasks on both, on the same rows, the original's scores kept
likewise. :func:`run_in_child` runs one in
a fresh Python process: an engine's memory, threads and crashes stay its own, and the
caller gets the figures back as the function's value, or one line when the check failed (its log has the rest).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from eval.quality.fidelity import FidelityOptions
from prune.errors import LayercutError, ended_by, show_native_crashes, signal_name

# a check's greedy continuation: this many tokens after the first window's first 32
GREEDY_TOKENS = 32


@dataclass(frozen=True)
class ServingCheck:
    """Perplexity and greedy ids of models in engines, on the same token ids of each held-out text.

    Attributes:
        models: (label, model, engine): a model is a checkpoint folder, alias or GGUF file, scored in that engine.
        texts: (label, held-out text): a .txt/.jsonl/.parquet file or datasets spec.
        tokenizer: the model whose tokenizer makes the token ids (every engine scores the same ids).
        seq_len: tokens per window.
        tokens: held-out tokens scored per text.
        greedy_tokens: greedy ids generated after each text's first window's first 32 tokens (0: none).
        threads: CPU threads (None: the free cores).
        converter: llama.cpp's ``convert_hf_to_gguf.py``, for a folder scored in llama.cpp.
        kept: labels of ``models`` whose rows are kept in the cache and read from it (:func:`kept_row_path`).
        dtype: the dtype the models are loaded in (``LoadConfig.dtype``; vLLM takes it too, llama.cpp its file's).
        device: where transformers runs them (``LoadConfig.device``: cpu, cuda, cuda:N, auto).
        offload: how transformers holds them (``LoadConfig.offload``; "sequential": a skeleton whose passes read
            one block at a time, for models larger than memory; the same figures).
        no_repack: llama.cpp loads with its extra buffer types off (``LlamaCppOptions.no_repack``).
    """

    models: tuple[tuple[str, str, str], ...]
    texts: tuple[tuple[str, str], ...]
    tokenizer: str
    seq_len: int = 512
    tokens: int = 4096
    greedy_tokens: int = GREEDY_TOKENS
    threads: int | None = None
    converter: str | None = None
    kept: tuple[str, ...] = ()
    dtype: str = "auto"
    device: str = "cpu"
    offload: str = "none"
    no_repack: bool = False

    def run(self) -> dict:
        """{text label: {"setup": ..., "rows": {model label: {engine: row}}}} (``eval.bench serving``'s rows)."""
        from eval.bench.serving import held_out_ids, model_layout, score_texts, serving_setup, windows_of
        from eval.speed.engines import EngineSettings
        from prune.checkpoint.load_config import LoadConfig

        windows = {label: windows_of(held_out_ids(text, self.tokenizer), self.seq_len, self.tokens)
                   for label, text in self.texts}
        settings = EngineSettings.build(load=LoadConfig(dtype=self.dtype, device=self.device, offload=self.offload),
                                        threads=self.threads,
                                        context=self.seq_len,
                                        **_llama_cpp_values(self.converter, self.no_repack))
        result = {label: {"setup": serving_setup(text, self.seq_len, windows[label]), "rows": {}}
                  for label, text in self.texts}
        engines: dict[str, dict[str, str]] = {}
        stored: dict[tuple[str, str], dict[str, Path]] = {}  # (label, engine) -> text -> its kept row's file
        for label, model, engine in self.models:
            if label in self.kept:
                paths = {text: kept_row_path(model, engine, windows[text], self.greedy_tokens, self.threads,
                                             dtype=self.dtype, device=self.device)
                         for text in windows}
                rows = {text: _read_row(path) for text, path in paths.items() if path is not None}
                if len(rows) == len(windows) and all(row is not None for row in rows.values()):
                    for text, row in rows.items():
                        result[text]["rows"].setdefault(label, {})[engine] = {**row, "kept": True}
                    continue
                stored[(label, engine)] = {text: path for text, path in paths.items() if path is not None}
            engines.setdefault(engine, {})[label] = model
        for engine, models in engines.items():
            scored = score_texts(engine, models, windows, settings, self.greedy_tokens)
            for text, per_model in scored.items():
                for label, row in per_model.items():
                    row.update(serving=model_layout(models[label]), path=str(models[label]))
                    result[text]["rows"].setdefault(label, {})[engine] = row
                    path = stored.get((label, engine), {}).get(text)
                    if path is not None and row.get("runs"):
                        _keep_row(path, row)
        return result


# the fidelity-original rows' format and the code that measures them: a change to either makes this larger, so rows
# kept before it are measured again rather than read
FIDELITY_ROWS_VERSION = 1


def kept_row_path(model: str, engine: str, window_ids: list[list[int]], greedy_tokens: int,
                  threads: int | None = None, *, dtype: str = "auto", device: str = "cpu",
                  kind: str = "serving-rows", extra: list | None = None) -> Path | None:
    """Where the cache keeps ``model``'s serving row in ``engine`` on these windows (None: its files unknown).

    ``kind``: the cache's folder for such rows (the fidelity check keeps the original's side apart); ``extra``: what
    else the rows depend on (the fidelity check's decode batch, since a greedy id may follow a kernel's order of
    sums as it does the threads', and the version of the code that measured them).

    The name is a digest of what the row depends on: the model's files (path, names, sizes and times), the
    engine and its version, torch's and transformers' versions, the token ids, the greedy length, the threads
    (the order of a sum changes with them, and a greedy id may follow), and the dtype and device it ran in.
    """
    import importlib.metadata

    from eval.speed.engines import get_engine
    from eval.speed.engines.base import checkpoint_folder, files_stamp
    from prune.loading.gguf import cache_dir

    given = Path(model).expanduser()
    found = given if given.exists() else Path(checkpoint_folder(model) or model)
    if not found.exists():
        return None
    stamp = files_stamp(found)
    versions = [get_engine(engine).version()] + [importlib.metadata.version(name) for name in ("torch", "transformers")]
    key = json.dumps([stamp, engine, versions, window_ids, greedy_tokens, threads, dtype, device]
                     + (list(extra) if extra else []))  # serving rows keep their keys
    return cache_dir() / kind / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _read_row(path: Path) -> dict | None:
    try:
        row = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent or damaged: measured again
        return None
    return row if isinstance(row, dict) and row.get("runs") else None


def _keep_row(path: Path, row: dict) -> None:
    from prune.atomic import write_file_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, lambda staging: Path(staging).write_text(json.dumps(row, default=str), encoding="utf-8"))


@dataclass(frozen=True)
class SpeedCheck:
    """Prefill and decode speed of ``model`` against ``baseline`` in ``engine`` (``eval.bench speed``).

    Attributes:
        baseline: the original model (name, folder).
        model: the checkpoint (folder, or a GGUF file for llama.cpp).
        engine: a registered engine.
        repeats: timed rounds.
        prompt_len: prompt tokens (the prefill).
        new_tokens: tokens generated (the decode).
        threads: CPU threads (None: the free cores).
        converter: llama.cpp's ``convert_hf_to_gguf.py``, for a folder timed in llama.cpp.
        dtype: the dtype both are loaded in (``LoadConfig.dtype``; vLLM takes it too).
        device: where transformers runs them (``LoadConfig.device``).
        gguf_type: llama.cpp's type for a folder it runs (the baseline): the shipped file's, so the ratio is the
            depth's alone (None: the engine's default, float32).
        no_repack: as :class:`ServingCheck`'s.
    """

    baseline: str
    model: str
    engine: str
    repeats: int = 3
    prompt_len: int = 256
    new_tokens: int = 64
    threads: int | None = None
    converter: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    gguf_type: str | None = None
    no_repack: bool = False

    def run(self) -> dict:
        """The speed comparison (``speed.json``'s fields)."""
        from eval.bench.speed import measure_speed
        from prune.checkpoint.load_config import LoadConfig

        values = _llama_cpp_values(self.converter, self.no_repack)
        if self.gguf_type:
            values["gguf_type"] = self.gguf_type
        load = LoadConfig(model=self.baseline, dtype=self.dtype, device=self.device)
        return measure_speed(self.engine, self.baseline, [self.model], load,
                             repeats=self.repeats, prompt_len=self.prompt_len, new_tokens=self.new_tokens,
                             threads=self.threads, settings=values)


@dataclass(frozen=True)
class FidelityCheck:
    """Generation fidelity of ``model`` to ``original`` (``eval.quality.fidelity``) on prompts cut from held-out texts.

    The original writes its greedy continuation of each prompt and judges the model's: its mean NLL per token of
    what the model wrote (the original's own text gives the floor) and the share of its greedy tokens the model
    keeps before the first that differs. Both load in transformers and are held together (the original judges).

    Attributes:
        original: the original model (name, folder).
        model: the checkpoint folder measured.
        texts: (label, held-out text), the prompts shared out evenly over them.
        tokenizer: the model whose tokenizer cuts the prompts.
        prompts, prompt_tokens, new_tokens: ``FidelityOptions``' (its defaults, ``eval.compare``'s column's).
        threads, dtype, device: as :class:`ServingCheck`'s.
        keep_original: read the original's side from the cache, or keep it there (:meth:`run`).
    """

    original: str
    model: str
    texts: tuple[tuple[str, str], ...]
    tokenizer: str
    prompts: int = FidelityOptions.prompts
    prompt_tokens: int = FidelityOptions.prompt_tokens
    new_tokens: int = FidelityOptions.new_tokens
    threads: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    keep_original: bool = False

    def run(self) -> dict:
        """``Reference.measure``'s figures for the model, with the texts the prompts came from.

        With ``keep_original``, the original's greedy continuations and its NLL of them are read from the cache
        when an earlier check wrote them for the same files, prompts, settings and libraries (:func:`kept_row_path`),
        else kept there: a second ship of the same model decodes only the checkpoint.
        """
        import torch

        from eval.quality.fidelity import Reference
        from prune.checkpoint.load_config import LoadConfig

        prompts = self._prompts()
        path = self._kept_path(prompts) if self.keep_original else None
        row = _read_row(path) if path is not None else None
        load = LoadConfig(dtype=self.dtype, device=self.device)
        original = load.load(self.original).model.eval()
        reference = Reference(original, prompts, self._options(),
                              greedy=torch.tensor(row["greedy"]) if row is not None else None,
                              own_nll=torch.tensor(row["own_nll"]) if row is not None else None)
        model = load.load(self.model).model.eval()
        figures = reference.measure(model)
        if path is not None and row is None:
            _keep_row(path, {"runs": 1, "greedy": reference.greedy.tolist(),
                             "own_nll": reference.own_nll.tolist()})
        return {**figures, "texts": [label for label, _ in self.texts], "original_kept": row is not None}

    def original_kept(self) -> bool:
        """Whether an earlier check kept the original's side of these prompts (the planner's question).

        An original without local files (a hub id) is never kept, and is answered before any text is tokenized.
        """
        from eval.speed.engines import REFERENCE

        if kept_row_path(self.original, REFERENCE, [], self.new_tokens) is None:
            return False
        path = self._kept_path(self._prompts())
        return path is not None and _read_row(path) is not None

    def _options(self) -> FidelityOptions:
        return FidelityOptions(prompts=self.prompts, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens)

    def _prompts(self):
        import torch

        from eval.bench.serving import held_out_ids
        from eval.quality.fidelity import prompts_from_streams

        streams = [torch.tensor(held_out_ids(text, self.tokenizer)) for _, text in self.texts]
        return prompts_from_streams(streams, self._options())

    def _kept_path(self, prompts) -> Path | None:
        from eval.speed.engines import REFERENCE

        return kept_row_path(self.original, REFERENCE, prompts.tolist(), self.new_tokens, self.threads,
                             dtype=self.dtype, device=self.device, kind="fidelity-original",
                             extra=[self._options().batch_size, FIDELITY_ROWS_VERSION])


# the tasks-original rows' format and the code that scores them, as FIDELITY_ROWS_VERSION
TASKS_ROWS_VERSION = 1


@dataclass(frozen=True)
class TasksCheck:
    """lm-eval tasks scored on ``original`` and ``model`` on the same rows (``eval.quality.lmeval.run_lm_eval``).

    Each task's primary metric is kept row by row, so the gap between the two is paired
    (:func:`eval.compare.stats.paired_tasks`): two models answering the same questions differ by far less noise than
    their two standard errors say. Both load in transformers, one after the other (one model in memory at a time).

    Attributes:
        original: the original model (name, folder).
        model: the checkpoint folder measured.
        tasks: lm-eval task names (an offline one runs from ``data_dir``).
        limit: rows per task, as ``run_lm_eval`` takes it (None: every row).
        data_dir: a folder laid out like ``shared/data`` (None: ``$LAYERCUT_DATA``, else the hub).
        batch_size: requests per forward pass.
        tokenizer: the original's tokenizer where the run gave one (``--tokenizer``; the checkpoint carries it).
        threads, dtype, device: as :class:`ServingCheck`'s.
        keep_original: read the original's scores from the cache, or keep them there (:meth:`run`).
    """

    original: str
    model: str
    tasks: tuple[str, ...]
    limit: int | float | str | None = None
    data_dir: str | None = None
    batch_size: int = 8
    tokenizer: str | None = None
    threads: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    keep_original: bool = False

    def run(self) -> dict:
        """:func:`eval.compare.stats.paired_tasks`' figures, each task's metric, chat setting and token budget beside.

        With ``keep_original``, the original's scores and rows are read from the cache when an earlier check kept
        them for the same files, tasks, rows, data, token budgets and libraries (:meth:`_kept_path`), else kept there
        as soon as they are scored: a second ship of the same model, or one stopped while the checkpoint was being
        scored, scores only the checkpoint.
        """
        from eval.compare.stats import paired_tasks
        from eval.quality.lmeval import describe_rows, plan_tasks, primary_metric, resolve_data_dir, task_table

        path = self._kept_path() if self.keep_original else None
        kept = self._kept_scores(path)
        if kept is None:
            original = self._score(self.original, self.tokenizer)
            if path is not None:  # before the checkpoint's hours: a run stopped there keeps the original's
                _keep_row(path, {"runs": 1, "scores": original})
        else:
            original = kept["scores"]
        model = self._score(self.model, None)
        local, registry = plan_tasks(self.tasks, resolve_data_dir(self.data_dir))  # an alias as lm-eval ran it
        figures = paired_tasks(original, model, [*local, *registry])
        table = task_table()
        for task, entry in figures["tasks"].items():
            entry.update(metric=primary_metric(task), chat=bool(task in table and table[task].chat),
                         **({"max_gen_toks": model["max_gen_toks"][task]} if task in model["max_gen_toks"] else {}))
        return {**figures, "limit": self.limit, "rows": describe_rows(self.limit), "original_kept": kept is not None}

    def original_kept(self) -> bool:
        """Whether an earlier check kept the original's scores of these tasks and rows (the planner's question)."""
        return self._kept_scores(self._kept_path()) is not None

    def _names(self) -> list[str]:
        """The tasks as lm-eval runs them: an offline alias (``lambada``) as its task where a data folder is used."""
        from eval.quality.lmeval import OFFLINE_ALIASES, resolve_data_dir

        offline = resolve_data_dir(self.data_dir) is not None
        return list(dict.fromkeys(OFFLINE_ALIASES.get(name, name) if offline else name for name in self.tasks))

    def _kept_scores(self, path: Path | None) -> dict | None:
        """The kept row at ``path``, unless a generating task's scores there ran at another token budget than now."""
        from eval.quality.lmeval import task_table

        kept = _read_row(path) if path is not None else None
        if kept is None:
            return None
        budgets, table = kept.get("scores", {}).get("max_gen_toks", {}), task_table()
        # the budget decides which answers a generating task scores: checked on the row itself, not only through the
        # key's stamp of the YAML that sets it
        wanted = {name: table[name].max_gen_toks for name in self._names() if name in table}
        if any(budget is not None and budgets.get(name) != budget for name, budget in wanted.items()):
            return None
        return kept

    def _score(self, name: str, tokenizer: str | None) -> dict:
        """One model's row as a comparison keeps it: each task's metric, standard error and rows; the token budgets.

        Raises:
            LayercutError: lm-eval's results of a task lack its primary metric (asked of the original first, so
                before the checkpoint is scored): the card would have nothing to show for it.
        """
        import gc

        import torch

        from eval.quality.lmeval import primary_metric, run_lm_eval
        from prune.checkpoint.load_config import LoadConfig

        loaded = LoadConfig(dtype=self.dtype, device=self.device, tokenizer=tokenizer).load(name)
        rows: dict[str, list[float]] = {}
        try:
            raw = run_lm_eval(loaded.model.eval(), loaded.tokenizer, list(self.tasks), data_dir=self.data_dir,
                              limit=self.limit, batch_size=self.batch_size, rows=rows)
        finally:  # the next model loads into the memory this one held
            del loaded
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        missing = [task for task in self._names() if task not in raw]
        if missing:  # a hub tag (lambada without a data folder) runs its tasks under their own names only
            raise LayercutError(f"lm-eval gave no figure named {', '.join(missing)} (it scored {', '.join(raw)}): "
                                "name those tasks in --tasks")
        for task, scores in raw.items():
            if primary_metric(task) not in scores:
                metrics = [m for m in scores if not m.endswith("_stderr") and m != "max_gen_toks"]
                raise LayercutError(f"lm-eval scored {task} without {primary_metric(task)}, the metric layercut "
                                    f"quotes for it (it gave {', '.join(metrics) or 'none'}): set primary_metric in "
                                    "the layercut: block of its task YAML to one of them (eval/tasks/README.md)")
        return {"tasks": {task: scores[primary_metric(task)] for task, scores in raw.items()},
                "task_stderr": {task: scores.get(f"{primary_metric(task)}_stderr") for task, scores in raw.items()},
                "task_rows": rows,
                "max_gen_toks": {task: int(scores["max_gen_toks"]) for task, scores in raw.items()
                                 if "max_gen_toks" in scores}}

    def _kept_path(self) -> Path | None:
        """The cache's file of the original's scores (None: its files unknown).

        Keyed on what the scores depend on: the original's files, the tokenizer's where it is a folder, the tasks,
        rows and batch, each task's YAML and those it includes (prompts, metrics, chat template, token budget), and
        with a data folder an offline task's data files and the code that reads them, and lm-eval's version.
        """
        import importlib.metadata

        from eval.quality.lmeval import (
            TASK_SEED,
            TASKS_DIR,
            local_data_files,
            resolve_data_dir,
            task_table,
            task_yaml_files,
        )
        from eval.speed.engines import REFERENCE
        from eval.speed.engines.base import files_stamp

        root, table = resolve_data_dir(self.data_dir), task_table()
        files, readers = [], set()  # a hub task's rows are lm-eval's version's
        for name in (name for name in self._names() if name in table):
            spec = table[name]
            if spec.source is not None:
                files += [files_stamp(path) for path in task_yaml_files(spec.source)]
            if root is not None and spec.offline:
                files += [files_stamp(path) for path in local_data_files(name, root)]
                # the readers its YAML names (local_docs.py's, or those beside a YAML on $LAYERCUT_TASKS), by content:
                # a checkout's times change with no change to what they read
                readers |= {*TASKS_DIR.glob("*.py"), *Path(spec.source).parent.glob("*.py")}
        code = [f"{path}:{hashlib.sha256(path.read_bytes()).hexdigest()}" for path in sorted(readers)]
        tokenizer = Path(self.tokenizer).expanduser() if self.tokenizer else None
        return kept_row_path(self.original, REFERENCE, [], 0, self.threads, dtype=self.dtype, device=self.device,
                             kind="tasks-original",
                             extra=[list(self.tasks), self.limit, TASK_SEED, self.batch_size,
                                    files_stamp(tokenizer) if tokenizer is not None and tokenizer.exists()
                                    else self.tokenizer,
                                    str(root), files, code, importlib.metadata.version("lm_eval"), TASKS_ROWS_VERSION])


class CheckCrashed(LayercutError):
    """A check's process ended by a signal.

    ``signal``: its name (``prune.errors.CRASH_SIGNALS``: a crash in native code; SIGKILL: out of memory, or stopped).
    """

    def __init__(self, kind: str, returncode: int, last: str, log: Path):
        self.signal = signal_name(returncode)
        super().__init__(f"the engine check failed ({kind}, ended by {ended_by(returncode)}): {last} (its log: {log})")


def _crash_words(lines: list[str]) -> str:
    """What a crashed check's log says of it: its own last line, and the innermost frame of faulthandler's stack."""
    fatal = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    if fatal is None:
        return lines[-1] if lines else "no output"
    own = lines[fatal].split("Fatal Python error")[0].strip() or (lines[fatal - 1] if fatal else "")
    current = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), None)
    frame = lines[current + 1].strip() if current is not None and current + 1 < len(lines) else ""
    return "; ".join(part for part in (own, f"crashed in {frame}" if frame else "") if part) or "no output"


def _llama_cpp_values(converter: str | None, no_repack: bool) -> dict:
    """llama.cpp's settings a check gives ``EngineSettings.build``: the ones that differ from its defaults."""
    return {**({"converter": converter} if converter else {}), **({"no_repack": True} if no_repack else {})}


def run_in_child(check: ServingCheck | SpeedCheck | FidelityCheck | TasksCheck, log: Path) -> dict:
    """``check.run()`` in a fresh Python process whose output goes to ``log``; its figures.

    The request travels as JSON beside the log (its fields), and the figures come back the same way: the
    child imports this module alone, not the caller's script.

    Raises:
        CheckCrashed: its process ended by a signal (a crash in native code, or killed); the line names the log.
        LayercutError: the check failed; the line names the log.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    request, result = log.with_suffix(".request.json"), log.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    request.write_text(json.dumps({"kind": type(check).__name__, "fields": asdict(check)}), encoding="utf-8")
    code = f"from eval.bench.checks import _child; _child({str(request)!r}, {str(result)!r}, {time.time()!r})"
    with log.open("w", encoding="utf-8") as handle:
        done = subprocess.run([sys.executable, "-c", code], stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not result.is_file():
        lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        last = lines[-1] if lines else "no output"
        if done.returncode < 0:
            raise CheckCrashed(type(check).__name__, done.returncode, _crash_words(lines), log)
        raise LayercutError(f"the engine check failed ({type(check).__name__}, exit {done.returncode}): "
                            f"{last} (its log: {log})")
    figures = json.loads(result.read_text(encoding="utf-8"))
    request.unlink()
    result.unlink()
    return figures


def _child(request: str, result: str, spawned: float | None = None) -> None:
    """The child's body: the check of ``request`` run, its figures into ``result``; an error as its last line.

    ``spawned``: when the parent started this process (``time.time()``); the log says how long the process took
    to start and how long its check ran, which on a GPU are of a size.
    """
    show_native_crashes()  # a crash in an engine's native code: the Python stack it was in goes to the log
    began = time.time()
    if spawned is not None:
        print(f"layercut check: this process started in {began - spawned:.1f} s", flush=True)
    data = json.loads(Path(request).read_text(encoding="utf-8"))
    kind = {cls.__name__: cls for cls in (ServingCheck, SpeedCheck, FidelityCheck, TasksCheck)}[data["kind"]]
    fields = {key: _tuples(value) for key, value in data["fields"].items()}  # JSON gave lists for the tuples
    check = kind(**fields)
    try:
        if check.threads:
            import torch

            torch.set_num_threads(check.threads)
        figures = check.run()
        Path(result).write_text(json.dumps(figures, default=str), encoding="utf-8")
        print(f"layercut check: {data['kind']} ran in {time.time() - began:.1f} s", flush=True)
    except LayercutError as err:
        print(f"error: {err}", flush=True)
        sys.exit(2)
    except Exception as err:  # noqa: BLE001 - the parent reads the log: the whole traceback goes there
        traceback.print_exc()
        print(f"error: {type(err).__name__}: {' '.join(str(err).split())}", flush=True)
        sys.exit(1)


def _tuples(value):
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value
