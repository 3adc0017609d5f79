"""The card stage: ``OUT/README.md``, rendered once from sections, and the commands that reproduce the checkpoint.

The sections: the hub's header and the checkpoint's replacements and use (``prune.checkpoint.write.card_sections``
of the final ``layercut.json``, so a healed checkpoint's lines speak of the healed model), then ship's own: what
was chosen and why, what was lost (each row naming the file it measured), the speed, how to rebuild it.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from pathlib import Path

from eval.bench.serving import first_difference
from eval.speed.engines import REFERENCE, display_name
from prune.checkpoint.write import card_sections, portable, portable_name, render_card
from prune.pipeline.config import PruneConfig
from prune.replace import METHODS
from ship.config import ShipConfig
from ship.heal import Healing
from ship.shortlist import Shortlist
from ship.verify import ORIGINAL, SHIPPED, SLIM, Verified
from ship.work import HELDOUT

CARD = "README.md"


def ship_card(config: ShipConfig, report: dict, shortlist: Shortlist, verified: Verified | None,
              chosen: PruneConfig, times: dict[str, float], healed: Healing | None = None,
              gguf: str | None = None, planned: dict[str, float] | None = None) -> str:
    """The page of a shipped checkpoint: the choice and its evidence, the loss, the speed, the commands.

    ``report``: the shipped checkpoint's ``layercut.json``; ``gguf``: the GGUF's path inside ``OUT``;
    ``planned``: the planner's seconds per stage, said beside the measured ones.
    """
    name = config.name
    prune = card_sections(report, plain=True, name=name)
    title = portable_name(report.get("model_name"), report.get("source_model"))
    before, after = report["num_blocks_before"], report["num_blocks_after"]
    best = shortlist.best
    engine = display_name(config.engine)
    sections = {
        "front": prune["front"],
        "title": [f"# {title}, {before} -> {after} blocks, for {engine}", ""],
        "made": [f"Made with `prune.ship` in {sum(times.values()) / 60:.1f} min ("
                 + ", ".join(f"{stage} {seconds:.0f} s" + (f" (planned {planned[stage]:.0f} s)"
                                                            if planned and stage in planned else "")
                             for stage, seconds in times.items())
                 + f"): blocks {best.blocks} removed, {_repair_words(best.repair)}; a plain "
                 f"{report['architecture']} checkpoint ({best.params:,} parameters, the original "
                 f"{shortlist.params_before:,}). Per-block scores and every setting are in `layercut.json`.", ""],
        "chosen": _chosen(shortlist, healed),
        "lost": _lost(config, report, verified, gguf),
        "speed": _speed(config, verified, before, after, gguf),
        "replacements": prune["replacements"],
        "use": prune["use"] + ([f"The GGUF for {engine} is `{gguf}`.", ""] if gguf else []),
        "reproduce": ["## Reproduce", "", "```bash", ship_command(config),
                      "# the checkpoint before healing, without the shortlist:" if healed and healed.kept
                      else "# the same checkpoint, without the shortlist:", prune_command(chosen), "```"],
    }
    # prune's sections are portable already (its report was); ship's own lines may name this machine's files
    own = {name: [portable(line) for line in lines] for name, lines in sections.items()
           if name not in ("front", "replacements", "use")}
    return render_card({**sections, **own})


def _chosen(shortlist: Shortlist, healed: Healing | None) -> list[str]:
    lines = ["## What was chosen, and why", "",
             f"Every candidate was fitted on calibration rows and measured on {_rows(shortlist)} it was not fitted "
             "on: the KL divergence of its next-token distribution from the original model's (the choice: "
             "lowest), and its perplexity"
             + (f" (the original's: {shortlist.dense_ppl:.3f})." if shortlist.dense_ppl else "."), "",
             "| | blocks removed | repair | chosen by | parameters | KL | perplexity | note |",
             "|---|---|---|---|---|---|---|---|"]
    for rank, index in enumerate(shortlist.ranked(), 1):
        c = shortlist.candidates[index]
        mark = "**chosen**" if index == shortlist.chosen else str(rank)
        lines.append(f"| {mark} | {_blocks(c.blocks)} | {c.repair} | {', '.join(c.chosen_by)} | "
                     f"{_count(c.params)} | {_num(c.kl, 4)} | {_num(c.ppl, 3)} | {c.note} |")
    for repair, why in shortlist.not_applicable.items():
        lines.append(f"\n`--replace {repair}` does not apply to this model: {why}")
    if healed is not None:
        lines += ["", healed.words()]
    return lines + [""]


def _lost(config: ShipConfig, report: dict, verified: Verified | None, gguf: str | None) -> list[str]:
    lines = ["## What was lost", ""]
    if verified is None:
        heldout = report.get("heldout")
        if heldout:
            stage = " before healing" if heldout.get("stage") else ""  # prune.run measured it; the heal came after
            lines.append(f"Held-out rows of the calibration source ({heldout['tokens']:,} tokens), in transformers"
                         f"{stage}: perplexity {heldout['original']:.3f} -> {heldout['pruned']:.3f} "
                         f"(x{heldout['ratio']:.3f})"
                         + (f"; removing the same blocks with nothing in their place: {heldout['removal']:.3f} "
                            f"(x{heldout['removal_ratio']:.3f})." if "removal" in heldout else "."))
        return lines + ["", "Not verified in an engine (--no-verify).", ""]
    shipped = _shipped_name(config, gguf)
    engine = display_name(config.engine)
    header = "| held-out text | original | this checkpoint | ratio |"
    if config.engine != REFERENCE:
        header += f" {shipped} in {engine} | vs transformers | same greedy ids |"
    header += " original's greedy tokens kept |"
    writer = f"`{shipped}` in {engine}" if config.engine != REFERENCE else "this checkpoint"
    lines += [f"Perplexity on each held-out text ({_texts(verified)}): the original and this checkpoint in "
              "transformers"
              + (f", and the file that ships, `{shipped}`, in {engine} on the same token ids" if config.engine
                 != REFERENCE else "") + ". Multiple choice and perplexity score text someone else wrote; the last "
              f"column is what the model writes: of the original's greedy continuation of the text's opening, how "
              f"many tokens {writer} writes the same before the first that differs.", "", header,
              "|" + "---|" * (header.count("|") - 1)]
    for domain, serving in verified.domains.items():
        lines.append(_domain_row(domain, serving, config.engine))
    lines.append("")
    measured = verified.files.get("no_repack") or {}
    if measured:
        checks = " and ".join(f"the {check} check" for check in measured)
        lines += [f"{engine} loaded its files with its extra buffer types off in {checks} "
                  f"({'; '.join(dict.fromkeys(measured.values()))}): the weights as stored, not repacked for this CPU; "
                  f"pass {engine}'s own --no-repack where you serve them if it crashes there too.", ""]
    return lines + _fidelity(verified.fidelity) + _tasks(config, verified.tasks, gguf)


def _fidelity(figures: dict) -> list[str]:
    """The generation fidelity paragraph (``eval.bench.checks.FidelityCheck``'s figures), or why there is none."""
    if not figures:  # a run verified before the check existed
        return []
    if "skipped" in figures:
        return [f"Generation fidelity not measured ({figures['skipped']}: each greedy token reads every block "
                "from disk).", ""]
    return [f"What it writes: after {figures['prompts']} prompts of {figures['prompt_tokens']} tokens cut from the "
            f"held-out texts, this checkpoint (in transformers) and the original each wrote {figures['new_tokens']} "
            f"greedy tokens. The original gives this checkpoint's text a negative log-likelihood of "
            f"{figures['nll']:.3f} ± {figures['nll_stderr']:.3f} per token, against {figures['own_nll']:.3f} for its "
            f"own (lower: closer to what the original would write); the checkpoint writes "
            f"{figures['kept']:.1%} of the original's tokens before the first that differs.", ""]


def _tasks(config: ShipConfig, figures: dict, gguf: str | None) -> list[str]:
    """The lm-eval tasks' table (``eval.bench.checks.TasksCheck``'s figures); nothing without ``--tasks``."""
    if not figures.get("tasks"):
        return []
    other = f" (not `{gguf}`)" if config.gguf and gguf else ""
    lines = [f"lm-eval tasks, in transformers on this checkpoint{other} and on the original, on the same rows "
             f"({figures['rows']}): kept is the checkpoint's score over the original's, and the gap is paired, its "
             "standard error from the row-by-row differences.", "",
             "| task | metric | original | this checkpoint | kept | gap ± SE (points) | rows |",
             "|---|---|---|---|---|---|---|"]
    for task, row in figures["tasks"].items():
        kept = "" if row["kept"] is None else f"{row['kept']:.1%}"
        gap = f"{100 * row['gap']:+.1f} ± {100 * row['gap_stderr']:.1f}" + ("" if row["paired"] else " (unpaired)")
        lines.append(f"| {task} | {row['metric']} | {row['original']:.3f} ± {row['original_stderr']:.3f} | "
                     f"{row['model']:.3f} ± {row['model_stderr']:.3f} | {kept} | {gap} | {_count(row['rows'])} |")
    lines.append("")
    excluded = "; ".join(f"{task}: {why}" for task, why in figures.get("excluded_tasks", {}).items())
    if "retention" in figures:
        lines += [f"Accuracy above chance kept over {', '.join(figures['retention_tasks'])}: "
                  f"{figures['retention']:.1%} ± {figures['retention_stderr']:.1%} (the sum of score - chance, over "
                  "the original's)" + (f"; not counted: {excluded}." if excluded else "."), ""]
    elif excluded:
        # each reason in its own words: the original near chance, or a task with no chance level known
        lines += [f"No retention above chance: no task counts ({excluded}).", ""]
    for task, row in figures["tasks"].items():
        if "max_gen_toks" in row:  # a generating task's figure holds for its token budget only
            lines += [f"{task} answers each prompt{' through the chat template' if row['chat'] else ''}, greedily, "
                      f"within {row['max_gen_toks']} new tokens: an answer cut there fails the checks that need a "
                      "longer one.", ""]
    return lines


def _speed(config: ShipConfig, verified: Verified | None, before: int, after: int, gguf: str | None) -> list[str]:
    if verified is None:
        return []
    engine = display_name(config.engine)
    which = f"`{gguf}`" if config.gguf and gguf else "This checkpoint"
    if config.gguf and config.gguf_type != "f32" and verified.speed.get("ratios"):
        which += f" ({config.gguf_type}, against the original converted and quantized the same way: the ratio is the " \
                 "depth's alone)"
    return [f"## Speed in {engine}", "", f"{which} against the original. " + _speed_words(verified.speed, before,
                                                                                          after), ""]


def _shipped_name(config: ShipConfig, gguf: str | None) -> str:
    return gguf if config.gguf and gguf else "this folder"


def ship_command(config: ShipConfig) -> str:
    """The ``prune.ship`` command of ``config``, as a user types it: every option that is not its default."""
    p = config.prune
    budget = (f"--drop {p.drop}" if p.drop is not None else f"--target-speedup {p.target_speedup}"
              if p.target_speedup is not None else f"--target-params {p.target_params}")
    parts = ["python -m prune.ship", f"--model {_quote(p.load.model)}", budget, f"--engine {config.engine}"]
    parts += _load_flags(p) + _budget_flags(p)
    if config.time_budget is not None:
        parts.append(f"--time-budget {config.time_budget:g}s")
    parts += [f"--heldout {_quote(text)}" for text in config.heldout]
    if config.gguf and config.gguf_type != "f32":
        parts.append(f"--gguf-type {config.gguf_type}")
    if config.no_repack:
        parts.append("--no-repack")
    defaults = ShipConfig.__dataclass_fields__
    # not --processes nor --threads: on any count the same checkpoint, within float rounding (ShipConfig.settings)
    for flag, key in (("--heal-steps", "heal_steps"), ("--repeats", "speed_repeats"), ("--prompt-len", "prompt_len"),
                      ("--new-tokens", "new_tokens")):
        if getattr(config, key) != defaults[key].default:
            parts.append(f"{flag} {getattr(config, key)}")
    parts += [f"--{key.replace('_', '-')} {shlex.quote(_number(value))}" for key, value in config.heal_train.items()]
    if config.heal_data:
        parts.append(f"--heal-data {_quote(portable(config.heal_data))}")
        if config.heal_samples != defaults["heal_samples"].default:
            parts.append(f"--heal-samples {config.heal_samples}")
    if not config.verify:
        parts.append("--no-verify")
    parts += _task_flags(config)
    parts += _data_flags(p)
    parts.append(f"--out {_quote(config.name)}")
    return " ".join(parts)


def prune_command(config: PruneConfig) -> str:
    """The ``prune.run`` command that writes the chosen checkpoint."""
    parts = ["python -m prune.run", f"--model {_quote(config.load.model)}", f"--drop {config.drop}"]
    if config.select != "topk":
        parts.append(f"--select {config.select}")
    if config.score != "linearity":
        parts.append(f"--score {config.score}")
    parts.append(f"--replace {config.replace.method}")
    if config.replace.fit_rows != "all":
        parts.append(f"--fit-rows {config.replace.fit_rows}")
    return " ".join(parts + _load_flags(config) + _budget_flags(config) + _data_flags(config) + ["--out slim/"])


def _task_flags(config: ShipConfig) -> list[str]:
    """``--tasks``, and its ``--limit`` and ``--data-dir`` where given."""
    if not config.tasks:
        return []
    flags = [f"--tasks {_quote(','.join(config.tasks))}"]
    if config.limit is not None:
        limit = _number(config.limit)
        # argparse reads "--limit -500:" as two flags: a range from the end goes in one word
        flags.append(f"--limit={shlex.quote(limit)}" if limit.startswith("-") else f"--limit {shlex.quote(limit)}")
    if config.data_dir is not None:
        flags.append(f"--data-dir {_quote(config.data_dir)}")
    return flags


def _load_flags(config: PruneConfig) -> list[str]:
    """The loading flags that differ from their defaults."""
    load, defaults = config.load, type(config.load)()
    flags = [f"--{key} {_quote(str(getattr(load, key)))}" for key in ("dtype", "device", "tokenizer")
             if getattr(load, key) != getattr(defaults, key)]
    return flags + [f"--{key.replace('_', '-')}" for key in ("load_in_4bit", "load_in_8bit") if getattr(load, key)]


def _budget_flags(config: PruneConfig) -> list[str]:
    """``--protect`` and ``--batch-size`` where they differ from their defaults."""
    defaults = PruneConfig.__dataclass_fields__
    return [f"--{key.replace('_', '-')} {_quote(str(getattr(config, key)))}" for key in ("protect", "batch_size")
            if getattr(config, key) != defaults[key].default]


def _data_flags(config: PruneConfig) -> list[str]:
    """The calibration flags that differ from their defaults."""
    data, defaults = config.data, type(config.data)()
    return [f"--{key.replace('_', '-')} {_quote(str(getattr(data, key)))}"
            for key in ("data", "samples", "seq_len", "seed", "text_field", "heldout_samples")
            if getattr(data, key) != getattr(defaults, key)]


def _domain_row(domain: str, serving: dict, engine: str) -> str:
    original, slim = _row(serving, ORIGINAL, REFERENCE), _row(serving, SLIM, REFERENCE)
    if not (original and slim):
        return f"| {domain} | not measured | | |"
    cells = f"| {domain} | {original['ppl']:.3f} | {slim['ppl']:.3f} | x{slim['ppl'] / original['ppl']:.3f} |"
    if engine == REFERENCE:
        return cells + f" {_kept(slim.get('greedy'), original.get('greedy'))} |"
    served = _row(serving, SHIPPED, engine)
    if not served:
        why = ((serving.get("rows") or {}).get(SHIPPED, {}).get(engine) or {}).get("why", "not measured")
        return cells + f" {why} | | | |"
    gap = f"{(served['ppl'] / slim['ppl'] - 1) * 100:+.3f} %"
    return (cells + f" {served['ppl']:.3f} | {gap} | {_greedy(served.get('greedy'), slim.get('greedy'))} | "
            f"{_kept(served.get('greedy'), original.get('greedy'))} |")


def _kept(mine: list | None, original: list | None) -> str:
    """How many of the original's greedy ids a slim model writes the same before the first that differs."""
    if not mine or not original:
        return ""
    return f"{first_difference(mine, original)} of {len(original)}"


def _greedy(mine: list | None, theirs: list | None) -> str:
    """``yes``, or where the shipped file's greedy ids first part from transformers'."""
    if not mine or not theirs:
        return ""
    if mine == theirs:
        return f"yes ({len(mine)} tokens)"
    return f"**no**: from token {first_difference(mine, theirs)} of {len(theirs)}"


def _row(serving: dict | None, model: str, engine: str) -> dict | None:
    """The row of ``model`` in ``engine`` (``eval.bench serving``'s ``rows``), if it ran."""
    row = (serving or {}).get("rows", {}).get(model, {}).get(engine)
    return row if row and row.get("runs") and row.get("ppl") is not None else None


def _speed_words(speed: dict, before: int, after: int) -> str:
    ideal = before / after
    ratios = speed.get("ratios") or []
    if not ratios:
        why = f", {speed['skipped']}" if speed.get("skipped") else ""
        return f"No speed figures{why} (the ideal decode speed-up is L/(L-k) = {ideal:.3f}x)."
    r = ratios[0]
    repeats = speed.get("options", {}).get("repeats", "")
    return (f"{repeats} timed rounds: prefill x{r['prefill']:.3f}, decode x{r['decode']:.3f} (ratio of median "
            f"throughputs; ideal L/(L-k) = {ideal:.3f}x; paired rounds: prefill x{r['prefill_paired']['min']:.3f}-"
            f"x{r['prefill_paired']['max']:.3f}, decode x{r['decode_paired']['min']:.3f}-"
            f"x{r['decode_paired']['max']:.3f}).")


def _texts(verified: Verified) -> str:
    texts = verified.heldout or []
    if len(texts) == 1 and Path(texts[0]).name == HELDOUT:
        return "the held-out rows of the calibration source, as text"
    return ", ".join(f"`{portable(text)}`" for text in texts)


def _repair_words(repair: str) -> str:
    return "nothing in their place" if repair == "none" else f"repaired by `--replace {repair}` " \
        f"({METHODS[repair].description})"


def _rows(shortlist: Shortlist) -> str:
    rows = shortlist.measuring_rows
    return f"{rows[0]} x {rows[1]} calibration tokens" if rows else "calibration rows"


def _blocks(blocks: Sequence[int]) -> str:
    return ", ".join(str(b) for b in blocks)


def _count(value) -> str:
    return "" if value is None else f"{value:,}"


def _num(value, digits: int) -> str:
    return "" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def _number(value) -> str:
    """A flag's value as typed: ``128`` for 128.0, every digit where ``:g`` would round it (it must parse back)."""
    if isinstance(value, float) and float(f"{value:g}") == value:
        return f"{value:g}"
    return repr(value) if isinstance(value, float) else str(value)


def _quote(text: str) -> str:
    return shlex.quote(str(portable(str(text))))
