"""Every `titan <command> --help` shows its whole text: Typer renders help as rich markup, which swallows
anything that reads as a style tag (a docstring's "[bos] + ids + [eos]" printed as " + ids + ")."""

from __future__ import annotations

import inspect

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from titan_cli.main import app

COMMANDS = get_command(app).commands


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_every_word_of_the_command_and_option_texts(name):
    command = COMMANDS[name]
    result = CliRunner().invoke(app, [name, "--help"], terminal_width=400, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    texts = [inspect.getdoc(command.callback) or "", *(getattr(p, "help", None) or "" for p in command.params)]
    missing = [word for text in texts for word in text.split() if word not in shown]
    assert not missing, f"titan {name} --help lost {missing}"
