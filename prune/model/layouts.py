"""Checkpoint layouts and the engines that run each: what ``layercut.json``, the card and ``eval.compare`` say.

Three layouts (what the engines' own code accepts, read in llama.cpp's converter and vLLM's model list):

* ``vanilla``: the original architecture with fewer blocks, the repair (if any) folded into standard
  weights. transformers, vLLM and llama.cpp (after ``prune.checkpoint.gguf``) run it.
* ``decilm``: attention-free or MLP-free layers as no-op entries of ``block_configs``
  (``DeciLMForCausalLM``, the Nemotron-NAS layout), for sub-layer removals on Llama-family models.
  vLLM (``nemotron_nas``) and llama.cpp (``deci``) run it; transformers needs the layout's remote code.
* ``layercut``: replacement maps between blocks, an architecture of layercut's own. ``prune.load`` and
  ``trust_remote_code`` run it; no serving engine does (vLLM's Nemotron-NAS has no path for a linear
  layer in a block's place), so its label names the vanilla recipe that ships the same blocks.

A replacement method declares its layout when it is registered (``prune.replace.registry.Method.serving``);
a checkpoint folder's entry is read by :mod:`prune.checkpoint.serving`. Each engine of ``eval.bench``
declares the layouts it runs (``eval.speed.engines``, ``Engine.layouts`` and ``Engine.entry_key``), and
``tests/eval/speed/test_engines.py`` keeps them in agreement with the table here. ``engines`` is data written
into ``layercut.json``: ``vllm`` and ``llama.cpp`` (the engine ``--engine llamacpp``) as written so far.
"""

from __future__ import annotations

from dataclasses import dataclass

VANILLA, DECILM, LAYERCUT = "vanilla", "decilm", "layercut"
# what a map checkpoint ships as instead: the same selection with the map folded into the MLP's projection
VANILLA_RECIPE = "recipes/methods/layercut-linear-vanilla.yaml (--replace fold)"


@dataclass(frozen=True)
class Layout:
    """One checkpoint layout and the engines that run it."""

    name: str
    engines: tuple[str, ...]
    label: str  # the leaderboard's "serves" column
    why: str


LAYOUTS = {
    VANILLA: Layout(VANILLA, ("transformers", "vllm", "llama.cpp"), "transformers, vLLM, llama.cpp",
                    "a plain checkpoint of the original architecture with fewer blocks"),
    DECILM: Layout(DECILM, ("vllm", "llama.cpp"), "vLLM, llama.cpp (DeciLM layout)",
                   "removed sub-layers are no-op entries of block_configs (DeciLMForCausalLM), which vLLM and "
                   "llama.cpp run; transformers needs that layout's remote code"),
    LAYERCUT: Layout(LAYERCUT, (), "no (maps)",
                     "replacement maps between blocks are part of no architecture that vLLM or llama.cpp runs"),
}


def serving_entry(layout: str, instead: str | None = None, why: str | None = None) -> dict:
    """``layercut.json``'s ``serving``: the layout, its engines and, for a layout no engine runs, what ships instead.

    ``why``: the reason, where it is not the layout's own (sub-layer removals the DeciLM layout cannot hold).
    """
    spec = LAYOUTS[layout]
    entry = {"layout": layout, "engines": list(spec.engines), "vllm": "vllm" in spec.engines,
             "llama_cpp": "llama.cpp" in spec.engines, "why": why or spec.why}
    if layout == DECILM:
        entry["export"] = ("python -m prune.decilm FOLDER --out OUT (vLLM); "
                           "python -m prune.export_gguf FOLDER (llama.cpp)")
    if layout == LAYERCUT:
        entry["servable_instead"] = instead or VANILLA_RECIPE
    return entry


ENGINE_NAMES = {"transformers": "transformers", "vllm": "vLLM", "llama.cpp": "llama.cpp", "llamacpp": "llama.cpp"}


def label(serving: dict | None, vanilla: bool | None = None) -> str:
    """The short "serves" label of a ``serving`` entry; results written before it existed fall back on ``vanilla``."""
    if serving and serving.get("layout") in LAYOUTS:
        engines = serving.get("engines")
        if engines is None or serving["layout"] == LAYERCUT:
            return LAYOUTS[serving["layout"]].label
        names = ", ".join(ENGINE_NAMES.get(e, e) for e in engines)
        return names + (" (DeciLM layout)" if serving["layout"] == DECILM else "")
    if vanilla is None:
        return "-"
    return LAYOUTS[VANILLA if vanilla else LAYERCUT].label
