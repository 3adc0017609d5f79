"""Which causal-LM architectures of the installed transformers layercut prunes, and why not the others.

``python -m prune.run --list-architectures`` prints :func:`architecture_markdown`; the tests check the
same :func:`architecture_table`. Each architecture is built tiny (a few blocks of width 64) on the
``meta`` device from its own default config, and its structure is read by ``prune.model.adapters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from prune.errors import LayercutError
from prune.model.adapters import ArchSpec, arch_spec, text_config
from prune.model.surgery import check_config_rules, remapped_config_entries
from prune.model.tiny import TINY_VOCAB, build_tiny, quiet, tiny_config

__all__ = ["TINY_VOCAB", "ArchStatus", "architecture_markdown", "architecture_status", "architecture_table",
           "build_tiny", "causal_lm_types", "supported_architectures", "tiny_config"]


@dataclass(frozen=True)
class ArchStatus:
    """One row of the architecture table."""

    model_type: str
    model_class: str
    supported: bool
    reason: str
    spec: ArchSpec | None = None
    checked: bool = True  # False: the tiny model does not build here, so nothing was read
    family: str | None = None  # encoder / encoder-decoder / recurrent: outside decoder-only pruning


def causal_lm_types() -> dict[str, str]:
    """``model_type`` -> ``*ForCausalLM`` class name, for the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


# Families refused before their structure is read, with the reason (the structure would mislead).
_REFUSED_FAMILIES = {
    "encoder": "an encoder (bidirectional) model with an LM head, not a decoder",
    "encoder-decoder": "an encoder-decoder model: its decoder blocks cross-attend to an encoder",
    "recurrent": "a pure recurrent / state-space stack: no attention block whose removal layercut can score",
}


# Architectures refused although their structure reads fine: pruning them needs more than removing blocks.
REFUSED = {
    "zamba2": "hybrid layers share one transformer whose adapters are indexed by hybrid position "
              "(hybrid_layer_ids); removing a block reshuffles them",
    "gemma4": "per-layer input embeddings are one table sized by the layer count (embed_tokens_per_layer)",
    "gemma4_text": "per-layer input embeddings are one table sized by the layer count (embed_tokens_per_layer)",
    "gemma4_unified": "per-layer input embeddings are one table sized by the layer count (embed_tokens_per_layer)",
    "gemma4_unified_text": "per-layer input embeddings are one table sized by the layer count "
                           "(embed_tokens_per_layer)",
}
REFUSED["youtu"] = ("after pruning, the logits of token 0 (its padding id) differ from the original's with "
                    "that block skipped; not yet explained, so refused")
# Architectures whose checkpoints transformers itself cannot reload through AutoModelForCausalLM.
UNCHECKABLE = {
    "emu3": "transformers cannot reload its ForCausalLM checkpoint with AutoModelForCausalLM (Emu3TextConfig)",
    "mllama": "transformers cannot reload its ForCausalLM checkpoint with AutoModelForCausalLM (MllamaTextConfig)",
}


def _family(config) -> str | None:
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    return None


def _runs(model_type: str) -> str | None:
    """None if the tiny model runs a forward pass on the CPU, else why not."""
    try:
        model = build_tiny(model_type)
        with torch.no_grad(), quiet():
            model(torch.randint(3, TINY_VOCAB, (1, 8)), use_cache=False)
    except Exception as exc:  # noqa: BLE001
        return f"tiny model does not run: {_one_line(exc)}"
    return None


def architecture_status(model_type: str, run: bool = True) -> ArchStatus:
    """Whether layercut prunes ``model_type``, with the reason when it does not.

    Args:
        model_type: a key of transformers' causal-LM mapping.
        run: also run the tiny model once on the CPU (an architecture whose tiny model does not run
            is unchecked, not supported).
    """
    model_class = causal_lm_types().get(model_type, "?")
    if model_type in UNCHECKABLE:
        return ArchStatus(model_type, model_class, False, UNCHECKABLE[model_type], checked=False)
    try:
        config = tiny_config(model_type)
    except Exception as exc:  # noqa: BLE001 - a config that does not build is a reason, not a crash
        return ArchStatus(model_type, model_class, False, f"tiny config does not build: {_one_line(exc)}",
                          checked=False)
    family = _family(config)
    if family is not None:
        return ArchStatus(model_type, model_class, False, _REFUSED_FAMILIES[family], family=family)
    try:
        model = build_tiny(model_type, device="meta")
    except Exception as exc:  # noqa: BLE001
        return ArchStatus(model_type, model_class, False, f"model does not build from a tiny config: {_one_line(exc)}",
                          checked=False)
    try:
        spec = arch_spec(model)
    except LayercutError as exc:
        reason = str(exc).split(": ", 1)[-1].split("; python -m")[0]
        family = "encoder" if reason.startswith("an encoder") else None
        return ArchStatus(model_type, model_class, False, reason, family=family)
    if model_type in REFUSED:
        return ArchStatus(model_type, model_class, False, REFUSED[model_type], spec)
    blocks = model.get_submodule(spec.blocks)
    refused = _config_rules_refusal(model, len(blocks))
    if refused is not None:
        return ArchStatus(model_type, model_class, False, refused, spec)
    if not any(k in type(m).__name__.lower() for m in blocks.modules() for k in ("attention", "attn")):
        return ArchStatus(model_type, model_class, False, _REFUSED_FAMILIES["recurrent"], spec, family="recurrent")
    failure = _runs(model_type) if run else None
    if failure is not None:
        return ArchStatus(model_type, model_class, False, failure, spec, checked=False)
    return ArchStatus(model_type, model_class, True, _notes(spec), spec)


def _config_rules_refusal(model, count: int) -> str | None:
    """Why transformers' own config rules refuse the model with its first block removed, or None."""
    kept = list(range(1, count))
    try:
        entries = remapped_config_entries(text_config(model), kept, count)
    except LayercutError:  # a per-layer pattern this removal breaks and others keep: not a refusal
        return None
    try:
        check_config_rules(model, len(kept), entries)
    except LayercutError as exc:
        return str(exc)
    return None


def _notes(spec: ArchSpec) -> str:
    notes = []
    if not spec.mlp_out:
        notes.append("no single MLP output projection (fold unavailable)")
    elif spec.mlp_out_norm:
        notes.append(f"MLP output normed by {spec.mlp_out_norm} (fold unavailable)")
    if not spec.final_norm:
        notes.append("no final norm")
    return "; ".join(notes)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"{type(exc).__name__}: {text[:160]}"


@lru_cache(maxsize=1)
def architecture_table() -> tuple[ArchStatus, ...]:
    """Every causal-LM architecture of the installed transformers with its status."""
    from tqdm import tqdm

    types = list(causal_lm_types())
    return tuple(architecture_status(t) for t in tqdm(types, desc="architectures", unit="arch", leave=False))


def architecture_markdown(rows: tuple[ArchStatus, ...] | None = None) -> str:
    """The table as markdown, with the supported / refused counts."""
    rows = architecture_table() if rows is None else rows
    supported = sum(r.supported for r in rows)
    unchecked = sum(not r.checked for r in rows)
    import transformers

    lines = [f"transformers {transformers.__version__}: {len(rows)} causal-LM architectures, {supported} supported, "
             f"{len(rows) - supported - unchecked} refused, {unchecked} unchecked (their tiny model does not build "
             "or run here)", "",
             "| model_type | class | status | notes |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        state = "supported" if r.supported else "refused" if r.checked else "unchecked"
        lines.append(f"| {r.model_type} | {r.model_class} | {state} | "
                     f"{r.reason.replace('|', '/')} |")  # fmt: skip
    return "\n".join(lines)


def supported_architectures() -> list[str]:
    """The ``model_type`` values of the installed transformers that layercut prunes, sorted (slow: surveys)."""
    return sorted(row.model_type for row in architecture_table() if row.supported)
