"""Calibration text: read it, tokenize it, pack it into fixed-length sequences.

Sources: a local ``.txt`` (one document), ``.jsonl`` / ``.json`` / ``.parquet`` (one document per row),
a ``datasets`` spec ``name[:config[:split]]``, the built-in public-domain corpus shipped inside the
package (Jane Austen's *Pride and Prejudice*; ``builtin`` names it in a mixture), or ``self``: text
sampled from the model being pruned (the self-generated calibration of Ji et al., "Beware of
Calibration Data for Pruning Large Language Models", ICLR 2025), spelled ``self`` or
``self:temperature=0.8:top_p=0.9`` (``:batch=64`` samples that many sequences at a time: faster on a GPU,
and other tokens than the default batch of :data:`prune.data.self_text.SELF_BATCH`; ``:chat`` starts each
sequence where the model's chat template opens a conversation, so an instruct model writes requests and answers
them, :func:`prune.data.self_text.chat_opening`). Sampled text is kept on disk
(:func:`prune.data.self_text.cached_samples`): the same model, seed and options sample once.

A mixture is a comma list of sources, each with an optional ``@weight`` (parsed by :mod:`prune.data.sources`)::

    --data "emma.txt@0.5,ptb.txt@0.25,wikitext:wikitext-2-raw-v1:train@0.25"
    --data "self@0.5,emma.txt@0.5"
    --data "emma.txt,ptb.txt"            # no weights: equal shares

The default (``--data`` unset) is :data:`DEFAULT_DATA`: half the built-in novel, half text sampled
from the model. Chosen on a selection split of texts and task prompts that no reported figure
uses (SmolLM2-135M, layercut-linear at drops 4 and 8): the mixture's geometric-mean perplexity
was 1.445x / 2.357x dense against the novel's 1.518x / 2.871x and self-sampled text's 1.471x /
2.501x; the model's own text covers what one novel does not, the novel keeps real prose in.

Weights are normalised to sum to one; each source gives its share of ``--samples`` (largest
remainders) and of the held-out sequences, drawn from its own windows so a source's held-out
sequences never overlap its calibration ones. A single source is read exactly as before.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import torch

from prune.data.self_text import cached_samples
from prune.data.sources import BUILTIN, SELF, Source, parse_sources, shares
from prune.data.windows import cut_windows, token_stream
from prune.errors import LayercutError

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "austen_pride_and_prejudice.txt"
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
DEFAULT_DATA = f"{BUILTIN}@0.5,{SELF}@0.5"


def check_seq_len(seq_len: int, flag: str = "--seq-len") -> None:
    """A sequence must hold at least two tokens: one to predict from, one to predict."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise LayercutError(f"{flag} must be at least 2, got {seq_len}")


def numeric_fields(config, section: str) -> None:
    """Read the number fields of the dataclass ``config`` as numbers, or refuse them in one line.

    A recipe may spell a number as text: YAML reads ``3e-4`` (no dot) as a string, and ``"64"`` is one. Such
    text becomes the number; anything else in an ``int`` or ``float`` field (``"eight"``, ``true``, 2.5 for a
    count) is a one-line error naming ``section: key`` and the type it takes.
    """
    for spec in fields(config):
        kinds = {part.strip() for part in str(spec.type).split("|")}
        # a field that also takes text (``drop: 25%``) reads its text itself
        kind = None if "str" in kinds else "int" if "int" in kinds else "float" if "float" in kinds else None
        value = getattr(config, spec.name)
        if kind is not None and not (value is None and "None" in kinds):
            setattr(config, spec.name, _number(value, kind, f"{section}: {spec.name}" if section else spec.name))


def _number(value, kind: str, where: str) -> int | float:
    """``value`` (a number, or its text) as ``kind`` ("int" or "float"); a one-line error when it is none."""
    number = value
    if isinstance(value, str):
        text = value.strip()
        try:
            number = int(text) if kind == "int" and text.lstrip("+-").isdigit() else float(text)
        except ValueError:
            number = None
    expected = "an integer" if kind == "int" else "a number"
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise LayercutError(f"{where} must be {expected}, got {value!r}")
    if kind == "float":
        return float(number)
    if isinstance(number, float) and not (math.isfinite(number) and number.is_integer()):
        raise LayercutError(f"{where} must be {expected}, got {value!r}")
    return int(number)


# The field types typed_fields checks, as an annotation spells them, with the Python types that hold them and how an
# error names them. A bool is not a number here (``samples: true``), though Python makes it an int.
_FIELD_TYPES = {"str": ((str,), "text"), "int": ((int,), "an integer"), "float": ((int, float), "a number"),
                "bool": ((bool,), "true or false"), "dict": ((dict,), "a mapping"), "list": ((list, tuple), "a list")}


def typed_fields(config, section: str, hints: dict[str, str] | None = None) -> None:
    """Refuse, in one line, a field of the dataclass ``config`` that holds none of the types its annotation names.

    A recipe's YAML or a keyword argument can put any value anywhere (``protect: 5``, ``load: {dtype: 7}``); found
    here, the error names ``section: key``, what it takes and an example (``hints[key]``, else the default), not a
    ``TypeError`` deep in the run. Fields annotated with other types (a nested config) are left to their own checks;
    numbers written as text are :func:`numeric_fields`' to read, so call it first where a field may hold them.
    """
    for spec in fields(config):
        kinds = [part.strip().split("[")[0] for part in str(spec.type).split("|")]
        value = getattr(config, spec.name)
        if (value is None and "None" in kinds) or not all(k in _FIELD_TYPES or k == "None" for k in kinds):
            continue
        taken = [k for k in kinds if k != "None"]
        if any(isinstance(value, _FIELD_TYPES[k][0]) and (k == "bool" or not isinstance(value, bool)) for k in taken):
            continue
        where = f"{section}: {spec.name}" if section else spec.name
        words = " or ".join(_FIELD_TYPES[k][1] for k in taken) + (" (or none)" if "None" in kinds else "")
        fix = (hints or {}).get(spec.name) or (f"write it like {spec.default!r}" if isinstance(spec.default, str)
                                               else f"write it as {words}")
        raise LayercutError(f"{where} must be {words}, got {value!r} ({type(value).__name__}): {fix}")


@dataclass
class DataConfig:
    """What to calibrate on.

    Attributes:
        data: file path, ``datasets`` spec (``wikitext:wikitext-2-raw-v1:train``), ``self`` (text
            sampled from the model), a weighted mixture of these (``a.txt@0.7,self@0.3``) or None for
            :data:`DEFAULT_DATA` (the built-in corpus and self-sampled text, half each).
        samples: number of packed sequences.
        seq_len: tokens per sequence.
        seed: picks which sequences; same seed, same tokens.
        text_field: column holding the text in jsonl / parquet / datasets rows.
        heldout_samples: sequences of the same text set aside, disjoint from the calibration ones, to
            measure the pruned model on (fewer when the text has no more).
    """

    data: str | None = None
    samples: int = 64
    seq_len: int = 512
    seed: int = 0
    text_field: str = "text"
    heldout_samples: int = 8

    def __post_init__(self):
        numeric_fields(self, "data")  # a recipe's "64" is 64; its "eight" a one-line error
        typed_fields(self, "data")
        if self.data is None:  # spelled out, so reports and resumed comparisons name what was read
            self.data = DEFAULT_DATA
        if self.samples <= 0:
            raise LayercutError(f"--samples must be positive, got {self.samples}")
        check_seq_len(self.seq_len)
        if not isinstance(self.heldout_samples, int) or self.heldout_samples < 0:
            raise LayercutError(f"--heldout-samples must be an integer >= 0, got {self.heldout_samples}")
        sources = parse_sources(self.data)
        if len(sources) > self.samples and self.data == DEFAULT_DATA:
            raise LayercutError(f"--samples {self.samples}: the default calibration ({DEFAULT_DATA}) takes a sequence "
                                f"from each of its {len(sources)} sources: raise --samples to at least "
                                f"{len(sources)} or pass --data builtin")
        if len(sources) > self.samples:
            raise LayercutError(f"--data mixes {len(sources)} sources but --samples is {self.samples}: raise "
                                f"--samples to at least {len(sources)}")

    @property
    def sources(self) -> list[Source]:
        """The sources of ``data`` with their normalised weights (one, weight 1, unless a mixture)."""
        return parse_sources(self.data)

    @property
    def num_tokens(self) -> int:
        """Tokens asked for: samples x seq_len."""
        return self.samples * self.seq_len


@dataclass
class CalibrationData:
    """Packed token ids and where they came from."""

    token_ids: torch.Tensor  # [samples, seq_len] int64
    source: str
    heldout_ids: torch.Tensor | None = None  # [heldout samples, seq_len], disjoint from token_ids
    # a mixture's parts: source, weight, samples, heldout (sequences each gave); None for one source
    mixture: list[dict] | None = None
    # held-out sequences of each source in --data order, by source description (may hold 0 rows)
    heldout_by_source: dict[str, torch.Tensor] = field(default_factory=dict)
    # a mixture's source of each row of token_ids, as an index into --data's order; None for one source
    row_sources: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Number of tokens in all sequences."""
        return self.token_ids.numel()

    def describe(self) -> dict:
        """JSON-ready summary for reports."""
        samples, seq_len = self.token_ids.shape
        summary = {"source": self.source, "samples": samples, "seq_len": seq_len, "tokens": self.num_tokens}
        if self.mixture is not None:
            summary["mixture"] = [dict(part) for part in self.mixture]
        return summary



def check_sources(config: DataConfig) -> None:
    """Read every local file of ``config.data`` now, so a bad or missing one fails before the model loads.

    Datasets specs are left to the read after loading: reaching the hub is not a cheap check.
    """
    for source in config.sources:
        if source.spec is None or source.is_self:
            continue
        path = Path(source.spec).expanduser()
        if path.is_file() or (not path.exists() and names_a_file(source.spec)):
            load_documents(source.spec, config.text_field)


def names_a_file(spec: str) -> bool:
    """Whether ``spec`` is spelled as a path (a known suffix, or starting with ``.``, ``/``, ``~``), not a dataset."""
    return Path(spec).suffix in FILE_SUFFIXES or spec.startswith((".", "/", "~"))


def default_corpus_text() -> str:
    """The built-in calibration corpus (public domain, see ``prune/data/corpus/LICENSE.md``)."""
    return resources.files("prune.data").joinpath("corpus", DEFAULT_CORPUS).read_text(encoding="utf-8")


def load_documents(spec: str | None, text_field: str = "text", flag: str = "--data") -> tuple[list[str], str]:
    """Documents named by ``spec`` and a short description of the source; errors name ``flag``."""
    if spec is None:
        return [default_corpus_text()], f"built-in:{DEFAULT_CORPUS}"
    path = Path(spec).expanduser()
    if path.exists():
        documents = _read_file(path, text_field)
        if not any(document.strip() for document in documents):  # else "0 sequences" only after the model loads
            why = ("it is empty or only whitespace" if path.suffix == ".txt" or _blank(path)
                   else f"no row has text in its '{text_field}' field")
            raise LayercutError(f"{flag} file {path} holds no text ({why}): pass a file with the text to read")
        return documents, str(path.resolve())
    if "," in spec or spec == SELF or spec.startswith(SELF + ":"):
        raise LayercutError(f"{flag} takes one text source here, got '{spec}': pass a single .txt/.jsonl/.parquet "
                            "file or datasets spec")
    if names_a_file(spec):
        raise LayercutError(f"data file '{spec}' not found: pass an existing .txt/.jsonl/.parquet file to {flag}")
    return _read_dataset(spec, text_field), f"datasets:{spec}"


def _read_file(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".txt":
        try:
            return [path.read_text(encoding="utf-8")]
        except UnicodeDecodeError as err:
            raise LayercutError(
                f"{path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}): convert it, "
                f"e.g. iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8.txt"
            ) from None
    if path.suffix not in FILE_SUFFIXES[1:]:
        raise LayercutError(f"unsupported data file '{path}': use .txt, .jsonl, .json or .parquet")
    if _blank(path):  # datasets fails on an empty file with a StopIteration traceback
        return []
    import datasets

    kind = "parquet" if path.suffix == ".parquet" else "json"
    rows = datasets.load_dataset(kind, data_files=str(path), split="train")
    return _column(rows, text_field, str(path))


def _blank(path: Path) -> bool:
    """Whether a file holds only whitespace (read until its first other byte: at once for any real file)."""
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _read_dataset(spec: str, text_field: str) -> list[str]:
    import datasets

    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        rows = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as err:  # datasets raises many types for a bad name or no network
        raise LayercutError(
            f"could not load dataset '{spec}' ({type(err).__name__}): use name[:config[:split]] of a reachable "
            "dataset, or a local .txt/.jsonl/.parquet file"
        ) from err
    return _column(rows, text_field, spec)


def _column(rows, text_field: str, where: str) -> list[str]:
    if text_field not in rows.column_names:
        raise LayercutError(
            f"{where} has no column '{text_field}' (columns: {', '.join(rows.column_names)}); pass --text-field"
        )
    return [t for t in rows[text_field] if t and t.strip()]


def _pack(documents: list[str], tokenizer, samples: int, heldout_samples: int, seq_len: int, seed: int | str,
          what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` windows of ``seq_len`` tokens, and up to ``heldout_samples`` others, from ``documents``.

    Documents are read in a seeded order and only as many as needed, as packed text
    (:mod:`prune.data.windows`: no special tokens, EOS after each). The windows do not overlap and are
    drawn with the same seed, so the same arguments always give the same tokens. The held-out windows
    are drawn afterwards from the ones calibration left, so asking for them never changes the
    calibration tokens.
    """
    rng = random.Random(seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    stream = token_stream(tokenizer, (documents[index] for index in order), limit=2 * samples * seq_len)
    ids = cut_windows(stream, seq_len)  # [windows, seq_len]
    windows = ids.shape[0]
    if windows < samples:
        raise LayercutError(
            f"{what} has {stream.numel()} tokens, {windows} sequences of {seq_len}; "
            f"{samples} were asked for: give more text with --data or lower --samples / --seq-len"
        )
    chosen = sorted(rng.sample(range(windows), samples))
    rest = sorted(set(range(windows)) - set(chosen))
    heldout = sorted(rng.sample(rest, min(heldout_samples, len(rest))))
    if len(heldout) < heldout_samples:
        logger.warning("the %s leaves %d held-out sequences of the %d asked for", what, len(heldout), heldout_samples)
    return ids[chosen], ids[heldout]  # [samples, seq_len], [heldout, seq_len]


def _source_seed(seed: int, index: int, mixed: bool) -> int:
    """The seed of a mixture's ``index``-th source; a lone source keeps ``seed`` (its tokens stay as before)."""
    if not mixed:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "big") >> 1


def _draw_source(source: Source, tokenizer, config: DataConfig, samples: int, heldout: int, seed: int,
                 model) -> tuple[torch.Tensor, torch.Tensor, str]:
    """[samples, seq_len] and [heldout, seq_len] token ids of one source, and its description."""
    if source.is_self:
        if model is None and config.data == DEFAULT_DATA:
            raise LayercutError(f"the default calibration ({DEFAULT_DATA}) samples half its text from the model, and "
                                "this command does not pass the model to the calibration step: pass --data builtin "
                                "or another text source")
        if model is None:
            raise LayercutError("--data self samples text from the model, and this command does not pass the model "
                                "to the calibration step: use a text source for --data")
        ids = cached_samples(model, tokenizer, samples + heldout, config.seq_len, seed, **dict(source.sampling))
        return ids[:samples], ids[samples:], source.label()
    documents, described = load_documents(source.spec, config.text_field)
    what = "calibration text" if source.weight == 1.0 else f"calibration text {described}"
    calibration, held = _pack(documents, tokenizer, samples, heldout, config.seq_len, seed, what)
    return calibration, held, described


def calibration_data(tokenizer, config: DataConfig, model=None) -> CalibrationData:
    """Read, tokenize and pack the calibration text described by ``config``.

    Args:
        tokenizer: the model's tokenizer.
        config: what to read and how much.
        model: the model itself, needed only when ``config.data`` holds ``self`` (text it samples).
    """
    sources = config.sources
    mixed = len(sources) > 1
    weights = [source.weight for source in sources]
    samples, heldouts = shares(config.samples, weights), shares(config.heldout_samples, weights)
    for source, count in zip(sources, samples, strict=True):
        if count == 0:
            raise LayercutError(f"--data source '{source.label()}' gets 0 of {config.samples} sequences at weight "
                                f"{source.weight:.3g}: raise --samples or its weight")
    parts, calibration, heldout_by_source = [], [], {}
    for index, (source, count, held) in enumerate(zip(sources, samples, heldouts, strict=True)):
        ids, held_ids, described = _draw_source(source, tokenizer, config, count, held,
                                                _source_seed(config.seed, index, mixed), model)
        if described in heldout_by_source:
            raise LayercutError(f"--data names {described} twice: give it once with the sum of its weights")
        calibration.append(ids)
        heldout_by_source[described] = held_ids
        parts.append({"source": described, "weight": round(source.weight, 6), "samples": int(ids.shape[0]),
                      "heldout": int(held_ids.shape[0])})
    ids = torch.cat(calibration)  # [samples, seq_len]
    row_sources = None
    if mixed:  # interleave the sources, so any prefix of the sequences is a mixture too
        order = list(range(ids.shape[0]))
        random.Random(config.seed).shuffle(order)
        ids = ids[order]
        row_sources = torch.repeat_interleave(torch.arange(len(sources)), torch.tensor(samples))[order]
        source = "mixture(" + ", ".join(f"{part['source']}@{part['weight']:.3g}" for part in parts) + ")"
    else:
        source = parts[0]["source"]
    heldout = torch.cat(list(heldout_by_source.values()))  # [heldout, seq_len]
    logger.info("calibration data: %d x %d tokens from %s (%d sequences held out)", ids.shape[0], ids.shape[1],
                source, heldout.shape[0])
    return CalibrationData(ids, source, heldout if heldout.shape[0] else None, parts if mixed else None,
                           heldout_by_source, row_sources)
