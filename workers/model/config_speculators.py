"""EAGLE-3 heads in the speculators library's layout (``speculators_model_type: "eagle3"``), as
vLLM reads it. Part of ``workers.model.config``.

The layout nests the decoder layer's settings in ``transformer_layer_config`` (a transformers
``LlamaConfig``, serialized by the library with ``to_diff_dict``: an absent key means
transformers' ``LlamaConfig`` default, ``LLAMA_DEFAULTS``), keeps the head's own settings at the
top (``draft_vocab_size``, ``norm_before_residual``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids``, and the switches of later variants, ``norm_before_fc``,
``fc_norm``, ``norm_output``), describes what it was trained for in ``speculators_config``
(algorithm, proposal methods, verifier) and names the midlayer's tensors ``layers.0.*``.

Its aux layer ids count the states between target layers from the embedding: id ``k`` is the
state entering target layer ``k`` (``k = L``: after the last layer), as vLLM captures them and as
the library's data generation extracts them; SGLang's layout counts from the first layer's
output (``Eagle3Config.aux_layer_ids``: id ``k`` enters layer ``k + 1``). The reader converts, so
the same head in both layouts captures the same states.

Every key is read, listed as not changing the forward, or refused by name, as in the other
readers; a value this implementation does not compute (a Qwen3 decoder layer, a norm before
``fc``, more than one layer) is refused naming the key and what is allowed.
"""
from __future__ import annotations

from typing import Any, Collection, Mapping

from workers.model.config_checks import (
    IRRELEVANT_KEYS,
    _architecture,
    _check_bool,
    _check_int,
    _check_unsupported,
)
from workers.model.config_dense import _DIMS_KEYS, LLAMA_ARCHITECTURE, _dims_kwargs, _dims_to_hf
from workers.model.config_eagle import Eagle3Config

SPECULATORS_EAGLE3_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_TYPE_KEY = "speculators_model_type"
"""The key that marks the layout (vLLM tells it by this key too)."""

LLAMA_DEFAULTS = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_act": "silu",
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "attention_bias": False,
    "mlp_bias": False,
}
"""transformers' ``LlamaConfig`` defaults of the keys the reader reads: what an absent key of a
``transformer_layer_config`` means (``num_key_value_heads`` defaults to the attention heads,
``head_dim`` to ``hidden_size / num_attention_heads`` and the RoPE theta to 10000 there as
here)."""

_HEAD_KEYS = ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
              "eagle_aux_hidden_state_layer_ids")
_OFF_SWITCHES = {
    "norm_before_fc": "an RMSNorm over the concatenated target states before fc",
    "fc_norm": "an RMSNorm over each target state before fc",
    "norm_output": "drafts fed back after the final norm",
}
"""Later variants' switches: read, and refused when on (this implementation does not compute
them)."""
_TRAINING_KEYS = ("speculators_version", "embed_requires_grad", "enable_sp_ulysses")
"""Top-level keys that do not change the forward: the library's version, training settings."""
_TOP_IGNORED = ("tie_word_embeddings", "bos_token_id", "eos_token_id")
"""Top-level keys transformers' ``PretrainedConfig`` writes that mean nothing to the head (its LM
head is over the draft vocabulary, never tied; the target's tokenizer ends the sequences)."""
_SPECULATORS_CONFIG_KEYS = ("algorithm", "proposal_methods", "default_proposal_method", "verifier")


def is_speculators_layout(raw: Mapping[str, Any]) -> bool:
    """Whether a parsed ``config.json`` is in the speculators library's layout."""
    return SPECULATORS_TYPE_KEY in raw


def _refuse_unknown(raw: Mapping[str, Any], understood: Collection[str], where: str) -> None:
    """Refuse every key of ``raw`` (found at ``where``) neither understood nor irrelevant."""
    unknown = sorted(k for k in raw if k not in understood and k not in IRRELEVANT_KEYS)
    if unknown:
        raise ValueError(f"config key '{where}{unknown[0]}' is not understood by this "
                         f"implementation of an EAGLE-3 head in the speculators layout: it may "
                         f"change the model's math, so it is refused (unknown keys: "
                         f"{[where + k for k in unknown]}; the keys known not to change the "
                         f"forward are workers.model.config.IRRELEVANT_KEYS)")


def _speculators_config(value: Any) -> None:
    """``speculators_config``: what the head was trained for. ``algorithm`` must be eagle3; the
    proposal methods (the library's drafting and acceptance hints) and the verifier's name are
    not read: the depth is the engine's (``--steps``, ``--adaptive``), verification is exact, and
    the head is checked against the target it is given."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"config key 'speculators_config' is {value!r}; allowed: an object")
    _refuse_unknown(value, _SPECULATORS_CONFIG_KEYS, "speculators_config.")
    algorithm = value.get("algorithm", "eagle3")
    if algorithm != "eagle3":
        raise ValueError(f"config key 'speculators_config.algorithm' is {algorithm!r}; "
                         f"supported: 'eagle3'")
    methods = value.get("proposal_methods", [])
    if not isinstance(methods, list) or not all(isinstance(m, dict) for m in methods):
        raise ValueError(f"config key 'speculators_config.proposal_methods' is {methods!r}; "
                         f"allowed: a list of objects")
    verifier = value.get("verifier", {})
    if verifier is not None and not isinstance(verifier, dict):
        raise ValueError(f"config key 'speculators_config.verifier' is {verifier!r}; allowed: "
                         f"an object")


def _layer_config(value: Any) -> dict[str, Any]:
    """``transformer_layer_config`` with transformers' ``LlamaConfig`` defaults filled in, checked
    key by key."""
    if not isinstance(value, dict):
        raise ValueError(f"config key 'transformer_layer_config' is {value!r}; allowed: an "
                         f"object (the decoder layer's settings)")
    kind = value.get("model_type")
    if kind != "llama":
        raise ValueError(f"config key 'transformer_layer_config.model_type' is {kind!r}; "
                         f"supported: 'llama' (the EAGLE-3 midlayer is a Llama decoder layer; "
                         f"the speculators library's default for an absent model_type differs "
                         f"between its releases)")
    _refuse_unknown(value, (*_DIMS_KEYS, "tie_word_embeddings"), "transformer_layer_config.")
    archs = value.get("architectures")
    if archs is not None and (not isinstance(archs, list) or LLAMA_ARCHITECTURE not in archs):
        raise ValueError(f"config key 'transformer_layer_config.architectures' is {archs!r}; "
                         f"allowed: null or a list naming {LLAMA_ARCHITECTURE!r}")
    return {**LLAMA_DEFAULTS, **{k: v for k, v in value.items() if k != "architectures"}}


def _aux_ids(value: Any) -> tuple[int, ...] | None:
    """The top-level ``eagle_aux_hidden_state_layer_ids`` (ids of the states entering target
    layers) as ``Eagle3Config.aux_layer_ids`` (ids of the layers whose output they are)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3 or len(set(value)) != 3 or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise ValueError(f"config key 'eagle_aux_hidden_state_layer_ids' is {value!r}; allowed: "
                         f"three distinct target layer ids >= 0 (id k: the state entering "
                         f"target layer k)")
    return tuple(k - 1 for k in value)


def eagle3_from_speculators(raw: Mapping[str, Any],
                            tensor_names: Collection[str] = ()) -> Eagle3Config:
    """An EAGLE-3 head's configuration from a ``config.json`` in the speculators layout
    (``tensor_names``: the checkpoint's tensors, which say whether ``fc`` has a bias and whether
    the head brings its own embedding); ``ValueError`` naming the key otherwise."""
    kind = raw.get(SPECULATORS_TYPE_KEY)
    if kind != "eagle3":
        raise ValueError(f"config key '{SPECULATORS_TYPE_KEY}' is {kind!r}; supported: 'eagle3' "
                         f"(an EAGLE-3 head in the speculators layout)")
    _architecture(raw, (SPECULATORS_EAGLE3_ARCHITECTURE,))
    _refuse_unknown(raw, ("architectures", SPECULATORS_TYPE_KEY, "speculators_config",
                          "transformer_layer_config", *_HEAD_KEYS, *_OFF_SWITCHES,
                          *_TRAINING_KEYS, *_TOP_IGNORED), "")
    _speculators_config(raw.get("speculators_config"))
    for key, what in _OFF_SWITCHES.items():
        value = raw.get(key, False)
        _check_bool(key, value)
        if value:
            raise ValueError(f"config key {key!r} is true ({what}); supported: false (not "
                             f"implemented)")
    for key in ("draft_vocab_size", "norm_before_residual"):
        if key not in raw:
            raise ValueError(f"config key {key!r} is missing; the speculators layout gives it "
                             f"(the library's default and vLLM's differ for "
                             f"norm_before_residual, and draft_vocab_size sizes the LM head)")
    _check_bool("norm_before_residual", raw["norm_before_residual"])
    _check_int("draft_vocab_size", raw["draft_vocab_size"])
    if raw.get("target_hidden_size") is not None:
        _check_int("target_hidden_size", raw["target_hidden_size"])
    ids = _aux_ids(raw.get("eagle_aux_hidden_state_layer_ids"))
    if "transformer_layer_config" not in raw:
        raise ValueError("config key 'transformer_layer_config' is missing; the speculators "
                         "layout gives the decoder layer's settings there")
    layer = _layer_config(raw["transformer_layer_config"])
    try:
        kwargs = _dims_kwargs(layer)
        _check_unsupported(layer)
    except ValueError as err:
        raise ValueError(f"transformer_layer_config: {err}") from None
    if isinstance(kwargs["vocab_size"], int) and raw["draft_vocab_size"] > kwargs["vocab_size"]:
        raise ValueError(f"config key 'draft_vocab_size' is {raw['draft_vocab_size']}; allowed: "
                         f"at most transformer_layer_config.vocab_size ({kwargs['vocab_size']})")
    names = set(tensor_names)
    try:       # what is left to go wrong is a setting of the decoder layer
        return Eagle3Config(**kwargs, draft_vocab_size=raw["draft_vocab_size"],
                            aux_layer_ids=ids, target_hidden_size=raw.get("target_hidden_size"),
                            norm_before_residual=raw["norm_before_residual"],
                            fc_bias="fc.bias" in names,
                            own_embedding="embed_tokens.weight" in names, layout="speculators")
    except ValueError as err:
        raise ValueError(f"transformer_layer_config: {err}") from None


def to_speculators(cfg: Eagle3Config) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` in the speculators layout (``eagle3_from_speculators``
    reads it back to ``cfg``)."""
    layer = _dims_to_hf(cfg)
    layer.pop("torch_dtype", None)
    layer.update(model_type="llama", attention_bias=False)
    ids = cfg.aux_layer_ids
    return {
        "architectures": [SPECULATORS_EAGLE3_ARCHITECTURE],
        SPECULATORS_TYPE_KEY: "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": None if ids is None else [k + 1 for k in ids],
        "norm_before_fc": False, "fc_norm": False, "norm_output": False,
    }
