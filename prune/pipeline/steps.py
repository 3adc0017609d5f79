"""Steps that run after surgery inside a prune run (distillation is one), found by name.

``prune`` is the base package and imports nothing above it, so a step that lives in another package
(``distill``) plugs in through the ``layercut.steps`` entry-point group in ``pyproject.toml``:

    [project.entry-points."layercut.steps"]
    distill = "distill.step:DistillStep"

A step class is built from its options (a recipe section such as ``distill: {steps: 100}``) and the
:class:`prune.pipeline.config.PruneConfig`, validating both before any model is loaded; calling it with
the surgered model returns a :class:`StepResult`. ``register_step`` adds one in-process (tests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Protocol

from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.registry import Registry

ENTRY_POINT_GROUP = "layercut.steps"


@dataclass
class StepResult:
    """What a step did.

    Attributes:
        report: the step's section of ``layercut.json`` (under the step's name).
        files: files to copy into the exported checkpoint folder (logs).
        cleanup: folders to delete once the checkpoint is written (work folders).
    """

    report: dict
    files: list[Path] = field(default_factory=list)
    cleanup: list[Path] = field(default_factory=list)


class SurgeryStep(Protocol):
    """A step run on the surgered model, before export.

    A step with defaults of its own keeps its resolved settings as a dataclass in ``config``:
    ``eval.compare`` hashes them into a cell's digest, so a changed default reruns the cells it changes.
    """

    name: str

    def __call__(self, loaded: LoadedModel, config, *, token_ids=None, heldout_ids=None,
                 teacher: LoadedModel | None = None) -> StepResult:
        """Change ``loaded.model`` in place; ``config`` is the run's ``PruneConfig``.

        A step that trains may be handed its sequences (``token_ids`` [n, seq], ``heldout_ids`` never trained
        on) and the original model already in memory (``teacher``); without them it draws and loads its own.
        """


StepFactory = Callable[[dict, object], SurgeryStep]
# steps added in this process (tests); the installed ones are found through the entry points
STEPS: Registry[StepFactory] = Registry("step")


def register_step(name: str, factory: StepFactory) -> None:
    """Make ``factory(options, prune_config)`` available as step ``name`` in this process."""
    STEPS.register(name, factory)


def unregister_step(name: str) -> None:
    """Undo :func:`register_step`."""
    STEPS.unregister(name)


def step_factory(name: str) -> StepFactory:
    """The factory registered as ``name`` (in process first, then the installed entry points)."""
    if name in STEPS:
        return STEPS[name]
    found = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        raise LayercutError(
            f"no '{name}' step is installed (entry point group {ENTRY_POINT_GROUP}; found: "
            f"{', '.join(sorted(found)) or 'none'}): reinstall layercut with `pip install -e .`"
        )
    return found[name].load()


def build_step(name: str, options: dict, config) -> SurgeryStep:
    """Build (and so validate) step ``name`` from its options and the run's config."""
    return step_factory(name)(options, config)
