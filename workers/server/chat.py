"""Chat templates: the prompt text of a list of messages, rendered as transformers renders a
checkpoint's ``chat_template`` (Jinja), without transformers.

Where the template comes from (``find_template``): ``--chat-template FILE``, else the model
directory's ``chat_template.jinja``, else its ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of ``{"name", "template"}`` of which the one named ``default`` is used).

How it renders (``ChatTemplate``): a sandboxed Jinja environment (``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation
%}`` block that renders its body), a ``tojson`` filter that writes JSON as Python's ``json.dumps``
does (non-ASCII kept, no HTML escaping), the globals ``raise_exception(message)`` (the template
refuses the messages: a 400 with that message) and ``strftime_now(format)``; the variables
``messages`` (``role``, ``content`` as one string, ``name`` when given), ``add_generation_prompt``,
``tools`` and ``documents`` (None), and the special tokens' texts of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``; "" when absent). The text then goes
through the tokenizer with special tokens' texts read as those tokens and nothing added
(``Codec.encode(text, add_special_tokens=False)``): the template writes the BOS itself.

No torch or transformers here (the frontend imports it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from workers.model_files import TOKENIZER_CONFIG_FILE

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateRefusal(ValueError):
    """The template refused the messages (``raise_exception``: `kind` "refused") or failed on
    them ("error"; the render pool adds "timeout" and "too_long")."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class TemplateSource:
    """A template's text and where it was found (for messages)."""

    text: str
    origin: str


def _special_text(value: Any) -> Optional[str]:
    """A `tokenizer_config.json` special-token entry: a string or `{"content": ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(model_dir: Path) -> dict:
    path = model_dir / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from None
    return config if isinstance(config, dict) else {}


def find_template(model_dir: Optional[str | Path], override: Optional[str | Path] = None
                  ) -> Optional[TemplateSource]:
    """The chat template to use (None: the model has none); see the module docstring.
    `ValueError` naming the file when one cannot be read."""
    if override is not None:
        path = Path(override)
        try:
            return TemplateSource(path.read_text(encoding="utf-8"), f"--chat-template {path}")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--chat-template {str(path)!r}: cannot be read ({err})") from None
    if model_dir is None:
        return None
    root = Path(model_dir)
    if (root / TEMPLATE_FILE).is_file():
        return TemplateSource((root / TEMPLATE_FILE).read_text(encoding="utf-8"),
                              str(root / TEMPLATE_FILE))
    value = _read_config(root).get("chat_template")
    origin = f"{root / TOKENIZER_CONFIG_FILE}'s chat_template"
    if isinstance(value, str):
        return TemplateSource(value, origin)
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return TemplateSource(named["default"], f"{origin} 'default'")
    return None


def special_tokens(model_dir: Optional[str | Path]) -> dict[str, str]:
    """The special tokens' texts a template may use (`SPECIAL_KEYS`; "" when absent)."""
    config = _read_config(Path(model_dir)) if model_dir is not None else {}
    return {key: _special_text(config.get(key)) or "" for key in SPECIAL_KEYS}


def _environment() -> Any:
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's tokens in training
        templates): renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
               separators: Optional[Sequence[str]] = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=tuple(separators) if separators else None,
                          sort_keys=sort_keys)

    def raise_exception(message: Any) -> None:
        raise TemplateRefusal(str(message), kind="refused")

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    class NoFolding(CodeGenerator):
        """Jinja evaluates constant expressions while it compiles (the optimizer, and each
        output's children), so `{{ 'x' * 10**10 }}` or `{{ 3 ** 10**8 }}` would run in
        whatever process compiles the template (the launch checks --chat-template), outside
        any bound. Nothing is folded here: it runs in the render worker, under its time and
        memory limits."""

        def _output_child_to_const(self, node: Any, frame: Any, finalize: Any) -> str:
            raise nodes.Impossible()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols],
                                        optimized=False)
    env.code_generator_class = NoFolding
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


@dataclass
class ChatTemplate:
    """A compiled chat template and the special tokens' texts it renders with."""

    source: TemplateSource
    specials: dict[str, str] = field(default_factory=dict)
    _template: Any = None

    def __post_init__(self) -> None:
        from jinja2 import TemplateError

        try:
            self._template = _environment().from_string(self.source.text)
        except TemplateError as err:
            raise ValueError(f"the chat template ({self.source.origin}) does not compile: "
                             f"{type(err).__name__}: {err}") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text; `TemplateRefusal` when the template refuses or fails on them (in
        this process, unbounded: the server renders through `render.RenderPool`)."""
        return self.render_bounded(messages, add_generation_prompt, None)

    def render_bounded(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       max_chars: Optional[int]) -> str:
        """`render`, stopped with `TemplateRefusal` (kind "too_long") as soon as the output
        passes `max_chars` characters (None: no bound). Any exception of the render is a
        `TemplateRefusal`."""
        from jinja2 import TemplateError

        try:
            pieces, total = [], 0
            for piece in self._template.generate(messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self.specials):
                total += len(piece)
                if max_chars is not None and total > max_chars:
                    raise TemplateRefusal(f"the chat template's output passed {max_chars} "
                                          f"characters (twice --max-body-size); it was stopped",
                                          kind="too_long")
                pieces.append(piece)
            return "".join(pieces)
        except TemplateRefusal:
            raise
        except TemplateError as err:
            raise TemplateRefusal(f"{type(err).__name__}: {err}") from None
        except Exception as err:    # OverflowError (range over the sandbox's limit), ...
            raise TemplateRefusal(f"the template failed on them ({type(err).__name__}: "
                                  f"{err})") from None


def load_chat_template(model_dir: Optional[str | Path], override: Optional[str | Path] = None
                       ) -> Optional[ChatTemplate]:
    """The model's chat template, compiled (None: it has none and no `override` is given);
    `ValueError` naming the file when it cannot be read or compiled."""
    source = find_template(model_dir, override)
    if source is None:
        return None
    return ChatTemplate(source, special_tokens(model_dir))
