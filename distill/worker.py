"""One process of a distillation that :func:`distill.launch.train_on_processes` launched (``prune.ship --processes N``).

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 -m distill.worker OUT.work/launch.json

Not typed by hand: the job file holds what every process reads (the student's folder, the options, the teacher
cache's key); the main process writes the trained weights and the report beside it (:mod:`distill.launch`).
"""

from __future__ import annotations

from pathlib import Path

from distill.launch import train_launched
from prune.errors import CommandParser, cli_entry


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Train this process's share of the job; returns the exit code."""
    parser = CommandParser(prog="python -m distill.worker", description=__doc__.split("\n")[0])
    parser.add_argument("job", help="the job file distill.launch wrote (launch.json in the run's work folder)")
    args = parser.parse_args(argv)
    train_launched(Path(args.job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
