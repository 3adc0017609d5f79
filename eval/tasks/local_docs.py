"""Readers that turn layercut's local benchmark files into the rows lm-eval's standard tasks expect.

Each ``load_*`` is a ``custom_dataset`` for the YAMLs next to it: lm-eval calls it with the task's
metadata, which carries ``data_dir`` (set by ``eval.quality.lmeval.run_lm_eval``, or on the lm-eval command line
with ``--metadata '{"data_dir": "/path/to/data"}'``; ``$LAYERCUT_DATA`` is the fallback) and the YAML's
``layercut`` block, whose ``files`` are what the reader reads. So a reader serves every task whose files
have its format: a new task in a known format needs only its YAML. Every reader returns the hub dataset's
layout (same column names, types and split name), so the prompts, targets and choices are produced by the
same templates and functions as lm-eval's own task.

The folder is laid out like layercut's ``shared/data``. lm-eval imports this file by path, so it uses
absolute imports only; a YAML outside this folder names a reader ``eval.tasks.local_docs.load_*``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import datasets
from lm_eval.tasks.hellaswag import utils as lm_eval_hellaswag
from lm_eval.tasks.winogrande import preprocess_winogrande as lm_eval_winogrande

from eval.quality.lmeval import local_data_files
from prune.errors import LayercutError

# a sentence end inside a HellaSwag context, possibly closed by quotes or brackets
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")
_HELLASWAG_LINES_PER_ITEM = 6  # context, gold label, four endings


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _read_lines(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as handle:
        return [line.strip() for line in handle if line.strip()]


def _one_split(split: str, rows: list[dict[str, Any]]) -> datasets.DatasetDict:
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})


def _files(task: str | None, data_dir: str | None, layercut: dict | None) -> list[Path]:
    """The task's files: those of its YAML's ``layercut`` block, else (a direct call) those of ``task``."""
    if layercut is None and task is None:  # a reader shared by several tasks cannot tell whose files to read
        raise LayercutError("this reader reads the files of its task's metadata.layercut block; call it through "
                            "lm-eval (which passes that block) or name the files as layercut={'files': [...]}")
    return local_data_files(task or "a task in the hub's layout", data_dir,
                            None if layercut is None else layercut["files"])


def _check_aligned(task: str, rows: list, labels: list, paths: list[Path]) -> None:
    if len(rows) != len(labels):
        raise LayercutError(
            f"{task}: {paths[0].name} has {len(rows)} rows but {paths[1].name} has {len(labels)} labels; "
            f"restore both files from the same release"
        )


# ---------------------------------------------- rows already in the hub's layout (ARC, IFEval)
def load_jsonl(data_dir: str | None = None, layercut: dict | None = None, split: str = "test",
               **_: Any) -> datasets.DatasetDict:
    """The task's one JSON-lines file as the split ``split``, rows already in the hub's layout.

    ARC's ``allenai/ai2_arc`` (test), IFEval's ``google/IFEval`` (``dataset_kwargs: {split: train}`` in its YAML,
    the hub's one split). A column of dicts whose rows name different keys (IFEval's ``kwargs``) becomes one struct
    with every key, the keys a row lacks set to ``None``, as on the hub; lm-eval's IFEval checks drop those
    ``None`` arguments.
    """
    (path,) = _files(None, data_dir, layercut)
    return _one_split(split, _read_jsonl(path))


# ------------------------------------------------------------------------------------------ PIQA
def load_piqa(data_dir: str | None = None, layercut: dict | None = None, **_: Any) -> datasets.DatasetDict:
    """PIQA validation rows as ``{goal, sol1, sol2, label}`` (the hub layout), labels joined by line."""
    paths = _files("piqa", data_dir, layercut)
    rows, labels = _read_jsonl(paths[0]), _read_lines(paths[1])
    _check_aligned("piqa", rows, labels, paths)
    docs = [
        {"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(y)}
        for r, y in zip(rows, labels, strict=True)
    ]
    return _one_split("validation", docs)


# --------------------------------------------------------------------------------------- LAMBADA
def load_lambada_openai(data_dir: str | None = None, layercut: dict | None = None,
                        **_: Any) -> datasets.DatasetDict:
    """LAMBADA (OpenAI detokenized) test rows ``{text}``, the hub's ``EleutherAI/lambada_openai`` layout."""
    (path,) = _files("lambada_openai", data_dir, layercut)
    return _one_split("test", [{"text": r["text"]} for r in _read_jsonl(path)])


# ----------------------------------------------------------------------------------------- BoolQ
def load_boolq(data_dir: str | None = None, layercut: dict | None = None, **_: Any) -> datasets.DatasetDict:
    """BoolQ validation rows with the label as 0 (false) / 1 (true), as in the hub's ``super_glue/boolq``."""
    (path,) = _files("boolq", data_dir, layercut)
    docs = [
        {"question": r["question"], "passage": r["passage"], "idx": int(r["idx"]),
         "label": int(str(r["label"]).strip().lower() == "true")}
        for r in _read_jsonl(path)
    ]
    return _one_split("validation", docs)


# ------------------------------------------------------------------------------------ WinoGrande
def winogrande_row(context_options: list[str], continuation: str, answer: str) -> dict[str, str]:
    """Rebuild the hub's WinoGrande row from llm-foundry's schema form.

    llm-foundry stores ``sentence[:blank] + option`` for both options and the text after the blank.
    The part the options share is the sentence up to the blank; we cut it at its last space so a
    shared first letter ("the blanket" / "the bed") stays in the options. lm-eval only ever uses
    ``sentence[:blank] + option`` and the stripped text after the blank, which this row reproduces
    exactly wherever the cut falls.

    Args:
        context_options: The two contexts, option 1 first.
        continuation: The sentence after the blank.
        answer: "1" or "2".

    Returns:
        ``{sentence, option1, option2, answer}`` with a single "_" at the blank.
    """
    shared = os.path.commonprefix(context_options)
    cut = shared.rfind(" ") + 1  # 0 when there is no space: the options are the whole contexts
    head = context_options[0][:cut]
    return {
        "sentence": f"{head}_ {continuation}",
        "option1": context_options[0][cut:],
        "option2": context_options[1][cut:],
        "answer": answer,
    }


def load_winogrande(data_dir: str | None = None, layercut: dict | None = None, **_: Any) -> datasets.DatasetDict:
    """WinoGrande dev (winogrande_xl validation) rows in the hub layout; answers from ``dev-labels.lst``."""
    paths = _files("winogrande", data_dir, layercut)
    rows, labels = _read_jsonl(paths[0]), _read_lines(paths[1])
    _check_aligned("winogrande", rows, labels, paths)
    docs = []
    for i, (row, label) in enumerate(zip(rows, labels, strict=True)):
        if int(row["gold"]) + 1 != int(label):
            raise LayercutError(
                f"winogrande: row {i} of {paths[0].name} says option {int(row['gold']) + 1} but {paths[1].name} "
                f"says {label}; restore both files from the same release"
            )
        docs.append(winogrande_row(row["context_options"], row["continuation"], label))
    return _one_split("validation", docs)


def winogrande_doc_to_text(doc: dict) -> int:
    """lm-eval's own WinoGrande ``doc_to_text`` (the index of the gold context)."""
    return lm_eval_winogrande.doc_to_text(doc)


def winogrande_doc_to_target(doc: dict) -> str:
    """lm-eval's own WinoGrande ``doc_to_target`` (the sentence after the blank)."""
    return lm_eval_winogrande.doc_to_target(doc)


def winogrande_doc_to_choice(doc: dict) -> list[str]:
    """lm-eval's own WinoGrande ``doc_to_choice`` (the sentence up to the blank, once per option)."""
    return lm_eval_winogrande.doc_to_choice(doc)


# ------------------------------------------------------------------------------------- HellaSwag
def split_hellaswag_context(ctx: str) -> tuple[str, str]:
    """Split a HellaSwag ``ctx`` back into ``ctx_a`` and ``ctx_b``.

    The text file keeps ``ctx = ctx_a + " " + ctx_b`` only. lm-eval capitalizes ``ctx_b`` (the
    unfinished noun phrase that starts the next ActivityNet sentence, e.g. "he" or "the lady"), so we
    need it back: it is the text after the last sentence end when the context does not itself end a
    sentence. WikiHow contexts end a sentence and have an empty ``ctx_b``.

    Args:
        ctx: The context without the activity label.

    Returns:
        ``(ctx_a, ctx_b)``; ``ctx_b`` is "" when ``ctx`` ends with ".", "!" or "?".
    """
    if not ctx or ctx[-1] in ".!?":
        return ctx, ""
    ends = list(_SENTENCE_END.finditer(ctx))
    if not ends:
        return "", ctx
    cut = ends[-1].end()
    return ctx[:cut].rstrip(), ctx[cut:]


def hellaswag_items(text: str) -> list[dict[str, Any]]:
    """Parse the 6-lines-per-item text form into rows in the hub's ``Rowan/hellaswag`` layout.

    Args:
        text: The whole file: ``label: context``, the gold index, then the four endings, per item.

    Returns:
        Rows ``{activity_label, ctx_a, ctx_b, ctx, endings, label}`` (label a string, as on the hub).

    Raises:
        LayercutError: the line count is not a multiple of 6 or an item is malformed.
    """
    lines = text.rstrip("\n").split("\n")
    if len(lines) % _HELLASWAG_LINES_PER_ITEM:
        raise LayercutError(
            f"hellaswag: expected 6 lines per item, got {len(lines)} lines; use the hellaswag_val_full.txt release"
        )
    rows = []
    for start in range(0, len(lines), _HELLASWAG_LINES_PER_ITEM):
        head, label, *endings = lines[start : start + _HELLASWAG_LINES_PER_ITEM]
        activity, sep, ctx = head.partition(": ")
        if not sep or label.strip() not in {"0", "1", "2", "3"}:
            raise LayercutError(
                f"hellaswag: item at line {start + 1} is not 'label: context' followed by a 0-3 gold index; "
                f"use the hellaswag_val_full.txt release"
            )
        ctx_a, ctx_b = split_hellaswag_context(ctx)
        rows.append({"activity_label": activity, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx,
                     "endings": endings, "label": label.strip()})
    return rows


def load_hellaswag(data_dir: str | None = None, layercut: dict | None = None, **_: Any) -> datasets.DatasetDict:
    """HellaSwag validation rows in the hub layout, parsed from ``hellaswag_val_full.txt``."""
    (path,) = _files("hellaswag", data_dir, layercut)
    return _one_split("validation", hellaswag_items(path.read_text(encoding="utf-8")))


def hellaswag_process_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """lm-eval's own HellaSwag ``process_docs`` (builds ``query``, ``choices`` and ``gold``)."""
    return lm_eval_hellaswag.process_docs(dataset)
