"""Write a slimmed checkpoint: weights, tokenizer, ``layercut.json`` and a model card, all or nothing.

Everything is written into a temporary sibling folder that is renamed into place at the end, so a
crash or Ctrl-C never leaves a half-written checkpoint under the user's ``--out``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prune.errors import LayercutError

logger = logging.getLogger(__name__)

REPORT_FILE = "layercut.json"


def read_report(folder: str | Path) -> dict:
    """The ``layercut.json`` of a checkpoint folder, or an empty dict when it has none (or is no folder).

    Raises:
        LayercutError: the file exists but is not valid JSON (a report we cannot read is never guessed).
    """
    path = Path(folder).expanduser() / REPORT_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise LayercutError(f"{path} is not valid JSON ({err.msg}): re-export the checkpoint with prune.run") from None


def check_output_dir(out: str | Path, overwrite: bool) -> Path:
    """Fail early (before any heavy work) if ``out`` is a non-empty folder and overwrite is off."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise LayercutError(f"--out {out} is a file: pass a folder path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise LayercutError(f"--out {out} exists and is not empty: pass --overwrite or choose another folder")
    _check_writable(path)
    return path


def _check_writable(path: Path) -> None:
    """Fail now, not after hours of work, when nothing can be written where ``path`` would go."""
    ancestor = path.parent.resolve()
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        probe = tempfile.mkdtemp(prefix=".layercut-probe-", dir=ancestor)
    except OSError as err:
        raise LayercutError(
            f"--out {path}: cannot write in {ancestor} ({err.strerror}); choose another folder"
        ) from None
    os.rmdir(probe)


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``out``; on success it replaces ``out``, on error it is removed."""
    target = check_output_dir(out, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield staging
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old)
        else:
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def write_file_atomic(path: Path, write) -> None:
    """Call ``write(staging)`` on a sibling path, then rename it onto ``path``: a reader never sees half a file."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(staging)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def library_versions() -> dict[str, str]:
    """Versions of the libraries that shape a checkpoint, for the report."""
    import importlib.metadata as metadata

    versions = {"python": platform.python_version()}
    for name in ("layercut", "torch", "transformers", "accelerate", "peft"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def write_json(path: Path, data: dict) -> None:
    """Pretty JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _what_removed(report: dict) -> str:
    units = (report.get("sublayers") or {}).get("units")
    return f"{len(units)} attention/MLP sub-layers" if units else f"{len(report.get('dropped', []))} blocks"


def model_card(report: dict, plain: bool = True) -> str:
    """A Hugging Face model card (README.md) describing what was removed and why.

    ``plain``: the checkpoint loads with plain transformers (False for one carrying replacement maps,
    whose writer adds how to load it).
    """
    dropped = report.get("dropped", [])
    lines = [
        "---",
        f"base_model: {report.get('source_model', 'unknown')}",
        "library_name: transformers",
        "tags:",
        "- layercut",
        "- pruned",
        "---",
        "",
        f"# {Path(str(report.get('source_model', 'model'))).name} with {_what_removed(report)} removed",
        "",
        f"Made with layercut from `{report.get('source_model')}`: {report.get('num_blocks_before')} decoder blocks "
        f"-> {report.get('num_blocks_after')}. Removed blocks (0-based, original numbering): {dropped}."
        + (f" Removed sub-layers (block.kind, original numbering): {', '.join(report['sublayers']['units'])}."
           if report.get("sublayers") else ""),
        f"Selection: `{report.get('select')}` on score `{report.get('score')}`; "
        f"calibration data: {report.get('data', {}).get('source')} ({report.get('data', {}).get('tokens')} tokens).",
        "",
        f"Per-block scores and every setting are in `{REPORT_FILE}`.",
        "",
    ]
    replacements = report.get("replacements") or []
    if plain:
        lines += ["It is a plain checkpoint: `AutoModelForCausalLM.from_pretrained(path)` loads it, no custom code.",
                  ""]
    if replacements:
        lines += ["## Replacements", "", *(f"- {r}" for r in replacements), ""]
    lines += _distill_section(report.get("distill")) + _heldout_section(report.get("heldout"))
    return "\n".join(lines)


def _distill_section(distill: dict | None) -> list[str]:
    if not distill:
        return []
    config = distill.get("config", {})
    return [
        "## Distillation", "",
        f"Trained layerwise towards `{distill.get('teacher', 'the original model')}` for {distill.get('steps')} steps "
        f"(`--train {config.get('train', '?')}`, lr {config.get('lr', '?')}): loss {distill.get('first_loss')} -> "
        f"{distill.get('final_loss')}"
        + (f"; {fit}" if (fit := describe_generalisation(distill.get("generalisation"))) else "")
        + f". Every setting is under `distill` in `{REPORT_FILE}`.", "",
    ]  # fmt: skip


def describe_generalisation(summary: dict | None) -> str | None:
    """The one-line summary of a report's ``generalisation``.

    ``held-out loss 0.61 -> 0.42 (training sequences 0.60 -> 0.30; each read 16 times)``.
    """
    if not summary:
        return None
    held, seen = summary["held_out"], summary["training"]
    if "before" not in held or "after" not in held:
        return None
    since = f" from step {summary['before_step']}" if summary.get("before_step") else ""
    reads = f"; each read {summary['reads']:.3g} times" if summary.get("reads") else ""
    return (f"held-out loss{since} {held['before']['loss']:.4g} -> {held['after']['loss']:.4g} "
            f"(training sequences {seen['before']['loss']:.4g} -> {seen['after']['loss']:.4g}{reads})")


def _heldout_section(heldout: dict | None) -> list[str]:
    if not heldout:
        return []
    return [
        "## Held-out perplexity", "",
        f"On {heldout['tokens']} tokens of the calibration source that scoring and fitting never saw "
        f"(windows of {heldout['seq_len']}): original {heldout['original']:.3f}, this model {heldout['pruned']:.3f} "
        f"(x{heldout['ratio']:.3f}).", "",
    ]  # fmt: skip


def export_checkpoint(model, tokenizer, out: str | Path, report: dict, overwrite: bool = False, extra=None,
                      plain: bool = True) -> Path:
    """Save ``model`` and ``tokenizer`` with ``layercut.json`` and README.md into ``out`` atomically.

    Args:
        model: the (surgered) model.
        tokenizer: its tokenizer.
        out: destination folder.
        report: JSON-ready dict written as ``layercut.json`` and summarised in the model card.
        overwrite: replace a non-empty ``out``.
        extra: optional callable ``(staging_folder) -> None`` writing more files (plots, tables).
        plain: the checkpoint loads with plain transformers (the model card says so).
    """
    with atomic_directory(out, overwrite) as staging:
        logger.info("saving checkpoint to %s", out)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        write_json(staging / REPORT_FILE, report)
        (staging / "README.md").write_text(model_card(report, plain), encoding="utf-8")
        if extra is not None:
            extra(staging)
    return Path(out)
