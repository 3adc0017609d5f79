"""``OUT.work/``: where each stage keeps its typed result, so a stopped run continues where it stopped.

Every file of the folder is read through :meth:`WorkFolder.read`: a file that is damaged (not JSON, or
not the stage's fields) is refused in one line that says how to start over, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prune.atomic import write_file_atomic
from prune.errors import LayercutError

SETTINGS = "ship.json"  # what a run depends on; in OUT/, with the shortlist and figures, it marks OUT shipped
# each stage's result, and what the stages keep beside them
PLAN, SHORTLIST, BUILD, HEAL, EXPORT, VERIFIED = ("plan.json", "shortlist.json", "build.json", "heal.json",
                                                  "export.json", "verify.json")
CHECKPOINT, HEALED, VERIFY = "checkpoint", "healed", "verify"
SHORTLIST_PROGRESS = "shortlist.partial.json"  # each repair's measured candidates, as it ends
CALIBRATION, HELDOUT = "calibration.safetensors", "heldout.txt"


@dataclass(kw_only=True)
class StageResult:
    """What one stage found, kept as ``OUT.work/<stage>.json``; ``seconds`` is the stage's wall time.

    ``cuda_peak``: the most bytes torch held on any one GPU in this process during the stage (None: CUDA unused),
    so a plan's peak can be held against the stage that reached it: since the stage started, or since a reset
    inside it (the heal's training resets the statistics as it starts). A stage's child processes are not in it.
    """

    seconds: float = 0.0
    cuda_peak: int | None = None

    def to_json(self) -> dict:
        """The JSON-ready fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, source: str = "") -> StageResult:
        """The result kept in ``data``; a value of another type or a missing field is :class:`ValueError`."""
        if not isinstance(data, dict):
            raise ValueError(f"holds {type(data).__name__}, not the stage's fields")
        hints = typing.get_type_hints(cls)
        values = {}
        for item in dataclasses.fields(cls):
            if item.name not in data:
                if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
                    raise ValueError(f"has no '{item.name}'")
                continue
            value = data[item.name]
            if not _matches(value, hints[item.name]):
                raise ValueError(f"'{item.name}' is {value!r}")
            values[item.name] = value
        return cls(**values)


def _matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's type (the outer type only: lists and dicts are not walked)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    target = origin or hint
    return isinstance(target, type) and isinstance(value, target)


Result = TypeVar("Result", bound=StageResult)


class WorkFolder:
    """``OUT.work/``: the stages' results and the settings they were made with."""

    def __init__(self, path: Path):
        self.path = path

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def start_over(self) -> str:
        """The fix a damaged file's message names."""
        return f"remove {self.path} (or pass --overwrite) to start over"

    def open(self, settings: dict) -> bool:
        """Check the folder against this run's ``settings``; True when it holds an earlier run of them.

        Raises:
            LayercutError: a file is in the way, or the folder holds a run of other settings.
        """
        if self.path.exists() and not self.path.is_dir():
            raise LayercutError(f"{self.path} is a file where prune.ship keeps its work folder: move it away")
        marker = self.path / SETTINGS
        if not marker.is_file():
            return False
        held = self.read_json(marker).get("settings") or {}
        if held != settings:  # named, so a setting the user never typed (another version's heal) is seen as such
            differ = sorted(key for key in {*held, *settings} if held.get(key) != settings.get(key))
            raise LayercutError(f"{self.path} holds a run with other settings ({', '.join(differ)}): type that "
                                "run's command again to continue it, or remove the folder")
        return True

    def mark(self, settings: dict) -> None:
        """Record the settings (once the plan accepted them: a refused plan leaves nothing that blocks)."""
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / SETTINGS, {"settings": settings})

    def read_json(self, path: Path) -> dict:
        """A JSON object of the folder; a damaged one is one line naming the fix."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LayercutError(f"{path} is damaged ({type(err).__name__}): {self.start_over()}") from None
        if not isinstance(data, dict):
            raise LayercutError(f"{path} is damaged (not a JSON object): {self.start_over()}")
        return data

    def read(self, name: str, kind: type[Result]) -> Result | None:
        """The kept result of stage ``name``, None when no run finished that stage."""
        path = self.path / name
        if not path.is_file():
            return None
        data = self.read_json(path)  # its own one-line error (a LayercutError is a ValueError: not wrapped again)
        try:
            return kind.from_json(data)
        except (TypeError, ValueError) as err:
            raise LayercutError(f"{path} is damaged ({err}): {self.start_over()}") from None

    def stage(self, name: str, kind: type[Result], make: Callable[[], Result]) -> Result:
        """The result of stage ``name``: kept by an earlier run, else made now, timed and kept atomically."""
        kept = self.read(name, kind)
        if kept is not None:
            return kept
        cuda = _cuda_in_use()
        if cuda is not None:
            for index in range(cuda.device_count()):
                cuda.reset_peak_memory_stats(index)
        began = time.perf_counter()
        result = make()
        result.seconds = round(time.perf_counter() - began, 2)
        cuda = cuda or _cuda_in_use()  # a stage that loaded the first model started CUDA itself
        if cuda is not None:
            result.cuda_peak = max(int(cuda.max_memory_allocated(index)) for index in range(cuda.device_count()))
        self.write(name, result)
        return result

    def write(self, name: str, result: StageResult) -> None:
        """Keep ``result`` as stage ``name``'s (atomically)."""
        write_json_atomic(self.path / name, result.to_json())

    def forget(self, *names: str) -> None:
        """Drop the results of these stages (their outputs went): they run again."""
        for name in names:
            (self.path / name).unlink(missing_ok=True)

    def remove(self) -> None:
        """Delete the folder (``--overwrite``)."""
        shutil.rmtree(self.path, ignore_errors=True)


def _cuda_in_use():
    """``torch.cuda`` where this process has started CUDA, else None (never imports torch, never starts CUDA)."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


def write_json_atomic(path: Path, data: dict) -> None:
    """``data`` as JSON into ``path`` under a temporary name first: a kill leaves the old file or none."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` under a temporary name first: a kill leaves the old file or none, never half."""
    write_file_atomic(path, lambda staging: staging.write_text(text, encoding="utf-8"))
