"""The grid loop: load and score once, measure the dense model, then every unfinished cell, writing after each."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from eval.compare.cells import CellRefused, cell_dir, complete_cell, measure, measure_tasks, run_cell
from eval.compare.config import CompareConfig, cell_config
from eval.compare.digest import recipe_digest, recipe_state
from eval.compare.heldout import Domain, Heldout, measure_domains, plan_domains, reconcile_domains, refresh_rows
from eval.compare.measurements import MeasurementStore, calibration_digest
from eval.compare.metrics import Original, has_metrics, measure_metrics
from eval.compare.plots import write_reports
from eval.compare.results import (
    Results,
    cell_key,
    check_calibration,
    check_task_limit,
    has_domains,
    has_tasks,
    open_results,
    write_text,
)
from eval.speed.engines import checkpoint_folder
from prune.data.self_text import samples_kept_in
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.pipeline.runner import Scored, layout_refusals, on_meta, preflight, score_calibration
from prune.replace import ReplaceConfig, check_drop_for_method
from prune.selection.oracle import oracle_table, removal_cache, run_oracle, spearman
from prune.selection.repaired_order import repaired_oracle
from prune.stamps import weights_fingerprint

logger = logging.getLogger(__name__)

ORACLE_MD = "oracle.md"


@dataclass
class Session:
    """What one invocation loads and scores once and hands to every cell."""

    loaded: LoadedModel
    scored: Scored
    heldout: Heldout
    store: MeasurementStore
    run: dict  # this invocation's entry under ``timing.runs``
    begun: float
    original: Original  # the loaded model and the held-out text, for metrics judged against the original


SAMPLES_FOLDER = "self-text"  # in a comparison's folder: the sampled text its cells were measured on


def check_methods(config: CompareConfig) -> dict[str, str]:
    """Every recipe read and checked at every drop before the model loads: a bad one costs no load.

    Returns the methods the model's layout refuses (name -> why; a fold on sandwich norms): they run at no
    drop, and the comparison records them and goes on with the others.
    """
    replaces = {}
    for name, path in config.methods.items():
        prune_config = cell_config(config, path, config.drops[-1], None)
        prune_config.build_steps()
        replaces[name] = prune_config.replace.method
        for drop in config.drops:
            check_drop_for_method(prune_config.replace.method, drop, fix=f"{name} cannot run at this drop; take "
                                  f"{drop} out of --drop, or leave {name} out of --methods")
    first = next(iter(config.methods.values()))
    meta = on_meta(cell_config(config, first, config.drops[-1], None).load.model)  # built once, checked twice
    by_method = layout_refusals(meta, replaces.values())
    refused = {name: by_method[method] for name, method in replaces.items() if method in by_method}
    runnable = [path for name, path in config.methods.items() if name not in refused]
    if not runnable:
        name, why = next(iter(refused.items()))
        raise LayercutError(f"every method named refuses this model ({name}: {why})")
    preflight(cell_config(config, runnable[0], config.drops[-1], None), meta)
    return refused


def record_refused(results: Results, config: CompareConfig, refused: dict[str, str]) -> None:
    """Enter the methods refused before the model loaded at every drop (a finished row of theirs stays)."""
    for name, why in refused.items():
        for drop in config.drops:
            key = cell_key(name, drop)
            if key not in results.cells:
                results.refused[key] = refused_entry(name, drop, config.methods[name], why)


def refused_entry(name: str, drop: int, recipe: Path, why: str) -> dict:
    """What results.json keeps of a refused cell; its recipe's digest says when to try it again."""
    return {"method": name, "drop": drop, "recipe_digest": recipe_digest(recipe), "why": why}


def unfinished(results: Results, config: CompareConfig, domains: list[Domain]) -> list[tuple[str, Path, int, str]]:
    """The cells to work on: ``(name, recipe, drop, "run" | "complete")``.

    "run": no row, or one of another recipe; "complete": a row lacking domains or tasks. A cell refused
    before is left out until its recipe changes.
    """
    names = [domain.name for domain in domains]
    todo = []
    for drop in config.drops:
        for name, path in config.methods.items():
            key = cell_key(name, drop)
            row = results.cells.get(key)
            if row is None and results.refused.get(key, {}).get("recipe_digest") == recipe_digest(path):
                continue
            if row is None or row.get("recipe_digest") != recipe_digest(path):
                todo.append((name, path, drop, "run"))
            elif not (has_domains(row, names) and has_tasks(row, config.tasks) and has_metrics(row, config.metrics)):
                todo.append((name, path, drop, "complete"))
    return todo


def _open_session(config: CompareConfig, results: Results, domains: list[Domain]) -> Session:
    """Load the model, draw and score the calibration once (every score, all pairwise cosines), tokenize the texts."""
    begun = started = time.perf_counter()
    # one entry per invocation: a comparison resumed over several processes sums them for its wall time
    run = {"cells": 0, "seconds": 0.0}
    results.timing.setdefault("runs", []).append(run)
    loaded = config.load.load()
    results.timing["load_seconds"] = round(time.perf_counter() - started, 2)
    base = cell_config(config, next(iter(config.methods.values())), config.drops[-1], None)
    started = time.perf_counter()
    scored = score_calibration(loaded, base, cosine_pairs="all")  # serves every score and selection
    results.timing["score_seconds"] = round(time.perf_counter() - started, 2)
    extra = {"load": config.setup()["load"], "batch_size": config.batch_size}
    tokens = scored.calibration.token_ids
    digest = calibration_digest(weights_fingerprint(loaded.model) or config.load.model, tokens, extra)
    check_calibration(results, digest, config.out)
    results.calibration = {**scored.calibration.describe(), "digest": digest}
    # SLEB's passes, the oracle's and the sub-layer costs outlive this process: a resumed run measures no set twice
    store = MeasurementStore(config.out, calibration_digest(loaded.model, tokens, extra))
    reused = run["removal_sets_read_back"] = store.attach(scored.memo)
    if reused:
        logger.info("%d removal measurements read back from %s", reused, store.path)
    run["setup_seconds"] = round(time.perf_counter() - begun, 2)
    heldout = Heldout(domains, scored, loaded.tokenizer, config.seq_len, config.batch_size, config.heldout_tokens)
    results.heldout = heldout.describe
    return Session(loaded, scored, heldout, store, run, begun, Original(loaded.model, heldout.streams()))


def _measure_dense(results: Results, session: Session, config: CompareConfig) -> None:
    """The dense model's row, or the domains and tasks added to it since."""
    model, tokenizer = session.loaded.model, session.loaded.tokenizer
    if results.dense is None:
        source = checkpoint_folder(config.load.model) or config.load.model  # what an engine other than torch loads
        results.dense = measure(model, tokenizer, session.heldout, config, source, session.original)
        return
    missing = [name for name in session.heldout.names() if name not in results.dense.get("domains", {})]
    measure_domains(model, session.heldout, results.dense, missing)
    measure_tasks(model, tokenizer, config.tasks, results.dense, limit=config.limit, data_dir=config.data_dir)
    measure_metrics(model, tokenizer, config.metrics, results.dense, session.original)


def _oracle(results: Results, session: Session, config: CompareConfig) -> None:
    started = time.perf_counter()
    scored = session.scored
    model, ids = session.loaded.model, scored.calibration.token_ids
    oracle = run_oracle(model, ids, scored.scores, config.batch_size, cache=removal_cache(scored.memo))
    # the repaired column: what each block costs removed and repaired by layercut's map, on rows the map never saw
    repaired = repaired_oracle(model, ids, scored.scores, ReplaceConfig(method="linear", progress=False),
                               config.batch_size, scored.memo)
    repaired["spearman"]["removal"] = spearman([-p for p in oracle.removed], [-p for p in repaired["ppl"]])
    results.oracle = {**oracle.as_dict(), "repaired": repaired,
                      "table": oracle_table(oracle, scored.scores, repaired)}
    write_text(config.out / ORACLE_MD, results.oracle["table"] + "\n")
    session.run["oracle_seconds"] = round(time.perf_counter() - started, 2)


def _work_on(results: Results, session: Session, config: CompareConfig, cell: tuple[str, Path, int, str]) -> None:
    """Complete one cell from its kept weights where that reproduces its row, else run it."""
    name, path, drop, need = cell
    key = cell_key(name, drop)
    completed = None
    if need == "complete":
        completed = complete_cell(results.cells[key], cell_dir(config.out, name, drop), config, session.heldout,
                                  session.original)
    if completed is not None:
        results.cells[key] = completed
        session.run["cells_completed"] = session.run.get("cells_completed", 0) + 1
    else:
        try:
            results.cells[key] = run_cell(name, path, drop, config, session.loaded, session.scored, session.heldout,
                                          results.dense, session.original)
        except CellRefused as err:
            # one method that cannot take this model or drop (a fold on sandwich norms) does not end the others
            logger.warning("%s at drop %d refused: %s", name, drop, err)
            results.refused[key] = refused_entry(name, drop, path, str(err))
            results.cells.pop(key, None)  # a row of an older recipe is not this recipe's figure
            session.run["cells_refused"] = session.run.get("cells_refused", 0) + 1
            return
        results.refused.pop(key, None)
        session.run["cells"] += 1


def _run_cells(results: Results, session: Session, config: CompareConfig, todo: list) -> None:
    blocks = results.dense["blocks"]
    total = len(config.methods) * len(config.drops)
    with tqdm(total=total, initial=total - len(todo), desc="compare", unit="cell") as bar:
        for cell in todo:
            bar.set_postfix_str(f"{cell[0]} drop {cell[2]}")
            _work_on(results, session, config, cell)
            refresh_rows(results, session.heldout.names())
            session.run["seconds"] = round(time.perf_counter() - session.begun, 2)
            write_reports(results, config.out, blocks, plots=False)  # a crash keeps the cell
            bar.update()


def run_comparison(config: CompareConfig) -> Results:
    """Run every unfinished cell of the comparison ``config`` asks for; the results."""
    refused = check_methods(config)
    domains = plan_domains(config.heldout, config.data)
    results = open_results(config.out, config.setup(), config.overwrite)
    record_refused(results, config, refused)
    check_task_limit(results, config.tasks, config.limit, config.out)
    reconcile_domains(results, domains)
    todo = unfinished(results, config, domains)
    need_oracle = config.oracle and not results.oracle
    names = [domain.name for domain in domains]
    dense_done = has_domains(results.dense, names) and has_tasks(results.dense, config.tasks) and has_metrics(
        results.dense, config.metrics)
    if not todo and not need_oracle and dense_done:
        check_something_ran(results, config)
        logger.info("every cell of %s is finished", config.out)
        refresh_rows(results, names)
        write_reports(results, config.out, results.dense["blocks"])
        return results
    # the text the model samples (calibration, distillation) is kept beside the results: sampling on another
    # machine draws other tokens, and the comparison could not be resumed there
    with samples_kept_in(Path(config.out) / SAMPLES_FOLDER):
        session = _open_session(config, results, domains)
        _measure_dense(results, session, config)
        refresh_rows(results, session.heldout.names())
        if need_oracle:
            _oracle(results, session, config)
        write_reports(results, config.out, results.dense["blocks"], plots=False)
        reused = session.run["removal_sets_read_back"]
        try:
            _run_cells(results, session, config, todo)
        finally:  # also after Ctrl-C: the plots show the cells finished so far
            session.run["seconds"] = round(time.perf_counter() - session.begun, 2)
            session.run["removal_sets_measured"] = session.store.count() - reused
            write_reports(results, config.out, results.dense["blocks"])
    check_something_ran(results, config)
    return results


def check_something_ran(results: Results, config: CompareConfig) -> None:
    """Refuse, in one line, a comparison every cell of which was refused: it measured no method at all."""
    keys = [cell_key(name, drop) for drop in config.drops for name in config.methods]
    if all(key in results.refused for key in keys):
        first = results.refused[keys[0]]
        raise LayercutError(f"every cell was refused ({len(keys)}; recorded in {config.out}/results.json), "
                            f"{first['method']} at drop {first['drop']} as: {first['why']}")


def summary_lines(results: Results) -> list[str]:
    """Best method per drop, one line each, after the dense model's line; then each refused cell, one line each."""
    dense = results.dense
    lines = [f"dense: held-out perplexity {dense['heldout_ppl']:.3f}, {dense['params']:,} parameters"]
    for drop in sorted({row["drop"] for row in results.cells.values()}):
        lines.append(_summary_line(results, drop))
    lines += [f"refused: {entry['method']} at drop {entry['drop']} ({entry['why']}); tried again once its recipe "
              "changes" for _, entry in sorted(results.refused.items())]
    return lines


def _summary_line(results: Results, drop: int) -> str:
    rows = sorted((r for r in results.cells.values() if r["drop"] == drop), key=lambda r: r["heldout_ppl"])
    best = rows[0]
    line = (f"drop {drop}: best {best['method']} {best['heldout_ppl']:.3f} (x{best['heldout_ratio']:.3f}) "
            f"of {len(rows)} method(s)")
    analysis = results.analysis or {}
    key = cell_key(best["method"], drop)
    retention = analysis.get("rows", {}).get(key, {}).get("retention")
    if retention is not None:
        line += f", task retention {100 * retention:.1f}%"
    beaten = analysis.get("better_than", {}).get(key)
    if beaten is not None and len(rows) > 1:
        line += f", better than {len(beaten)} of {len(rows) - 1} on every domain" + (
            " and the tasks" if analysis.get("tasks") else "")
    if recipe_state(best) == "changed":
        line += f"; {best['method']} ran before its recipe or a default it uses changed: rerun to refresh"
    worse = [results.cells[k]["method"] for k, v in sorted(analysis.get("vs_removal", {}).items())
             if v and v.get("worse_than_removal") and results.cells[k]["drop"] == drop]
    if worse:
        line += f"; WORSE than removing their own blocks on every domain: {', '.join(worse)} (do not ship them)"
    unpaired = [results.cells[k]["method"] for k, v in sorted(analysis.get("vs_removal", {}).items())
                if v is None and results.cells[k]["drop"] == drop]
    if unpaired:
        line += (f"; no removal of the blocks of {', '.join(unpaired)} ran (a recipe with their score and "
                 "selection and replace: none gives it, e.g. recipes/repairs/remove.yaml for the linearity top-k)")
    return line
