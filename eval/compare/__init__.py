"""Every method recipe x every drop on one model, one calibration set, one table (``python -m eval.compare``).

    python -m eval.compare --model smollm2-135m --drop 2,4,6,8 --methods all --out cmp/
    python -m eval.compare --model smollm2-135m --drop 4 --methods shortgpt,sleb,linearpatch
        --heldout ../shared/data/austen/emma.txt --tasks arc_easy,piqa --limit 200 --out cmp4/
    python -m eval.compare --model smollm2-135m --drop 4,8 --methods shortgpt,layercut-linear
        --data "emma.txt@0.5,wikitext:wikitext-2-raw-v1:train@0.5"
        --heldout novel=persuasion.txt,news=ptb.test.txt,wiki=wiki.test.txt
        --tasks arc_easy,hellaswag,piqa,lambada --out cmp-domains/
    python -m eval.compare --methods list

A method is a recipe in ``recipes/methods/`` (named by its file stem) or any recipe file. The model is
loaded once, the calibration text is drawn and scored once (all scores, all pairwise cosines), and every
cell (method, drop) runs ``prune.pipeline.runner.run_prune`` on a fresh copy of the model with those shared
statistics. Each cell reports the blocks removed, parameters, held-out perplexity on each domain of
text calibration never saw and their geometric mean (``--heldout novel.txt,news=ptb.txt,...``, one domain
per entry, named by file stem or ``name=``; default: the calibration's held-out sequences, one domain
per source of a ``--data`` mixture, disjoint from the calibration ones), optional lm-eval tasks with their
standard errors, the task mean and the task retention above chance, decode speed-up over the dense
model, wall time and whether its export is a vanilla transformers checkpoint.

Task retention: the sum over tasks of (accuracy - chance) divided by the same sum for the dense
model, over the tasks where the dense model is clearly above chance (by more than two standard
errors); chance is 1 / the choices a row offers (0 for LAMBADA's open next word). A task difference
under two standard errors is a tie; the standard error of a difference is paired, from the two models'
row-by-row scores on the same rows (kept in ``results.json``), so a real gap of a point or two shows.
Method A is *better* than B at a drop only when A has the lower perplexity on every domain and, with
``--tasks``, a retention higher by two standard errors or more. A repair (a replacement, or training after
removal) is also set against the plain removal of exactly its blocks when that row ran ("vs removal of its
blocks"): removal of other blocks is no baseline for it.
Rerunning with more ``--heldout`` domains or ``--tasks`` measures only what is missing: the dense model on
the new ones, and each finished cell of the ``--methods`` x ``--drop`` asked for on its own weights when
``--keep-checkpoints`` kept them under ``cells/``. Those weights are first checked to give the row's own
perplexity on a domain it already has; when they do not, or were not kept, the cell runs again, so a
figure is never one of another model. Every task figure of one comparison is taken at one ``--limit``, and
every cell is fitted on one calibration: ``results.json`` keeps a digest of its tokens and the weights, and a
resumed run whose calibration differs (text sampled again differently) is refused.
A method the model refuses (a fold on sandwich norms, read from its config before the model loads; a span
that ends the model, found once its cell runs) is entered under ``refused`` in ``results.json`` and the
README's "Refused" table with its one-line reason, and the other cells run; a resumed run tries it again
once its recipe changes. Naming only methods the model refuses is a one-line error.
``--oracle`` adds SLEB's oracle (calibration perplexity with each block alone removed) and every
score's Spearman correlation with it.

Writes to ``--out``: ``results.json`` (after every cell: rerunning skips finished cells, so a crash or
Ctrl-C loses at most one), ``README.md`` (a leaderboard per drop, dense row on top, best first),
``perplexity_vs_blocks.png``, ``chosen_blocks.png``, ``oracle.md`` with ``--oracle``, ``measurements.json``
(every calibration perplexity measured with blocks or sub-layers removed, for SLEB, the oracle and the
measured sub-layer ranking, written as each is taken and read back by a resumed run on the same model
and calibration: ``eval.compare.measurements``), and each cell's reports under ``cells/<method>-drop<K>/``
(weights too with ``--keep-checkpoints``).
"""

from eval.compare.config import CompareConfig, method_list, parse_drops, parse_methods
from eval.compare.grid import run_comparison, summary_lines
from eval.compare.results import FORMAT, Results, Row, migrate, read_results

__all__ = ["FORMAT", "CompareConfig", "Results", "Row", "method_list", "migrate", "parse_drops", "parse_methods",
           "read_results", "run_comparison", "summary_lines"]
