"""The repository's layout promises: reports hold data, prose and run.sh only; recipes ship with the package."""

from pathlib import Path

from prune.pipeline.recipes import METHODS_DIR, RECIPES_DIR, method_recipes

ROOT = Path(__file__).resolve().parents[1]


def test_reports_hold_data_markdown_and_run_scripts_only():
    """Code behind a report is a tested library function (``eval.lab``), never a script beside the figures."""
    # a comparison's cells/ (git-ignored) hold the checkpoints it wrote, whose remote code is theirs
    code = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "reports").rglob("*.py") if "cells" not in p.parts)
    assert code == [], f"move these into eval/lab/ and call them from run.sh: {code}"


def test_run_scripts_call_modules_not_files():
    for script in (ROOT / "reports").rglob("run.sh"):
        text = script.read_text()
        assert "python reports/" not in text and "PYTHONPATH=." not in text, script


def test_recipes_are_a_package_with_every_method():
    assert (RECIPES_DIR / "__init__.py").is_file() and METHODS_DIR.parent == RECIPES_DIR
    assert {"shortgpt", "sleb", "layercut-linear", "gromov", "linearpatch"} <= set(method_recipes())
    shipped = [line.strip() for line in (ROOT / "pyproject.toml").read_text().splitlines()
               if line.startswith("recipes =")]
    assert shipped == ['recipes = ["*.yaml", "methods/*.yaml", "repairs/*.yaml", "accelerate/*.yaml"]']
    folders = {p.parent.relative_to(RECIPES_DIR).as_posix() for p in RECIPES_DIR.rglob("*.yaml")}
    assert folders <= {".", "methods", "repairs", "accelerate"}, "a new recipe folder must be listed in package-data"
