"""Load and save models in the Hugging Face layout.

A model directory holds ``config.json`` and its weights in any format ``workers.model.weights``
reads (safetensors or ``pytorch_model.bin``, one file or shards with an index). Each rank reads
only its slice of every split tensor: the attention projections' slice of its attention-TP group,
the MLP's and the vocabulary's slice of the world (see ``workers.model.parallel``).
Weights are converted to ``dtype`` (float32 by default) on load; ``checkpoint_dtype`` reads
the dtype a checkpoint says it is stored in (what ``--dtype auto`` loads on a GPU);
``save_pretrained`` writes bfloat16 by default.

* ``load_llama(dir)``: a target (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
  ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``,
  ``Qwen2MoeForCausalLM``); ``generation_config.json``'s end-of-sequence ids win over
  ``config.json``'s.
* ``load_eagle(dir, target)``: a draft head for ``target``, by its ``architectures``: an EAGLE
  (1/2) head (``EagleLlamaHead``, or the EAGLE project's ``LlamaForCausalLM`` /
  ``LlamaForCausalLMEagle``) or an EAGLE-3 head (``LlamaForCausalLMEagle3``, or the speculators
  library's layout, told by its ``speculators_model_type``: ``Eagle3Speculator``).

Errors name the file and what is wrong: ``FileNotFoundError`` for a missing directory,
``config.json`` or weights file; ``CheckpointError`` (a ``ValueError``) for unreadable JSON or
weights, a missing tensor, a shape mismatch, a bad ``d2t``, an unsupported architecture or a
draft that does not fit its target.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from workers.model.config import (
    EAGLE3_ARCHITECTURE,
    EAGLE_ARCHITECTURE,
    EAGLE_PROJECT_ARCHITECTURES,
    Eagle3Config,
    EagleConfig,
    LlamaConfig,
)
from workers.model.config_speculators import (
    eagle3_from_speculators,
    is_speculators_layout,
    to_speculators,
)
from workers.model.eagle import EagleHead
from workers.model.eagle3 import Eagle3Head, vocab_map_problem
from workers.model.layers import shard_specs
from workers.model.llama import LlamaForCausalLM
from workers.model.parallel import ModelParallel
from workers.model.weights import (
    BIN_FILE,
    BIN_INDEX_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    WeightFiles,
)
from workers.model_files import GENERATION_CONFIG_FILE, eos_token_ids

CONFIG_FILE = "config.json"
DRAFT_ARCHITECTURES = (EAGLE_ARCHITECTURE, *EAGLE_PROJECT_ARCHITECTURES, EAGLE3_ARCHITECTURE)
DraftHead = EagleHead | Eagle3Head


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of the model directory ``path``."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(root)!r} does not exist (or is not a directory)")
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"model directory {str(root)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{str(cfg_path)!r} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(cfg_path)!r} holds {type(raw).__name__}; expected a JSON object")
    return raw


def _in_file(root: Path, err: ValueError, file: str = CONFIG_FILE) -> CheckpointError:
    """``err`` (a config problem) as a ``CheckpointError`` naming the file it came from."""
    return CheckpointError(f"{str(root / file)!r}: {err}")


def _tensor_name(module: nn.Module) -> Any:
    """The checkpoint's name of each parameter of ``module`` (an EAGLE-3 head's depends on its
    layout: ``Eagle3Config.tensor_name``)."""
    cfg = getattr(module, "config", None)
    return cfg.tensor_name if isinstance(cfg, Eagle3Config) else (lambda name: name)


def _load_into(module: nn.Module, weights: WeightFiles) -> None:
    specs = shard_specs(module)
    stored = _tensor_name(module)
    with torch.no_grad():
        for name, param in module.named_parameters():
            shard = specs.get(name)
            shape = list(param.shape)
            if shard is not None:
                shape[shard.dim] = shard.full
            param.copy_(weights.read(stored(name), tuple(shape), shard))


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "trunc_normal_", "zeros_", "ones_",
                   "constant_")


@contextlib.contextmanager
def _building(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Modules built in the block get their tensors on ``device`` in ``dtype`` (floating-point
    factories without a dtype), uninitialised: ``torch.nn.init``'s initialisers are skipped,
    the weights are loaded next. Not on the meta device and converted after: meta tensors run
    torch's Python reference kernels, whose first call imports ``torch._dynamo`` (3.5-7 s of a
    start-up on the 2-core CPU), and a float32 model converted to bfloat16 is allocated twice
    (an 8B model: 32 GB, then 16 GB more, the float32 blocks left in the caching allocator)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    previous = torch.get_default_dtype()
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _materialize(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating-point buffers a module made with a dtype of its own follow ``dtype`` (as
    ``module.to(dtype)`` casts them; integer buffers, d2t and t2d, keep theirs), without a
    cast of the parameters, which are in ``dtype`` already (a cast re-fuses the fused weights:
    ``workers.model.layers.FusedOwner``)."""
    if any(p.is_floating_point() and p.dtype != dtype for p in module.parameters()):
        module.to(dtype)
        return
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                sub._buffers[name] = buf.to(dtype)


CHECKPOINT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                     "float32": torch.float32}
"""The dtypes a checkpoint's ``torch_dtype`` (or transformers' newer ``dtype``) may name for
``--dtype auto`` (``float``, ``half`` and ``torch.``-prefixed spellings read the same)."""


def checkpoint_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype ``config.json`` says the weights are stored in (``torch_dtype``, or ``dtype``
    as transformers >= 4.56 writes it); None when it names none. ``CheckpointError`` naming the
    file and key for a value that is not a floating-point dtype."""
    root = Path(path)
    raw = read_config(root)
    for key in ("torch_dtype", "dtype"):
        value = raw.get(key)
        if value is None:
            continue
        name = str(value).removeprefix("torch.")
        name = {"float": "float32", "half": "float16"}.get(name, name)
        if not isinstance(value, str) or name not in CHECKPOINT_DTYPES:
            raise CheckpointError(f"{str(root / CONFIG_FILE)!r}: {key}={value!r}; allowed: "
                                  f"{', '.join(CHECKPOINT_DTYPES)}")
        return CHECKPOINT_DTYPES[name]
    return None


def target_config(path: str | Path) -> LlamaConfig:
    """The target's configuration: ``config.json``, with ``generation_config.json``'s
    end-of-sequence ids when it gives some. Errors name the file."""
    root = Path(path)
    raw = read_config(root)
    try:
        cfg = LlamaConfig.from_hf(raw)
        eos = eos_token_ids(root)
        if eos and eos != cfg.eos_token_ids:
            cfg = dataclasses.replace(cfg, eos_token_id=eos)
    except ValueError as err:
        where = GENERATION_CONFIG_FILE if "eos_token_id" in str(err) and (
            root / GENERATION_CONFIG_FILE).is_file() else CONFIG_FILE
        raise _in_file(root, err, where) from None
    return cfg


def load_llama(path: str | Path, par: ModelParallel | None = None,
               dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Load a target directory; this rank keeps its shards only (``par``)."""
    root = Path(path)
    cfg = target_config(root)
    weights = WeightFiles(root)
    par = par if par is not None else ModelParallel.single(device)
    try:
        cfg.check_tp(par.attn.size, par.mlp.size, moe_parallel=par.moe)
    except ValueError as err:
        raise _in_file(root, err) from None
    with _building(device, dtype):
        model = LlamaForCausalLM(cfg, par)
    _materialize(model, dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _load_into(model, weights)
    model.reset_buffers()
    return model.eval()


def draft_config(path: str | Path, target: LlamaForCausalLM,
                 weights: Optional[WeightFiles] = None) -> EagleConfig | Eagle3Config:
    """The draft head's configuration, checked against ``target``; errors name the file."""
    root = Path(path)
    raw = read_config(root)
    names = (weights or WeightFiles(root)).names
    try:
        archs = raw.get("architectures")
        if is_speculators_layout(raw):
            cfg: EagleConfig | Eagle3Config = eagle3_from_speculators(raw, names)
        elif isinstance(archs, list) and EAGLE3_ARCHITECTURE in archs:
            cfg = Eagle3Config.from_hf(raw, names)
        elif isinstance(archs, list) and any(a in DRAFT_ARCHITECTURES for a in archs):
            cfg = EagleConfig.from_hf(raw, names)
        else:
            raise ValueError(f"unsupported architecture {archs!r} for a draft head; supported: "
                             f"{list(DRAFT_ARCHITECTURES)!r}")
        cfg.check_target(target.config)
        cfg.check_tp(target.par.attn.size, target.par.mlp.size)
    except ValueError as err:
        raise _in_file(root, err) from None
    if "fc.weight" not in names:
        raise CheckpointError(f"draft model {str(root)!r} has no tensor 'fc.weight': not an EAGLE "
                              f"head (a standalone draft model is not supported)")
    return cfg


def load_eagle(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> DraftHead:
    """Load a draft head directory for ``target`` (split like the target; dtype/device default
    to the target's): an EAGLE head, or an EAGLE-3 head (which attaches its ``fc`` to
    ``target``)."""
    root = Path(path)
    weights = WeightFiles(root)
    cfg = draft_config(root, target, weights)
    ref = target.lm_head.weight
    kind = Eagle3Head if isinstance(cfg, Eagle3Config) else EagleHead
    with _building(device or ref.device, dtype or ref.dtype):
        head = kind(cfg, target)
    _materialize(head, dtype or ref.dtype)
    _load_into(head, weights)
    if isinstance(head, Eagle3Head):
        _load_vocab_map(head, weights)
    head.reset_buffers()
    return head.eval()


def _load_vocab_map(head: Eagle3Head, weights: WeightFiles) -> None:
    """``d2t`` (required unless the draft vocabulary is the target's) and ``t2d`` (optional),
    checked: one-to-one into the target's vocabulary, ``t2d`` marking exactly those ids."""
    cfg = head.config
    if "d2t" in weights.names:
        d2t = weights.read("d2t", (cfg.draft_vocab_size,), None)
    elif cfg.draft_vocab_size == cfg.vocab_size:
        d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    else:
        raise CheckpointError(f"tensor 'd2t' is missing from checkpoint {str(weights.root)!r} "
                              f"(needed: draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                              f"{cfg.vocab_size})")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"tensor 'd2t' in {weights.where('d2t')!r} has dtype {d2t.dtype}; "
                              f"expected an integer dtype")
    t2d = weights.read("t2d", (cfg.vocab_size,), None) if "t2d" in weights.names else None
    problem = vocab_map_problem(d2t, t2d, cfg.vocab_size)
    if problem is not None:
        where = weights.where("t2d" if problem.startswith("t2d") else "d2t")
        raise CheckpointError(f"{where!r}: {problem}")
    head.set_vocab_map(d2t.to(torch.int64).to(head.d2t.device))


# ---- saving -----------------------------------------------------------------------------------

def _shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> Iterator[dict[str, torch.Tensor]]:
    shard: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard and max_bytes is not None and size + nbytes > max_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def _tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Parameters in ``dtype`` and persistent buffers as they are (d2t, t2d), whole, on the CPU."""
    out = {n: _own(p.detach().to("cpu", dtype).contiguous()) for n, p in model.named_parameters()}
    persistent = set(model.state_dict())
    out.update({n: b.detach().to("cpu").contiguous() for n, b in model.named_buffers()
                if n in persistent})
    return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view into a larger buffer (fused Q/K/V, gate/up: see
    ``workers.model.layers.FusedColumns``), so every saved tensor owns exactly its bytes."""
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def save_pretrained(model: LlamaForCausalLM | DraftHead, path: str | Path,
                    dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int | None = None,
                    weights_format: str = "safetensors", layout: str | None = None) -> None:
    """Write ``config.json`` and the weights (one file, or shards of at most ``max_shard_bytes``
    with an index) as ``safetensors`` or ``bin`` (``pytorch_model.bin``). Only a one-rank model
    can be saved (every tensor is whole). ``layout`` (an EAGLE-3 head only; default: the one it
    was loaded from): ``"sglang"`` or ``"speculators"`` (``Eagle3Config.layout``)."""
    if weights_format not in ("safetensors", "bin"):
        raise ValueError(f"weights_format={weights_format!r}; allowed: 'safetensors', 'bin'")
    config = model.config
    if layout is not None:
        if not isinstance(config, Eagle3Config):
            raise ValueError(f"layout={layout!r} applies to an EAGLE-3 head only")
        config = dataclasses.replace(config, layout=layout)
    par = model.par if isinstance(model, LlamaForCausalLM) else model.target.par
    if par.mlp.size != 1:
        raise ValueError(f"save_pretrained needs a one-rank model; this one is split over "
                         f"{par.mlp.size} ranks")
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for stale in [root / SINGLE_FILE, root / INDEX_FILE, root / BIN_FILE, root / BIN_INDEX_FILE,
                  *root.glob("model-*-of-*.safetensors"), *root.glob("pytorch_model-*-of-*.bin")]:
        stale.unlink(missing_ok=True)
    stored = config.tensor_name if isinstance(config, Eagle3Config) else (lambda name: name)
    tensors = {stored(name): t for name, t in _tensors(model, dtype).items()}
    speculators = isinstance(config, Eagle3Config) and config.layout == "speculators"
    cfg = to_speculators(config) if speculators else config.to_hf()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (root / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    shards = list(_shards(tensors, max_shard_bytes))
    single, index, stem, ext = ((SINGLE_FILE, INDEX_FILE, "model", "safetensors")
                                if weights_format == "safetensors"
                                else (BIN_FILE, BIN_INDEX_FILE, "pytorch_model", "bin"))
    if len(shards) == 1:
        _write(shards[0], root / single)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}"
        _write(shard, root / file)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / index).write_text(json.dumps({"metadata": {"total_size": total},
                                          "weight_map": weight_map}, indent=2) + "\n")


def _write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, str(path))
