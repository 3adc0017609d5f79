r"""Held-out perplexity against heal time: ``prune.ship``'s heal run at several step counts on one built checkpoint.

``python -m eval.bench heal-curve`` loads the original once and, for each step count of ``--steps`` (0: the
checkpoint as built), loads the built checkpoint afresh and heals it exactly as ``prune.ship`` does
(:func:`distill.heal.heal_training`: the same options, seed and rows, with its own schedule and its own teacher
cache in a folder of its own; ``--train``, ``--lr``, ``--lora-r``, ``--lora-alpha`` and ``--lora-targets`` change what
it trains). ``--train blocks`` heals as ``prune.ship --offload sequential`` does (the two blocks beside each cut
trained towards the original's hidden states, :func:`distill.local_heal.heal_built`, here with both models in
memory: the same arithmetic), ``--steps`` steps a cut, ``--loss`` what they minimise. Each run's wall
time (the teacher cache included), the KL to the original on the calibration's measuring rows (the rows ship's heal
is judged on, never trained on) and the perplexity of each ``--heldout`` text (its first ``--heldout-tokens`` tokens
in ``--window``-token windows) are a row; the original's perplexities are measured once. The curve is what a minute
of healing buys, the data behind ship's default ``--heal-steps``. With ``--tasks`` each row also has lm-eval's
accuracies on them (``--limit``, ``--data-dir`` as ``eval.compare`` takes them) and the retention above chance they
make against the original's (measured once), with its paired gap to the checkpoint as built: what the minutes buy on
the tasks, drawn beside the perplexity.

The calibration rows are a ship run's own (``--calibration OUT.work/calibration.safetensors``, key ``token_ids``),
else drawn as ``prune.ship`` draws them (``--data --samples --seq-len --seed``); ``--seed`` seeds the heal as
ship's does. ``--train``, ``--lora-r``, ``--lora-alpha`` and ``--lora-targets`` heal otherwise than ship's
defaults (every weight but the embedding and head at distillation's learning rate for it, or LoRA of another rank,
scale or set of layers, as ``prune.ship --lora-r`` and its kin train it): what chooses ship's own on the selection
split; the record says what was trained, at what learning rate.

    python -m eval.bench heal-curve --model smollm2-135m --checkpoint slim.work/checkpoint \
        --calibration slim.work/calibration.safetensors --steps 0,50,100,200 --heldout plays=plays.txt --out curve/ \
        --tasks arc_easy,hellaswag,piqa,lambada_openai --limit 400~:-500
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.config import DEFAULT_LR, MAX_LR, DistillConfig
from distill.heal import HEAL_OPTIONS, HealRows, heal_data_config, heal_settings, heal_student, heal_training
from distill.local_heal import LOCAL_HEAL_LOSS, LOCAL_HEAL_LR, LOSSES, heal_built, local_heal_settings
from distill.trainable import lora_target_names
from eval.bench.output import finish_figure, pyplot, report_results, steps_line
from eval.bench.registry import bench_option, data_option, load_option, register_subcommand, threads_option
from eval.compare.cells import measure_tasks
from eval.compare.heldout import Heldout, mean_perplexity, plan_domains
from eval.compare.leaderboard import task_cells
from eval.compare.stats import TIE_SE, gap_stderr, retention_tasks, task_figures
from eval.quality.evaluate import parse_limit
from eval.quality.lmeval import check_registry_data, describe_rows, plan_tasks
from eval.quality.task_specs import resolve_data_dir
from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig, calibration_data
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model.adapters import max_positions
from prune.options import apply_threads
from prune.pipeline.config import PruneConfig
from prune.selection.repaired import divergence, split_rows

HEAL_CURVE_HELP = "held-out perplexity against heal minutes: prune.ship's heal at several step counts on one checkpoint"
DEFAULT_STEPS = (0, 50, 100, 200)
HELDOUT_TOKENS = 4096
WINDOW = 512


def parse_steps(text: str) -> tuple[int, ...]:
    """``0,50,100,200`` -> the step counts: whole numbers of 0 or more, each once, in the order given."""
    try:
        steps = tuple(int(item) for item in str(text).split(","))
    except ValueError:
        steps = ()
    if not steps or any(count < 0 for count in steps) or len(set(steps)) < len(steps):
        raise LayercutError(f"--steps takes distinct step counts of 0 or more, like 0,50,100,200; got '{text}'")
    return steps


def read_calibration(path: str | Path) -> torch.Tensor:
    """The calibration rows [samples, seq] of a ship run's ``calibration.safetensors`` (key ``token_ids``)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not path.is_file():
        raise LayercutError(f"--calibration {path}: no such file: pass a prune.ship run's "
                            "OUT.work/calibration.safetensors, or leave it out to draw rows with --data")
    try:
        token_ids = load_file(str(path)).get("token_ids")
    except (SafetensorError, OSError) as err:
        raise LayercutError(f"--calibration {path} is not a readable safetensors file ({err})") from None
    if token_ids is None or token_ids.dim() != 2 or token_ids.shape[0] < 2 or token_ids.shape[1] < 2:
        raise LayercutError(f"--calibration {path}: needs a tensor 'token_ids' of [samples >= 2, seq >= 2] token "
                            "ids, as prune.ship keeps in OUT.work/calibration.safetensors")
    return token_ids.long()


def check_checkpoint(path: str | Path) -> Path:
    """``path`` as the built checkpoint folder; a one-line refusal when it holds no model."""
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise LayercutError(f"--checkpoint {path}: no checkpoint there (no config.json): pass the built, pruned "
                            "checkpoint, e.g. a prune.ship run's OUT.work/checkpoint or a prune.run --out folder")
    return folder


@dataclass(frozen=True)
class CurveTasks:
    """lm-eval tasks scored at every point of a curve.

    ``names``: as ``plan_tasks`` resolves them (the tasks with local files first; ``lambada`` offline is
    ``lambada_openai``); ``limit`` rows of each (``eval.compare --limit``'s values), from ``data_dir`` (None:
    ``$LAYERCUT_DATA``, else the hub).
    """

    names: tuple[str, ...]
    limit: int | float | str | None = None
    data_dir: str | None = None

    def measure(self, model, tokenizer) -> dict:
        """A row of task figures: accuracy, standard error and the row-by-row scores of each task."""
        row: dict = {}
        measure_tasks(model, tokenizer, list(self.names), row, limit=self.limit, data_dir=self.data_dir)
        return row


def _point(student: LoadedModel, original: LoadedModel, rows: HealRows, heldout: Heldout, batch_size: int,
           steps: int, seconds: float, report: dict | None, before: dict, tasks: CurveTasks | None,
           tokens: int) -> dict:
    """One row of the curve: the healed (or built) student's KL on the measuring rows and held-out perplexities.

    ``before``: the built checkpoint's KL and perplexity on the measuring rows (step 0's own); ``kept``: whether
    ship's heal would keep this one (its KL fell); with ``tasks``, its task figures (``tasks``, ``task_stderr``,
    ``task_rows``, as an ``eval.compare`` row's); ``tokens``: the tokens its steps read.
    """
    measured = divergence(student.model, original.model, rows.measure, batch_size) if steps else before
    domains = {name: heldout.perplexity(student.model, name) for name in heldout.names()}
    point = {"steps": steps, "seconds": round(seconds, 2), "minutes": round(seconds / 60, 3),
             "tokens": tokens, "distill_seconds": (report or {}).get("seconds"),
             "kl": measured["kl"], "measure_ppl": measured["ppl"], "kept": measured["kl"] < before["kl"],
             "domains": domains, "heldout_ppl": mean_perplexity(domains, heldout.names())}
    if tasks is not None:
        point.update(tasks.measure(student.model, student.tokenizer))
    return point


def task_summary(points: list[dict], original: dict, names: Sequence[str]) -> dict:
    """The task figures of every point and of the original, and each point's paired gap to the one of 0 steps.

    Each row gets ``figures``: its task mean and its retention above chance, counted over the tasks the original is
    clearly above chance on, as a comparison counts them (:func:`eval.compare.stats.retention_tasks`); ``quality``
    names the one the curve follows (the retention, or the task mean where no task is counted). A point gets
    ``vs_built``: its gap to the checkpoint as built (the point of 0 steps, if one was run) in that figure, paired
    row by row with its standard error and ``clear`` when it is at least :data:`~eval.compare.stats.TIE_SE` of them.
    A task lm-eval gave no score for leaves the figures that need it out.
    """
    names = list(names)
    counted, excluded = retention_tasks(original, names)
    quality = "retention" if counted else "task_mean"
    used = counted or [name for name in names if original.get("tasks", {}).get(name) is not None]
    original["figures"] = task_figures(original, names, counted, original)
    for point in points:
        point["figures"] = task_figures(point, names, counted, original)
    built = next((point for point in points if point["steps"] == 0), None)
    for point in points:
        if built is None or point is built or quality not in point["figures"] or quality not in built["figures"]:
            continue
        gap = point["figures"][quality] - built["figures"][quality]
        stderr = gap_stderr(point, built, point["figures"], built["figures"], quality, used, original)
        # no answer changed: a gap of 0 with an error of 0 is no difference at all
        point["vs_built"] = {"gap": gap, "gap_stderr": stderr, "clear": gap != 0 and abs(gap) >= TIE_SE * stderr}
    return {"quality": quality, "counted": counted, "excluded": excluded}


def heal_curve(original: LoadedModel, checkpoint: Path, calibration: torch.Tensor, heldout: Heldout,
               steps: Sequence[int], prune: PruneConfig, more: torch.Tensor | None = None,
               tasks: CurveTasks | None = None, train: dict | None = None) -> dict:
    """The curve's rows, one per step count, and the original's perplexities (see the module's docstring).

    ``prune``: how the checkpoint loads (``load``'s dtype and device), the heal's seed (``data.seed``) and the
    sequences per forward pass of the measuring (``batch_size``), as a ship run's; ``more``: rows of other text
    trained on too (``prune.ship --heal-data``); ``tasks``: lm-eval tasks scored at every point and once for the
    original, each row's figures and gap to step 0 as :func:`task_summary` gives them; ``train``: distillation
    options in place of the heal's own (:func:`distill.heal.heal_training`), or ``{"train": "blocks"}`` (with
    ``lr`` and ``loss``) for the heal block by block, which trains on the fitting rows as they are.
    """
    blocks = (train or {}).get("train") == "blocks"
    if blocks:
        fit, measure = split_rows(calibration)
        rows = HealRows(fit if more is None else torch.cat([fit, more]), measure)
        settings = {**local_heal_settings(), **train}
        as_ship = settings["lr"] == LOCAL_HEAL_LR and settings["loss"] == LOCAL_HEAL_LOSS
    else:
        rows = HealRows.of(calibration, more)
        settings, as_ship = heal_settings(train), not train
        if settings.get("lora_targets"):  # a misspelt layer name: refused before the minutes of measuring
            lora_target_names(original.model, targets=settings["lora_targets"])
    dense = {name: heldout.perplexity(original.model, name) for name in heldout.names()}
    dense_tasks = tasks.measure(original.model, original.tokenizer) if tasks is not None else {}
    points, before = [], None
    with tempfile.TemporaryDirectory(prefix="heal-curve-") as work:
        for count in tqdm(steps, desc="heal curve", unit="run"):
            student, built = heal_student(checkpoint, prune.load.dtype, prune.load.device)
            if before is None:  # the built checkpoint's: what ship's heal must lower to be kept
                before = divergence(student.model, original.model, rows.measure, prune.batch_size)
            seconds, report, tokens = 0.0, None, rows.tokens(count)
            started = time.perf_counter()
            if count and blocks:
                records = heal_built(student.model, original.model, built, rows.train, steps=count,
                                     lr=settings["lr"], loss=settings["loss"], batch_size=prune.batch_size,
                                     seed=prune.data.seed, say=tqdm.write)
                seconds, report = time.perf_counter() - started, {"block_by_block": records}
                tokens = sum(record["tokens_read"] for record in records)
            elif count:
                done = heal_training(student, original, rows, count,
                                     dataclasses.replace(prune, out=str(Path(work) / f"steps-{count}")), train=train)
                seconds, report = time.perf_counter() - started, done.report
                for folder in done.cleanup:  # its teacher cache and checkpoints: the next run writes its own
                    shutil.rmtree(folder, ignore_errors=True)
            points.append(_point(student, original, rows, heldout, prune.batch_size, count, seconds, report,
                                 before, tasks, tokens))
            del student
    return {"model": original.name, "checkpoint": str(checkpoint),
            # what was trained and how (a LoRA setting only where LoRA trained), and whether as ship trains
            "heal": {**settings, "as_ship": as_ship,
                     "teacher_cache": None if blocks else HEAL_OPTIONS["teacher_cache"],
                     "batch_size": prune.batch_size if blocks else HEAL_OPTIONS["batch_size"], "seed": prune.data.seed,
                     "seq_len": int(rows.train.shape[1]),
                     "train_rows": int(rows.train.shape[0]), "measure_rows": int(rows.measure.shape[0]),
                     "measure_tokens": int(rows.measure.numel())},
            "kl_before": before["kl"] if before else None,  # None: no step count given
            "heldout": {**heldout.describe, "window": heldout.seq_len},
            "original": {"domains": dense, "heldout_ppl": mean_perplexity(dense, heldout.names()), **dense_tasks},
            "tasks": None if tasks is None or not points else
            {"names": list(tasks.names), "limit": tasks.limit, **task_summary(points, dense_tasks, tasks.names)},
            "points": points}


def heal_curve_markdown(results: dict) -> str:
    """The rows as a markdown table: steps, minutes, tokens trained, KL, each text's perplexity, their mean."""
    names = list(results["heldout"]["domains"])
    heal = results["heal"]
    blocks = heal["train"] == "blocks"
    ship = "prune.ship --offload sequential" if blocks else "prune.ship"
    how = f"as {ship} heals" if heal.get("as_ship", True) else f"otherwise than {ship} heals by default"
    lines = [f"{results['model']} healed from {Path(results['checkpoint']).name} {how} (train {heal['train']}"
             + (f", rank {heal['lora_r']}, alpha {heal['lora_alpha']:g}" if "lora_r" in heal else "")
             + (f", adapters on {heal['lora_targets']}" if "lora_targets" in heal else "")
             + (f", lr {heal['lr']:g}" if "lr" in heal else "") + (f", loss {heal['loss']}" if blocks else "")
             + (f", teacher cache {heal['teacher_cache']}" if heal.get("teacher_cache") else "")
             + f", {heal['batch_size']} x {heal['seq_len']} tokens a step{' of each cut' if blocks else ''}, "
             f"seed {heal['seed']}, {heal['train_rows']} training rows"
             + (f", {results['heal_data']['rows'][0]} sequences of them from {results['heal_data']['source']}"
                if results.get("heal_data") else "") + "); KL to the original on "
             f"{heal['measure_tokens']:,} tokens of measuring rows it never trains on; perplexity in "
             f"{results['heldout']['window']}-token windows.", "",
             "| steps | minutes | tokens trained | KL (measuring rows) | "
             + " | ".join(f"{name} ppl" for name in names) + " | geometric mean |" + _task_heads(results),
             "|" + "---:|" * (5 + len(names) + _task_columns(results))]
    for point in results["points"]:
        lines.append(f"| {point['steps']} | {point['minutes']:.2f} | {point['tokens']:,} | {point['kl']:.4f} | "
                     + " | ".join(f"{point['domains'][name]:.3f}" for name in names)
                     + f" | {point['heldout_ppl']:.3f} |" + _task_cells(results, point))
    original = results["original"]
    lines.append("| original | - | - | 0 | " + " | ".join(f"{original['domains'][name]:.3f}" for name in names)
                 + f" | {original['heldout_ppl']:.3f} |" + _task_cells(results, original))
    if results.get("tasks"):
        lines += ["", _task_note(results["tasks"])]
    return "\n".join(lines)


def _task_columns(results: dict) -> int:
    """How many task columns the table has: one per task, the task mean, the retention and the gap to step 0."""
    return len(results["tasks"]["names"]) + 3 if results.get("tasks") else 0


def _task_heads(results: dict) -> str:
    if not results.get("tasks"):
        return ""
    return "".join(f" {name} |" for name in results["tasks"]["names"]) + " task mean | retention | vs step 0 |"


def _task_cells(results: dict, row: dict) -> str:
    """A row's task columns as a comparison writes them, then its paired gap to the checkpoint as built."""
    tasks = results.get("tasks")
    if not tasks:
        return ""
    vs = row.get("vs_built")
    gap = "-" if vs is None else (f"{100 * vs['gap']:+.1f} ± {100 * vs['gap_stderr']:.1f}"
                                  + ("" if vs["clear"] else " (tie)"))
    return "".join(f" {cell} |" for cell in task_cells(row, tasks["names"], row.get("figures", {}), gap))


def _task_note(tasks: dict) -> str:
    counted = ", ".join(tasks["counted"])
    excluded = "; ".join(f"{name}: {why}" for name, why in tasks["excluded"].items())
    retention = (f"Retention = sum over {counted} of (accuracy - chance) / the same sum for the original"
                 if counted else "Retention: none, no task has the original clearly above chance (the curve follows "
                                 "the task mean)")
    quality = tasks["quality"].replace("_", " ")
    return (f"Tasks ({describe_rows(tasks['limit'])}): accuracy ± lm-eval's standard error, in %. {retention}"
            + (f"; left out: {excluded}" if excluded else "") + f". \"vs step 0\": the paired gap in {quality} "
            f"(points) to the checkpoint as built, row by row on the same rows; tie when it is under {TIE_SE:g} "
            "standard errors.")


def plot_heal_curve(results: dict, path) -> Path:
    """PNG: geometric-mean held-out perplexity against heal minutes, each point labelled with its steps.

    With tasks, the retention (or the task mean) against the same minutes beside it.
    """
    points = results["points"]
    minutes, steps = [p["minutes"] for p in points], [p["steps"] for p in points]
    tasks = results.get("tasks")
    if tasks:
        fig, (side, ax) = pyplot().subplots(1, 2, figsize=(11, 4), dpi=120)
        quality = tasks["quality"]
        shown = [p for p in points if quality in p.get("figures", {})]
        values = [100 * p["figures"][quality] for p in shown]
        side.errorbar([p["minutes"] for p in shown], values,
                      yerr=[100 * p["figures"][f"{quality}_stderr"] for p in shown], fmt="none", ecolor="gray",
                      capsize=3)
        steps_line(side, [p["minutes"] for p in shown], values, [p["steps"] for p in shown],
                   "healed as prune.ship heals (steps at each point)")
        reference = results["original"].get("figures", {}).get(quality)
        if reference is not None:
            side.axhline(100 * reference, color="black", ls="--", lw=1, label="original")
        side.set_xlabel("heal minutes (wall, teacher cache included)")
        side.set_ylabel("retention above chance (%)" if quality == "retention" else "task mean (%)")
        counted = tasks["counted"] or tasks["names"]
        side.set_title(f"{len(counted)} task{'s' if len(counted) > 1 else ''} against heal minutes (± one error)")
        side.grid(alpha=0.3)
        side.legend(fontsize=8)
    else:
        fig, ax = pyplot().subplots(figsize=(6, 4), dpi=120)
    steps_line(ax, minutes, [p["heldout_ppl"] for p in points], steps,
               "healed as prune.ship heals (steps at each point)")
    return finish_figure(fig, ax, path, reference=(results["original"]["heldout_ppl"], "original"),
                         xlabel="heal minutes (wall, teacher cache included)",
                         ylabel="held-out perplexity (geometric mean)",
                         title=f"{Path(results['model']).name}: quality against heal minutes")


# ---- eval.bench heal-curve ----


def _heal_default(name: str):
    """The heal's own value of a distillation option (:data:`HEAL_OPTIONS`, else distillation's default)."""
    return HEAL_OPTIONS.get(name, getattr(DistillConfig, name))


@dataclass(frozen=True)
class HealCurveBenchOptions:
    """The options of ``eval.bench heal-curve``: its flags, in ``--help``'s order.

    Attributes:
        load: the original (``--model``) and how both models load (dtype, device).
        checkpoint: the built, pruned checkpoint folder.
        calibration: a ship run's ``calibration.safetensors`` (None: rows drawn from ``data``).
        data: the calibration text drawn when ``calibration`` is None; its seed seeds the heal either way.
        heal_data: more text the heal trains on (``prune.ship --heal-data``), ``heal_samples`` sequences of it.
        train, lr, lora_r, lora_alpha, lora_targets: what the heal trains and its peak learning rate, in place of
            ship's (None: ship's, :data:`HEAL_OPTIONS`); ``train`` ``blocks``: the heal block by block.
        loss: what the heal block by block minimises (a key of :data:`distill.local_heal.LOSSES`; None: its own).
        steps: comma list of step counts (0: the checkpoint as built).
        heldout: ``LABEL=TEXT`` held-out texts, repeatable.
        heldout_tokens: tokens of each text scored.
        window: tokens per scored window.
        batch_size: sequences per forward pass of the measuring.
        tasks: comma list of lm-eval tasks scored at each point (None: none).
        limit: rows per task (``eval.quality.evaluate.parse_limit``'s values; None: every row).
        data_dir: local lm-eval data (None: ``$LAYERCUT_DATA``, else the hub).
        out: folder for ``heal_curve.json``, ``heal_curve.md`` and ``heal_curve.png`` (None: print only).
        threads: CPU threads (None: the free cores).
    """

    load: LoadConfig = load_option()
    checkpoint: str | None = bench_option(None, "the built, pruned checkpoint folder (prune.ship's OUT.work/checkpoint "
                                                "or a prune.run --out)", required=True, metavar="DIR")
    calibration: str | None = bench_option(
        None, "a safetensors of calibration rows (key token_ids), as prune.ship keeps in "
              "OUT.work/calibration.safetensors (default: rows drawn from --data --samples --seq-len --seed)",
        metavar="FILE")
    data: DataConfig = data_option(samples=64, seq_len=512,
                                   title="calibration data (drawn without --calibration; --seed seeds the heal too)")
    heal_data: str | None = bench_option(None, "more text the heal trains on beside the calibration rows, as "
                                               "prune.ship --heal-data (default: none)", metavar="DATA")
    heal_samples: int = bench_option(64, "sequences drawn from --heal-data, of the calibration's length (default: 64)",
                                     type=int)
    train: str | None = bench_option(
        None, "what the heal trains, as distill.run --train: lora (adapters on every Linear of the blocks, merged; "
              f"lr {DEFAULT_LR['lora']:g}) or all (every weight but the embedding and head; lr {DEFAULT_LR['all']:g}); "
              "or blocks, as prune.ship --offload sequential (the two blocks beside each cut towards the original's "
              f"hidden states, --steps a cut; lr {LOCAL_HEAL_LR:g}) (default: {HEAL_OPTIONS['train']}, as prune.ship)",
        choices=("lora", "all", "blocks"))
    lr: float | None = bench_option(None, "the heal's peak learning rate (default: the one --train names)",
                                    type=float)
    loss: str | None = bench_option(None, "what --train blocks minimises: rms (each token's state at unit RMS, as "
                                          "the next block's norm reads it) or mse (the stream as it is) (default: "
                                          f"{LOCAL_HEAL_LOSS})", choices=tuple(LOSSES))
    lora_r: int | None = bench_option(None, f"LoRA's rank (default: {_heal_default('lora_r')}, as prune.ship); "
                                            "alpha stays as given, so a new rank also changes the scale",
                                      type=int)
    lora_alpha: float | None = bench_option(None, "LoRA's scale numerator: adapters scaled by alpha / rank (default: "
                                                  f"{_heal_default('lora_alpha'):g}, as prune.ship)", type=float)
    lora_targets: str | None = bench_option(None, "the blocks' Linear layers LoRA adapts, as distill.run "
                                                  "--lora-targets: a comma list of their names (q_proj,v_proj) or "
                                                  f"all-linear (default: {_heal_default('lora_targets')}, as "
                                                  "prune.ship)", metavar="NAMES")
    steps: str = bench_option(",".join(map(str, DEFAULT_STEPS)),
                              "heal step counts, each run from the built checkpoint; 0: as built (default: "
                              f"{','.join(map(str, DEFAULT_STEPS))})")
    heldout: list[str] | None = bench_option(None, "a held-out text LABEL=TEXT (.txt/.jsonl/.parquet or a datasets "
                                                   "spec), repeatable", action="append", required=True,
                                             metavar="LABEL=TEXT")
    heldout_tokens: int = bench_option(HELDOUT_TOKENS, f"tokens of each text scored (default: {HELDOUT_TOKENS})",
                                       type=int)
    window: int = bench_option(WINDOW, f"tokens per scored window (default: {WINDOW})", type=int)
    batch_size: int = bench_option(4, "sequences per forward pass of the measuring (default: 4, as prune.ship)",
                                   type=int)
    tasks: str | None = bench_option(None, "lm-eval tasks scored at every point and for the original, comma list "
                                           "(arc_easy,piqa), with each point's retention (default: none)")
    limit: int | float | str | None = bench_option(
        None, "rows per --tasks task, as eval.compare --limit takes them (400~:-500: 400 drawn from all but the last "
              "500) (default: all)", type=parse_limit)
    data_dir: str | None = bench_option(None, "local lm-eval data laid out like shared/data (default: "
                                              "$LAYERCUT_DATA, else the hub)", metavar="DIR")
    out: str | None = bench_option(None, "folder for heal_curve.json, heal_curve.md and heal_curve.png (default: "
                                         "print only)")
    threads: int | None = threads_option()


def _heldout_domains(command: HealCurveBenchOptions):
    """The held-out texts as ``eval.compare`` domains, their files and sizes checked before any model loads."""
    for flag, value, least in (("--heldout-tokens", command.heldout_tokens, 2), ("--window", command.window, 2),
                               ("--batch-size", command.batch_size, 1)):
        if value < least:
            raise LayercutError(f"{flag} must be at least {least}, got {value}")
    return plan_domains(",".join(command.heldout), command.data)


def _curve_tasks(command: HealCurveBenchOptions) -> CurveTasks | None:
    """``--tasks`` planned and their data read before any model loads (a missing file or unknown name: one line)."""
    if command.tasks is None:
        if command.limit is not None or command.data_dir is not None:  # rows of nothing: a flag that does nothing
            raise LayercutError("--limit and --data-dir choose the rows of --tasks: pass --tasks too "
                                "(e.g. --tasks arc_easy,piqa)")
        return None
    local, registry = plan_tasks(command.tasks, resolve_data_dir(command.data_dir))
    check_registry_data(registry)
    return CurveTasks((*local, *registry), command.limit, command.data_dir)


def heal_train(command: HealCurveBenchOptions) -> dict:
    """``--train`` and the ``--lora-*`` flags as the options they change, checked before any model loads.

    The layer names of ``--lora-targets`` are checked against the model's once the checkpoint loads (one line).
    """
    train = {key: value for key, value in (("train", command.train), ("lr", command.lr), ("lora_r", command.lora_r),
                                           ("lora_alpha", command.lora_alpha), ("lora_targets", command.lora_targets),
                                           ("loss", command.loss))
             if value is not None}
    if {"lora_r", "lora_alpha", "lora_targets"} & set(train) and train.get("train", HEAL_OPTIONS["train"]) != "lora":
        raise LayercutError("--lora-r, --lora-alpha and --lora-targets shape LoRA's adapters: pass --train lora, or "
                            "drop them")
    if "loss" in train and command.train != "blocks":
        raise LayercutError("--loss is what the heal block by block minimises: pass --train blocks, or drop it")
    if command.lora_alpha is not None and not command.lora_alpha > 0:
        raise LayercutError(f"--lora-alpha must be positive, got {command.lora_alpha}")
    if command.lr is not None and not (math.isfinite(command.lr) and 0 < command.lr <= MAX_LR):
        raise LayercutError(f"--lr must be a positive number at most {MAX_LR:g}, got {command.lr}")
    if command.train != "blocks":
        DistillConfig.from_dict({**HEAL_OPTIONS, **train})  # a rank below 1: its own one line
    return train


def run_heal_curve(command: HealCurveBenchOptions) -> int:
    """Run the benchmark of ``command``, print its table and write it under ``--out``."""
    apply_threads(command)
    steps = parse_steps(command.steps)
    train = heal_train(command)
    checkpoint = check_checkpoint(command.checkpoint)
    calibration = read_calibration(command.calibration) if command.calibration is not None else None
    domains = _heldout_domains(command)
    tasks = _curve_tasks(command)
    prune = PruneConfig(load=command.load, data=command.data, batch_size=command.batch_size)
    original = prune.load.load()
    limit = max_positions(original.model)
    if limit is not None and command.window > limit:
        raise LayercutError(f"--window {command.window}: {original.name} holds {limit} positions: pass --window "
                            f"{limit} or less")
    source = str(Path(command.calibration).expanduser()) if command.calibration is not None else prune.data.data
    if calibration is None:
        calibration = calibration_data(original.tokenizer, prune.data, model=original.model).token_ids
    more = None
    if command.heal_data is not None:
        drawn = heal_data_config(command.heal_data, command.heal_samples, prune.data, int(calibration.shape[1]))
        more = calibration_data(original.tokenizer, drawn, model=original.model).token_ids
    heldout = Heldout(domains, None, original.tokenizer, command.window, command.batch_size, command.heldout_tokens)
    results = {**heal_curve(original, checkpoint, calibration, heldout, steps, prune, more, tasks, train),
               "calibration": {"source": source, "rows": list(calibration.shape)},
               "heal_data": None if more is None else {"source": command.heal_data, "rows": list(more.shape)}}
    report_results(command.out, "heal_curve", results, heal_curve_markdown(results), plot_heal_curve)
    return 0


register_subcommand("heal-curve", HEAL_CURVE_HELP, HealCurveBenchOptions, run_heal_curve)
