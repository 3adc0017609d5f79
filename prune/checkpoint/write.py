"""Write a slimmed checkpoint: weights, tokenizer, ``layercut.json`` and a model card, all or nothing.

Everything is written into a temporary sibling folder that is renamed into place at the end, so a
crash, Ctrl-C or a full disk never leaves a half-written checkpoint under the user's ``--out`` (nor
touches the one already there). The folder and its files get the modes of any file the user writes
(``0o755`` / ``0o644`` under umask 022), not the private ones of a temporary folder.
"""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

from prune.atomic import atomic_directory, write_json
from prune.errors import LayercutError
from prune.loading.names import base_model_id, model_license
from prune.model.adapters import is_offloaded

logger = logging.getLogger(__name__)

REPORT_FILE = "layercut.json"
# a report's heldout "stage" when its figure was measured before a later distill.run
HELDOUT_BEFORE_DISTILL = "before distill.run"


def read_report(folder: str | Path) -> dict:
    """The ``layercut.json`` of a checkpoint folder, or an empty dict when it has none (or is no folder).

    Raises:
        LayercutError: the file exists but is not valid JSON (a report we cannot read is never guessed).
    """
    path = Path(folder).expanduser() / REPORT_FILE
    if not path.is_file():
        return {}
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        why = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
        raise LayercutError(f"{path} is damaged, not valid JSON ({why}): re-export the checkpoint with prune.run "
                            "or restore the file from a copy") from None
    if not isinstance(report, dict):
        raise LayercutError(f"{path} is damaged (a JSON {type(report).__name__}, not an object): re-export the "
                            "checkpoint with prune.run or restore the file from a copy")
    return report




















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




def _what_removed(report: dict) -> str:
    units = (report.get("sublayers") or {}).get("units")
    return f"{len(units)} attention/MLP sub-layers" if units else f"{len(report.get('dropped', []))} blocks"


def _front_matter(base: str | None, license_: str | None) -> list[str]:
    """The card's YAML header: the hub id the model came from and its licence, when known."""
    return ["---", *([f"base_model: {base}"] if base else []), *([f"license: {license_}"] if license_ else []),
            "library_name: transformers", "tags:", "- layercut", "- pruned", "---", ""]


def _license_note(base: str | None, license_: str | None) -> list[str]:
    """A line saying where the licence is, for a card whose header could not name it."""
    if license_:
        return []
    where = f"`{base}`'s model card" if base else "the original model's model card"
    return [f"Licence: not recorded in the files layercut read; this model keeps the original's licence (see {where}).",
            ""]


def model_card(report: dict, plain: bool = True, name: str = "path/to/this/folder") -> str:
    """A Hugging Face model card (README.md) describing what was removed and why, and how to use the model.

    Args:
        report: the ``layercut.json`` dict.
        plain: the checkpoint loads with plain transformers (False for one carrying replacement maps,
            whose writer adds how to load it).
        name: the folder's name, used in the code the card shows.
    """
    dropped = report.get("dropped", [])
    base = base_model_id(report.get("model_name"), str(report.get("source_model", "")))
    license_ = model_license(str(report.get("source_model", "")), base)  # read once: a card file or a GGUF header
    lines = [
        *_front_matter(base, license_),
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
        *_license_note(base, license_),
    ]
    if plain:
        lines += ["It is a plain checkpoint: `AutoModelForCausalLM.from_pretrained(path)` loads it, no custom code.",
                  ""]
    replacements = report.get("replacements") or []
    if replacements:
        lines += ["## Replacements", "", *(f"- {describe_replacement(r)}" for r in replacements), ""]
    lines += _distill_section(report.get("distill")) + _heldout_section(report.get("heldout"))
    return "\n".join(lines + use_section(name, plain, report.get("serving")))


def describe_replacement(record: dict) -> str:
    """One line for a replacement record: ``blocks [2, 3] -> linear (after the block before; 1,056 parameters)``."""
    if not isinstance(record, dict):
        return str(record)
    # records name their method under "method" ("kind" in checkpoints written before the rename)
    method = record.get("method", record.get("kind", "?"))
    details = [f"placed {record['where']}"] if record.get("where") else []
    details += [f"{record['params']:,} parameters"] if isinstance(record.get("params"), int) else []
    details += [f"fitted on {record['tokens']:,} tokens"] if isinstance(record.get("tokens"), int) else []
    return f"blocks {record.get('replaces', '?')} -> `{method}`" + (f" ({'; '.join(details)})" if details else "")


def _number(value) -> str:
    """A loss as the card shows it: four significant figures (the exact value is in the report)."""
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def _objective(config: dict) -> str:
    """What the distillation minimised, from its config: ```teacher_student_kl``` or ``0.5 x `kl` + 1 x `mse```."""
    losses = config.get("losses")
    if not isinstance(losses, dict) or not losses:
        return "its loss"
    terms = [f"`{name}`" if len(losses) == 1 else f"{weight:g} x `{name}`" for name, weight in losses.items()]
    return " + ".join(terms)


def _distill_section(distill: dict | None) -> list[str]:
    if not distill:
        return []
    config = distill.get("config", {})
    return [
        "## Distillation", "",
        f"Trained towards `{distill.get('teacher', 'the original model')}` on {_objective(config)} for "
        f"{distill.get('steps')} steps (`--train {config.get('train', '?')}`, lr {config.get('lr', '?')}): loss "
        f"{_number(distill.get('first_loss'))} -> {_number(distill.get('final_loss'))}"
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
    # distill.run keeps its student's figure, measured before the training that made this model
    which = ("the pruned model before distillation" if heldout.get("stage") == HELDOUT_BEFORE_DISTILL
             else "this model")
    after = (" distill.run does not measure it again: `python -m eval.run --model <this folder>` measures this "
             "model." if heldout.get("stage") == HELDOUT_BEFORE_DISTILL else "")
    return [
        "## Held-out perplexity", "",
        f"On {heldout['tokens']} tokens of the calibration source that scoring and fitting never saw "
        f"(windows of {heldout['seq_len']}): original {heldout['original']:.3f}, {which} {heldout['pruned']:.3f} "
        f"(x{heldout['ratio']:.3f}).{after}", "",
    ]  # fmt: skip


_USE_PLAIN = """## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}")
tokenizer = AutoTokenizer.from_pretrained("{name}")
# or, with layercut: import prune; loaded = prune.load("{name}")  # loaded.model, loaded.tokenizer
```

Push it to the hub with `huggingface_hub` (`hf auth login` first):

```python
from huggingface_hub import HfApi
HfApi().upload_folder(folder_path="{name}", repo_id="<you>/{name}", repo_type="model")
```

Serve it as any checkpoint of its architecture: `vllm serve {name}`, or convert it for llama.cpp with
`python -m prune.export_gguf {name}` (llama.cpp's `convert_hf_to_gguf.py`, with the result read back and checked).
"""

_USE_MAPS = """## Use

Push it to the hub with `huggingface_hub` (`hf auth login` first):

```python
from huggingface_hub import HfApi
HfApi().upload_folder(folder_path="{name}", repo_id="<you>/{name}", repo_type="model")
```

Serving: vLLM and llama.cpp cannot run it (its maps or removed sub-layers are in no architecture they know;
llama.cpp's converter answers "Model LayercutForCausalLM is not supported"). For a checkpoint they serve,
export {instead} (the same blocks, the map folded into standard weights), `--replace none` or the
`magcomp` recipe.
"""

_USE_DECILM = """## Use

Push it to the hub with `huggingface_hub` (`hf auth login` first):

```python
from huggingface_hub import HfApi
HfApi().upload_folder(folder_path="{name}", repo_id="<you>/{name}", repo_type="model")
```

Serving: its removed sub-layers fit the DeciLM layout (`DeciLMForCausalLM`, no-op entries of `block_configs`),
which vLLM runs: `python -m prune.decilm {name} --out {name}-decilm` writes that folder for `vllm serve`.
Where `layercut.json` says `llama_cpp: true`, `python -m prune.export_gguf {name}` writes a GGUF for llama.cpp
(its DeciLM converter reads Llama-2 and Llama-3 vocabularies only).
"""


def use_section(name: str, plain: bool, serving: dict | None = None) -> list[str]:
    """The card's "Use" section: load, push and serve (engines by the checkpoint's layout, ``prune.model.layouts``)."""
    layout = (serving or {}).get("layout")
    if plain:
        text = _USE_PLAIN
    elif layout == "decilm":
        text = _USE_DECILM
    else:
        text = _USE_MAPS
    instead = (serving or {}).get("servable_instead") or "recipes/methods/layercut-linear-vanilla.yaml (--replace fold)"
    return ["", text.format(name=name, instead=f"`{instead}`").rstrip("\n"), ""]


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
        if is_offloaded(model):  # a skeleton: its tensors are copied from its checkpoint one file at a time
            from prune.loading.offload import write_offloaded

            write_offloaded(model, staging)
        else:
            model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        write_json(staging / REPORT_FILE, report)
        (staging / "README.md").write_text(model_card(report, plain, Path(out).name), encoding="utf-8")
        if extra is not None:
            extra(staging)
    return Path(out)
