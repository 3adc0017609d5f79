"""Bytes each stage of a run holds, per device: the memory half of ``prune.planner.estimate``.

Every figure is a product of shapes (``prune.planner.shape.ModelShape``) and options
(``prune.planner.estimate.PlanInput``), named for what it is so the printed plan can say what fills a device.
The buffers counted are the ones the code keeps alive (read off ``prune.measure.moments``, ``prune.measure.perplexity``,
``prune.replace`` and ``distill.losses``):

- scoring: the weights, one block's forward activations and the streamed moments, one float64 [d, d]
  Gram per residual state and one cross Gram per block (kept until the run ends);
- evaluation: the held-out perplexity's logits, [batch, seq, vocab], counted as two float32 copies on a CPU (the
  logits and one row's chunk of their log-softmax are alive; the allocator keeps what the fits freed);
- fitting: a closed-form fit's three float64 [d, d] sums per span and the recorded span inputs and outputs;
- a repaired selection (``prune.ship``'s shortlist): the measuring rows' moments beside the others, the scores'
  cached decompositions, every repair's fit sums at once, and the original's float32 log-probabilities of the
  measuring rows with the states entering each block (``prune.selection.repaired``);
- distillation: student and teacher weights, what is trained with its gradient and two AdamW states,
  the activations backward needs, and the KL's float32 logits of teacher and student (from a teacher cache, a
  chunk of positions' logits through the head: ``distill.head_kl``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prune.measure.perplexity import LOGPROB_POSITIONS
from prune.planner.inputs import LORA_ALL
from prune.planner.shape import ModelShape

if TYPE_CHECKING:
    from prune.planner.inputs import PlanInput

# NF4 with double quantization: 4 bits, an 8-bit absmax per 64 weights, a float32 scale per 256 absmax
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
INT8_BYTES = 1.0
# Python, torch, transformers, the tokenizer and the calibration text: VmHWM of a process that imported
# prune.run, loaded SmolLM2-135M's tokenizer and drew its calibration, less the weights (2026-11-27, this
# 2-core machine: 1.07 GB with 0.54 GB of weights)
CPU_BASELINE_BYTES = 0.53e9
# a CUDA context and cuBLAS workspace per GPU, outside torch's allocator (assumption: 0.5-1 GB on an H100)
CUDA_CONTEXT_BYTES = 1.0e9
# copies of [batch, seq, vocab] float32 logits counted for a perplexity pass on a CPU. Alive: the logits, the
# log-softmax's buffer of one row's chunk (prune.measure.perplexity.log_prob_chunks) and the head's activations,
# 0.45 GB above the loaded model for 4 x 512 x 49152 on SmolLM2-135M = 1.12 copies (2026-12-05; 3.05 before the
# log-softmax went a row's chunk at a time into one buffer). Counted as 2: a run's held-out pass comes after the
# fits, whose freed memory the allocator keeps, and prune.run's peak RSS on SmolLM2-135M (8 x 512 tokens, drop 4,
# fold) read 1.87-2.15 GB in four runs that day, 2.07 GB planned so. Tight on purpose: a repaired selection's
# passes (stage_selection) count their logits with it too.
PERPLEXITY_LOGIT_COPIES = 2
# float32 [batch, seq, vocab] tensors alive at the KL's peak: both log-softmaxes, the teacher's
# probabilities, their difference and product, the student's gradient (distill.losses.teacher_student_kl)
KL_LOGIT_COPIES = 7
# float32 [LOGPROB_POSITIONS, vocab] chunks of one row alive as ``prune.selection.repaired.divergence`` sums its KL: two
# buffers every chunk reuses (the model's log-probabilities, the original's probabilities) and 16-bit logits'
# float32 copy
KL_CHUNK_COPIES = 3
# activations saved for backward per token and block, in units of (hidden, intermediate) elements: the
# Korthikanti et al. (2022) count without the attention matrix (SDPA keeps none), for SwiGLU blocks
TRAIN_ACT_HIDDEN, TRAIN_ACT_INTERMEDIATE = 10, 4
# frozen weights save no inputs for their own gradients: backward through them keeps ~60 % of the above
FROZEN_ACT_SHARE = 0.6
# the forward of one block alive at once (no grad): residual, norm, q/k/v/o, the stats' float32 rows; MLP
FWD_ACT_HIDDEN, FWD_ACT_INTERMEDIATE = 8, 4

Parts = dict[str, float]


def weight_bytes(shape: ModelShape, inp: PlanInput, blocks: float, *, embed: bool = True,
                 head: bool = True) -> float:
    """Bytes of ``blocks`` blocks (plus the embedding and head when asked) in ``inp``'s dtype and quantization."""
    dense = inp.dtype_bytes
    linear = {4: NF4_BYTES, 8: INT8_BYTES}.get(inp.quant_bits, dense)
    block = shape.block_linear_params * linear + (shape.block_params - shape.block_linear_params) * dense
    rest = (shape.embed_params if embed else 0) + (shape.head_params + shape.other_params if head else 0)
    return blocks * block + rest * dense


def placed(shape: ModelShape, inp: PlanInput, blocks: int, gpus: int) -> list[float]:
    """Weight bytes per device when ``blocks`` blocks are spread over ``gpus`` devices (accelerate's device map).

    The first device holds the embedding, the last the head; blocks are shared out in order.
    """
    gpus = max(1, gpus)
    per = math.ceil(blocks / gpus)
    return [weight_bytes(shape, inp, min(per, max(0, blocks - i * per)), embed=i == 0, head=i == gpus - 1)
            for i in range(gpus)]


def moment_bytes(shape: ModelShape) -> float:
    """The scoring pass's float64 moments: a Gram per state (L + 1) and a cross Gram per block (L)."""
    return (2 * shape.layers + 1) * shape.hidden ** 2 * 8


def fit_bytes(shape: ModelShape, spans: int, width: int | None = None) -> float:
    """A closed-form fit's float64 sums per span: the regressor's Gram, its cross Gram with the target, the target's.

    ``width``: the regressor's (the method's ``fit_width``; None: the hidden size).
    """
    width = shape.hidden if width is None else width
    return spans * (width ** 2 + width * shape.hidden + shape.hidden ** 2) * 8


def decomposition_bytes(shape: ModelShape) -> float:
    """The scores' eigendecompositions of every block's input Gram (float64 eigenvalues and [d, d] vectors).

    ``StateMoments.gram_eigh`` keeps each one beside the moments, so every later score and fit starting at that
    state reads it instead of decomposing again: once every block is scored, L of them live as long as the moments.
    """
    return shape.layers * (shape.hidden ** 2 + shape.hidden) * 8


def solve_bytes(width: int) -> float:
    """A closed-form solve's float64 workspace at ``width``: three [width, width] matrices at once.

    The centred Gram and its uncentred copy with the outer product between them (``prune.replace.fold.uncentred``),
    or the ridged copy and its factor (``prune.measure.least_squares``, ``prune.replace.rotate._factor``).
    """
    return 3 * width ** 2 * 8


def fitted_map_bytes(shape: ModelShape, spans: float, widths: Sequence[int]) -> float:
    """The fits kept once solved, ``spans`` of each width in ``widths``: a float64 [width, d] map each, at most.

    A rotating fold keeps that (its map and its rotation); a fold's or a cosine's patch is one projection in the
    model's dtype, a magnitude factor nothing: an upper bound, not a measure.
    """
    return spans * sum(width * shape.hidden for width in widths) * 8


def logits_left_to_head(shape: ModelShape) -> bool:
    """Whether a measuring pass makes a candidate's logits a row's chunk at a time (``prune.model.head``).

    Where no config field caps or scales the logits after the head; a skeleton too (it holds its head and final
    norm whole). A model with something between its norm and its head (OPT's ``project_out``) is counted so too,
    though it keeps its whole logits.
    """
    return not shape.logits_after_head


def measuring_logit_bytes(shape: ModelShape, inp: PlanInput, rows: int) -> float:
    """A repaired selection's vocabulary-wide logits while it measures on ``rows`` calibration rows.

    The original's float32 log-probabilities of every measuring row stay for the whole measuring, shared by
    every repair (``prune.selection.repaired.shared_references``), beside one batch of a candidate's logits in
    the model's dtype (none where they are made a row's chunk at a time: :func:`logits_left_to_head`) and the KL's
    chunks of one row's positions (:data:`KL_CHUNK_COPIES`).
    """
    batch = 0 if logits_left_to_head(shape) else min(inp.batch_size, rows)
    chunks = KL_CHUNK_COPIES * min(LOGPROB_POSITIONS, inp.seq_len) * 4
    return ((rows * 4 + batch * inp.act_bytes) * inp.seq_len + chunks) * shape.vocab


def measuring_state_bytes(shape: ModelShape, inp: PlanInput, rows: int) -> float:
    """The original's state entering every block over the measuring rows, kept with its log-probabilities.

    A candidate's pass starts at the first block it changes, from the state kept there
    (``prune.selection.oracle.logits_and_states``).
    """
    return shape.layers * rows * inp.seq_len * shape.hidden * inp.act_bytes


def map_params(shape: ModelShape, inp: PlanInput) -> int:
    """Parameters of the replacement maps: ``h A + b`` per span (0 for plain removal)."""
    return 0 if inp.replace == "none" else inp.spans * (shape.hidden ** 2 + shape.hidden)


def forward_bytes(shape: ModelShape, inp: PlanInput, tokens: int) -> float:
    """One block's forward activations over ``tokens`` tokens, no grad."""
    return tokens * (FWD_ACT_HIDDEN * shape.hidden + FWD_ACT_INTERMEDIATE * shape.intermediate) * inp.act_bytes


def perplexity_logit_bytes(shape: ModelShape, inp: PlanInput) -> float:
    """The held-out perplexity's logits of one batch (float32 copies, and the model-dtype ones on a GPU)."""
    tokens = inp.batch_size * inp.seq_len
    per_token = PERPLEXITY_LOGIT_COPIES * 4 + (inp.act_bytes if inp.act_bytes != 4 else 0)
    return tokens * shape.vocab * per_token


def divergence_logit_bytes(shape: ModelShape, inp: PlanInput, rows: int | None = None) -> float:
    """The KL of one model against another (``prune.selection.repaired.divergence``): its vocabulary-wide tensors.

    One batch's float32 log-probabilities of the original and logits of the model (none where they are made a
    row's chunk at a time: :func:`logits_left_to_head`), and beside them the KL's chunks of one row's positions
    (:data:`KL_CHUNK_COPIES`). ``rows``: the rows measured (a batch holds no more of them; None: a whole batch).
    """
    chunk = min(LOGPROB_POSITIONS, inp.seq_len)
    batch = inp.batch_size if rows is None else min(inp.batch_size, rows)
    model = 0 if logits_left_to_head(shape) else inp.act_bytes
    return shape.vocab * (batch * inp.seq_len * (4 + model) + KL_CHUNK_COPIES * chunk * 4)


def train_activation_bytes(shape: ModelShape, blocks: int, tokens: int, act_bytes: float, train: str) -> float:
    """Activations backward keeps over ``blocks`` blocks for ``tokens`` tokens (``train`` = what has gradients)."""
    per_token = TRAIN_ACT_HIDDEN * shape.hidden + TRAIN_ACT_INTERMEDIATE * shape.intermediate
    share = 1.0 if train == "all" else FROZEN_ACT_SHARE
    return share * blocks * tokens * per_token * act_bytes


def kl_logit_bytes(shape: ModelShape, tokens: int, act_bytes: float, cached: bool, through_head: bool = False) -> float:
    """The KL's logits: float32 copies (fewer with cached top-k teacher logits) and the model-dtype outputs.

    ``through_head``: from a cache, the KL through the frozen head a chunk of positions at a time
    (``distill.head_kl``): one float32 [chunk, vocab] buffer and, in 16 bits, the head's output and the gradient's
    cast of a chunk. A student that is not sharded and whose logits are the head's product alone takes it
    (``distill.forward.head_for_losses``; ``ModelShape.logits_after_head``).
    """
    if cached and through_head:
        return min(LOGPROB_POSITIONS, tokens) * shape.vocab * (4 + (2 * act_bytes if act_bytes != 4 else 0))
    copies = KL_LOGIT_COPIES - (3 if cached else 0)  # a cache hands over top-k values, not [vocab] tensors
    return tokens * shape.vocab * (copies * 4 + 2 * act_bytes)


def lora_params(shape: ModelShape, blocks: int, rank: int, targets: str = LORA_ALL) -> float:
    """LoRA adapters on the Linear layers of ``blocks`` blocks that ``targets`` names: r x (in + out) each.

    ``targets``: ``--lora-targets``, ``all-linear`` or a comma list of the layers' own names; a shape without
    the names (made before they were kept) counts every Linear, as ``all-linear`` does. GPT-2's ``Conv1D``
    layers, which LoRA adapts too, are not ``nn.Linear`` and are not counted.
    """
    named = dict(shape.block_linear_io_names)
    if targets == LORA_ALL or not named:
        return blocks * rank * shape.block_linear_io
    return blocks * rank * sum(named.get(name, 0) for name in targets.split(","))


def add(parts: Parts, name: str, value: float) -> None:
    """Add ``value`` bytes under ``name`` (nothing for 0)."""
    if value > 0:
        parts[name] = parts.get(name, 0.0) + value
