"""Whether each checkpoint runs in each serving engine, and with the perplexity transformers gives it.

    python -m eval.bench serving --model dense=smollm2-135m --model drop4=slim4/ --heldout ptb.test.txt
        --engines transformers,llamacpp --out serving/
    # vLLM pins its own torch: run it from its environment into the same folder, which adds its column
    python -m eval.bench serving --model ... --heldout ptb.test.txt --engines vllm --out serving/

Every model is scored on the same token ids (the held-out text tokenized once by the first model's
tokenizer, cut into windows of ``--seq-len``; each window's first token is not predicted), in every
engine, through :mod:`eval.speed.engines` (``nll``); the engines, their flags and the layouts each runs
are that registry's. A model an engine does not run (its layout, ``prune.model.layouts``) is not sent to
that engine: its row says why. A conversion or load that fails is recorded in one line, and
the other models go on. ``serving.json`` keeps the rows of every engine run into the folder, so a second
environment adds its engine's column to the same table.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from eval.bench.registry import bench_option, engine_settings_option, register_subcommand
from eval.speed.engines import (
    ENGINES,
    REFERENCE,
    EngineSettings,
    display_name,
    get_engine,
    serves_label,
)
from prune.checkpoint.report import upgrade_serving
from prune.errors import LayercutError

logger = logging.getLogger(__name__)

RESULTS, TABLE = "serving.json", "serving.md"
# 1: every serving.json written before the format was numbered; 2: each row's ``serving`` names no engine
FORMAT = 2
# an engine's perplexity counts as the same as transformers' within this relative gap (the issue's 0.1 %)
AGREEMENT = 1e-3
DEFAULT_ENGINES = (REFERENCE, "llamacpp")  # the engines a CPU runs from one environment


def parse_models(specs: list[str]) -> dict[str, str]:
    """``label=path`` (or a bare path, labelled by its name) -> {label: path}, in order."""
    models: dict[str, str] = {}
    for spec in specs:
        label, _, path = spec.rpartition("=") if "=" in spec else (Path(spec.rstrip("/")).name, "", spec)
        if label in models:
            raise LayercutError(f"two models are labelled '{label}': name them with --model LABEL=PATH")
        models[label] = path
    return models


def serving_setup(heldout: str, seq_len: int, windows: list[list[int]]) -> dict:
    """What a serving table was measured on: the text, the windows and a digest of their token ids."""
    import hashlib

    return {"heldout": heldout, "seq_len": seq_len, "windows": len(windows), "predicted": len(windows) * (seq_len - 1),
            "token_digest": hashlib.sha256(json.dumps(windows).encode()).hexdigest()[:16]}


def windows_of(ids: list[int], seq_len: int, tokens: int) -> list[list[int]]:
    """The first ``tokens`` ids cut into whole windows of ``seq_len`` (a short tail is left out)."""
    ids = ids[:tokens]
    count = len(ids) // seq_len
    if count == 0:
        raise LayercutError(f"the held-out text has {len(ids)} tokens, fewer than one window of {seq_len}: "
                            "give a longer text or a smaller --seq-len")
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(count)]


def held_out_ids(path: str, tokenizer_source: str, chars: int | None = None) -> list[int]:
    """The held-out text's token ids, by the tokenizer of ``tokenizer_source`` (no special tokens added)."""
    from prune.data.calibration import load_documents
    from prune.data.windows import encode
    from prune.loading.loader import load_tokenizer

    text = "\n\n".join(load_documents(path, flag="--heldout")[0])
    if chars:
        text = text[:chars]
    tokenizer = load_tokenizer(tokenizer_source)
    return list(encode(tokenizer, text))


def model_layout(path: str) -> dict:
    """The serving entry of a model: its ``layercut.json``'s, or the layout read from its files (aliases: vanilla)."""
    from prune.checkpoint.serving import folder_serving
    from prune.model.layouts import VANILLA, serving_entry

    folder = Path(path).expanduser()
    return folder_serving(folder) if folder.is_dir() else serving_entry(VANILLA)


def score_engine(engine_name: str, models: dict[str, str], windows: list[list[int]], settings,
                 greedy_tokens: int = 32) -> dict[str, dict]:
    """One engine's row per model: runs / perplexity / greedy ids, or the one-line reason it does not run.

    The greedy ids continue the first window's first 32 tokens for ``greedy_tokens`` steps.
    """
    return score_texts(engine_name, models, {"": windows}, settings, greedy_tokens)[""]


def score_texts(engine_name: str, models: dict[str, str], texts: dict[str, list[list[int]]], settings,
                greedy_tokens: int = 32) -> dict[str, dict[str, dict]]:
    """:func:`score_engine` on several texts' windows, each model loaded once: {text: {model label: row}}."""
    engine = get_engine(engine_name)
    engine.check()
    rows: dict[str, dict[str, dict]] = {text: {} for text in texts}
    for label, path in tqdm(models.items(), desc=f"serving {engine_name}", unit="model"):
        layout = model_layout(path)
        row = {"engine": engine_name, "version": engine.version(), "layout": layout.get("layout")}
        why = engine.refusal(layout)  # the layouts it runs, as it declares them
        if why:
            for text in texts:
                rows[text][label] = {**row, "runs": False, "why": why}
            continue
        started = time.perf_counter()
        try:
            handle = engine.load(path, settings)
        except LayercutError as err:
            for text in texts:
                rows[text][label] = {**row, "runs": False, "why": str(err)}
            continue
        try:
            for text, windows in texts.items():
                total, count = 0.0, 0
                for window in windows:
                    nll, n = engine.nll(handle, window)
                    total, count = total + nll, count + n
                greedy = engine.greedy(handle, [windows[0][:32]], greedy_tokens) if greedy_tokens else []
                rows[text][label] = {**row, "runs": True, "blocks": handle.blocks, "nll": total, "predicted": count,
                                     "ppl": math.exp(total / count), "greedy": greedy,
                                     "seconds": time.perf_counter() - started}
                started = time.perf_counter()
        finally:
            engine.close(handle)
    return rows


def migrate(stored: dict) -> dict:
    """Bring a ``serving.json`` mapping of an earlier format up to :data:`FORMAT`; the one place that knows them.

    Format 1 (unnumbered) rows hold their model's ``serving`` entry as ``layercut.json`` wrote it then, with the
    engines listed in it (``prune.checkpoint.report.upgrade_serving``).
    """
    version = stored.get("format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise LayercutError(f"{RESULTS} has format {version!r}, newer than this layercut's {FORMAT}: upgrade with "
                            "pip install -U layercut")
    if version == 1:
        for per_engine in (stored.get("rows") or {}).values():
            for row in per_engine.values():
                if isinstance(row.get("serving"), dict):
                    row["serving"] = upgrade_serving(row["serving"])
    stored["format"] = FORMAT
    return stored


def merge(out: Path | None, setup: dict, rows: dict[str, dict[str, dict]]) -> dict:
    """The rows of earlier engine runs in ``out`` (same setup) with these; refuses another setup's folder."""
    result = {"format": FORMAT, "setup": setup, "rows": {}}
    if out is not None and (out / RESULTS).is_file():
        stored = migrate(json.loads((out / RESULTS).read_text(encoding="utf-8")))
        if stored.get("setup", {}).get("token_digest") != setup["token_digest"]:
            raise LayercutError(f"{out} holds a serving table of other tokens (held-out text, tokenizer, windows): "
                                "pass another --out")
        result["rows"] = stored.get("rows", {})
    for engine, per_model in rows.items():
        for label, row in per_model.items():
            before = {r.get("path") for r in result["rows"].get(label, {}).values()} - {None}
            if before and before != {row.get("path")}:
                raise LayercutError(f"{out} has a model labelled '{label}' at {before.pop()}, not {row.get('path')}: "
                                    "label this one otherwise, or pass another --out")
            result["rows"].setdefault(label, {})[engine] = row
    return result


def markdown(result: dict) -> str:
    """One row per model: layout, then per engine whether it runs and its perplexity (gap to transformers')."""
    present = {e for row in result["rows"].values() for e in row}
    # the registry's order (the reference first), then engines of the file this environment does not know
    engines = [e for e in ENGINES.names() if e in present] + sorted(present - set(ENGINES.names()))
    setup = result["setup"]
    lines = [f"Held-out text {setup['heldout']}: {setup['windows']} windows of {setup['seq_len']} tokens "
             f"({setup['predicted']} predicted tokens), the same ids in every engine.", "",
             "Beside each engine's perplexity: its gap to transformers' and whether its greedy continuation of "
             "the first window's first 32 tokens is transformers'.", "",
             "| model | serves | " + " | ".join(f"{display_name(e)} ppl" for e in engines) + " |",
             "|---|---|" + "---|" * len(engines)]

    for label, per_engine in result["rows"].items():
        layout = next((r.get("serving") for r in per_engine.values() if r.get("serving")), None)
        base = per_engine.get(REFERENCE, {}).get("ppl")
        cells = []
        for engine in engines:
            row = per_engine.get(engine)
            if row is None:
                cells.append("-")
            elif not row["runs"]:
                cells.append(f"no: {row['why']}")
            elif engine != REFERENCE and base:
                gap = row["ppl"] / base - 1
                mark = "" if abs(gap) <= AGREEMENT else " (beyond 0.1 %)"
                cells.append(f"{row['ppl']:.3f} ({100 * gap:+.3f} %){mark}{_greedy_note(row, per_engine)}")
            else:
                cells.append(f"{row['ppl']:.3f}")
        lines.append(f"| {label} | {serves_label(layout)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _greedy_note(row: dict, per_engine: dict) -> str:
    """``; greedy =`` when the engine's greedy ids are transformers', else where they first part."""
    mine, theirs = row.get("greedy"), per_engine.get(REFERENCE, {}).get("greedy")
    if not mine or not theirs:
        return ""
    if mine == theirs:
        return f"; greedy {len(mine)} = transformers"
    return f"; greedy differs from token {first_difference(mine, theirs)}"


def first_difference(mine: list[int], theirs: list[int]) -> int:
    """The first position where two greedy continuations part (the shorter one's length when one ends first)."""
    return next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), min(len(mine), len(theirs)))


def _engines_help() -> str:
    # written when the parser is built: an engine registered after this module is imported is listed too
    return f"comma list of {', '.join(ENGINES.names())} (default: {','.join(DEFAULT_ENGINES)})"


@dataclass(frozen=True)
class ServingBenchOptions:
    """The options of ``eval.bench serving``: its flags, in ``--help``'s order.

    Attributes:
        model: ``LABEL=PATH`` (or a path) of each checkpoint folder, alias or GGUF file.
        heldout: held-out text (a file or datasets spec).
        tokens: held-out tokens scored.
        seq_len: tokens per window.
        greedy_tokens: greedy ids generated after the first window's first 32 tokens (0: skip).
        engines: comma list of the engines scoring.
        settings: the engines' own settings given, by name.
        threads: CPU threads (None: the free cores).
        out: folder for ``serving.json`` and ``serving.md`` (None: print only).
    """

    model: list[str] | None = bench_option(
        None, "LABEL=PATH (or a path): a checkpoint folder, alias or GGUF file (repeatable)", action="append",
        required=True)
    heldout: str | None = bench_option(None, "held-out text (.txt/.jsonl/.parquet or datasets spec)", required=True)
    tokens: int = bench_option(4096, "held-out tokens scored (default: 4096)", type=int)
    seq_len: int = bench_option(512, "tokens per window (default: 512)", type=int)
    greedy_tokens: int = bench_option(32, "greedy ids generated after the first window's first 32 tokens, compared "
                                          "with transformers' (0: skip; default: 32)", type=int)
    engines: str = bench_option(",".join(DEFAULT_ENGINES), _engines_help)
    settings: dict = engine_settings_option()
    threads: int | None = bench_option(None, "CPU threads (default: the free cores)", type=int)
    out: str | None = bench_option(None, "folder for serving.json and serving.md (default: print only)")


def _resolved(path: str) -> str:
    """A model's identity in ``serving.json``: a local path made absolute, an alias or hub id as given."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def run_serving(options: ServingBenchOptions) -> int:
    """Score every model in every engine on the same ids; print and save the table."""
    from prune.atomic import write_json
    from prune.options import apply_threads

    apply_threads(options)
    if options.seq_len < 2 or options.tokens < options.seq_len:
        raise LayercutError(f"--seq-len must be at least 2 and at most --tokens ({options.tokens}), got "
                            f"{options.seq_len}")
    models = parse_models(options.model)
    ids = held_out_ids(options.heldout, next(iter(models.values())))
    windows = windows_of(ids, options.seq_len, options.tokens)
    setup = serving_setup(options.heldout, options.seq_len, windows)
    settings = EngineSettings.build(threads=options.threads, context=options.seq_len, **options.settings)
    rows = {engine: score_engine(engine, models, windows, settings, options.greedy_tokens)
            for engine in options.engines.split(",")}
    for per_model in rows.values():
        for label, row in per_model.items():
            row["serving"] = model_layout(models[label])
            row["path"] = _resolved(models[label])
    out = Path(options.out) if options.out else None
    result = merge(out, setup, rows)
    table = markdown(result)
    print(table)
    if out is not None:
        from prune.atomic import write_file_atomic

        out.mkdir(parents=True, exist_ok=True)
        write_file_atomic(out / RESULTS, lambda path: write_json(path, result))
        write_file_atomic(out / TABLE, lambda path: path.write_text(table + "\n", encoding="utf-8"))
        print(f"wrote {out / RESULTS} and {out / TABLE}")
    return 0


def _in_words(names: list[str]) -> str:
    """``a, b and c``."""
    return " and ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)


SERVING_HELP = (f"perplexity of each checkpoint in {_in_words([e.display for e in ENGINES.values()])} on the same "
                "token ids")

register_subcommand("serving", SERVING_HELP, ServingBenchOptions, run_serving)
