"""The policy registry: the one place a policy's name becomes its class.

``register_policy(cls)`` adds a ``DepthPolicy`` class under ``cls.name``. Everything else that
lists policies reads it: ``adaptive_dist.config.POLICIES`` (the configuration's ``policy`` key
and every ``--policy`` flag's choices), the sections an ``AdaptiveConfig`` holds (``cls.Section``,
its own keys), ``load_config``'s defaults (``cls.default_candidates``), what an engine measures at
start-up (``cls.start_up_needs``, ``adaptive_dist.startup.prepare``). So a new policy is its own
module and one ``register_policy`` call; the built-in ones register in
``adaptive_dist.policy.__init__``.

Here too the base of a section (``PolicySection``). This module imports nothing of the adaptive
layer: ``adaptive_dist.config`` imports it (the policy names, the sections), the policies import
both, and importing ``adaptive_dist`` registers the built-in ones (no circle of imports).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Optional

_CLASSES: dict[str, type] = {}


class PolicySection:
    """Base of a policy's own configuration section: a frozen dataclass of the keys only that
    policy reads, each a field with its default (``DepthPolicy.Section``). A JSON file sets them
    inside an object named after the policy (``{"goodput": {"switch_margin": 0.1}}``) or, the
    older spelling, at the top level (``{"switch_margin": 0.1}``); the effective configuration
    (``to_dict``, the digest) lists them at the top level, as it always has.

    ``removed``: keys the section no longer has, each with what replaced it (refused by name).
    The checks that read other keys are the policy's ``check_section``; ``__post_init__`` only
    brings values to their canonical form (a float field's ``0`` is ``0.0``: the same setting
    must hash the same)."""

    removed: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        float_fields(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def to_json(self) -> dict:
        return {f.name: json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}


def float_fields(obj: Any) -> None:
    """Every field annotated ``float`` holding a finite number, as a float (``0`` -> ``0.0``)."""
    for f in dataclasses.fields(obj):
        if f.type in ("float", float):
            v = getattr(obj, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                object.__setattr__(obj, f.name, float(v))


def json_value(v: Any) -> Any:
    """A setting's JSON form: a table's ``to_json()``, a tuple as a list, anything else as it is."""
    if hasattr(v, "to_json"):
        return v.to_json()
    if isinstance(v, tuple):
        return list(v)
    return v



def register_policy(cls: type) -> type:
    """Add the policy class ``cls`` under ``cls.name`` and return it (usable as a decorator).

    Refused (``ValueError``) when the name is taken or empty, or when a key of ``cls.Section``
    (a ``PolicySection`` dataclass, or None) is another policy's (or a policy's name): a flat
    key in a config file names exactly one setting (one every policy reads is refused when the
    configuration is built, ``adaptive_dist.config``)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_policy({cls.__name__}): name={name!r} must be an identifier")
    if _CLASSES.get(name) is cls:
        return cls
    if name in _CLASSES:
        raise ValueError(f"register_policy({cls.__name__}): a policy {name!r} is registered "
                         f"already ({_CLASSES[name].__name__})")
    section = getattr(cls, "Section", None)
    if section is not None:
        if not (isinstance(section, type) and issubclass(section, PolicySection)
                and dataclasses.is_dataclass(section)):
            raise ValueError(f"register_policy({cls.__name__}): Section must be a frozen "
                             f"dataclass deriving from adaptive_dist.config.PolicySection")
        taken = {n: f"policy {n!r}" for n in _CLASSES}
        for other, other_cls in _CLASSES.items():
            if other_cls.Section is not None:
                taken.update({k: f"policy {other!r}" for k in other_cls.Section.keys()})
        clash = [f"{k!r} ({taken[k]})" for k in section.keys() if k in taken]
        if clash:
            raise ValueError(f"register_policy({cls.__name__}): key(s) {', '.join(clash)} "
                             f"taken already; a policy's keys are its own")
    _CLASSES[name] = cls
    return cls


def unregister_policy(name: str) -> None:
    """Remove the policy ``name`` (a test's own policy, when the test ends)."""
    _CLASSES.pop(name, None)


def policy_class(name: str) -> Any:
    """The class of the registered policy ``name`` (``KeyError`` when none)."""
    return _CLASSES[name]


def policy_names(adaptive: Optional[bool] = None) -> tuple[str, ...]:
    """The registered policies' names in registration order; ``adaptive`` True/False: only
    those that may / may not change the depth."""
    return tuple(n for n, c in _CLASSES.items() if adaptive is None or c.adaptive == adaptive)


def policy_sections() -> dict[str, type]:
    """Policy name -> its ``Section`` class, for every registered policy that has one."""
    return {n: c.Section for n, c in _CLASSES.items() if c.Section is not None}
