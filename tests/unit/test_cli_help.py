"""`--help` of every command a user meets (issue 34 §4): each flag says what it does, each flag
with a default shows it, the help names what the engine accepts, and each command has a
description."""
from __future__ import annotations

import argparse

import pytest

from adaptive_dist.cli import build_parser

COMMANDS = ("generate", "serve", "client", "consensus", "config")


def _command(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def _options(name: str) -> dict[str, argparse.Action]:
    return {a.option_strings[-1]: a for a in _command(name)._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_has_help_and_shows_its_default(name):
    for flag, action in _options(name).items():
        assert action.help, f"{name} {flag} has no help text"
        default = action.default
        if default is None or isinstance(default, bool) or action.const is not None:
            continue       # no default to show (a switch, or 'absent' means unset)
        assert "default" in action.help, f"{name} {flag}: help shows no default ({default!r})"
        if isinstance(default, str) and "/" in default and "://" not in default:
            continue       # a path of this checkout: described in words
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert shown in action.help, \
            f"{name} {flag}: default {default!r} not in its help: {action.help!r}"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_a_description(name):
    assert _command(name).description, f"{name} has no description"


@pytest.mark.parametrize("name", ("generate", "serve"))
def test_engine_help_names_both_policies_and_every_target_family(name):
    opts = _options(name)
    for policy in ("ema", "goodput"):
        assert policy in opts["--adaptive"].help, opts["--adaptive"].help
    for family in ("Llama", "Qwen2", "Qwen3", "Qwen3-MoE", "Mixtral", "Qwen2-MoE"):
        assert family in opts["--model"].help, (family, opts["--model"].help)


def test_the_rendered_help_shows_the_defaults_users_asked_for():
    text = _command("generate").format_help()
    assert "--max-new-tokens N" in text and "(default: 128)" in text
    assert "(default: 16)" in text and "(default: 60)" in text
    assert "(default: http://127.0.0.1:8000)" in _command("client").format_help()
