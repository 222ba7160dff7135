"""Each engine setting is declared once (issue 38 §2, §3): the flag, the typed settings, the
engine's configuration and both checks derive from one field; the parsers import no torch; the
layers below the command line import neither it nor, on the device side, the scheduler."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from adaptive_dist.cli import build_parser
from workers.cli import generate_settings
from workers.config import EngineConfig, EngineOptions
from workers.options import (add_flags, check_flags, check_values, declared, flag_of,
                             from_flags, nested, setting)
from workers.settings import LaunchSettings

ROOT = Path(__file__).resolve().parents[2]


def _other_value(f: dataclasses.Field, meta) -> object:
    """A value of the setting other than its default."""
    if meta.choices is not None:
        return [c for c in meta.choices if c != f.default][-1]
    return f.default + 3


def test_every_engine_option_is_a_flag_that_reaches_the_engine_config() -> None:
    parser = build_parser()
    for f, meta in declared(EngineOptions):
        value = _other_value(f, meta)
        args = parser.parse_args(["generate", "--prompt", "x", flag_of(f.name), str(value)])
        launch = generate_settings(args).launch
        assert getattr(launch.engine, f.name) == value, f.name
        config = EngineConfig.from_options(launch.engine, max_context_len=64)
        assert getattr(config, f.name) == value, f.name
        assert config.to_dict()[f.name] == value      # agreed at start-up with the rest
        untouched = parser.parse_args(["generate", "--prompt", "x"])
        assert getattr(generate_settings(untouched).launch.engine, f.name) == f.default


def test_one_minimum_checks_the_flag_and_the_config() -> None:
    for name, minimum in (("catchup_rounds", 1), ("padded_prefill_tokens", 0),
                          ("defer_prefill_width", 0), ("max_batch_size", 1)):
        bad = minimum - 1
        options = EngineOptions(**{name: bad})
        with pytest.raises(ValueError) as flag:
            LaunchSettings(engine=options).check()
        assert str(flag.value) == f"{flag_of(name)} {bad}: must be >= {minimum}"
        with pytest.raises(ValueError) as config:
            EngineConfig.from_options(options)
        assert str(config.value) == f"{name}={bad}: must be an integer >= {minimum}"


def test_one_choice_list_checks_the_parser_the_flag_and_the_config(capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--mlp-scatter", "gather"])
    assert "invalid choice: 'gather'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--mlp-scatter gather: allowed: reduce_scatter, "
                                         r"all_reduce$"):
        LaunchSettings(engine=EngineOptions(mlp_scatter="gather")).check()
    with pytest.raises(ValueError, match=r"^mlp_scatter='gather'; allowed: reduce_scatter, "
                                         r"all_reduce$"):
        EngineConfig(mlp_scatter="gather")


def test_the_choices_are_their_owners() -> None:
    from adaptive_dist.config import POLICIES
    from workers.attention import BACKENDS
    from workers.loading import DTYPES
    from workers.model.config import MOE_PARALLEL
    from workers.model.parallel import SCATTERS

    opts = {a.option_strings[-1]: a for a in build_parser()._subparsers._group_actions[0]
            .choices["generate"]._actions if a.option_strings}
    assert opts["--attention-backend"].choices == BACKENDS
    assert opts["--mlp-scatter"].choices == SCATTERS
    assert opts["--moe-parallel"].choices == MOE_PARALLEL
    assert opts["--dtype"].choices == DTYPES
    assert set(opts["--policy"].choices) == set(POLICIES) - {"static"}


# ---- the mechanism on settings of its own ---------------------------------------------------------

@dataclass(frozen=True)
class _Inner:
    width: int = setting(8, minimum=2, metavar="W", help="a width (default: 8)")
    hidden: int = setting(5, minimum=1)      # no help: no flag, still checked as a value


@dataclass(frozen=True)
class _Outer:
    fast: bool = setting(False, one_of="speed", help="go fast")
    slow: bool = setting(False, one_of="speed", help="go slow")
    mode: Optional[str] = setting(None, choices=("a", "b"), help="a mode")
    inner: _Inner = nested(_Inner)


def test_the_mechanism_derives_flags_settings_and_checks() -> None:
    import argparse

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, _Outer)
    assert [a.option_strings[-1] for a in parser._actions[1:]] == ["--fast", "--slow", "--mode",
                                                                   "--width"]
    got = from_flags(_Outer, parser.parse_args(["--slow", "--width", "3"]))
    assert got == _Outer(slow=True, inner=_Inner(width=3))
    assert from_flags(_Outer, parser.parse_args([])) == _Outer()
    with pytest.raises(argparse.ArgumentError, match="not allowed with argument --fast"):
        parser.parse_args(["--fast", "--slow"])
    check_flags(got)
    with pytest.raises(ValueError, match="^--width 1: must be >= 2$"):
        check_flags(_Outer(inner=_Inner(width=1)))
    check_flags(_Inner(hidden=0))            # not a flag: the command line cannot set it
    with pytest.raises(ValueError, match="^hidden=0: must be an integer >= 1$"):
        check_values(_Inner(hidden=0))


# ---- imports -------------------------------------------------------------------------------------

def test_the_parsers_and_the_settings_import_no_torch() -> None:
    code = ("import sys\n"
            "from adaptive_dist.cli import build_parser\n"
            "from workers.cli import generate_settings\n"
            "from workers.server.cli import serve_settings\n"
            "p = build_parser(); sub = p._subparsers._group_actions[0].choices\n"
            "sub['generate'].format_help(); sub['serve'].format_help()\n"
            "generate_settings(p.parse_args(['generate', '--prompt', 'x', '--adaptive']))\n"
            "serve_settings(p.parse_args(['serve', '--max-batch-size', '4']))\n"
            "import workers.config, workers.attention, workers.model.parallel\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("below, above", [
    (("workers/config.py", "workers/options.py", "workers/loading.py", "workers/attention",
      "workers/model", "workers/worker", "workers/engine.py", "workers/scheduler.py"),
     ("workers.settings", "workers.cli", "workers.server", "workers.launch")),
    (("workers/worker",), ("workers.scheduler", "workers.engine")),
])
def test_lower_layers_do_not_import_higher_ones(below, above) -> None:
    for place in below:
        path = ROOT / place
        for source in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            wrong = {m for m in _imports(source) if m.split(".")[:2] in
                     [a.split(".")[:2] for a in above]}
            assert not wrong, f"{source.relative_to(ROOT)} imports {sorted(wrong)}"
