"""prune.errors: every command's argument errors are one line and exit 2 (``CommandParser``)."""

import importlib

import pytest

from prune.errors import EXIT_BAD_INPUT, CommandParser

COMMANDS = ("prune.run", "prune.ship", "prune.export_gguf", "prune.decilm", "distill.run", "eval.run", "eval.bench.cli",
            "eval.lens.run", "eval.compare.cli", "eval.mapfit.cli", "eval.lab.cli")


def _error_lines(parser, argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as done:
        parser.parse_args(argv)
    assert done.value.code == EXIT_BAD_INPUT
    out, err = capsys.readouterr()
    assert out == ""
    return err.splitlines()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses_with_the_one_line_parser(command, capsys):
    # before, argparse printed its usage (a dozen lines for prune.run) above the message
    parser = importlib.import_module(command).build_parser()
    assert isinstance(parser, CommandParser)
    lines = _error_lines(parser, ["--no-such-flag"], capsys)
    assert len(lines) == 1 and lines[0].startswith(f"{parser.prog}: error: ") and "--help" in lines[0]


def test_a_subcommand_error_is_one_line(capsys):
    from eval.bench.cli import build_parser

    lines = _error_lines(build_parser(), ["speed", "--model", "a"], capsys)
    assert lines == ["python -m eval.bench speed: error: the following arguments are required: --baseline (see "
                     "python -m eval.bench speed --help)"]


def test_a_negative_value_read_as_a_flag_asks_for_a_positive_one(capsys):
    from prune.ship import build_parser

    lines = _error_lines(build_parser(), ["--out", "o", "--time-budget", "-5m"], capsys)
    assert lines == ["python -m prune.ship: error: argument --time-budget: -5m is not a value it takes: give a "
                     "positive duration such as 30m (see python -m prune.ship --help)"]


def test_a_value_that_starts_with_a_dash_is_named_with_the_spelling_that_passes_it(capsys):
    parser = CommandParser(prog="tool")
    parser.add_argument("--data")
    lines = _error_lines(parser, ["--data", "-notes.txt"], capsys)
    assert lines == ["tool: error: argument --data: -notes.txt reads as a flag, not as its value: write "
                     "--data=-notes.txt (see tool --help)"]
    assert parser.parse_args(["--data=-notes.txt"]).data == "-notes.txt"
