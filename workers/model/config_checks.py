"""What every ``config.json`` reader shares: the value checks (each error names the key, the
value and what is allowed), the keys known not to change the forward (``IRRELEVANT_KEYS``), the
refusal of every other key, and the architecture lookup. Part of ``workers.model.config``."""
from __future__ import annotations

import math
from typing import Any, Collection, Mapping, Optional


def _check_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"config key {name!r} is {value!r}; allowed: an integer >= {minimum}")


def _check_positive_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"config key {name!r} is {value!r}; allowed: a finite number > 0")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"config key {name!r} is {value!r}; allowed: true or false")


def _check_token_id(name: str, value: Any, vocab_size: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise ValueError(f"config key {name!r} is {value!r}; allowed: None or an integer in [0, {vocab_size})")



def _check_fits(key: str, mine: int, theirs: int, their_key: Optional[str] = None) -> None:
    if mine != theirs:
        raise ValueError(f"draft config key {key!r} is {mine}; allowed: the target's "
                         f"{their_key or key} ({theirs})")



def _architecture(raw: Mapping[str, Any], supported: Collection[str]) -> str:
    """The first entry of ``architectures`` this implementation supports."""
    archs = raw.get("architectures")
    if isinstance(archs, list):
        for arch in archs:
            if arch in supported:
                return arch
    raise ValueError(f"unsupported architecture {archs!r} in config.json; supported: "
                     f"{sorted(supported)!r}")


# config.json keys that do not change the forward: bookkeeping, training-time settings and the
# generation defaults older transformers wrote into every config
IRRELEVANT_KEYS = frozenset({
    "_name_or_path", "transformers_version", "model_type", "torch_dtype", "dtype",
    "initializer_range", "use_cache", "pad_token_id", "attention_dropout", "pretraining_tp",
    "auto_map", "_attn_implementation_autoset", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "finetuning_task", "id2label",
    "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k",
    "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens",
})


def _check_keys(raw: Mapping[str, Any], understood: Collection[str], what: str) -> None:
    """Refuse every key of ``raw`` that is neither understood nor listed as irrelevant."""
    unknown = sorted(k for k in raw if k not in understood and k not in IRRELEVANT_KEYS)
    if unknown:
        raise ValueError(f"config key {unknown[0]!r} is not understood by this implementation of "
                         f"{what}: it may change the model's math, so it is refused (unknown keys: "
                         f"{unknown}; the keys known not to change the forward are "
                         f"workers.model.config.IRRELEVANT_KEYS)")


def _check_unsupported(raw: Mapping[str, Any], attention_bias_ok: bool = False) -> None:
    refused = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False}
    if not attention_bias_ok:
        refused["attention_bias"] = False
    for key, allowed in refused.items():
        if key in raw and raw[key] != allowed:
            raise ValueError(f"config key {key!r} is {raw[key]!r}; supported: {allowed!r}")
    layers = raw.get("layer_types")
    if layers is not None and (not isinstance(layers, list)
                               or any(t != "full_attention" for t in layers)):
        raise ValueError(f"config key 'layer_types' is {layers!r}; supported: every layer "
                         f"'full_attention' (sliding windows are not implemented)")

