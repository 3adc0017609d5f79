"""A distillation loss is one ``register_loss``: the config, the recipes and ``distill.run``'s flags follow.

A toy loss registered here is weighed into the objective, named in a recipe's ``losses:`` and given on
the command line with ``--loss``, without any other file changing; the older weight keys and flags
still land on their losses.
"""

import pytest
import torch

from distill.config import DistillConfig
from distill.losses import (
    LOSSES,
    NEEDS_LOGITS,
    LossInputs,
    masked_token_mean,
    register_loss,
    total_loss,
    unregister_loss,
)
from distill.run import build_parser, config_from_args
from prune.errors import LayercutError


def toy_l1(inputs: LossInputs) -> torch.Tensor:
    """Mean absolute difference of the last student state and its teacher target."""
    last = len(inputs.targets)
    diff = (inputs.student_states[last] - inputs.teacher_states[inputs.targets[-1]]).abs()  # [batch, seq, hidden]
    return masked_token_mean(diff.mean(dim=-1), inputs.mask)


@pytest.fixture
def toy():
    register_loss("toy_l1", key="toy_weight")(toy_l1)
    try:
        yield LOSSES["toy_l1"]
    finally:
        unregister_loss("toy_l1")


def inputs() -> LossInputs:
    # one student block whose output is 2.0 everywhere, matched to a teacher state of 0.5: |diff| 1.5, diff^2 2.25
    zeros = torch.zeros(1, 3, 4)
    return LossInputs(student_states={0: zeros, 1: torch.full((1, 3, 4), 2.0)},
                      teacher_states={0: zeros, 1: torch.full((1, 3, 4), 0.5)}, targets=[1], mask=torch.ones(1, 3))


def distill_config(*argv: str) -> DistillConfig:
    return config_from_args(build_parser().parse_args(["--student", "s", "--out", "o", *argv]))


def test_a_registered_loss_is_weighed_named_in_recipes_and_given_with_loss(toy):
    assert toy.help == "Mean absolute difference of the last student state and its teacher target."
    assert "toy_l1" not in NEEDS_LOGITS
    total, terms = total_loss(inputs(), {"layerwise_mse": 1.0, "toy_l1": 0.5})
    assert terms == {"layerwise_mse": 2.25, "toy_l1": 1.5} and float(total) == 2.25 + 0.5 * 1.5
    # a recipe's losses, kept in registration order (the order the terms are summed in), weights of 0 dropped
    config = DistillConfig.from_dict({"losses": {"toy_l1": 0.5, "layerwise_mse": 1, "teacher_student_kl": 0}})
    assert list(config.loss_weights().items()) == [("layerwise_mse", 1.0), ("toy_l1", 0.5)]
    # the command line: --loss, repeated, and the key's own flag over it
    assert distill_config("--loss", "toy_l1=0.5", "--loss", "layerwise_mse=1").losses == config.losses
    assert distill_config("--toy-weight", "2").losses == {"teacher_student_kl": 1.0, "toy_l1": 2.0}
    assert DistillConfig.from_dict({"toy_weight": 2}).losses == {"teacher_student_kl": 1.0, "toy_l1": 2.0}
    assert "toy_l1: Mean absolute difference" in " ".join(build_parser().format_help().split())


def test_an_unregistered_loss_is_unknown(toy):
    unregister_loss("toy_l1")
    with pytest.raises(LayercutError, match=r"^unknown loss 'toy_l1' \(--loss\): choose one of layerwise_mse, "
                                            "teacher_student_kl, consecutive_cosine_distance$"):
        DistillConfig(losses={"toy_l1": 1.0})
    assert "--toy-weight" not in build_parser().format_help()


def test_the_older_weight_keys_and_flags_land_on_their_losses():
    # each sets its loss's weight over the default KL, as the separate weight fields did
    assert DistillConfig.from_dict({"mse_weight": 1.0}).losses == {"layerwise_mse": 1.0, "teacher_student_kl": 1.0}
    assert DistillConfig.from_dict({"mse_weight": 1.0, "kl_weight": 0.0}).losses == {"layerwise_mse": 1.0}
    assert DistillConfig.from_dict({"kl_weight": 1.0, "mse_weight": 0.0}) == DistillConfig()
    assert distill_config().losses == {"teacher_student_kl": 1.0}
    assert distill_config("--mse-weight", "1", "--kl-weight", "0").losses == {"layerwise_mse": 1.0}
    assert distill_config("--cosine-reg", "0.1").losses == {"teacher_student_kl": 1.0,
                                                            "consecutive_cosine_distance": 0.1}
    assert distill_config("--loss", "layerwise_mse=1", "--kl-weight", "0.5").losses == {
        "layerwise_mse": 1.0, "teacher_student_kl": 0.5}


@pytest.mark.parametrize("argv,message", [
    (["--loss", "kl"], "--loss takes NAME=WEIGHT (teacher_student_kl=1), got 'kl'"),
    (["--loss", "teacher_student_kl=high"], "--loss takes NAME=WEIGHT (teacher_student_kl=1), got "),
    (["--loss", "kl=1"], "unknown loss 'kl' (--loss): choose one of layerwise_mse"),
    (["--loss", "layerwise_mse=-1"], "loss weight layerwise_mse=-1.0 must be a finite number >= 0"),
    (["--kl-weight", "0"], "no loss has a weight above 0: nothing to distill"),
])
def test_bad_losses_fail_in_one_line(argv, message):
    with pytest.raises(LayercutError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        distill_config(*argv)
    assert "\n" not in str(err.value)


def test_the_layout_before_losses_for_digests_of_finished_cells(toy):
    legacy = DistillConfig.from_dict({"mse_weight": 1.0, "kl_weight": 0.0}).legacy_dict()
    assert (legacy["mse_weight"], legacy["kl_weight"], legacy["cosine_reg"], legacy["toy_weight"]) == (1.0, 0.0, 0.0,
                                                                                                       0.0)
    assert "losses" not in legacy and legacy["steps"] == 100
    assert DistillConfig().legacy_dict()["kl_weight"] == 1.0
