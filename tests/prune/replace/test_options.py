"""A replacement method's options are the fields of its options class: a new option is one field.

A toy method with one toy option, registered here, gets its ``prune.run`` flag, its recipe key, its
checks and the one-line refusal for other methods without any other file changing.
"""

from dataclasses import dataclass, fields

import pytest

from prune.errors import LayercutError
from prune.pipeline.recipes import config_from_recipe
from prune.replace import (
    METHODS,
    Method,
    MethodOptions,
    ReplaceConfig,
    neutral_options,
    option,
    register_method,
    unregister_method,
    unset_options,
)
from prune.replace.lowrank import LowRankOptions
from prune.replace.options import NO_NEUTRAL, OptionSpec, is_unset, ridge_option, spec_of
from prune.run import build_parser, config_from_args


@dataclass
class ToyOptions(MethodOptions):
    """The toy method's one option."""

    strength: float = option(0.5, "how hard the toy pushes, in [0, 1]", flag="--toy-strength", metavar="X",
                             check=lambda v: 0 <= v <= 1, expect="must be in [0, 1]", neutral=0.0)


@pytest.fixture
def toy():
    method = register_method(Method("toy", "a toy with one option (test only)", serving="vanilla", options=ToyOptions))
    try:
        yield method
    finally:
        unregister_method("toy")


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["--drop", "1", *argv]))


def test_a_toy_option_is_a_flag_a_recipe_key_and_a_checked_value(toy, tmp_path):
    assert "--toy-strength X" in build_parser().format_help()
    assert "(--replace toy; default: 0.5)" in " ".join(build_parser().format_help().split())
    config = parse("--replace", "toy", "--toy-strength", "0.25")
    assert config.replace.options == ToyOptions(strength=0.25) and config.replace.options.strength == 0.25
    assert parse("--replace", "toy").replace.options.strength == 0.5  # the field's default
    recipe = tmp_path / "toy.yaml"
    recipe.write_text("drop: 1\nreplace: {method: toy, strength: 0.75}\n")
    assert config_from_recipe(recipe).replace.options == ToyOptions(strength=0.75)
    typed = config_from_recipe(recipe, {"replace": {"strength": 0.125}})
    assert typed.replace.options.strength == 0.125  # a typed flag wins
    with pytest.raises(LayercutError, match=r"^--toy-strength must be in \[0, 1\], got 2.0$"):
        ReplaceConfig(method="toy", strength=2.0)
    # a method without the option refuses it in one line naming the methods that take it
    with pytest.raises(LayercutError, match=r"^--toy-strength applies to --replace toy only \(got --replace linear\); "
                                            r"drop --toy-strength$"):
        parse("--replace", "linear", "--toy-strength", "0.25")
    # the neutral value: left out of eval.compare's digests; the other methods' flat view has the option unset
    assert neutral_options()["strength"] == (None, 0.0) and unset_options()["strength"] is None
    linear = ReplaceConfig(method="linear")
    assert linear.to_dict()["strength"] is None and not hasattr(linear.options, "strength")


def test_an_unregistered_method_takes_its_options_along(toy):
    unregister_method("toy")
    assert "--toy-strength" not in build_parser().format_help() and "strength" not in ReplaceConfig.recipe_keys()
    with pytest.raises(LayercutError, match="^unknown replacement option.s. strength; known: ridge, update_scale"):
        ReplaceConfig(method="linear", strength=0.5)


def test_an_option_shared_by_methods_is_declared_the_same_way():
    @dataclass
    class Clash(MethodOptions):
        ridge: float = option(0.0, "a ridge under another flag", flag="--other-ridge")

    with pytest.raises(ValueError, match="option 'ridge' differs from the one of --replace linear, lowrank, fold"):
        register_method(Method("clash", "test only", serving="vanilla", options=Clash))
    assert "clash" not in METHODS


def test_the_built_in_options_keep_their_flags_and_recipe_keys():
    config = parse("--replace", "lowrank", "--rank", "3", "--ridge", "0.1", "--replace-steps", "7")
    assert config.replace.options == LowRankOptions(rank=3, ridge=0.1, steps=7, lr=1e-3)
    assert parse("--replace", "fold", "--update-scale", "0.3").replace.options.update_scale == 0.3
    keys = set(ReplaceConfig.recipe_keys())
    assert {"rank", "ridge", "steps", "lr", "update_scale", "method", "fit", "short"} <= keys
    # the values that mean "not given", and the one option added after results were recorded
    # (the built-in methods' options: a new method's module adds its own, unset for every other method)
    built_in = ("ridge", "update_scale", "rank", "steps", "lr", "rotate_iterations")
    assert {k: v for k, v in unset_options().items() if k in built_in} == {
        "ridge": 0.0, "update_scale": None, "rank": None, "steps": None, "lr": None, "rotate_iterations": None}
    assert {k: v for k, v in neutral_options().items() if k in built_in} == {
        "update_scale": (None, 1.0), "rotate_iterations": (None, 50)}
    # the flat view is the layout every config had before the options became fields
    flat = ReplaceConfig(method="block").to_dict()
    assert {k: v for k, v in flat.items() if k in built_in or k not in unset_options()} == {
        "method": "block", "fit": "independent", "fit_rows": "all", "short": 0, "batch_size": 4,
        "cache_bytes": 1 << 30, "seed": 0, "progress": True, "rank": None, "ridge": 0.0, "steps": 200, "lr": 1e-4,
        "update_scale": None,
        "rotate_iterations": None}


def test_an_option_spec_checks_given_values_and_lets_the_unset_one_through():
    spec = OptionSpec("a share", flag="--share", check=lambda v: 0 < v <= 1, expect="must be in (0, 1]", unset=None)
    spec.validate(0.5)
    spec.validate(None)  # not given: never checked
    assert is_unset(None, spec) and not is_unset(0.5, spec) and spec.neutral is NO_NEUTRAL
    with pytest.raises(LayercutError, match=r"^--share must be in \(0, 1\], got 2$"):
        spec.validate(2)
    assert OptionSpec("no flag", label="the thing").name_in_messages == "the thing"

    @dataclass
    class Plain(MethodOptions):
        ridge: float = ridge_option()
        loose: int = 3  # not made by option(): a declaration error, found when its spec is read

    declared = {item.name: item for item in fields(Plain)}
    assert spec_of(declared["ridge"]).flag == "--ridge"
    with pytest.raises(TypeError, match="option field 'loose' needs its metadata"):
        spec_of(declared["loose"])
