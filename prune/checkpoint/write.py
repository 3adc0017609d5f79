"""Write a slimmed checkpoint: weights, tokenizer, ``layercut.json`` and a model card, all or nothing.

Everything is written into a temporary sibling folder that is renamed into place at the end, so a
crash, Ctrl-C or a full disk never leaves a half-written checkpoint under the user's ``--out`` (nor
touches the one already there). The folder and its files get the modes of any file the user writes
(``0o755`` / ``0o644`` under umask 022), not the private ones of a temporary folder.
"""

from __future__ import annotations

import logging
import os
import platform
import re
from pathlib import Path

from prune.atomic import atomic_directory, write_json
from prune.checkpoint.report import MODEL_PATH, REPORT_FILE, stamped
from prune.loading.names import EMBEDDED_MODEL, MODEL_ALIASES, base_model_id, model_license
from prune.model.adapters import is_offloaded
from prune.replace.registry import describe_replacement

logger = logging.getLogger(__name__)

# a report's heldout "stage" when its figure was measured before a later distill.run
HELDOUT_BEFORE_DISTILL = "before distill.run"


# an absolute path inside a longer text ("a.txt@0.5,/home/me/b.txt@0.5"): it keeps its last component
_EMBEDDED_PATH = re.compile(r"(?<![\w/.~-])~?/(?:[^\s/,@'\"`()\[\]]+/)*([^\s/,@'\"`()\[\]]+)")


def portable_name(name: str | None, source: str | None) -> str:
    """How a card and ``layercut.json`` name the original model: never a path of this machine.

    The hub id loaded, else the alias typed (``smollm2-135m``, whose file is local), else the base name of the
    local file or folder.
    """
    hub_id = base_model_id(None, source or "")  # None for a local file or folder
    typed = (name or "").strip()
    if hub_id is None and (typed.lower() in MODEL_ALIASES or typed.lower() == EMBEDDED_MODEL):
        return typed
    return hub_id or Path(str(source or name or "model")).name


def portable(value):
    """``value`` (text, or a mapping or list of them) with every absolute path cut to the path's last component."""
    if isinstance(value, dict):
        return {portable(key): portable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(item) for item in value]
    if not isinstance(value, str):
        return value
    if (os.path.isabs(value) or value.startswith("~/")) and "," not in value:  # one path, spaces and all
        return Path(value).name
    return _EMBEDDED_PATH.sub(lambda match: match.group(1), value)


def portable_report(report: dict) -> dict:
    """``report`` as ``layercut.json`` and the card show it: no absolute path of this machine in it.

    ``source_model`` is :func:`portable_name`; any other absolute path (``model_name`` and ``config.load.model``
    when typed as one, ``config.out``, calibration files) keeps its last component. A relative path typed on
    the command line, an alias and a hub id stay as typed: they still name the model where they did.
    """
    shown = portable(report)
    if report.get("source_model") is not None:
        shown["source_model"] = portable_name(report.get("model_name"), str(report["source_model"]))
    return shown


def report_license(report: dict) -> str | None:
    """The original model's licence: recorded in ``report``, else read from its files (``model_license``)."""
    if report.get("license"):
        return str(report["license"])
    source = str(report.get("source_model", ""))
    return model_license(source, base_model_id(report.get("model_name"), source))


def written_report(report: dict, folder: str | Path | None = None) -> dict:
    """What ``layercut.json`` in ``folder`` holds: :func:`portable_report`, its format number and two additions.

    The licence, read while the model's files are at hand, and where a local original model lies relative to
    ``folder`` (``MODEL_PATH``), for :func:`prune.checkpoint.report.read_report` to re-open it.
    """
    shown = portable_report(report)
    license_ = report_license(report)
    if license_:
        shown["license"] = license_
    shown.pop(MODEL_PATH, None)
    local = _relative_model_path(report, folder) if folder is not None else None
    if local is not None:
        shown[MODEL_PATH] = local
    return stamped(shown)


def _relative_model_path(report: dict, folder: str | Path) -> str | None:
    """The local original model typed as a path, relative to ``folder``.

    None for an alias or a hub id, or when the relative path would still spell out the machine (the two paths
    meet only at ``/`` or above the home folder).
    """
    typed = str(report.get("model_name") or "")
    if not typed or typed.lower() in MODEL_ALIASES or typed.lower() == EMBEDDED_MODEL:
        return None
    local = Path(typed).expanduser()
    if not local.exists():
        return None
    local, out = local.resolve(), Path(folder).expanduser().resolve()
    common = Path(os.path.commonpath([local, out]))
    if common == Path(common.anchor) or (Path.home() != common and Path.home().is_relative_to(common)):
        return None
    return os.path.relpath(local, out)


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
    return render_card(card_sections(report, plain, name))


def card_sections(report: dict, plain: bool = True, name: str = "path/to/this/folder") -> dict[str, list[str]]:
    """The card's sections of ``report``, by name, in the order :func:`model_card` renders them.

    ``front`` (the hub's YAML header), ``title``, ``made`` (what was removed, how it was chosen),
    ``replacements``, ``distill``, ``heldout`` and ``use``. A tool that writes its own card (``prune.ship``)
    renders the ones it keeps beside its own, so each line is made once, from the final report.
    """
    base = base_model_id(report.get("model_name"), str(report.get("source_model", "")))
    license_ = report_license(report)  # read once: recorded, a card file or a GGUF header
    report = portable_report(report)  # no path of this machine in the card
    dropped = report.get("dropped", [])
    made = [
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
        made += ["It is a plain checkpoint: `AutoModelForCausalLM.from_pretrained(path)` loads it, no custom code.",
                 ""]
    replacements = report.get("replacements") or []
    return {
        "front": _front_matter(base, license_),
        "title": [f"# {Path(str(report.get('source_model', 'model'))).name} with {_what_removed(report)} removed", ""],
        "made": made,
        "replacements": ["## Replacements", "", *(f"- {describe_replacement(r)}" for r in replacements), ""]
        if replacements else [],
        "distill": _distill_section(report.get("distill")),
        "heldout": _heldout_section(report.get("heldout")),
        "use": use_section(name, plain, report.get("serving")),
    }


def render_card(sections: dict[str, list[str]]) -> str:
    """The card's text: its sections' lines in order."""
    return "\n".join(line for lines in sections.values() for line in lines)


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
Unless `layercut.json`'s `serving.why_not` names `llamacpp`, `python -m prune.export_gguf {name}` writes a GGUF
for llama.cpp (its DeciLM converter reads Llama-2 and Llama-3 vocabularies only).
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


_CARD_NOTE = """
## Loading

This checkpoint carries {what}, so it is not a plain
transformers checkpoint. Load it with layercut:

```python
import prune
loaded = prune.load("{name}")   # loaded.model, loaded.tokenizer
```

or, without layercut installed, with the modeling code it carries (`{code}`):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)  # reads the wrapped config
```

Plain `AutoModelForCausalLM.from_pretrained("{name}")` refuses it (model type `{model_type}`): loading
the kept blocks without {without} would give another model.
"""


def remote_code_note(name: str, maps: bool, sublayers: int) -> str:
    """The card's "Loading" section of a checkpoint that carries modeling code: what it holds, how to load it."""
    from prune.model import remote_code

    what = [f"replacement maps for the removed blocks in `{remote_code.MAPS_FILE}`"] if maps else []
    what += [f"{sublayers} removed attention/MLP sub-layer(s), listed in its config as "
             f"`{remote_code.SUBLAYERS_KEY}`"] if sublayers else []
    without = " and ".join((["their maps"] if maps else []) + (["the sub-layer removals"] if sublayers else []))
    return _CARD_NOTE.format(what=" and ".join(what), name=name, code=remote_code.MODELING_FILE,
                             model_type=remote_code.MODEL_TYPE, without=without)


def export_checkpoint(model, tokenizer, out: str | Path, report: dict, overwrite: bool = False,
                      plain: bool = True, remote: tuple[bool, int] | None = None) -> Path:
    """Save ``model`` and ``tokenizer`` with ``layercut.json`` and README.md into ``out`` atomically.

    :func:`write_checkpoint` into a staging folder, then one rename; a writer with more files to add
    (plots, maps, logs) owns the staging folder itself (``prune.atomic.atomic_directory``) and runs the writers
    in turn.

    Args:
        model: the (surgered) model.
        tokenizer: its tokenizer.
        out: destination folder.
        report: JSON-ready dict written as ``layercut.json`` and summarised in the model card.
        overwrite: replace a non-empty ``out``.
        plain: the checkpoint loads with plain transformers (the model card says so).
        remote: ``(maps, sublayers)`` of a checkpoint that carries its modeling code (the card says how to
            load it); None for one that does not.
    """
    with atomic_directory(out, overwrite) as staging:
        write_checkpoint(staging, model, tokenizer, out, report, plain=plain, remote=remote)
    return Path(out)


def write_checkpoint(staging: Path, model, tokenizer, out: str | Path, report: dict, *, plain: bool = True,
                     remote: tuple[bool, int] | None = None) -> dict:
    """Write the weights, the tokenizer, ``layercut.json`` and README.md into ``staging``; the report written.

    ``staging`` is the caller's folder, renamed to ``out`` once every writer ran: ``out`` names the folder in
    the card and places the report's relative paths. This module is the card's one author.
    """
    logger.info("saving checkpoint to %s", out)
    if is_offloaded(model):  # a skeleton: its tensors are copied from its checkpoint one file at a time
        from prune.loading.offload import write_offloaded

        write_offloaded(model, staging)
    else:
        model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    written = written_report(report, out)  # no path of this machine; the licence read while its files are here
    write_json(staging / REPORT_FILE, written)
    card = model_card(written, plain, Path(out).name)
    if remote is not None:
        card += remote_code_note(Path(out).name, *remote)
    (staging / "README.md").write_text(card, encoding="utf-8")
    return written
