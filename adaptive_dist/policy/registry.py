"""The policy registry: the one place a policy's name becomes its class.

``register_policy(cls)`` adds a ``DepthPolicy`` class under ``cls.name``. Everything else that
lists policies reads it: ``adaptive_dist.config.POLICIES`` (the configuration's ``policy`` key
and every ``--policy`` flag's choices), the sections an ``AdaptiveConfig`` holds (``cls.Section``,
its own keys), ``load_config``'s defaults (``cls.default_candidates``), what an engine measures at
start-up (``cls.start_up_needs``, ``adaptive_dist.startup.prepare``). So a new policy is its own
module and one ``register_policy`` call; the built-in ones register in
``adaptive_dist.policy.__init__``.

Importing this module imports nothing of the adaptive layer (``adaptive_dist.config`` reads it
when it is used), so the configuration and the policies do not import each other at load time.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

_CLASSES: dict[str, type] = {}


def _load_builtins() -> None:
    """Register the built-in policies (importing the package does it, once; importing this
    module imports the package first, so this only matters while it is being imported)."""
    import adaptive_dist.policy  # noqa: F401  (its __init__ registers static, ema, goodput)


def register_policy(cls: type) -> type:
    """Add the policy class ``cls`` under ``cls.name`` and return it (usable as a decorator).

    Refused (``ValueError``) when the name is taken or empty, or when a key of ``cls.Section``
    (a ``PolicySection`` dataclass, or None) is a key every policy reads or another policy's:
    a flat key in a config file names exactly one setting."""
    from adaptive_dist.config import AdaptiveConfig, PolicySection

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
        taken = {k: "every policy" for k in AdaptiveConfig.core_keys()}
        taken.update({n: f"policy {n!r}" for n in _CLASSES})
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
    if not _CLASSES:
        _load_builtins()
    return _CLASSES[name]


def policy_names(adaptive: Optional[bool] = None) -> tuple[str, ...]:
    """The registered policies' names in registration order; ``adaptive`` True/False: only
    those that may / may not change the depth."""
    if not _CLASSES:
        _load_builtins()
    return tuple(n for n, c in _CLASSES.items() if adaptive is None or c.adaptive == adaptive)


def policy_sections() -> dict[str, type]:
    """Policy name -> its ``Section`` class, for every registered policy that has one."""
    if not _CLASSES:
        _load_builtins()
    return {n: c.Section for n, c in _CLASSES.items() if c.Section is not None}
