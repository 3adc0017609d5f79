"""Checkpoint layouts: what ``layercut.json``'s ``serving`` entry, the card and ``eval.compare`` say of a checkpoint.

Three layouts (what serving engines' own code accepts, read in llama.cpp's converter and vLLM's model list):

* ``vanilla``: the original architecture with fewer blocks, the repair (if any) folded into standard
  weights: a plain checkpoint, which any engine of its architecture runs.
* ``decilm``: attention-free or MLP-free layers as no-op entries of ``block_configs``
  (``DeciLMForCausalLM``, the Nemotron-NAS layout), for sub-layer removals on Llama-family models.
  vLLM (``nemotron_nas``) and llama.cpp (``deci``) run it; transformers needs the layout's remote code.
* ``layercut``: replacement maps between blocks, an architecture of layercut's own. ``prune.load`` and
  ``trust_remote_code`` run it; no serving engine does (vLLM's Nemotron-NAS has no path for a linear
  layer in a block's place), so its entry names the vanilla recipe that ships the same blocks.

A replacement method declares its layout when it is registered (``prune.replace.registry.Method.serving``);
a checkpoint folder's entry is read by :mod:`prune.checkpoint.serving`. Which engines run a layout is declared
by each engine where it registers (``eval.speed.engines``: ``Engine.layouts``), never here: ``prune`` is the
base and knows no engine. What the entry holds beyond the layout are facts of the checkpoint itself: the
reason, what ships instead, how to export it, and ``why_not``, engine name -> why that engine would run this
checkpoint wrong although it runs its layout (the DeciLM converter limits of llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass

VANILLA, DECILM, LAYERCUT = "vanilla", "decilm", "layercut"
# what a map checkpoint ships as instead: the same selection with the map folded into the MLP's projection
VANILLA_RECIPE = "recipes/methods/layercut-linear-vanilla.yaml (--replace fold)"


@dataclass(frozen=True)
class Layout:
    """One checkpoint layout.

    Attributes:
        name: its name in a ``serving`` entry.
        why: why engines run it or not, in a sentence.
        note: how a short label qualifies it ("DeciLM layout", "maps"); None for a plain checkpoint.
    """

    name: str
    why: str
    note: str | None = None


LAYOUTS = {
    VANILLA: Layout(VANILLA, "a plain checkpoint of the original architecture with fewer blocks"),
    DECILM: Layout(DECILM, "removed sub-layers are no-op entries of block_configs (DeciLMForCausalLM), which vLLM "
                   "and llama.cpp run; transformers needs that layout's remote code", "DeciLM layout"),
    LAYERCUT: Layout(LAYERCUT, "replacement maps between blocks are part of no architecture that vLLM or llama.cpp "
                     "runs", "maps"),
}


def serving_entry(layout: str, instead: str | None = None, why: str | None = None) -> dict:
    """``layercut.json``'s ``serving``: the layout and, for a layout no serving engine runs, what ships instead.

    ``why``: the reason, where it is not the layout's own (sub-layer removals the DeciLM layout cannot hold).
    """
    entry = {"layout": layout, "why": why or LAYOUTS[layout].why}
    if layout == DECILM:
        entry["export"] = ("python -m prune.decilm FOLDER --out OUT (vLLM); "
                           "python -m prune.export_gguf FOLDER (llama.cpp)")
    if layout == LAYERCUT:
        entry["servable_instead"] = instead or VANILLA_RECIPE
    return entry
