"""``ReplaceConfig``: a recipe's ``replace:`` section, the method's options resolved into its options class."""

import dataclasses

import pytest

from prune.errors import LayercutError
from prune.replace.config import DEFAULT_CACHE_BYTES, ReplaceConfig
from prune.replace.linear import LinearOptions


def test_options_are_resolved_with_the_methods_defaults():
    config = ReplaceConfig(method="linear", ridge=0.1)
    assert isinstance(config.options, LinearOptions)
    assert (config.options.ridge, config.options.update_scale, config.short) == (0.1, 0.7, 64)  # linear's defaults
    assert config.cache_bytes == DEFAULT_CACHE_BYTES == 1 << 30
    assert ReplaceConfig(method="block").short == 0


def test_options_are_read_from_the_options_object_only():
    config = ReplaceConfig(method="linear")
    assert config.options.values() == {"ridge": 0.0, "update_scale": 0.7}  # the method's fields
    for name in ("rank", "update_scale", "ridge"):  # neither an option linear lacks nor one it takes reads flat
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(config, name)
    assert not hasattr(config.options, "rank")
    assert ReplaceConfig(method="lowrank", rank=8).options.rank == 8


def test_to_dict_is_flat_and_covers_every_recipe_key():
    config = ReplaceConfig(method="lowrank", rank=4)
    flat = config.to_dict()
    assert flat["method"] == "lowrank" and flat["rank"] == 4 and flat["update_scale"] is None
    assert "options" not in flat
    assert set(ReplaceConfig.recipe_keys()) == set(flat) | {"options"}
    # an options object or a mapping is taken as given, the keywords winning over it
    again = ReplaceConfig(method="lowrank", options=config.options, rank=2)
    assert again.options.rank == 2 and again.options.steps == config.options.steps
    assert dataclasses.replace(config, seed=3).options.rank == 4


@pytest.mark.parametrize("values,message", [
    (dict(fit="sideways"), "unknown --fit 'sideways'"),
    (dict(short=1), "--fit-short takes a sequence length of at least 2"),
    (dict(batch_size=-1), "--batch-size must be positive"),
    (dict(fit_rows="most"), "--fit-rows most: choose one of all, fitting"),
    (dict(fit_rows="fitting", fit="sequential"), "drop --fit sequential, or use --fit-rows all"),
])
def test_bad_settings_are_one_line_errors(values, message):
    with pytest.raises(LayercutError, match=message) as err:
        ReplaceConfig(method="linear", **values)
    assert "\n" not in str(err.value)


def test_fit_rows_fitting_is_refused_before_any_pass_for_a_method_measured_through_another_and_kept_by_auto():
    from prune.checkpoint.load_config import LoadConfig
    from prune.pipeline.config import PruneConfig
    from tests.helpers import make_tiny_model

    # local is measured through a linear map's fit: it has no fit of its own on the fitting rows to ship
    with pytest.raises(LayercutError, match="--replace local is measured through another method's fit") as err:
        ReplaceConfig(method="local", fit_rows="fitting")
    assert "\n" not in str(err.value)
    # --replace auto (prune.run's default) keeps the rows it was told to fit on when it names the method
    config = PruneConfig(load=LoadConfig(model="tiny"), drop=2, replace={"method": "auto", "fit_rows": "fitting"})
    chosen = config.with_default_repair(make_tiny_model("llama"))
    assert chosen.replace.method != "none" and chosen.replace.fit_rows == "fitting"
