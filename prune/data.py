"""Calibration text: read it, tokenize it, pack it into fixed-length sequences.

Sources: a local ``.txt`` (one document), ``.jsonl`` / ``.json`` / ``.parquet`` (one document per row),
a ``datasets`` spec ``name[:config[:split]]``, or the built-in public-domain corpus shipped inside
the package (Jane Austen's *Pride and Prejudice*).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from prune.errors import LayercutError

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "austen_pride_and_prejudice.txt"
FILE_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")


def check_seq_len(seq_len: int, flag: str = "--seq-len") -> None:
    """A sequence must hold at least two tokens: one to predict from, one to predict."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise LayercutError(f"{flag} must be at least 2, got {seq_len}")


@dataclass
class DataConfig:
    """What to calibrate on.

    Attributes:
        data: file path, ``datasets`` spec (``wikitext:wikitext-2-raw-v1:train``) or None for the
            built-in corpus.
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
        if self.samples <= 0:
            raise LayercutError(f"--samples must be positive, got {self.samples}")
        check_seq_len(self.seq_len)
        if not isinstance(self.heldout_samples, int) or self.heldout_samples < 0:
            raise LayercutError(f"--heldout-samples must be an integer >= 0, got {self.heldout_samples}")

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

    @property
    def num_tokens(self) -> int:
        """Number of tokens in all sequences."""
        return self.token_ids.numel()

    def describe(self) -> dict:
        """JSON-ready summary for reports."""
        samples, seq_len = self.token_ids.shape
        return {"source": self.source, "samples": samples, "seq_len": seq_len, "tokens": self.num_tokens}


def default_corpus_text() -> str:
    """The built-in calibration corpus (public domain, see ``prune/corpus/LICENSE.md``)."""
    return resources.files("prune").joinpath("corpus", DEFAULT_CORPUS).read_text(encoding="utf-8")


def load_documents(spec: str | None, text_field: str = "text", flag: str = "--data") -> tuple[list[str], str]:
    """Documents named by ``spec`` and a short description of the source; errors name ``flag``."""
    if spec is None:
        return [default_corpus_text()], f"built-in:{DEFAULT_CORPUS}"
    path = Path(spec).expanduser()
    if path.exists():
        return _read_file(path, text_field), str(path.resolve())
    if path.suffix in FILE_SUFFIXES or spec.startswith((".", "/", "~")):
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
    import datasets

    kind = "parquet" if path.suffix == ".parquet" else "json"
    rows = datasets.load_dataset(kind, data_files=str(path), split="train")
    return _column(rows, text_field, str(path))


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


def pack_with_heldout(documents: list[str], tokenizer, config: DataConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize, join with EOS, and cut ``config.samples`` windows of ``config.seq_len`` tokens, plus held-out ones.

    Documents are read in a seeded order and only as many as needed; the windows do not overlap and
    are drawn with the same seed, so the same config always gives the same tokens. Up to
    ``config.heldout_samples`` more windows are drawn afterwards from the ones calibration left, so
    asking for them never changes the calibration tokens.
    """
    rng = random.Random(config.seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for index in order:
        # verbose=False: a whole book is longer than model_max_length by design; windows are cut below
        stream += tokenizer(documents[index], add_special_tokens=False, verbose=False)["input_ids"] + separator
        if len(stream) >= 2 * config.num_tokens:  # enough to choose from without reading everything
            break
    windows = len(stream) // config.seq_len
    if windows < config.samples:
        raise LayercutError(
            f"calibration text has {len(stream)} tokens, {windows} sequences of {config.seq_len}; "
            f"{config.samples} were asked for: give more text with --data or lower --samples / --seq-len"
        )
    chosen = sorted(rng.sample(range(windows), config.samples))
    rest = sorted(set(range(windows)) - set(chosen))
    heldout = sorted(rng.sample(rest, min(config.heldout_samples, len(rest))))
    if len(heldout) < config.heldout_samples:
        logger.warning("the calibration text leaves %d held-out sequences of the %d asked for", len(heldout),
                       config.heldout_samples)
    ids = torch.tensor(stream[: windows * config.seq_len], dtype=torch.long).view(windows, config.seq_len)
    return ids[chosen], ids[heldout]  # [samples, seq_len], [heldout, seq_len]


def calibration_data(tokenizer, config: DataConfig) -> CalibrationData:
    """Read, tokenize and pack the calibration text described by ``config``."""
    documents, source = load_documents(config.data, config.text_field)
    ids, heldout = pack_with_heldout(documents, tokenizer, config)
    logger.info("calibration data: %d x %d tokens from %s (%d sequences held out)", ids.shape[0], ids.shape[1],
                source, heldout.shape[0])
    return CalibrationData(ids, source, heldout if heldout.shape[0] else None)
