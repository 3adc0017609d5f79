"""The field in one command: every method recipe x every drop on one model, one calibration set, one table.

    python -m eval.compare --model smollm2-135m --drop 2,4,6,8 --methods all --out cmp/
    python -m eval.compare --model smollm2-135m --drop 4 --methods shortgpt,sleb,linearpatch
        --heldout ../shared/data/austen/emma.txt --tasks arc_easy,piqa --limit 200 --out cmp4/
    python -m eval.compare --model smollm2-135m --drop 4,8 --methods shortgpt,layercut-linear
        --data "emma.txt@0.5,wikitext:wikitext-2-raw-v1:train@0.5"
        --heldout novel=persuasion.txt,news=ptb.test.txt,wiki=wiki.test.txt
        --tasks arc_easy,hellaswag,piqa,lambada --out cmp-domains/
    python -m eval.compare --methods list

A method is a recipe in ``recipes/methods/`` (named by its file stem) or any recipe file. The model is
loaded once, the calibration text is drawn and scored once (all scores, all pairwise cosines), and every
cell (method, drop) runs ``prune.pipeline.run_prune`` on a fresh copy of the model with those shared
statistics. Each cell reports the blocks removed, parameters, held-out perplexity on each domain of
text calibration never saw and their geometric mean (``--heldout novel.txt,news=ptb.txt,...``, one domain
per entry, named by file stem or ``name=``; default: ``prune/corpus/austen_emma.txt`` when shipped and
the calibration is the built-in corpus, else the calibration's held-out sequences, one domain per
source of a ``--data`` mixture, disjoint from the calibration ones), optional lm-eval tasks with their
standard errors, the task mean and the task retention above chance, decode speed-up over the dense
model, wall time and whether its export is a vanilla transformers checkpoint.

Task retention: the sum over tasks of (accuracy - chance) divided by the same sum for the dense
model, over the tasks where the dense model is clearly above chance (by more than two standard
errors); chance is 1 / the choices a row offers (0 for LAMBADA's open next word). A task difference
under two standard errors is a tie; the standard error of a difference is paired, from the two models'
row-by-row scores on the same rows (kept in ``results.json``), so a real gap of a point or two shows.
Method A is *better* than B at a drop only when A has the lower perplexity on every domain and, with
``--tasks``, a retention higher by two standard errors or more. A repair (a replacement, or training after
removal) is also set against the plain removal of exactly its blocks when that row ran ("vs removal of its
blocks"): removal of other blocks is no baseline for it.
Rerunning with more ``--heldout`` domains or ``--tasks`` measures only what is missing: the dense model on
the new ones, and each finished cell of the ``--methods`` x ``--drop`` asked for on its own weights when
``--keep-checkpoints`` kept them under ``cells/``. Those weights are first checked to give the row's own
perplexity on a domain it already has; when they do not, or were not kept, the cell runs again, so a
figure is never one of another model. Every task figure of one comparison is taken at one ``--limit``, and
every cell is fitted on one calibration: ``results.json`` keeps a digest of its tokens and the weights, and a
resumed run whose calibration differs (text sampled again differently) is refused.
``--oracle`` adds SLEB's oracle (calibration perplexity with each block alone removed) and every
score's Spearman correlation with it.

Writes to ``--out``: ``results.json`` (after every cell: rerunning skips finished cells, so a crash or
Ctrl-C loses at most one), ``README.md`` (a leaderboard per drop, dense row on top, best first),
``perplexity_vs_blocks.png``, ``chosen_blocks.png``, ``oracle.md`` with ``--oracle``, ``measurements.json``
(every calibration perplexity measured with blocks or sub-layers removed, for SLEB, the oracle and the
measured sub-layer ranking, written as each is taken and read back by a resumed run on the same model
and calibration: ``eval.measurements``), and each cell's reports under ``cells/<method>-drop<K>/``
(weights too with ``--keep-checkpoints``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from distill.config import DistillConfig
from eval.evaluate import parse_limit
from eval.lmeval import describe_rows, primary_metric, run_lm_eval
from eval.measurements import MeasurementStore, calibration_digest
from eval.perplexity import perplexity, tokenize_text
from eval.speed import WEIGHT_SUFFIXES, SpeedOptions, count_parameters, make_prompt, time_decode
from prune import hf_remote_code
from prune.adapters import get_blocks, num_blocks
from prune.checkpoint import REPLACEMENTS_FILE
from prune.data import FILE_SUFFIXES, load_documents
from prune.errors import LayercutError, cli_entry
from prune.export import write_file_atomic
from prune.heldout import packed_perplexity
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_threads_argument,
    apply_threads,
    data_config_from_args,
    load_config_from_args,
)
from prune.oracle import oracle_table, removal_cache, run_oracle
from prune.pipeline import PruneConfig, Scored, preflight, run_prune, score_calibration
from prune.recipes import config_from_recipe, method_recipes, method_summary, resolve_method
from prune.replace import check_drop_for_method, parameter_count
from prune.replace.registry import UNSET
from prune.stamps import weights_fingerprint
from prune.sublayers import is_sublayer, parse_units

logger = logging.getLogger(__name__)

RESULTS = "results.json"
README = "README.md"
PPL_PNG = "perplexity_vs_blocks.png"
BLOCKS_PNG = "chosen_blocks.png"
ORACLE_MD = "oracle.md"
CELLS = "cells"
# The default held-out text, once one distinct from the calibration corpus is shipped beside it; until
# then the calibration source's held-out sequences (disjoint from the calibration ones) stand in.
SHIPPED_HELDOUT = Path(__file__).resolve().parents[1] / "prune" / "corpus" / "austen_emma.txt"


def build_parser() -> argparse.ArgumentParser:
    """The ``eval.compare`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__.split("\n")[0])
    add_load_arguments(parser)
    add_data_arguments(parser, samples=32, seq_len=512, heldout_samples=8)
    group = parser.add_argument_group("comparison")
    group.add_argument("--drop", default=None, help="block counts to remove, comma list (2,4,6,8)")
    group.add_argument("--methods", default="all",
                       help="all (every recipe in recipes/methods/), a comma list of method names and/or recipe "
                       "files, or list (print the known methods and exit) (default: all)")
    group.add_argument("--heldout", default=None,
                       help="texts the calibration never saw, one perplexity domain each: comma list of "
                       ".txt/.jsonl/.parquet files or datasets specs, named by file stem or name=FILE "
                       "(novel=emma.txt,news=ptb.txt); default: prune/corpus/austen_emma.txt when shipped and "
                       "--data is unset, else the calibration's --heldout-samples sequences, one domain per "
                       "--data source, disjoint from the calibration ones")
    group.add_argument("--heldout-tokens", type=int, default=None,
                       help="score only the first this many tokens of each --heldout text (default: all)")
    group.add_argument("--tasks", default=None, help="lm-eval tasks, comma list (arc_easy,piqa; default: none)")
    group.add_argument("--limit", type=parse_limit, default=None,
                       help="rows per lm-eval task: a count (the first N), a fraction, START:END (--limit=-500: is "
                       "the last 500), or N rows drawn at random from a range, N~START:END (1000~1000: draws 1,000 "
                       "from the rows a report on --limit 1000 never reads: choose defaults there) (default: all)")
    group.add_argument("--data-dir", default=None,
                       help="local lm-eval data laid out like shared/data (default: $LAYERCUT_DATA, else the hub)")
    group.add_argument("--batch-size", type=int, default=4,
                       help="sequences per forward pass while scoring, fitting and measuring (default: 4)")
    group.add_argument("--speed-tokens", type=int, default=32,
                       help="decode steps timed per model for the speed-up (0: skip; default: 32)")
    group.add_argument("--oracle", action="store_true",
                       help="also measure calibration perplexity with each block alone removed, and each score's "
                       "Spearman correlation with it")
    group.add_argument("--keep-checkpoints", action="store_true",
                       help="keep every cell's weights under cells/ (default: reports only; a cell's weights are "
                       "the size of the model)")
    parser.add_argument("--out", default=None, help="folder for results.json, README.md and the plots (required)")
    parser.add_argument("--overwrite", action="store_true", help="start afresh in a --out that holds another run")
    add_threads_argument(parser)
    return parser


def parse_drops(text: str | None) -> list[int]:
    """``"2,4,6,8"`` -> ``[2, 4, 6, 8]`` (sorted, unique, positive)."""
    if not text:
        raise LayercutError("--drop is required: block counts to remove, e.g. --drop 4 or --drop 2,4,6,8")
    try:
        drops = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise LayercutError(f"--drop takes block counts like 2,4,6,8, got '{text}'") from None
    if not drops or drops[0] <= 0:
        raise LayercutError(f"--drop takes positive block counts like 2,4,6,8, got '{text}'")
    return drops


def parse_methods(text: str) -> dict[str, Path]:
    """``all``, or a comma list of method names / recipe files -> name -> recipe path."""
    if text.strip() == "all":
        methods = method_recipes()
        if not methods:
            raise LayercutError("--methods all found no recipe in recipes/methods/: name recipe files instead")
        return methods
    chosen = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        path = resolve_method(item)
        chosen[item if item in method_recipes() else path.stem] = path
    if not chosen:
        raise LayercutError("--methods is empty: pass all, list, or method names")
    return chosen


def method_list() -> str:
    """One line per known method: its name and its recipe's summary."""
    methods = method_recipes()
    width = max((len(name) for name in methods), default=0)
    return "\n".join(f"{name:<{width}}  {method_summary(path)}" for name, path in methods.items())


def cell_config(path: Path, drop: int, args: argparse.Namespace, out: Path | None,
                budget: tuple[int, float] | None = None) -> PruneConfig:
    """The method's recipe with the comparison's model, data, drop and batch size on top.

    A method that removes sub-layers (``unit: attention,mlp``) meets, at drop K, the parameter count
    of the model less K blocks (``budget``: the model's parameters and a block's), so its row compares
    with the whole-block rows at equal parameters; without ``budget`` (checks before the model loads)
    K stands in as a sub-layer count.
    """
    load = dataclasses.asdict(load_config_from_args(args))
    data = dataclasses.asdict(data_config_from_args(args))
    overrides = {"load": load, "data": data, "drop": drop, "batch_size": args.batch_size,
                 "out": None if out is None else str(out), "overwrite": True}
    config = config_from_recipe(path, overrides)
    if budget is not None and is_sublayer(parse_units(config.unit)):
        total, block = budget
        config = dataclasses.replace(config, drop=None, target_params=int(total - drop * block))
    return config


def block_budget(model) -> tuple[int, float]:
    """The model's parameters and its mean block's: what a drop of K blocks frees, for sub-layer methods."""
    _, blocks = get_blocks(model)
    return parameter_count(model), sum(parameter_count(b) for b in blocks) / len(blocks)


RUN_KEYS = ("load", "data", "drop", "target_params", "target_speedup", "out", "overwrite")


# Options added after results were written, with the values that do what was done before them: the
# registry's "not given" (a method that does not read the option) and the value every method applied before
# it existed. At those values they are left out of the digest: adding an option must not make every finished
# cell look stale and run again. Anything else, a changed method default included, is hashed like every
# other option.
ADDED_OPTIONS = {"update_scale": (UNSET["update_scale"], 1.0)}


def _without_added_options(node: Any) -> Any:
    if isinstance(node, dict):
        return {key: _without_added_options(value) for key, value in node.items()
                if not (key in ADDED_OPTIONS and value in ADDED_OPTIONS[key])}
    if isinstance(node, list):
        return [_without_added_options(value) for value in node]
    return node


def resolved_method(path: Path) -> dict:
    """The recipe's method as it runs, defaults filled in, without the run's own keys (model, data, amount)."""
    config = config_from_recipe(path, {"drop": 1, "load": {"model": "digest"}})
    resolved = dataclasses.asdict(config)
    method = {key: value for key, value in resolved.items() if key not in RUN_KEYS}
    for step in config.build_steps():  # a step's section is a raw mapping until its step fills in the defaults
        options = getattr(step, "config", None)
        if dataclasses.is_dataclass(options):
            method[step.name] = dataclasses.asdict(options)
    return _without_added_options(method)


def recipe_digest(path: Path) -> str:
    """Changes when the method does: a finished cell is run again after its recipe changed.

    The resolved method configuration is hashed with the file, so a changed default that the recipe
    leaves unset (``replace.short`` of ``linear``, say, or the text ``distill`` reads) reruns the cell too.
    """
    text = json.dumps(resolved_method(path), sort_keys=True, default=str).encode()
    return hashlib.sha256(path.read_bytes() + text).hexdigest()[:16]


STALE_MARKS = {"changed": "†", "missing": "‡"}


def recipe_state(row: dict) -> str | None:
    """Whether a row's figures are still its recipe's: None (they are), "changed" or "missing".

    "changed": the recipe, or a default it leaves unset, has changed since the row ran; "missing": there is no
    recipe at the row's path, so it cannot be checked.
    """
    path = Path(row.get("recipe") or "")
    if not row.get("recipe") or not path.is_file():
        return "missing"
    try:
        return None if recipe_digest(path) == row.get("recipe_digest") else "changed"
    except LayercutError:  # the recipe no longer reads: not the method the row ran
        return "changed"


def _stale_note(states: dict[str, str | None]) -> list[str]:
    found = set(states.values()) - {None}
    if not found:
        return []
    notes = {"changed": f"{STALE_MARKS['changed']}: its recipe, or a default the recipe leaves unset, has changed "
                        "since this row ran; its figures are the method's as it was, not as the recipe runs now "
                        "(the same command runs the cell again)",
             "missing": f"{STALE_MARKS['missing']}: its recipe is not at the path it ran from, so whether it has "
                        "changed cannot be checked"}
    return ["; ".join(notes[state] for state in ("changed", "missing") if state in found) + ".", ""]


def write_text(path: Path, text: str) -> None:
    """Write ``text`` so a reader never sees half a file."""
    write_file_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def setup_of(args: argparse.Namespace) -> dict:
    """What every cell of one comparison shares; a --out written for another setup is refused."""
    # --heldout and --tasks are not here: domains and tasks can be added to a comparison
    return {"model": args.model, "load": dataclasses.asdict(load_config_from_args(args)),
            "data": dataclasses.asdict(data_config_from_args(args)),
            "heldout_tokens": args.heldout_tokens, "batch_size": args.batch_size, "speed_tokens": args.speed_tokens}


def open_results(out: Path, setup: dict, overwrite: bool) -> dict:
    """The results so far in ``out`` (resume), or a fresh record."""
    path = out / RESULTS
    if path.is_file() and not overwrite:
        results = json.loads(path.read_text(encoding="utf-8"))
        _migrate_task_setup(results)
        differs = sorted(k for k in setup if results.get("setup", {}).get(k) != setup[k])
        if differs:
            raise LayercutError(f"{out} holds a comparison with another {', '.join(differs)}: pass another --out, "
                                "the same options to resume it, or --overwrite to start afresh")
        return results
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LayercutError(f"--out {out} exists and is not a comparison folder: pass another --out or "
                                "--overwrite")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"setup": setup, "dense": None, "cells": {}, "oracle": None, "timing": {}}
    # at once: a run stopped before its first cell (in the oracle, say) is still a comparison to resume
    write_text(path, json.dumps(results, indent=2) + "\n")
    return results


def check_calibration(results: dict, digest: str, out: Path) -> None:
    """Refuse to add cells fitted on other calibration tokens (or weights) to the ones already in ``out``.

    The options can match while the tokens do not: text sampled from the model (``--data self``) is drawn
    again on a machine without the sample cache, and another torch or model build can draw other text.
    A leaderboard mixing the two would pass one calibration's figures off as the other's.
    """
    stored = (results.get("calibration") or {}).get("digest")
    if stored is not None and stored != digest:
        raise LayercutError(f"{out} holds cells fitted on other calibration tokens or weights (digest {stored}, "
                            f"now {digest}: sampled text drawn again differently, or another model build): pass "
                            "another --out, or --overwrite to start afresh")
    if stored is None and results["cells"]:
        logger.warning("%s has no calibration digest: recording this run's; its %d earlier cell(s) cannot be "
                       "checked against it", out, len(results["cells"]))


def _migrate_task_setup(results: dict) -> None:
    """Comparisons written when --tasks and --limit were part of the setup: the limit their figures have."""
    legacy = results.get("setup", {})
    if "tasks" in legacy or "limit" in legacy:
        tasks, limit = legacy.pop("tasks", None), legacy.pop("limit", None)
        if tasks:
            results.setdefault("task_limit", limit)


def requested_tasks(args: argparse.Namespace) -> list[str]:
    """The lm-eval tasks ``--tasks`` names, in order."""
    return [t.strip() for t in (args.tasks or "").split(",") if t.strip()]


def check_task_limit(results: dict, args: argparse.Namespace) -> None:
    """One ``--limit`` for every task figure of a comparison: a gap between rows is then one of models."""
    if not requested_tasks(args):
        return
    rows = [results["dense"] or {}, *results["cells"].values()]
    if "task_limit" in results and results["task_limit"] != args.limit and any(row.get("tasks") for row in rows):
        had = results["task_limit"]
        # a range starting with "-" reaches argparse only glued to its flag
        taken, fix = (("on whole splits", "no --limit") if had is None
                      else (f"at --limit {had}", f"--limit={had}" if isinstance(had, str) else f"--limit {had}"))
        raise LayercutError(f"{args.out} holds task figures taken {taken}: pass {fix} to add tasks to it, or another "
                            "--out")
    results["task_limit"] = args.limit


def _has_tasks(row: dict | None, tasks: list[str]) -> bool:
    return row is not None and all(task in row.get("tasks", {}) for task in tasks)


@dataclass(frozen=True)
class Domain:
    """One held-out perplexity domain.

    Attributes:
        name: its column in the tables.
        spec: the file or datasets spec read; None: the calibration's held-out sequences.
        part: with ``spec`` None, which ``--data`` source's held-out sequences (None: all of them).
    """

    name: str
    spec: str | None
    part: int | None = None

    @property
    def key(self) -> str:
        """What the domain's figures were measured on; a name whose key changed is measured again."""
        if self.spec is not None:
            return _source_key(self.spec)
        return f"calibration held-out {'all' if self.part is None else self.part}"


def _source_key(spec: str) -> str:
    """A file by its absolute path, so one text named from another folder, or by a relative path, is one text."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.is_file() else spec


def _domain_name(spec: str) -> str:
    path = Path(spec).expanduser()
    if path.suffix in FILE_SUFFIXES or path.exists():
        return path.stem
    return spec.replace("/", "-").replace(":", "-")  # a datasets spec


def plan_domains(args: argparse.Namespace) -> list[Domain]:
    """The held-out domains ``args`` asks for, before anything is loaded; bad spellings are one-line errors."""
    if args.heldout is None:
        if args.data is None and SHIPPED_HELDOUT.is_file():  # a text the default calibration corpus does not contain
            return [Domain(SHIPPED_HELDOUT.stem, str(SHIPPED_HELDOUT))]
        sources = data_config_from_args(args).sources
        if len(sources) == 1:
            return [Domain("heldout", None)]
        names = [_domain_name(source.label()) if not source.is_self else "self" for source in sources]
        return [Domain(name, None, index) for index, name in enumerate(names)]
    items = [args.heldout] if Path(args.heldout).expanduser().exists() else [
        item.strip() for item in args.heldout.split(",")]
    domains = []
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or Path(item).expanduser().exists():
            name, spec = _domain_name(item), item
        if not name.strip() or not spec.strip():
            raise LayercutError(f"--heldout entry '{item}' is empty: give FILE or NAME=FILE, e.g. "
                                "novel=emma.txt,news=ptb.txt")
        domains.append(Domain(name.strip(), spec.strip()))
    names = [domain.name for domain in domains]
    for name in names:
        if names.count(name) > 1:
            raise LayercutError(f"--heldout names the domain '{name}' twice: name them apart, e.g. "
                                f"{name}1=FIRST.txt,{name}2=SECOND.txt")
    for domain in domains:
        path = Path(domain.spec).expanduser()
        if path.is_file() or path.suffix in FILE_SUFFIXES or domain.spec.startswith((".", "/", "~")):
            load_documents(domain.spec, flag="--heldout")  # a bad file's one-line error, before the model loads
    return domains


class Heldout:
    """The held-out domains and how to score a model on them."""

    def __init__(self, args: argparse.Namespace, scored: Scored | None, tokenizer,
                 domains: list[Domain] | None = None):
        self.seq_len = args.seq_len
        self.batch_size = args.batch_size
        self.domains = domains if domains is not None else plan_domains(args)
        self.ids: dict[str, torch.Tensor] = {}  # name -> 1-D stream of a text
        self.packed: dict[str, torch.Tensor] = {}  # name -> [sequences, seq_len] calibration held-out
        self.describe = {"domains": {}}
        for domain in self.domains:
            if domain.spec is not None:
                documents, source = load_documents(domain.spec, flag="--heldout")
                ids = tokenize_text(tokenizer, "\n\n".join(documents))
                self.ids[domain.name] = ids[: args.heldout_tokens] if args.heldout_tokens else ids
                tokens = int(self.ids[domain.name].numel())
            else:
                source, self.packed[domain.name] = self._calibration_part(scored, domain)
                tokens = int(self.packed[domain.name].numel())
            self.describe["domains"][domain.name] = {"source": source, "tokens": tokens, "key": domain.key}
        if len(self.domains) == 1:  # the one-text layout of earlier results.json files
            self.describe.update({k: v for k, v in self.describe["domains"][self.domains[0].name].items()
                                  if k != "key"})

    @staticmethod
    def _calibration_part(scored: Scored | None, domain: Domain) -> tuple[str, torch.Tensor]:
        calibration = scored.calibration if scored is not None else None
        if domain.part is None:
            heldout, source = (calibration.heldout_ids, calibration.source) if calibration else (None, "")
        else:
            source, heldout = list(calibration.heldout_by_source.items())[domain.part]
        if heldout is None or heldout.numel() == 0:
            raise LayercutError(f"no held-out text for the domain '{domain.name}': pass --heldout FILE or raise "
                                "--heldout-samples")
        return f"{source} (held-out sequences, disjoint from calibration)", heldout

    def names(self) -> list[str]:
        """The domain names in order."""
        return [domain.name for domain in self.domains]

    def perplexity(self, model, name: str) -> float:
        """Held-out perplexity of ``model`` on the domain ``name``."""
        if name in self.packed:
            return packed_perplexity(model, self.packed[name], self.batch_size, progress=False)
        return perplexity(model, self.ids[name], seq_len=self.seq_len, batch_size=self.batch_size,
                          progress=False).perplexity


def mean_perplexity(domains: dict[str, float], names: list[str]) -> float:
    """Geometric mean of the perplexities of ``names``: the perplexity of their mean per-token loss."""
    return math.exp(sum(math.log(domains[name]) for name in names) / len(names))


def measure_domains(model, heldout: Heldout, row: dict, names: list[str] | None = None) -> None:
    """Put the perplexity of each domain (``names``, default all) and their mean into ``row``."""
    domains = row.setdefault("domains", {})
    for name in names if names is not None else heldout.names():
        domains[name] = heldout.perplexity(model, name)
    row["heldout_ppl"] = mean_perplexity(domains, heldout.names())


def measure(model, tokenizer, heldout: Heldout, args: argparse.Namespace) -> dict:
    """Parameters, held-out perplexity per domain, lm-eval tasks and decode seconds of one model."""
    row = {"params": count_parameters(model), "blocks": num_blocks(model)}
    measure_domains(model, heldout, row)
    measure_tasks(model, tokenizer, args, row)
    if args.speed_tokens:
        options = SpeedOptions(prompt_len=min(64, args.seq_len), new_tokens=args.speed_tokens)
        prompt = make_prompt(model.config.vocab_size, options)
        time_decode(model, prompt, 2)  # warm-up
        row["decode_s"] = sorted(time_decode(model, prompt, options.new_tokens) for _ in range(3))[1]
    return row


def measure_tasks(model, tokenizer, args: argparse.Namespace, row: dict) -> None:
    """Put the ``--tasks`` that ``row`` lacks into it: score, standard error and the row-by-row scores."""
    tasks = [task for task in requested_tasks(args) if task not in row.get("tasks", {})]
    if not tasks:
        return
    rows: dict[str, list[float]] = {}
    raw = run_lm_eval(model, tokenizer, tasks, data_dir=args.data_dir, limit=args.limit, rows=rows)
    row.setdefault("tasks", {}).update({task: raw[task].get(primary_metric(task)) for task in tasks if task in raw})
    row.setdefault("task_rows", {}).update({task: [int(v) if v in (0.0, 1.0) else v for v in rows[task]]
                                            for task in tasks if task in rows})
    row.setdefault("task_stderr", {}).update({task: raw[task].get(f"{primary_metric(task)}_stderr")
                                              for task in tasks if task in raw})


def kept_weights(folder: Path) -> bool:
    """Whether a cell's folder still holds its checkpoint's weights (``--keep-checkpoints``)."""
    return (folder / "config.json").is_file() and any(f.suffix in WEIGHT_SUFFIXES for f in folder.iterdir())


# A cell's weights read back must give its row's perplexity to this relative tolerance (the same
# float32 arithmetic agrees to ~1e-6; a checkpoint without its maps or from another run is off by far more)
REPRODUCE_RTOL = 1e-4


def complete_cell(row: dict, folder: Path, args: argparse.Namespace, heldout: Heldout) -> dict | None:
    """``row`` with the domains and tasks it lacks, measured on the cell's kept weights.

    None, and the cell runs again, when no weights were kept or they do not give the row's own
    perplexity on a domain it has: the figures added must be those of the model the row describes.
    """
    known = [name for name in heldout.names() if name in row.get("domains", {})]
    if not known or not kept_weights(folder):
        return None
    loaded = load_config_from_args(args, model=str(folder)).load()
    again = heldout.perplexity(loaded.model, known[0])
    if not math.isclose(again, row["domains"][known[0]], rel_tol=REPRODUCE_RTOL):
        logger.warning("%s gives %s perplexity %.5f where its row says %.5f: running the cell again", folder,
                       known[0], again, row["domains"][known[0]])
        return None
    row = copy.deepcopy(row)
    measure_domains(loaded.model, heldout, row, [name for name in heldout.names() if name not in known])
    measure_tasks(loaded.model, loaded.tokenizer, args, row)
    row["completed_from_checkpoint"] = True
    return row


def reconcile_domains(results: dict, domains: list[Domain]) -> None:
    """Forget every figure of a domain whose name now means another text, so it is measured again."""
    measured = results.get("heldout", {}).get("domains", {})
    for domain in domains:
        # keys of comparisons written before keys were absolute paths compare by the file they name
        if domain.name in measured and _source_key(measured[domain.name].get("key", "")) != domain.key:
            for row in [results["dense"] or {}, *results["cells"].values()]:
                row.get("domains", {}).pop(domain.name, None)


def _has_domains(row: dict | None, domains: list[Domain]) -> bool:
    return row is not None and all(domain.name in row.get("domains", {}) for domain in domains)


def is_vanilla(folder: Path) -> bool:
    """Whether a written checkpoint loads with plain transformers (no maps, no removed sub-layers)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return not (folder / REPLACEMENTS_FILE).exists() and not hf_remote_code.is_wrapped(config)


def run_cell(name: str, path: Path, drop: int, args, loaded, scored: Scored, heldout: Heldout, out: Path,
             dense: dict) -> dict:
    """One method at one drop on a fresh copy of the model; the cell's row."""
    started = time.perf_counter()
    # before the recipe is read: a recipe edited while the cell runs must not lend the row its new digest
    digest = recipe_digest(path)
    cell_dir = out / CELLS / f"{name}-drop{drop}"
    config = cell_config(path, drop, args, cell_dir, block_budget(loaded.model))
    copied = time.perf_counter()
    student = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model))
    copy_seconds = time.perf_counter() - copied
    # the cell measures on its own held-out text: keep run_prune from scoring the dense model again
    shared = dataclasses.replace(scored, calibration=dataclasses.replace(scored.calibration, heldout_ids=None))
    result = run_prune(config, loaded=student, scored=shared)
    prune_seconds = time.perf_counter() - started
    row = {"method": name, "recipe": str(path), "recipe_digest": digest, "drop": drop,
           "dropped": result.dropped, "score": config.score, "select": config.select,
           "replace": config.replace.method, "distill_steps": result.report.get("distill", {}).get("steps", 0),
           "vanilla": is_vanilla(cell_dir), "prune_seconds": round(prune_seconds, 2),
           "copy_seconds": round(copy_seconds, 2)}
    if "sublayers" in result.report:
        row.update(unit=config.unit, sublayers=result.report["sublayers"]["units"])
    if "distill" in result.report:
        row["distill"] = distill_summary(result.report["distill"]["config"])
        if result.report["distill"].get("generalisation"):
            row["distill"]["generalisation"] = result.report["distill"]["generalisation"]
    row.update(measure(student.model, student.tokenizer, heldout, args))
    row["heldout_ratio"] = row["heldout_ppl"] / dense["heldout_ppl"]
    row["domain_ratios"] = {name: row["domains"][name] / dense["domains"][name] for name in heldout.names()}
    row["params_ratio"] = row["params"] / dense["params"]
    if "decode_s" in row and dense.get("decode_s"):
        row["decode_speedup"] = dense["decode_s"] / row["decode_s"]
    row["seconds"] = round(time.perf_counter() - started, 2)
    if not args.keep_checkpoints:
        for file in cell_dir.iterdir():
            if file.suffix in WEIGHT_SUFFIXES:
                file.unlink()
    del student
    return row


def distill_summary(config: dict) -> dict:
    """What a cell's distillation read and optimised, from its resolved settings (``layercut.json``).

    Two rows of one recipe can differ here when a default moved between runs: the row says so itself, not
    only its cell folder.
    """
    resolved = DistillConfig.from_dict(config)
    return {"data": resolved.data.data, "samples": resolved.data.samples, "seq_len": resolved.data.seq_len,
            "train": resolved.train, "losses": resolved.loss_weights()}


# Accuracy of a random guess on each task: 1 / the choices a row offers (ARC: 4 on almost every row,
# HellaSwag 4 endings, PIQA 2 solutions, WinoGrande 2 options, BoolQ yes/no); LAMBADA's target is an
# open next word, so 0.
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5, "boolq": 0.5,
          "openbookqa": 0.25, "sciq": 0.25, "copa": 0.5, "mmlu": 0.25, "lambada": 0.0, "lambada_openai": 0.0,
          "lambada_standard": 0.0}
TIE_SE = 2.0  # differences under this many standard errors are ties


def refresh_rows(results: dict, names: list[str]) -> None:
    """Mean perplexity and ratios of every row over the domains ``names`` (the ones asked for now)."""
    results["domains"] = list(names)
    dense = results["dense"]
    if not _has_domains(dense, [Domain(n, None) for n in names]):
        return
    dense["heldout_ppl"] = mean_perplexity(dense["domains"], names)
    for row in results["cells"].values():
        if all(name in row.get("domains", {}) for name in names):
            row["heldout_ppl"] = mean_perplexity(row["domains"], names)
            row["heldout_ratio"] = row["heldout_ppl"] / dense["heldout_ppl"]
            row["domain_ratios"] = {name: row["domains"][name] / dense["domains"][name] for name in names}


def _stderr(row: dict, task: str) -> float:
    value = row.get("task_stderr", {}).get(task)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def task_figures(row: dict, tasks: list[str], counted: list[str], dense: dict) -> dict:
    """Task mean, retention above chance and their standard errors for one row."""
    figures = {}
    present = [t for t in tasks if row.get("tasks", {}).get(t) is not None]
    if present:
        figures["task_mean"] = sum(row["tasks"][t] for t in present) / len(present)
        figures["task_mean_stderr"] = math.sqrt(sum(_stderr(row, t) ** 2 for t in present)) / len(present)
    if counted and all(row.get("tasks", {}).get(t) is not None for t in counted):
        above = sum(dense["tasks"][t] - CHANCE[t] for t in counted)  # the dense model's, > 0 by the choice of tasks
        figures["retention"] = sum(row["tasks"][t] - CHANCE[t] for t in counted) / above
        # the dense model's own error is shared by every row: only the row's error separates two rows
        figures["retention_stderr"] = math.sqrt(sum(_stderr(row, t) ** 2 for t in counted)) / above
    return figures


def gap_stderr(a: dict, b: dict, fa: dict, fb: dict, quality: str, tasks: list[str], dense: dict) -> float:
    """Standard error of ``fa[quality] - fb[quality]``: paired over rows where both rows have them.

    Both models answer the same questions, and most answers they share: the spread of the row-by-row
    difference is the noise of the gap, far less than the two separate standard errors combined.
    """
    rows_a, rows_b = a.get("task_rows", {}), b.get("task_rows", {})
    if not all(t in rows_a and t in rows_b and len(rows_a[t]) == len(rows_b[t]) > 1 for t in tasks):
        return math.hypot(fa[f"{quality}_stderr"], fb[f"{quality}_stderr"])
    variance = 0.0
    for task in tasks:
        diff = torch.tensor(rows_a[task], dtype=torch.float64) - torch.tensor(rows_b[task], dtype=torch.float64)
        variance += float(diff.var()) / diff.numel()
    scale = len(tasks) if quality == "task_mean" else sum(dense["tasks"][t] - CHANCE[t] for t in tasks)
    return math.sqrt(variance) / scale


def _beats(a: dict, b: dict, fa: dict, fb: dict, names: list[str], quality: str | None, stderr) -> bool:
    """Lower perplexity on every domain and, when tasks ran, the task figure higher by two standard errors."""
    if not all(a["domains"][n] < b["domains"][n] for n in names):
        return False
    if quality is None or (quality not in fa and quality not in fb):  # neither row ran the tasks: perplexity alone
        return True
    if quality not in fa or quality not in fb:
        return False
    return fa[quality] - fb[quality] >= TIE_SE * stderr() and fa[quality] > fb[quality]


def analyse(results: dict) -> dict:
    """Task means, retention above chance, ties and the "better than" relation of every finished row."""
    dense = results["dense"] or {}
    names = results.get("domains") or list(dense.get("domains", {}))
    rows = {key: row for key, row in results["cells"].items() if all(n in row.get("domains", {}) for n in names)}
    tasks = sorted({t for row in [dense, *rows.values()] for t in row.get("tasks", {})})
    counted, excluded = [], {}
    for task in tasks:
        value = dense.get("tasks", {}).get(task)
        if task not in CHANCE:
            excluded[task] = "no chance level known"
        elif value is None:
            excluded[task] = "no dense score"
        elif value - CHANCE[task] <= TIE_SE * _stderr(dense, task):
            excluded[task] = f"dense {value:.3f} is within {TIE_SE:g} standard errors of chance {CHANCE[task]:g}"
        else:
            counted.append(task)
    figures = {key: task_figures(row, tasks, counted, dense) for key, row in rows.items()}
    figures["dense"] = task_figures(dense, tasks, counted, dense) if dense else {}
    quality = None if not tasks else ("retention" if counted else "task_mean")
    used = counted if quality == "retention" else [t for t in tasks if t in dense.get("tasks", {})]

    def stderr(a: str, b: str) -> float:
        return gap_stderr(rows[a], rows[b], figures[a], figures[b], quality, used, dense)

    better, ties = {}, {}
    for key, row in rows.items():
        same = [(k, r) for k, r in rows.items() if r["drop"] == row["drop"] and k != key]
        better[key] = sorted(k for k, r in same if _beats(row, r, figures[key], figures[k], names, quality,
                                                          lambda k=k, key=key: stderr(key, k)))
        if quality is not None and quality in figures[key]:
            best = max((k for k, _ in [(key, row), *same] if quality in figures[k]), key=lambda k: figures[k][quality])
            gap = figures[best][quality] - figures[key][quality]
            tie = best == key or gap < TIE_SE * stderr(best, key)
            ties[key] = "best" if best == key else ("tie" if tie else f"-{100 * gap:.1f}")
    versus = {key: vs_removal(rows, key, figures, names, quality, stderr) for key, row in rows.items()
              if not is_plain_removal(row) and "replace" in row and "sublayers" not in row}
    return {"domains": names, "tasks": tasks, "chance": {t: CHANCE[t] for t in tasks if t in CHANCE},
            "retention_tasks": counted, "excluded_tasks": excluded, "task_quality": quality, "rows": figures,
            "better_than": better, "vs_best_tasks": ties, "vs_removal": versus}


def is_plain_removal(row: dict) -> bool:
    """Blocks removed whole, nothing in their place and no training after: the baseline of every repair."""
    return row.get("replace") == "none" and not row.get("distill_steps") and "sublayers" not in row


def vs_removal(rows: dict, key: str, figures: dict, names: list[str], quality: str | None, stderr) -> dict | None:
    """A repaired row against plain removal of exactly its blocks at the same drop, where that row ran.

    A repair earns its parameters only if it keeps the task figure of removing the same blocks and beats it
    in perplexity on every domain. Removal of other blocks says nothing about the repair (fold and LinearPatch
    choose their own), so without that row there is no verdict, rather than one against the wrong baseline.
    """
    row = rows[key]
    base = next((k for k, r in sorted(rows.items()) if is_plain_removal(r) and r["drop"] == row["drop"]
                 and list(r["dropped"]) == list(row["dropped"])), None)
    if base is None:
        return None
    higher = [n for n in names if row["domains"][n] >= rows[base]["domains"][n]]
    entry = {"baseline": base, "perplexity_higher_on": higher}
    if quality is not None and quality in figures[key] and quality in figures[base]:
        gap, se = figures[key][quality] - figures[base][quality], stderr(key, base)
        entry.update(gap=gap, gap_stderr=se,
                     verdict="tie" if abs(gap) < TIE_SE * se else ("win" if gap > 0 else "loss"))
    elif quality is not None and (quality in figures[key] or quality in figures[base]):
        entry["verdict"] = "tasks on one row only"  # perplexity alone would read as a verdict on both
    return entry


def cell_key(name: str, drop: int) -> str:
    """The key of a cell in ``results.json``."""
    return f"{name}@{drop}"


def leaderboard(results: dict) -> str:
    """README.md: one table per drop, dense on top, best mean held-out perplexity first; then the oracle."""
    dense, setup = results["dense"], results["setup"]
    analysis = results.get("analysis") or analyse(results)
    names, tasks, figures = analysis["domains"], analysis["tasks"], analysis["rows"]
    cells = {key: row for key, row in results["cells"].items() if key in analysis["better_than"]}
    timing = results.get("timing", {})
    heldout = results.get("heldout", {})
    texts = "; ".join(f"{name}: {d['source']} ({d['tokens']} tokens)" for name, d in heldout.get("domains", {}).items()
                      if name in names)
    lines = [f"# Method comparison: {setup['model']}", "",
             f"Held-out perplexity on {texts or '?'}; with several domains, \"held-out ppl\" is their geometric "
             f"mean. Calibration {results.get('calibration', {}).get('tokens', '?')} tokens of "
             f"{results.get('calibration', {}).get('source', '?')}, scored once for every cell "
             f"({timing.get('score_seconds', '?')} s). Decode speed-up: {setup['speed_tokens']} greedy steps "
             "with the KV cache, median of 3, against the dense model. Wall time: the cell's prune, fit, "
             "distillation and measurements.", ""]
    lines += _task_note(analysis, results)
    states = {key: recipe_state(row) for key, row in cells.items()}
    lines += _stale_note(states)
    lines += _versus_note(analysis)
    lines += _wall_time_note(timing)
    copies = sorted(row["copy_seconds"] for row in cells.values())
    if copies and "load_seconds" in timing:
        lines += [f"Each cell starts from a copy of the loaded model: {copies[len(copies) // 2]:.2f} s (median) "
                  f"to copy it in memory against {timing['load_seconds']:.2f} s to load it.", ""]
    domain_heads = [f"{name} ppl" for name in names] if len(names) > 1 else []
    task_heads = [*tasks, "task mean", "retention", "tasks vs best"] if tasks else []
    head = ["rank", "method", "blocks removed", "params", "held-out ppl", "vs dense", *domain_heads, *task_heads,
            "better than", "vs removal of its blocks", "decode speed-up", "wall s", "vanilla"]
    for drop in sorted({row["drop"] for row in cells.values()}):
        rows = sorted(((k, r) for k, r in cells.items() if r["drop"] == drop), key=lambda kr: kr[1]["heldout_ppl"])
        lines += [f"## Drop {drop}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        domain_cells = [f"{dense['domains'][n]:.3f}" for n in names] if len(names) > 1 else []
        lines.append(f"| - | dense | - | {dense['params']:,} | {dense['heldout_ppl']:.3f} | 1.000 | "
                     + "".join(f"{v} | " for v in domain_cells + _task_cells(dense, tasks, figures["dense"], "-"))
                     + "- | - | " + ("1.00" if "decode_s" in dense else "-") + " | - | yes |")
        for rank, (key, row) in enumerate(rows, 1):
            speed = f"{row['decode_speedup']:.2f}" if "decode_speedup" in row else "-"
            domain_cells = [f"{row['domains'][n]:.3f} ({100 * (row['domains'][n] / dense['domains'][n] - 1):+.1f}%)"
                            for n in names] if len(names) > 1 else []
            beaten = ", ".join(cells[k]["method"] for k in analysis["better_than"][key]) or "-"
            mark = STALE_MARKS.get(states[key], "")
            lines.append(f"| {rank} | {row['method']}{mark} | {_removed(row)} | {row['params']:,} | "
                         f"{row['heldout_ppl']:.3f} | {row['heldout_ppl'] / dense['heldout_ppl']:.3f} | "
                         + "".join(f"{v} | " for v in domain_cells + _task_cells(
                             row, tasks, figures[key], analysis["vs_best_tasks"].get(key, "-")))
                         + f"{beaten} | {_versus(analysis, key)} | {speed} | {row['seconds']:.1f} | "
                         f"{'yes' if row['vanilla'] else 'no'} |")
        lines.append("")
    lines += [f"![held-out perplexity vs blocks removed]({PPL_PNG})", "", f"![chosen blocks]({BLOCKS_PNG})", ""]
    if results.get("oracle"):
        lines += ["## Oracle", "", results["oracle"]["table"], ""]
    return "\n".join(lines)


def _versus(analysis: dict, key: str) -> str:
    versus = analysis.get("vs_removal", {})
    if key not in versus:
        return "-"
    entry = versus[key]
    if entry is None:
        return "no removal row"
    higher = entry["perplexity_higher_on"]
    ppl = "ppl lower on all" if not higher else f"ppl higher on {', '.join(higher)}"
    if "gap" not in entry:
        return ppl if "verdict" not in entry else f"{entry['verdict']}; {ppl}"
    return f"{100 * entry['gap']:+.1f} ± {100 * entry['gap_stderr']:.1f} ({entry['verdict']}); {ppl}"


def _versus_note(analysis: dict) -> list[str]:
    if not analysis.get("vs_removal"):
        return []
    quality = "retention" if analysis["task_quality"] == "retention" else "task mean"
    return [f"\"vs removal of its blocks\": a repaired row against the plain removal of exactly the blocks it "
            f"removed, at the same drop: the paired gap in {quality} (points; tie under {TIE_SE:g} standard errors) "
            "and the domains where its perplexity is not lower. \"no removal row\": that removal did not run "
            "here, so the repair has no baseline (a recipe with the same score and selection and `replace: none` "
            "gives it).", ""]


def _wall_time_note(timing: dict) -> list[str]:
    runs = timing.get("runs", [])
    if not runs:
        return []
    total = sum(run.get("seconds", 0.0) for run in runs)
    measured = sum(run.get("removal_sets_measured", 0) for run in runs)
    return [f"Wall time so far: {total / 3600:.2f} h over {len(runs)} invocation(s) and "
            f"{sum(run.get('cells', 0) for run in runs)} cell(s) (each invocation loads the model, draws and "
            f"scores the calibration once: {', '.join(str(run.get('setup_seconds', '?')) for run in runs)} s). "
            f"Calibration passes with blocks or sub-layers removed (SLEB, the oracle, measured rankings): "
            f"{measured} set(s) measured, each once; every later use reads it back (`measurements.json`).", ""]


def _removed(row: dict) -> str:
    """The blocks a cell removed; for a sub-layer method, its sub-layers by kind and the blocks gone whole."""
    if "sublayers" not in row:
        return str(row["dropped"])
    kinds = [u.split(".")[1] for u in row["sublayers"]]
    return (f"{kinds.count('attention')} attention + {kinds.count('mlp')} MLP sub-layers "
            f"(whole: {row['dropped'] or 'none'})")


def _task_rows(results: dict) -> str:
    """Which rows of each task the figures read: they differ between a selection run and a report."""
    return f" ({describe_rows(results['task_limit'])})" if "task_limit" in results else ""


def _head_caveat(results: dict) -> str:
    """A warning for figures read from the head of each task: a file's order is not a sample of the task."""
    limit = results.get("task_limit")
    if limit is None or isinstance(limit, str):
        return ""
    return (" The first rows of a task need not be a sample of it (HellaSwag's first 2,565 of 10,042 rows are all "
            "ActivityNet captions, and two thirds of the task is WikiHow): for figures that speak for whole tasks, "
            "draw the rows across each (`--limit 1000~:`).")


def _task_note(analysis: dict, results: dict) -> list[str]:
    if not analysis["tasks"]:
        return ["\"Better than\": lower perplexity on every held-out domain.", ""]
    counted = ", ".join(analysis["retention_tasks"])
    excluded = "; ".join(f"{t}: {why}" for t, why in analysis["excluded_tasks"].items())
    quality = "retention" if analysis["task_quality"] == "retention" else "task mean"
    chance = ", ".join(f"{t} {c:g}" for t, c in analysis["chance"].items())
    retention = (f"Retention = sum over {counted} of (accuracy - chance) / the same sum for the dense model"
                 if counted else "Retention: none, no task has the dense model clearly above chance")
    return [f"Tasks{_task_rows(results)}: accuracy ± lm-eval's standard error, in %. {retention} (chance: {chance})"
            + (f"; left out: {excluded}" if excluded else "") + f". \"Tasks vs best\" compares the {quality} with "
            f"the best at the same drop: tie when the gap is under {TIE_SE:g} standard errors of the paired "
            f"difference (row by row on the same rows). \"Better than\": "
            f"lower perplexity on every domain and a {quality} higher by {TIE_SE:g} standard errors or more; "
            "rows without task figures are compared with each other on perplexity alone." + _head_caveat(results), ""]


def _task_cells(row: dict, tasks: list[str], figures: dict, vs_best: str) -> list[str]:
    if not tasks:
        return []
    cells = []
    for task in tasks:
        value = row.get("tasks", {}).get(task)
        cells.append("-" if value is None else f"{100 * value:.1f} ± {100 * _stderr(row, task):.1f}")
    for quality in ("task_mean", "retention"):
        cells.append(f"{100 * figures[quality]:.1f} ± {100 * figures[f'{quality}_stderr']:.1f}"
                     if quality in figures else "-")
    return [*cells, vs_best]


def _task(row: dict, task: str) -> str:
    value = row.get("tasks", {}).get(task)
    return "-" if value is None else f"{value:.3f}"


def plot_perplexity(results: dict, path: Path) -> None:
    """PNG: held-out perplexity against blocks removed, one line per method, dense as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    dense = results["dense"]["heldout_ppl"]
    methods = sorted({row["method"] for row in results["cells"].values()})
    for name in methods:  # every line starts at the dense model (0 blocks removed)
        rows = sorted((r for r in results["cells"].values() if r["method"] == name), key=lambda r: r["drop"])
        ax.plot([0] + [r["drop"] for r in rows], [dense] + [r["heldout_ppl"] for r in rows], marker="o", label=name)
    ax.axhline(dense, color="black", ls="--", lw=1, label="dense")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xticks([0] + sorted({row["drop"] for row in results["cells"].values()}))
    ax.set_xlabel("blocks removed")
    ax.set_ylabel("held-out perplexity (log)")
    ax.set_title(f"{results['setup']['model']}: held-out perplexity by method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    write_file_atomic(path, fig.savefig)
    plt.close(fig)


def plot_blocks(results: dict, path: Path, blocks: int) -> None:
    """PNG: which blocks each method removed at each drop, one row per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(results["cells"].values(), key=lambda r: (r["drop"], r["method"]))
    grid = torch.zeros(len(rows), blocks)
    for i, row in enumerate(rows):
        grid[i, row["dropped"]] = 1
        for unit in row.get("sublayers", []):  # half a block for each sub-layer removed alone
            block = int(unit.split(".")[0])
            if block not in row["dropped"]:
                grid[i, block] += 0.5
    fig, ax = plt.subplots(figsize=(max(5, blocks * 0.3 + 3), max(2, len(rows) * 0.25 + 1)), dpi=120)
    ax.imshow(grid.numpy(), cmap="Greys", aspect="auto", vmin=0, vmax=1)
    ax.set_yticks(range(len(rows)), [f"{r['method']} (drop {r['drop']})" for r in rows], fontsize=7)
    ax.set_xticks(range(blocks), [str(b) for b in range(blocks)], fontsize=7)
    ax.set_xlabel("block (black: removed; grey: its attention or MLP alone)")
    ax.set_title("blocks each method removed")
    fig.tight_layout()
    write_file_atomic(path, fig.savefig)
    plt.close(fig)


def write_reports(results: dict, out: Path, blocks: int, plots: bool = True) -> None:
    """results.json, README.md and (unless ``plots`` is False) the plots, each replaced whole."""
    results["analysis"] = analyse(results)
    write_text(out / RESULTS, json.dumps(results, indent=2) + "\n")
    if results["cells"]:
        write_text(out / README, leaderboard(results) + "\n")
        if plots:
            plot_perplexity(results, out / PPL_PNG)
            plot_blocks(results, out / BLOCKS_PNG, blocks)


def compare(args: argparse.Namespace) -> dict:
    """Run every unfinished cell of the comparison ``args`` asks for; the results."""
    if args.out is None:
        raise LayercutError("--out is required: the folder for results.json, README.md and the plots")
    drops = parse_drops(args.drop)
    methods = parse_methods(args.methods)
    for name, path in methods.items():  # every recipe checked before the model loads
        config = cell_config(path, drops[-1], args, None)
        config.build_steps()
        for drop in drops:
            check_drop_for_method(config.replace.method, drop, fix=f"{name} cannot run at this drop; take {drop} out "
                                  f"of --drop, or leave {name} out of --methods")
    preflight(cell_config(next(iter(methods.values())), drops[-1], args, None))
    domains = plan_domains(args)
    out = Path(args.out)
    results = open_results(out, setup_of(args), args.overwrite)
    check_task_limit(results, args)
    reconcile_domains(results, domains)
    tasks = requested_tasks(args)

    def unfinished(name: str, path: Path, drop: int) -> str | None:
        """"run" (no row, or one of another recipe), "complete" (a row lacking domains or tasks) or None."""
        row = results["cells"].get(cell_key(name, drop))
        if row is None or row.get("recipe_digest") != recipe_digest(path):
            return "run"
        return None if _has_domains(row, domains) and _has_tasks(row, tasks) else "complete"

    todo = [(name, path, drop, need) for drop in drops for name, path in methods.items()
            if (need := unfinished(name, path, drop))]
    need_oracle = args.oracle and not results.get("oracle")
    if not todo and not need_oracle and _has_domains(results["dense"], domains) and _has_tasks(results["dense"], tasks):
        logger.info("every cell of %s is finished", out)
        refresh_rows(results, [domain.name for domain in domains])
        write_reports(results, out, results["dense"]["blocks"])
        return results
    begun = started = time.perf_counter()
    # one entry per invocation: a comparison resumed over several processes sums them for its wall time
    run = {"cells": 0, "seconds": 0.0}
    results["timing"].setdefault("runs", []).append(run)
    loaded = load_config_from_args(args).load()
    results["timing"]["load_seconds"] = round(time.perf_counter() - started, 2)
    base = cell_config(next(iter(methods.values())), drops[-1], args, None)
    started = time.perf_counter()
    scored = score_calibration(loaded, base, cosine_pairs="all")  # serves every score and selection
    results["timing"]["score_seconds"] = round(time.perf_counter() - started, 2)
    extra = {"load": setup_of(args)["load"], "batch_size": args.batch_size}
    digest = calibration_digest(weights_fingerprint(loaded.model) or args.model, scored.calibration.token_ids, extra)
    check_calibration(results, digest, out)
    results["calibration"] = {**scored.calibration.describe(), "digest": digest}
    # SLEB's passes, the oracle's and the sub-layer costs outlive this process: a resumed run measures no set twice
    store = MeasurementStore(out, calibration_digest(loaded.model, scored.calibration.token_ids, extra))
    reused = run["removal_sets_read_back"] = store.attach(scored.memo)
    if reused:
        logger.info("%d removal measurements read back from %s", reused, store.path)
    run["setup_seconds"] = round(time.perf_counter() - begun, 2)
    heldout = Heldout(args, scored, loaded.tokenizer, domains)
    results["heldout"] = heldout.describe
    if results["dense"] is None:
        results["dense"] = measure(loaded.model, loaded.tokenizer, heldout, args)
    else:  # a domain added since: measure the dense model on it alone
        missing = [name for name in heldout.names() if name not in results["dense"].get("domains", {})]
        measure_domains(loaded.model, heldout, results["dense"], missing)
        measure_tasks(loaded.model, loaded.tokenizer, args, results["dense"])
    refresh_rows(results, heldout.names())
    if need_oracle:
        started = time.perf_counter()
        oracle = run_oracle(loaded.model, scored.calibration.token_ids, scored.scores, args.batch_size,
                            cache=removal_cache(scored.memo))
        results["oracle"] = {**oracle.as_dict(), "table": oracle_table(oracle, scored.scores)}
        write_text(out / ORACLE_MD, results["oracle"]["table"] + "\n")
        run["oracle_seconds"] = round(time.perf_counter() - started, 2)
    write_reports(results, out, results["dense"]["blocks"], plots=False)
    done = len(methods) * len(drops) - len(todo)
    try:
        with tqdm(total=len(methods) * len(drops), initial=done, desc="compare", unit="cell") as bar:
            for name, path, drop, need in todo:
                bar.set_postfix_str(f"{name} drop {drop}")
                key = cell_key(name, drop)
                completed = None
                if need == "complete":
                    completed = complete_cell(results["cells"][key], out / CELLS / f"{name}-drop{drop}", args, heldout)
                if completed is not None:
                    results["cells"][key] = completed
                    run["cells_completed"] = run.get("cells_completed", 0) + 1
                else:
                    results["cells"][key] = run_cell(name, path, drop, args, loaded, scored, heldout, out,
                                                     results["dense"])
                    run["cells"] += 1
                refresh_rows(results, heldout.names())
                run["seconds"] = round(time.perf_counter() - begun, 2)
                write_reports(results, out, results["dense"]["blocks"], plots=False)  # a crash keeps the cell
                bar.update()
    finally:  # also after Ctrl-C: the plots show the cells finished so far
        run["seconds"] = round(time.perf_counter() - begun, 2)
        run["removal_sets_measured"] = sum(len(cache) for cache in store.caches.values()) - reused
        write_reports(results, out, results["dense"]["blocks"])
    return results


def print_summary(results: dict) -> None:
    """Best method per drop, one line each."""
    dense = results["dense"]
    print(f"dense: held-out perplexity {dense['heldout_ppl']:.3f}, {dense['params']:,} parameters")
    for drop in sorted({row["drop"] for row in results["cells"].values()}):
        rows = sorted((r for r in results["cells"].values() if r["drop"] == drop), key=lambda r: r["heldout_ppl"])
        best = rows[0]
        line = (f"drop {drop}: best {best['method']} {best['heldout_ppl']:.3f} (x{best['heldout_ratio']:.3f}) "
                f"of {len(rows)} method(s)")
        analysis = results.get("analysis", {})
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
        unpaired = [results["cells"][k]["method"] for k, v in sorted(analysis.get("vs_removal", {}).items())
                    if v is None and results["cells"][k]["drop"] == drop]
        if unpaired:
            line += (f"; no removal of the blocks of {', '.join(unpaired)} ran (a recipe with their score and "
                     "selection and replace: none gives it)")
        print(line)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the comparison CLI; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.methods.strip() == "list":
        print(method_list())
        return 0
    apply_threads(args)
    results = compare(args)
    print_summary(results)
    print(f"wrote {args.out}/{README}")
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
