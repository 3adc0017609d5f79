"""The held-out perplexity domains of a comparison: which texts, read and tokenized once, and how a model scores."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.compare.results import has_domains
from eval.quality.perplexity import tokenize_text
from prune.data.calibration import FILE_SUFFIXES, DataConfig, load_documents
from prune.errors import LayercutError
from prune.measure.heldout import packed_perplexity
from prune.measure.perplexity import perplexity
from prune.pipeline.runner import Scored


@dataclass(frozen=True)
class Domain:
    """One held-out perplexity domain.

    Attributes:
        name: its column in the tables.
        spec: the file or datasets spec read; None: the calibration's held-out sequences.
        part: with ``spec`` None, which ``--data`` source's held-out sequences (None: all of them).
    """

    name: str
    spec: str | None
    part: int | None = None

    @property
    def key(self) -> str:
        """What the domain's figures were measured on; a name whose key changed is measured again."""
        if self.spec is not None:
            return source_key(self.spec)
        return f"calibration held-out {'all' if self.part is None else self.part}"


def source_key(spec: str) -> str:
    """A file by its absolute path, so one text named from another folder, or by a relative path, is one text."""
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.is_file() else spec


def _domain_name(spec: str) -> str:
    path = Path(spec).expanduser()
    if path.suffix in FILE_SUFFIXES or path.exists():
        return path.stem
    return spec.replace("/", "-").replace(":", "-")  # a datasets spec


def _calibration_domains(data: DataConfig) -> list[Domain]:
    """No ``--heldout``: the calibration's held-out sequences, one domain per source of a mixture."""
    sources = data.sources
    if len(sources) == 1:
        return [Domain("heldout", None)]
    names = [_domain_name(source.label()) if not source.is_self else "self" for source in sources]
    return [Domain(name, None, index) for index, name in enumerate(names)]


def plan_domains(heldout: str | None, data: DataConfig) -> list[Domain]:
    """The held-out domains ``heldout`` names, before anything is loaded; bad spellings are one-line errors."""
    if heldout is None:
        return _calibration_domains(data)
    items = [heldout] if Path(heldout).expanduser().exists() else [item.strip() for item in heldout.split(",")]
    domains = []
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or Path(item).expanduser().exists():
            name, spec = _domain_name(item), item
        if not name.strip() or not spec.strip():
            raise LayercutError(f"--heldout entry '{item}' is empty: give FILE or NAME=FILE, e.g. "
                                "novel=emma.txt,news=ptb.txt")
        domains.append(Domain(name.strip(), spec.strip()))
    names = [domain.name for domain in domains]
    for name in names:
        if names.count(name) > 1:
            raise LayercutError(f"--heldout names the domain '{name}' twice: name them apart, e.g. "
                                f"{name}1=FIRST.txt,{name}2=SECOND.txt")
    for domain in domains:
        path = Path(domain.spec).expanduser()
        if path.is_file() or path.suffix in FILE_SUFFIXES or domain.spec.startswith((".", "/", "~")):
            load_documents(domain.spec, flag="--heldout")  # a bad file's one-line error, before the model loads
    return domains


class Heldout:
    """The held-out domains, tokenized once, and how to score a model on them.

    Args:
        domains: from :func:`plan_domains`.
        scored: the shared calibration (its held-out sequences serve the domains without a text).
        tokenizer: the model's tokenizer.
        seq_len: tokens per scored window.
        batch_size: windows per forward pass.
        max_tokens: score only the first this many tokens of each text (None: all).
    """

    def __init__(self, domains: list[Domain], scored: Scored | None, tokenizer, seq_len: int, batch_size: int,
                 max_tokens: int | None = None):
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.domains = domains
        self.ids: dict[str, torch.Tensor] = {}  # name -> 1-D stream of a text
        self.packed: dict[str, torch.Tensor] = {}  # name -> [sequences, seq_len] calibration held-out
        self.describe: dict = {"domains": {}}
        for domain in self.domains:
            if domain.spec is not None:
                documents, source = load_documents(domain.spec, flag="--heldout")
                ids = tokenize_text(tokenizer, "\n\n".join(documents))
                self.ids[domain.name] = ids[:max_tokens] if max_tokens else ids
                tokens = int(self.ids[domain.name].numel())
            else:
                source, self.packed[domain.name] = self._calibration_part(scored, domain)
                tokens = int(self.packed[domain.name].numel())
            self.describe["domains"][domain.name] = {"source": source, "tokens": tokens, "key": domain.key}

    @staticmethod
    def _calibration_part(scored: Scored | None, domain: Domain) -> tuple[str, torch.Tensor]:
        calibration = scored.calibration if scored is not None else None
        if domain.part is None:
            heldout, source = (calibration.heldout_ids, calibration.source) if calibration else (None, "")
        else:
            source, heldout = list(calibration.heldout_by_source.items())[domain.part]
        if heldout is None or heldout.numel() == 0:
            raise LayercutError(f"no held-out text for the domain '{domain.name}': pass --heldout FILE or raise "
                                "--heldout-samples")
        return f"{source} (held-out sequences, disjoint from calibration)", heldout

    def names(self) -> list[str]:
        """The domain names in order."""
        return [domain.name for domain in self.domains]

    def streams(self) -> list[torch.Tensor]:
        """Each domain's tokens as one 1-D stream, in domain order (calibration sequences laid end to end)."""
        return [self.packed[name].reshape(-1) if name in self.packed else self.ids[name] for name in self.names()]

    def perplexity(self, model, name: str) -> float:
        """Held-out perplexity of ``model`` on the domain ``name``."""
        if name in self.packed:
            return packed_perplexity(model, self.packed[name], self.batch_size, progress=False)
        return perplexity(model, self.ids[name], seq_len=self.seq_len, batch_size=self.batch_size,
                          progress=False).perplexity


def mean_perplexity(domains: dict[str, float], names: list[str]) -> float:
    """Geometric mean of the perplexities of ``names``: the perplexity of their mean per-token loss."""
    return math.exp(sum(math.log(domains[name]) for name in names) / len(names))


def measure_domains(model, heldout: Heldout, row: dict, names: list[str] | None = None) -> None:
    """Put the perplexity of each domain (``names``, default all) and their mean into ``row``."""
    domains = row.setdefault("domains", {})
    for name in names if names is not None else heldout.names():
        domains[name] = heldout.perplexity(model, name)
    row["heldout_ppl"] = mean_perplexity(domains, heldout.names())


def reconcile_domains(results, domains: list[Domain]) -> None:
    """Forget every figure of a domain whose name now means another text, so it is measured again."""
    measured = results.heldout.get("domains", {})
    for domain in domains:
        # keys written as relative paths compare by the file they name
        if domain.name in measured and source_key(measured[domain.name].get("key", "")) != domain.key:
            for row in results.rows():
                row.get("domains", {}).pop(domain.name, None)


def refresh_rows(results, names: list[str]) -> None:
    """Mean perplexity and ratios of every row over the domains ``names`` (the ones asked for now)."""
    results.domains = list(names)
    dense = results.dense
    if not has_domains(dense, names):
        return
    dense["heldout_ppl"] = mean_perplexity(dense["domains"], names)
    for row in results.cells.values():
        if has_domains(row, names):
            row["heldout_ppl"] = mean_perplexity(row["domains"], names)
            row["heldout_ratio"] = row["heldout_ppl"] / dense["heldout_ppl"]
            row["domain_ratios"] = {name: row["domains"][name] / dense["domains"][name] for name in names}
