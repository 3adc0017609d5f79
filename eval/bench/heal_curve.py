r"""Held-out perplexity against heal time: ``prune.ship``'s heal run at several step counts on one built checkpoint.

``python -m eval.bench heal-curve`` loads the original once and, for each step count of ``--steps`` (0: the
checkpoint as built), loads the built checkpoint afresh and heals it exactly as ``prune.ship`` does
(:func:`distill.heal.heal_training`: the same options, seed and rows, with its own schedule and its own teacher
cache in a folder of its own). Each run's wall time (the teacher cache included), the KL to the original on the
calibration's measuring rows (the rows ship's heal is judged on, never trained on) and the perplexity of each
``--heldout`` text (its first ``--heldout-tokens`` tokens in ``--window``-token windows) are a row; the original's
perplexities are measured once. The curve is what a minute of healing buys, the data behind ship's default
``--heal-steps``.

The calibration rows are a ship run's own (``--calibration OUT.work/calibration.safetensors``, key ``token_ids``),
else drawn as ``prune.ship`` draws them (``--data --samples --seq-len --seed``); ``--seed`` seeds the heal as
ship's does.

    python -m eval.bench heal-curve --model smollm2-135m --checkpoint slim.work/checkpoint \
        --calibration slim.work/calibration.safetensors --steps 0,50,100,200 --heldout plays=plays.txt --out curve/
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.heal import HEAL_OPTIONS, HealRows, heal_data_config, heal_student, heal_training
from eval.bench.output import finish_figure, pyplot, report_results, steps_line
from eval.bench.registry import bench_option, data_option, load_option, register_subcommand, threads_option
from eval.compare.heldout import Heldout, mean_perplexity, plan_domains
from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig, calibration_data
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model.adapters import max_positions
from prune.options import apply_threads
from prune.pipeline.config import PruneConfig
from prune.selection.repaired import divergence

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


def _point(student: LoadedModel, original: LoadedModel, rows: HealRows, heldout: Heldout, batch_size: int,
           steps: int, seconds: float, report: dict | None, before: dict) -> dict:
    """One row of the curve: the healed (or built) student's KL on the measuring rows and held-out perplexities.

    ``before``: the built checkpoint's KL and perplexity on the measuring rows (step 0's own); ``kept``: whether
    ship's heal would keep this one (its KL fell).
    """
    measured = divergence(student.model, original.model, rows.measure, batch_size) if steps else before
    domains = {name: heldout.perplexity(student.model, name) for name in heldout.names()}
    return {"steps": steps, "seconds": round(seconds, 2), "minutes": round(seconds / 60, 3),
            "tokens": rows.tokens(steps), "distill_seconds": (report or {}).get("seconds"),
            "kl": measured["kl"], "measure_ppl": measured["ppl"], "kept": measured["kl"] < before["kl"],
            "domains": domains, "heldout_ppl": mean_perplexity(domains, heldout.names())}


def heal_curve(original: LoadedModel, checkpoint: Path, calibration: torch.Tensor, heldout: Heldout,
               steps: Sequence[int], prune: PruneConfig, more: torch.Tensor | None = None) -> dict:
    """The curve's rows, one per step count, and the original's perplexities (see the module's docstring).

    ``prune``: how the checkpoint loads (``load``'s dtype and device), the heal's seed (``data.seed``) and the
    sequences per forward pass of the measuring (``batch_size``), as a ship run's; ``more``: rows of other text
    trained on too (``prune.ship --heal-data``).
    """
    rows = HealRows.of(calibration, more)
    dense = {name: heldout.perplexity(original.model, name) for name in heldout.names()}
    points, before = [], None
    with tempfile.TemporaryDirectory(prefix="heal-curve-") as work:
        for count in tqdm(steps, desc="heal curve", unit="run"):
            student, _ = heal_student(checkpoint, prune.load.dtype, prune.load.device)
            if before is None:  # the built checkpoint's: what ship's heal must lower to be kept
                before = divergence(student.model, original.model, rows.measure, prune.batch_size)
            seconds, report = 0.0, None
            if count:
                started = time.perf_counter()
                done = heal_training(student, original, rows, count,
                                     dataclasses.replace(prune, out=str(Path(work) / f"steps-{count}")))
                seconds, report = time.perf_counter() - started, done.report
                for folder in done.cleanup:  # its teacher cache and checkpoints: the next run writes its own
                    shutil.rmtree(folder, ignore_errors=True)
            points.append(_point(student, original, rows, heldout, prune.batch_size, count, seconds, report,
                                 before))
            del student
    return {"model": original.name, "checkpoint": str(checkpoint),
            "heal": {**HEAL_OPTIONS, "seed": prune.data.seed, "seq_len": int(rows.train.shape[1]),
                     "train_rows": int(rows.train.shape[0]), "measure_rows": int(rows.measure.shape[0]),
                     "measure_tokens": int(rows.measure.numel())},
            "kl_before": before["kl"] if before else None,  # None: no step count given
            "heldout": {**heldout.describe, "window": heldout.seq_len},
            "original": {"domains": dense, "heldout_ppl": mean_perplexity(dense, heldout.names())},
            "points": points}


def heal_curve_markdown(results: dict) -> str:
    """The rows as a markdown table: steps, minutes, tokens trained, KL, each text's perplexity, their mean."""
    names = list(results["heldout"]["domains"])
    heal = results["heal"]
    lines = [f"{results['model']} healed from {Path(results['checkpoint']).name} as prune.ship heals (train "
             f"{heal['train']}, teacher cache {heal['teacher_cache']}, {heal['batch_size']} x {heal['seq_len']} "
             f"tokens a step, seed {heal['seed']}, {heal['train_rows']} training rows"
             + (f", {results['heal_data']['rows'][0]} sequences of them from {results['heal_data']['source']}"
                if results.get("heal_data") else "") + "); KL to the original on "
             f"{heal['measure_tokens']:,} tokens of measuring rows it never trains on; perplexity in "
             f"{results['heldout']['window']}-token windows.", "",
             "| steps | minutes | tokens trained | KL (measuring rows) | "
             + " | ".join(f"{name} ppl" for name in names) + " | geometric mean |",
             "|" + "---:|" * (5 + len(names))]
    for point in results["points"]:
        lines.append(f"| {point['steps']} | {point['minutes']:.2f} | {point['tokens']:,} | {point['kl']:.4f} | "
                     + " | ".join(f"{point['domains'][name]:.3f}" for name in names)
                     + f" | {point['heldout_ppl']:.3f} |")
    original = results["original"]
    lines.append("| original | - | - | 0 | " + " | ".join(f"{original['domains'][name]:.3f}" for name in names)
                 + f" | {original['heldout_ppl']:.3f} |")
    return "\n".join(lines)


def plot_heal_curve(results: dict, path) -> Path:
    """PNG: geometric-mean held-out perplexity against heal minutes, each point labelled with its steps."""
    points = results["points"]
    fig, ax = pyplot().subplots(figsize=(6, 4), dpi=120)
    steps_line(ax, [p["minutes"] for p in points], [p["heldout_ppl"] for p in points], [p["steps"] for p in points],
               "healed as prune.ship heals (steps at each point)")
    return finish_figure(fig, ax, path, reference=(results["original"]["heldout_ppl"], "original"),
                         xlabel="heal minutes (wall, teacher cache included)",
                         ylabel="held-out perplexity (geometric mean)",
                         title=f"{Path(results['model']).name}: quality against heal minutes")


# ---- eval.bench heal-curve ----


@dataclass(frozen=True)
class HealCurveBenchOptions:
    """The options of ``eval.bench heal-curve``: its flags, in ``--help``'s order.

    Attributes:
        load: the original (``--model``) and how both models load (dtype, device).
        checkpoint: the built, pruned checkpoint folder.
        calibration: a ship run's ``calibration.safetensors`` (None: rows drawn from ``data``).
        data: the calibration text drawn when ``calibration`` is None; its seed seeds the heal either way.
        heal_data: more text the heal trains on (``prune.ship --heal-data``), ``heal_samples`` sequences of it.
        steps: comma list of step counts (0: the checkpoint as built).
        heldout: ``LABEL=TEXT`` held-out texts, repeatable.
        heldout_tokens: tokens of each text scored.
        window: tokens per scored window.
        batch_size: sequences per forward pass of the measuring.
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


def run_heal_curve(command: HealCurveBenchOptions) -> int:
    """Run the benchmark of ``command``, print its table and write it under ``--out``."""
    apply_threads(command)
    steps = parse_steps(command.steps)
    checkpoint = check_checkpoint(command.checkpoint)
    calibration = read_calibration(command.calibration) if command.calibration is not None else None
    domains = _heldout_domains(command)
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
    results = {**heal_curve(original, checkpoint, calibration, heldout, steps, prune, more),
               "calibration": {"source": source, "rows": list(calibration.shape)},
               "heal_data": None if more is None else {"source": command.heal_data, "rows": list(more.shape)}}
    report_results(command.out, "heal_curve", results, heal_curve_markdown(results), plot_heal_curve)
    return 0


register_subcommand("heal-curve", HEAL_CURVE_HELP, HealCurveBenchOptions, run_heal_curve)
