"""Checks that a student can be distilled from a teacher: same architecture, width, vocabulary and tokenizer."""

from __future__ import annotations

from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import hidden_size

# Mixed text (words, digits, punctuation, accents, spaces) that two tokenizers split the same way only if
# they are the same tokenizer.
TOKENIZER_PROBE = "It is a truth universally acknowledged, 1813: Élisabeth's naïve café -- 42 tokens?\n  Yes."


def _vocab_rows(model: nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def check_models(student: nn.Module, teacher: nn.Module) -> None:
    """Same ``model_type``, hidden size and embedding rows, or a one-line error."""
    s_type, t_type = student.config.model_type, teacher.config.model_type
    if s_type != t_type:
        raise LayercutError(
            f"the student is a {s_type} model but the teacher is {t_type}: pass the model the student was pruned from"
        )
    if hidden_size(student) != hidden_size(teacher):
        raise LayercutError(
            f"hidden size differs: student {hidden_size(student)}, teacher {hidden_size(teacher)}; layerwise "
            "distillation needs the model the student was pruned from as --teacher"
        )
    if _vocab_rows(student) != _vocab_rows(teacher):
        raise LayercutError(
            f"vocabulary size differs: student {_vocab_rows(student)}, teacher {_vocab_rows(teacher)}; "
            "pass the model the student was pruned from as --teacher"
        )


def check_tokenizers(student_tokenizer, teacher_tokenizer) -> None:
    """Same vocabulary size and the same ids for a probe string, or a one-line error."""
    if len(student_tokenizer) != len(teacher_tokenizer):
        raise LayercutError(
            f"the tokenizers differ: student vocabulary {len(student_tokenizer)}, teacher {len(teacher_tokenizer)}; "
            "pass the model the student was pruned from as --teacher"
        )
    s_ids = student_tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    t_ids = teacher_tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if s_ids != t_ids:
        raise LayercutError(
            "the tokenizers differ: they split the same probe text into different token ids; pass the model the "
            "student was pruned from as --teacher"
        )


def check_compatible(student: nn.Module, teacher: nn.Module, student_tokenizer=None, teacher_tokenizer=None) -> None:
    """Everything :func:`check_models` and (when both tokenizers are given) :func:`check_tokenizers` check."""
    if student_tokenizer is not None and teacher_tokenizer is not None:
        check_tokenizers(student_tokenizer, teacher_tokenizer)
    check_models(student, teacher)
