"""One declaration per setting of the engine commands.

A setting is a field of a frozen dataclass made by `setting(...)`: the field's name is the
setting's (its flag is ``--`` and the name with ``-`` for ``_``), its annotation the type, and
`setting` holds the default, the flag's help text (a setting with help is a flag of the command
line) and the check (`minimum`, `choices`). A field made by `nested(cls)` holds another class of
settings whose flags come in its place. Everything else is derived from the declarations:

- `add_flags(parser, cls)`: the argparse flags of `cls`, in declaration order (a ``bool`` is a
  switch; `one_of` names a group of flags that exclude each other);
- `from_flags(cls, args)`: the typed settings of a parsed namespace;
- `check_flags(settings)`: every value given against its check, the error naming the flag
  (``--max-batch-size 0: must be >= 1``), as the start-up checks report it;
- `check_values(config)`: the same for a configuration built in code, naming the setting
  (``max_batch_size=0: must be an integer >= 1``);
- `values(obj)`: a settings object's values by name (shallow), to build a larger one from it.

Importing this module imports only the standard library (the parsers use it).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator, Optional

_SETTING = "workers.options.setting"
_NESTED = "workers.options.nested"


@dataclass(frozen=True)
class Setting:
    """What a field declares beside its name, type and default (see the module docstring)."""

    help: Optional[str] = None
    """The flag's help text; None: no flag (a value built in code, still checked)."""
    metavar: Optional[str] = None
    choices: Optional[Any] = None   # a tuple, or a container read when used
    minimum: Optional[int] = None
    """The value is an integer of at least this."""
    parse: Optional[Callable[[str], Any]] = None
    """How the flag's text becomes the value (default: the annotated type)."""
    one_of: Optional[str] = None
    """A group of flags of which at most one is given (exactly one with `required`)."""
    required: bool = False


def setting(default: Any = MISSING, *, default_factory: Any = MISSING,
            help: Optional[str] = None, metavar: Optional[str] = None,
            choices: Optional[tuple] = None, minimum: Optional[int] = None,
            parse: Optional[Callable[[str], Any]] = None, one_of: Optional[str] = None,
            required: bool = False) -> Any:
    """A dataclass field that declares one setting."""
    # a list becomes a tuple; any other container stays (a live view, e.g. the registered
    # policies: a policy registered later is a choice too)
    meta = {_SETTING: Setting(help, metavar, tuple(choices) if isinstance(choices, list)
                              else choices, minimum, parse, one_of, required)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def nested(cls: type) -> Any:
    """A dataclass field holding the settings of `cls` (its flags come in its place)."""
    return dataclasses.field(default_factory=cls, metadata={_NESTED: cls})


def flag_of(name: str) -> str:
    """The flag of setting `name`: ``catchup_rounds`` -> ``--catchup-rounds``."""
    return "--" + name.replace("_", "-")


def declared(cls: Any) -> Iterator[tuple[dataclasses.Field, Setting]]:
    """The fields of `cls` (a class or an instance) that declare a setting, in order."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_SETTING)
        if meta is not None:
            yield f, meta


def values(obj: Any) -> dict[str, Any]:
    """`obj`'s fields by name (not copied, not recursed)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


# ---- the command line ---------------------------------------------------------------------------

def add_flags(parser: argparse.ArgumentParser, cls: type,
              _groups: Optional[dict[str, Any]] = None) -> None:
    """Add a flag to `parser` for every setting of `cls` that has help (and of the classes it
    nests), in declaration order."""
    groups = {} if _groups is None else _groups
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            add_flags(parser, f.metadata[_NESTED], groups)
            continue
        meta = f.metadata.get(_SETTING)
        if meta is None or meta.help is None:
            continue
        target: Any = parser
        if meta.one_of is not None:
            if meta.one_of not in groups:
                groups[meta.one_of] = parser.add_mutually_exclusive_group(required=meta.required)
            target = groups[meta.one_of]
        kind = _value_type(hints[f.name])
        if kind is bool:
            target.add_argument(flag_of(f.name), action="store_true", help=meta.help)
            continue
        options: dict[str, Any] = {"help": meta.help, "default": _default(f)}
        parse = meta.parse or (kind if kind in (int, float) else None)
        if parse is not None:
            options["type"] = parse
        if meta.choices is not None:
            options["choices"] = meta.choices
        if meta.metavar is not None:
            options["metavar"] = meta.metavar
        target.add_argument(flag_of(f.name), **options)


def from_flags(cls: type, args: argparse.Namespace) -> Any:
    """The settings `cls` of a namespace `add_flags(parser, cls)` parsed."""
    given: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if _NESTED in f.metadata:
            given[f.name] = from_flags(f.metadata[_NESTED], args)
        elif f.metadata.get(_SETTING) is not None and f.metadata[_SETTING].help is not None:
            given[f.name] = getattr(args, f.name)
    return cls(**given)


def _value_type(hint: Any) -> Any:
    """``Optional[X]`` (``X | None``) -> X; anything else as it is."""
    args = typing.get_args(hint)
    rest = [a for a in args if a is not type(None)]
    return rest[0] if len(rest) == 1 and len(args) == 2 else hint


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()        # type: ignore[misc]
    return None


# ---- checks ---------------------------------------------------------------------------------------

def check_flags(settings: Any) -> None:
    """`ValueError` for the first flag whose value fails its check (the classes `settings`
    nests included), named by the flag: ``--catchup-rounds 0: must be >= 1``,
    ``--dtype x: allowed: auto, bfloat16, ...``. A value of None (not given) passes."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if _NESTED in f.metadata:
            check_flags(value)
            continue
        meta = f.metadata.get(_SETTING)
        if meta is None or meta.help is None or value is None:
            continue
        if meta.minimum is not None and not _at_least(value, meta.minimum):
            raise ValueError(f"{flag_of(f.name)} {value}: must be >= {meta.minimum}")
        if meta.choices is not None and value not in meta.choices:
            raise ValueError(f"{flag_of(f.name)} {value}: allowed: {', '.join(meta.choices)}")


def check_values(config: Any) -> None:
    """`ValueError` for the first setting of `config` whose value fails its check, named by
    the setting: ``max_batch_size=0: must be an integer >= 1``,
    ``mlp_scatter='x'; allowed: reduce_scatter, all_reduce``."""
    for f, meta in declared(config):
        value = getattr(config, f.name)
        if meta.minimum is not None and not _at_least(value, meta.minimum):
            raise ValueError(f"{f.name}={value!r}: must be an integer >= {meta.minimum}")
        if meta.choices is not None and value not in meta.choices:
            raise ValueError(f"{f.name}={value!r}; allowed: {', '.join(meta.choices)}")


def _at_least(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum
