"""The draft heads' ``config.json``: EAGLE (1/2) heads (``EagleConfig``, ours or the EAGLE
project's layout) and EAGLE-3 heads (``Eagle3Config``, SGLang's ``LlamaForCausalLMEagle3``
layout; the speculators library's layout is read by ``workers.model.config_speculators``). Part
of ``workers.model.config``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

from workers.model.config_checks import (
    _architecture,
    _check_bool,
    _check_fits,
    _check_int,
    _check_keys,
    _check_unsupported,
)
from workers.model.config_dense import (
    _DIMS_KEYS,
    LLAMA_ARCHITECTURE,
    LlamaConfig,
    _DecoderDims,
    _dims_kwargs,
    _dims_of,
    _dims_to_hf,
)

EAGLE_ARCHITECTURE = "EagleLlamaHead"
EAGLE_PROJECT_ARCHITECTURES = (LLAMA_ARCHITECTURE, "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE3_LAYOUTS = ("sglang", "speculators")   # Eagle3Config.layout: whose layout the checkpoint is in


@dataclass(frozen=True, kw_only=True)
class EagleConfig(_DecoderDims):
    """An EAGLE (1/2) draft head: ``fc([embed; feature]) -> num_hidden_layers decoder layers
    -> norm``.

    Its dimensions are the decoder layer's; ``hidden_size`` and ``vocab_size`` must equal the
    target's (the head shares the target's embedding and LM head). ``layout`` is ``"own"``
    (``EagleLlamaHead``: ``fc_bias`` from the config, every norm present) or ``"eagle"`` (the
    EAGLE project's: ``fc_bias``, ``first_input_norm``, ``final_norm`` and ``attention_qkv_bias``
    say which of ``fc.bias``, ``layers.0.input_layernorm.weight``, ``norm.weight`` and
    ``layers.0.self_attn.{q,k,v}_proj.bias`` (its heads for Qwen2 targets) the checkpoint holds;
    a head without the final norm hands its output to the target's LM head as it is).
    """

    num_hidden_layers: int = 1
    fc_bias: bool = True
    layout: str = "own"
    first_input_norm: bool = True
    final_norm: bool = True
    attention_qkv_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("fc_bias", "first_input_norm", "final_norm", "attention_qkv_bias"):
            _check_bool(key, getattr(self, key))
        if self.layout not in ("own", "eagle"):
            raise ValueError(f"EAGLE layout {self.layout!r}; allowed: 'own', 'eagle'")
        if self.layout == "own" and (not (self.first_input_norm and self.final_norm)
                                     or self.attention_qkv_bias):
            raise ValueError("an EagleLlamaHead has every norm and no attention bias; other heads "
                             "are in the EAGLE project's layout (layout='eagle')")

    @property
    def qkv_bias(self) -> bool:
        """Whether the head's q/k/v projections have biases (``attention_qkv_bias``)."""
        return self.attention_qkv_bias

    @staticmethod
    def for_target(target: LlamaConfig, **overrides: Any) -> EagleConfig:
        """A one-layer head with the target's dimensions (``overrides`` replace fields)."""
        base = _dims_of(target)
        base.update(num_hidden_layers=1)
        base.update(overrides)
        return EagleConfig(**base)

    def check_target(self, target: LlamaConfig) -> None:
        """Raise ``ValueError`` unless this head fits ``target`` (hidden size and vocabulary)."""
        for key in ("hidden_size", "vocab_size"):
            _check_fits(key, getattr(self, key), getattr(target, key))

    @staticmethod
    def from_hf(raw: Mapping[str, Any], tensor_names: Collection[str] = ()) -> EagleConfig:
        """Build from a parsed ``config.json`` of an EAGLE head (``tensor_names``: the checkpoint's
        tensors, which decide the optional parts of the EAGLE project's layout)."""
        arch = _architecture(raw, (EAGLE_ARCHITECTURE, *EAGLE_PROJECT_ARCHITECTURES))
        # the EAGLE project's `bias` says whether fc has one: the tensors decide, as for the norms
        _check_keys(raw, (*_DIMS_KEYS, "fc_bias" if arch == EAGLE_ARCHITECTURE else "bias",
                          "tie_word_embeddings"), f"an EAGLE head ({arch})")
        kwargs = _dims_kwargs(raw)
        _check_unsupported(raw, attention_bias_ok=arch != EAGLE_ARCHITECTURE)  # tensors decide
        if arch == EAGLE_ARCHITECTURE:
            return EagleConfig(**kwargs, fc_bias=raw.get("fc_bias", True))
        names = set(tensor_names)
        return EagleConfig(**kwargs, layout="eagle", fc_bias="fc.bias" in names,
                           first_input_norm="layers.0.input_layernorm.weight" in names,
                           final_norm="norm.weight" in names,
                           attention_qkv_bias=any(f"layers.0.self_attn.{p}_proj.bias" in names
                                                  for p in "qkv"))

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of the head."""
        out = _dims_to_hf(self)
        out["attention_bias"] = self.attention_qkv_bias
        if self.layout == "own":
            out.update(architectures=[EAGLE_ARCHITECTURE], model_type="eagle_llama_head",
                       fc_bias=self.fc_bias)
        else:  # the EAGLE project writes a Llama config (its optional parts live in the tensors)
            out.update(architectures=[LLAMA_ARCHITECTURE], model_type="llama", bias=self.fc_bias)
        return out


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(_DecoderDims):
    """An EAGLE-3 draft head (see ``workers.model.eagle3``).

    ``draft_vocab_size``: rows of its own LM head (mapped to target ids by ``d2t``);
    ``aux_layer_ids``: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as the config gives them
    (id ``k`` names the output of target layer ``k``, i.e. the residual entering layer ``k + 1``;
    ``None``: the residual entering layers ``2``, ``L // 2`` and ``L - 3``);
    ``target_hidden_size``: the width of each target hidden state ``fc`` takes (default
    ``hidden_size``); ``fc_bias`` / ``own_embedding``: whether the checkpoint holds ``fc.bias`` /
    ``embed_tokens.weight`` (without it the head uses the target's embedding);
    ``norm_before_residual``: the midlayer's residual is the normed hidden state
    (``hidden_norm(hidden)``) instead of the hidden state itself; ``layout``: the checkpoint's
    layout, ``"sglang"`` (``LlamaForCausalLMEagle3``: a flat ``config.json``, the midlayer's
    tensors under ``midlayer.``) or ``"speculators"`` (the speculators library's, as vLLM reads
    it: ``workers.model.config_speculators``; the midlayer's tensors under ``layers.0.``, the aux
    layer ids counted from the embedding, so its id ``k`` is ``aux_layer_ids``' ``k - 1``).

    The captured states are concatenated in layer order, whatever order the config lists them in
    (as SGLang and vLLM capture them during the target's forward).
    """

    num_hidden_layers: int = 1
    draft_vocab_size: int
    aux_layer_ids: Optional[tuple[int, ...]] = None
    target_hidden_size: Optional[int] = None
    fc_bias: bool = False
    own_embedding: bool = False
    norm_before_residual: bool = False
    layout: str = "sglang"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout not in EAGLE3_LAYOUTS:
            raise ValueError(f"EAGLE-3 layout {self.layout!r}; allowed: "
                             f"{', '.join(map(repr, EAGLE3_LAYOUTS))}")
        if self.num_hidden_layers != 1:
            raise ValueError(f"config key 'num_hidden_layers' is {self.num_hidden_layers!r}; "
                             f"allowed: 1 (an EAGLE-3 head has one midlayer)")
        _check_int("draft_vocab_size", self.draft_vocab_size)
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"config key 'draft_vocab_size' is {self.draft_vocab_size}; allowed: "
                             f"at most vocab_size ({self.vocab_size})")
        if self.target_hidden_size is not None:
            _check_int("target_hidden_size", self.target_hidden_size)
        for key in ("fc_bias", "own_embedding", "norm_before_residual"):
            _check_bool(key, getattr(self, key))
        if self.aux_layer_ids is not None and (
                len(self.aux_layer_ids) != 3 or len(set(self.aux_layer_ids)) != 3 or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in self.aux_layer_ids)):
            raise ValueError(f"config key 'eagle_config.eagle_aux_hidden_state_layer_ids' is "
                             f"{list(self.aux_layer_ids)!r}; allowed: three distinct layer ids")

    @property
    def fused_width(self) -> int:
        """Width of ``fc``'s input: three target hidden states."""
        return 3 * (self.target_hidden_size or self.hidden_size)

    def capture_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose entering residual stream ``fc`` fuses, in layer order (index
        ``L``: after the last layer, before the final norm)."""
        n = num_target_layers
        # listed ids in layer order (as SGLang and vLLM capture them); the default is in layer
        # order already from 7 layers on (smaller test targets keep it as written)
        layers = ((2, n // 2, n - 3) if self.aux_layer_ids is None
                  else tuple(sorted(k + 1 for k in self.aux_layer_ids)))
        if not all(0 <= i <= n for i in layers) and self.layout == "speculators":
            given = ("the default (2, L//2, L-3)" if self.aux_layer_ids is None
                     else f"eagle_aux_hidden_state_layer_ids "
                          f"{[k + 1 for k in self.aux_layer_ids]}, the speculators layout's ids "
                          f"of the states entering target layers")
            raise ValueError(f"EAGLE-3 layers to capture {list(layers)} (from {given}) are outside "
                             f"the target's {n} layers; allowed: layer ids in [0, {n}]")
        if not all(0 <= i <= n for i in layers):
            given = ("the default (2, L//2, L-3)" if self.aux_layer_ids is None
                     else f"eagle_config.eagle_aux_hidden_state_layer_ids "
                          f"{list(self.aux_layer_ids)}")
            raise ValueError(f"EAGLE-3 layers to capture {list(layers)} (from {given}) are outside "
                             f"the target's {n} layers; allowed: layer ids in [-1, {n - 1}]")
        return layers

    def check_target(self, target: LlamaConfig) -> None:
        """Raise ``ValueError`` unless this head fits ``target``."""
        _check_fits("hidden_size", self.hidden_size, target.hidden_size)
        _check_fits("vocab_size", self.vocab_size, target.vocab_size)
        if self.target_hidden_size is not None:
            _check_fits("target_hidden_size", self.target_hidden_size, target.hidden_size,
                        "hidden_size")
        self.capture_layers(target.num_hidden_layers)

    @staticmethod
    def for_target(target: LlamaConfig, draft_vocab_size: int, **overrides: Any) -> Eagle3Config:
        """A head with the target's dimensions (``overrides`` replace fields)."""
        base = _dims_of(target)
        base.update(num_hidden_layers=1, draft_vocab_size=draft_vocab_size, explicit_head_dim=None)
        base.update(overrides)
        return Eagle3Config(**base)

    @staticmethod
    def from_hf(raw: Mapping[str, Any], tensor_names: Collection[str] = ()) -> Eagle3Config:
        """Build from a parsed ``config.json`` (``tensor_names``: the checkpoint's tensors).

        The aux layer ids are read from the top level first, then from ``eagle_config`` (as vLLM
        reads them); both present and different is refused."""
        _architecture(raw, (EAGLE3_ARCHITECTURE,))
        _check_keys(raw, (*_DIMS_KEYS, "draft_vocab_size", "eagle_config", "target_hidden_size",
                          "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
                          "tie_word_embeddings"), f"an EAGLE-3 head ({EAGLE3_ARCHITECTURE})")
        kwargs = _dims_kwargs(raw)
        _check_unsupported(raw)
        eagle = raw.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise ValueError(f"config key 'eagle_config' is {eagle!r}; allowed: an object")
        for key in eagle:
            if key not in ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"):
                raise ValueError(f"config key 'eagle_config.{key}' is not understood by this "
                                 f"implementation of an EAGLE-3 head (it may change the math); "
                                 f"understood: ['eagle_aux_hidden_state_layer_ids', "
                                 f"'use_aux_hidden_state']")
        if eagle.get("use_aux_hidden_state", True) is not True:
            raise ValueError(f"config key 'eagle_config.use_aux_hidden_state' is "
                             f"{eagle['use_aux_hidden_state']!r}; supported: true (the head fuses "
                             f"three target layers)")
        ids = _aux_layer_ids(raw.get("eagle_aux_hidden_state_layer_ids"),
                             eagle.get("eagle_aux_hidden_state_layer_ids"))
        names = set(tensor_names)
        return Eagle3Config(**kwargs, draft_vocab_size=raw.get("draft_vocab_size", raw["vocab_size"]),
                            aux_layer_ids=ids, target_hidden_size=raw.get("target_hidden_size"),
                            norm_before_residual=raw.get("norm_before_residual", False),
                            fc_bias="fc.bias" in names, own_embedding="embed_tokens.weight" in names)

    def tensor_name(self, name: str) -> str:
        """The checkpoint's name of this head's parameter or buffer ``name`` in its ``layout``."""
        if self.layout == "speculators" and name.startswith("midlayer."):
            return "layers.0." + name[len("midlayer."):]
        return name

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict of the head in SGLang's layout. The speculators layout has
        its own writer, ``workers.model.config_speculators.to_speculators`` (which reads and
        builds this class: the one direction between the two modules)."""
        if self.layout == "speculators":
            raise ValueError("Eagle3Config.to_hf writes SGLang's layout; a head in the "
                             "speculators layout is written by config_speculators.to_speculators")
        out = _dims_to_hf(self)
        out.update(architectures=[EAGLE3_ARCHITECTURE], model_type="llama", attention_bias=False,
                   draft_vocab_size=self.draft_vocab_size)
        if self.aux_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        if self.target_hidden_size is not None:
            out["target_hidden_size"] = self.target_hidden_size
        if self.norm_before_residual:
            out["norm_before_residual"] = True
        return out


def _aux_layer_ids(top: Any, nested: Any) -> tuple[int, ...] | None:
    """The EAGLE-3 aux layer ids from the top-level key or ``eagle_config``'s."""
    for key, ids in (("eagle_aux_hidden_state_layer_ids", top),
                     ("eagle_config.eagle_aux_hidden_state_layer_ids", nested)):
        if ids is not None and not isinstance(ids, list):
            raise ValueError(f"config key {key!r} is {ids!r}; allowed: a list of three layer ids")
    if top is not None and nested is not None and top != nested:
        raise ValueError(f"config keys 'eagle_aux_hidden_state_layer_ids' ({top}) and "
                         f"'eagle_config.eagle_aux_hidden_state_layer_ids' ({nested}) differ; "
                         f"give one, or the same ids in both")
    ids = top if top is not None else nested
    return tuple(ids) if ids is not None else None


DraftConfig = EagleConfig | Eagle3Config
