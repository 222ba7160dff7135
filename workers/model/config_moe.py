"""The mixture-of-experts targets' keys (Qwen3-MoE, Mixtral, Qwen2-MoE): ``MoeSpec``, the sparse
MLP a ``LlamaConfig`` of those architectures carries. Part of ``workers.model.config``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from workers.model.config_checks import _check_bool, _check_int

QWEN3_MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
QWEN2_MOE_ARCHITECTURE = "Qwen2MoeForCausalLM"
MIXTRAL_ARCHITECTURE = "MixtralForCausalLM"


@dataclass(frozen=True)
class MoeSpec:
    """The sparse MLP of a mixture-of-experts target: a router ``gate`` [E, d], softmax over the
    ``num_experts`` logits, the ``top_k`` most probable experts per token (their probabilities
    renormalised to sum to 1 when ``norm_topk_prob``), each expert a SwiGLU of width
    ``expert_size``. Layer ``i`` is sparse when ``(i + 1) % sparse_step == 0`` and ``i`` is not in
    ``dense_layers`` (those keep the dense MLP of ``intermediate_size``).

    ``shared_expert_size`` (Qwen2-MoE's ``shared_expert_intermediate_size``; ``None``: none): every
    sparse layer also runs a SwiGLU shared expert of that width over every token, scaled per token
    by ``sigmoid(shared_expert_gate(x))`` (a ``[1, d]`` linear) and added to the routed output.

    ``names`` is the checkpoint's layout: ``"qwen3_moe"`` (``mlp.gate``,
    ``mlp.experts.{e}.{gate,up,down}_proj``, and for a shared expert ``mlp.shared_expert.*`` and
    ``mlp.shared_expert_gate``; Qwen3-MoE and Qwen2-MoE) or ``"mixtral"``
    (``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1/w3/w2``)."""

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk_prob: bool
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    names: str = "qwen3_moe"
    shared_expert_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("num_experts", self.num_experts)
        _check_int("num_experts_per_tok", self.top_k)
        if self.top_k > self.num_experts:
            raise ValueError(f"config key 'num_experts_per_tok' is {self.top_k}; allowed: at most "
                             f"the number of experts ({self.num_experts})")
        _check_int("moe_intermediate_size", self.expert_size)
        _check_bool("norm_topk_prob", self.norm_topk_prob)
        _check_int("decoder_sparse_step", self.sparse_step)
        for layer in self.dense_layers:
            _check_int("mlp_only_layers", layer, 0)
        if self.names not in ("qwen3_moe", "mixtral"):
            raise ValueError(f"MoE names {self.names!r}; allowed: 'qwen3_moe', 'mixtral'")
        if self.shared_expert_size is not None:
            _check_int("shared_expert_intermediate_size", self.shared_expert_size)
            if self.names != "qwen3_moe":
                raise ValueError("a shared expert is read in the 'qwen3_moe' names only (Qwen2-MoE)")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has the sparse MLP."""
        return (layer + 1) % self.sparse_step == 0 and layer not in self.dense_layers

    def check_split(self, mode: str, ranks: int) -> None:
        """Raise ``ValueError`` unless the experts split over ``ranks`` in ``mode``: ``"tp"``
        (every expert's width split) or ``"ep"`` (whole experts per rank). A shared expert's
        width splits over the ranks in both modes, as the dense MLP's does."""
        if mode == "ep" and self.num_experts % ranks:
            raise ValueError(f"expert parallelism over {ranks} ranks needs a number of experts "
                             f"divisible by {ranks}; the checkpoint has {self.num_experts}")
        if mode == "tp" and self.expert_size % ranks:
            raise ValueError(f"config key 'moe_intermediate_size' is {self.expert_size}; expert "
                             f"tensor parallelism over {ranks} ranks needs a multiple of {ranks} "
                             f"(or use --moe-parallel ep)")
        if self.shared_expert_size is not None and self.shared_expert_size % ranks:
            raise ValueError(f"config key 'shared_expert_intermediate_size' is "
                             f"{self.shared_expert_size}; the shared expert's tensor parallelism "
                             f"over {ranks} ranks needs a multiple of {ranks}")
        if mode not in MOE_PARALLEL:
            raise ValueError(f"MoE parallel mode {mode!r}; allowed: {', '.join(MOE_PARALLEL)}")

    @staticmethod
    def from_hf(raw: Mapping[str, Any], arch: str) -> MoeSpec:
        """The MoE fields of a Qwen3-MoE, Qwen2-MoE or Mixtral ``config.json`` (the defaults of
        absent keys are transformers' for that architecture)."""
        if arch == MIXTRAL_ARCHITECTURE:
            if raw.get("sliding_window") is not None:
                raise ValueError(f"config key 'sliding_window' is {raw['sliding_window']!r}; "
                                 f"supported: null (sliding windows are not implemented)")
            return MoeSpec(raw.get("num_local_experts", 8), raw.get("num_experts_per_tok", 2),
                           raw["intermediate_size"], True, names="mixtral")
        both = [k for k in ("num_experts", "num_local_experts") if k in raw]
        if len(both) == 2 and raw["num_experts"] != raw["num_local_experts"]:
            raise ValueError(f"config keys 'num_experts' ({raw['num_experts']}) and "
                             f"'num_local_experts' ({raw['num_local_experts']}) differ")
        if not both or "moe_intermediate_size" not in raw:
            raise ValueError("config.json lacks the MoE keys 'num_experts' (or "
                             "'num_local_experts') and 'moe_intermediate_size'")
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise ValueError(f"config key 'mlp_only_layers' is {dense!r}; allowed: a list of layer ids")
        shared, top_k = None, raw.get("num_experts_per_tok", 8)
        if arch == QWEN2_MOE_ARCHITECTURE:
            if "shared_expert_intermediate_size" not in raw:
                raise ValueError("config.json lacks the Qwen2-MoE key "
                                 "'shared_expert_intermediate_size' (the shared expert's width)")
            shared, top_k = raw["shared_expert_intermediate_size"], raw.get("num_experts_per_tok", 4)
        return MoeSpec(raw[both[0]], top_k, raw["moe_intermediate_size"],
                       raw.get("norm_topk_prob", False), raw.get("decoder_sparse_step", 1),
                       tuple(dense), shared_expert_size=shared)

    def to_hf(self) -> dict[str, Any]:
        """The MoE keys of ``config.json``."""
        if self.names == "mixtral":
            return {"num_local_experts": self.num_experts, "num_experts_per_tok": self.top_k}
        out = {"num_experts": self.num_experts, "num_experts_per_tok": self.top_k,
               "moe_intermediate_size": self.expert_size, "norm_topk_prob": self.norm_topk_prob,
               "decoder_sparse_step": self.sparse_step, "mlp_only_layers": list(self.dense_layers)}
        if self.shared_expert_size is not None:
            out["shared_expert_intermediate_size"] = self.shared_expert_size
        return out


MOE_PARALLEL = ("tp", "ep")    # how a MoE target's experts split (ModelParallel.moe)
# keys of MoE configs read by MoeSpec, or (router training losses, jitter) irrelevant to inference
_MOE_KEYS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "output_router_logits",
             "router_aux_loss_coef", "router_jitter_noise")
# keys only some MoE targets have: Qwen2-MoE's shared expert, and its q/k/v bias switch (checked:
# true, the biases its architecture has)
_ARCH_KEYS = {QWEN2_MOE_ARCHITECTURE: ("shared_expert_intermediate_size", "qkv_bias")}
