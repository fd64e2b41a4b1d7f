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



@pytest.mark.parametrize("name", sorted(COMMANDS))
@pytest.mark.parametrize("width", [80, 400])
def test_help_breaks_the_command_text_only_where_the_terminal_ends(name, width):
    """Typer's rich help keeps the docstring's line breaks: a paragraph wrapped at the source's width printed
    ragged ("the same token stream" / "as tokenizing on the fly") on every terminal wider than the source."""
    result = CliRunner().invoke(app, [name, "--help"], terminal_width=width, env={"COLUMNS": str(width)})
    lines = result.output.splitlines()
    shown = max(len(line.rstrip()) for line in lines)  # the panels' borders span the whole width; rich pads text by 1 each side
    text = [line.rstrip() for line in lines if not any(c in line for c in "│╭╰")]
    for line, following in zip(text, text[1:]):
        if line.strip() and following.strip() and not line.strip().startswith("Usage:"):
            next_word = following.split()[0]
            assert len(line) + 1 + len(next_word) > shown - 2, f"titan {name} --help broke the line {line.strip()!r}"
