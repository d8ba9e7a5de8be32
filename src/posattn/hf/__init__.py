"""Hugging Face checkpoints: load them exactly into a `TransformerLM`, save them back.

    model = posattn.hf.from_pretrained("path/to/dir")      # config.json + *.safetensors
    logits = model(tokens)                                   # float32[B, T, V], as transformers
    posattn.hf.save_pretrained(model, "out/")                # transformers reads it back

No torch at run time: tensors stream from the safetensors files (memory-mapped, `safe_open`)
into the parameter tree one at a time, each placed straight to its sharding under a mesh.
Architectures, the tensor mapping of each, and the tolerances: docs/checkpoints.md.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import numpy as np
from flax import nnx

from posattn.hf import mapping
from posattn.hf.config import ARCHITECTURES, HfConfigError, hf_config, model_config, read_config
from posattn.nn.config import ModelConfig
from posattn.nn.model import TransformerLM, convert_layout

__all__ = [
    "ARCHITECTURES",
    "HfConfigError",
    "from_pretrained",
    "load_config",
    "load_params",
    "model_type_of",
    "save_pretrained",
]

_FLOATS = ("F32", "F16", "BF16", "F64")


def load_config(path, *, dtype: str | None = None) -> tuple[ModelConfig, str]:
    """(ModelConfig, model_type) of the checkpoint directory `path`'s config.json."""
    hf = read_config(path)
    return model_config(hf, dtype=dtype), hf.get("model_type")


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """tensor name -> the safetensors file holding it (one file, or the index's shards)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json "
            "(only safetensors checkpoints load; convert a .bin file with transformers first)"
        )
    return {name: single for name in _header(single) if name != "__metadata__"}


def _header(file: pathlib.Path) -> dict[str, Any]:
    """The safetensors header: name -> {"dtype", "shape", "data_offsets"} (and __metadata__)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def _numpy_dtype(code: str):
    import ml_dtypes

    return {
        "F64": np.float64,
        "F32": np.float32,
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
    }.get(code)


class _Reader:
    """Reads single tensors of safetensors files (the format: an 8-byte header length, a JSON
    header, the tensors' bytes) with plain file reads at their offsets.

    Reading rather than memory-mapping keeps the file's pages out of this process's resident
    set: only the tensor being placed is held on the host (benchmarks/hf_load.py measures it).
    The format is the one `safetensors` writes (safetensors.numpy.save_file, transformers).
    """

    def __init__(self, files: dict[str, pathlib.Path]):
        self.files = files
        self.headers = {f: _header(f) for f in set(files.values())}

    def _entry(self, name: str) -> dict:
        return self.headers[self.files[name]][name]

    def dtype(self, name: str) -> str:
        return self._entry(name)["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def get(self, name: str) -> np.ndarray:
        file, entry = self.files[name], self._entry(name)
        dtype = np.dtype(_numpy_dtype(entry["dtype"]))
        start, stop = entry["data_offsets"]
        count = (stop - start) // dtype.itemsize
        with open(file, "rb") as f:
            header_len = 8 + int.from_bytes(f.read(8), "little")
            f.seek(header_len + start)
            data = np.fromfile(f, dtype=dtype, count=count)
        if data.size != int(np.prod(entry["shape"], dtype=np.int64)):
            raise ValueError(f"tensor {name} in {file} is truncated")
        return data.reshape(entry["shape"])

    def close(self):
        pass


def _resolve_names(names, model_type: str, rules) -> dict[str, str]:
    """Rule name -> the file's name for it (files of a bare base model lack its prefix; files of
    older transformers may spell it with an older prefix, `mapping.renamed`)."""
    prefix = mapping.base_prefix(model_type)
    out = {}
    for rule in rules:
        for name in rule.hf:
            if name in names:
                out[name] = name
            elif name.startswith(prefix) and name[len(prefix) :] in names:
                out[name] = name[len(prefix) :]
            else:
                found = [
                    old + name[len(new) :]
                    for new, old in mapping.renamed(model_type)
                    if name.startswith(new) and old + name[len(new) :] in names
                ]
                if found:
                    out[name] = found[0]
    return out


def from_pretrained(path, *, dtype: str | None = None, mesh=None) -> TransformerLM:
    """A `TransformerLM` holding a Hugging Face checkpoint's weights exactly.

    Args:
      path: a directory with config.json and model.safetensors (or sharded files and
        model.safetensors.index.json), as `transformers` writes them.
      dtype: None (float32 parameters and compute) or "bfloat16" / "float32": `model.dtype` and
        `model.param_dtype` of the result.
      mesh: optional `jax.sharding.Mesh` with an `fsdp` axis: each tensor goes straight to its
        `posattn.train.sharding.state_shardings` placement.

    Raises:
      HfConfigError: an architecture or config option posattn cannot compute exactly (named).
      ValueError: a tensor the file has that the mapping does not use, a parameter no tensor
        fills, or a shape/dtype mismatch, each naming the tensors.
    """
    path = pathlib.Path(path)
    cfg, model_type = load_config(path, dtype=dtype)
    graphdef, abstract, constants = _skeleton(cfg)
    params = _load(path, cfg, model_type, abstract, _shardings(mesh, abstract))
    return nnx.merge(graphdef, params, constants)


def load_params(path, cfg: ModelConfig, *, shardings=None) -> nnx.State:
    """The parameters (`nnx.Param` state) of the checkpoint at `path` for `cfg`, which must have
    its architecture (`model.init_from`: dtype, scan_layers, rope_scaling may differ);
    `shardings` (a pytree of NamedShardings like the state) places each tensor."""
    path = pathlib.Path(path)
    _, model_type = load_config(path)
    flat_cfg = cfg.replace(scan_layers=False)
    _, abstract, _ = _skeleton(flat_cfg, constants=False)
    if cfg.scan_layers:
        params = _load(path, flat_cfg, model_type, abstract, None)
        (params,) = convert_layout((params,), flat_cfg, scan_layers=True)
        return params if shardings is None else jax.device_put(params, shardings)
    flat_sh = None
    if shardings is not None:
        flat_sh = {
            p: s.get_value() if isinstance(s, nnx.Variable) else s
            for p, s in nnx.to_flat_state(shardings)
        }
    return _load(path, flat_cfg, model_type, abstract, flat_sh)


def _load(path, cfg, model_type, abstract, shardings) -> nnx.State:
    flat_abstract = dict(nnx.to_flat_state(abstract))
    rules = mapping.rules(cfg, model_type)
    reader = _Reader(_weight_files(path))
    try:
        file_names = set(reader.files)
        resolved = _resolve_names(file_names, model_type, rules)
        missing = [n for r in rules for n in r.hf if n not in resolved]
        used = set(resolved.values())
        unused = sorted(
            n
            for n in file_names - used
            if not n.endswith(mapping.ignored(model_type))
            and not n.startswith(mapping.skipped(model_type))
        )
        filled = {p for r in rules for p in r.ours}
        unfilled = sorted("/".join(map(str, p)) for p in set(flat_abstract) - filled)
        problems = []
        if missing:
            problems.append(f"tensors the {model_type} mapping needs are absent: {_few(missing)}")
        if unused:
            problems.append(f"tensors in the file that the mapping does not use: {_few(unused)}")
        if unfilled:
            problems.append(f"parameters no tensor fills: {_few(unfilled)}")
        if problems:
            raise ValueError(f"{path}: " + "; ".join(problems))
        values = {}
        for rule in rules:
            arrays = []
            for name in rule.hf:
                file_name = resolved[name]
                kind = reader.dtype(file_name)
                if kind not in _FLOATS:
                    raise ValueError(
                        f"tensor {file_name} has dtype {kind}; floating-point tensors expected "
                        f"({', '.join(_FLOATS)})"
                    )
                arrays.append(reader.get(file_name))
            try:
                outs = rule.load(*arrays)
            except ValueError as e:
                shapes = ", ".join(f"{n} {a.shape}" for n, a in zip(rule.hf, arrays, strict=True))
                raise ValueError(f"tensor {shapes} does not fit the model: {e}") from None
            for p, x in zip(rule.ours, outs, strict=True):
                want = flat_abstract[p]
                if tuple(x.shape) != tuple(want.shape):
                    raise ValueError(
                        f"tensor {', '.join(rule.hf)} gives parameter {'/'.join(map(str, p))} "
                        f"the shape {tuple(x.shape)}; the config says {tuple(want.shape)}"
                    )
                host = np.ascontiguousarray(x.astype(want.dtype, copy=False))
                array = jax.device_put(host, shardings[p] if shardings else None)
                values[p] = want.replace(array)
                del host, array
            del arrays, outs
            _release_host_memory()
    finally:
        reader.close()
    return nnx.from_flat_state([(p, values[p]) for p in flat_abstract])


def _release_host_memory() -> None:
    """Hands freed host buffers back to the OS (glibc `malloc_trim`; elsewhere nothing).

    Without it the heap keeps each tensor's freed host copy between the device buffers placed
    after it, and the resident set grows to about twice the parameters (benchmarks/hf_load.py).
    """
    global _TRIM
    if _TRIM is None:
        try:
            import ctypes

            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def _few(names, n: int = 8) -> str:
    names = list(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _skeleton(cfg: ModelConfig, *, constants: bool = True):
    """(graphdef, abstract params, real constants) without allocating the parameters."""
    abstract_model = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, abstract, _ = nnx.split(abstract_model, nnx.Param, ...)
    if not constants:
        return graphdef, abstract, None

    # The constants (RoPE frequencies, ALiBi slopes) are computed from the config; the random
    # parameters of this program are dead code that XLA drops.
    @jax.jit
    def constants():
        return nnx.split(TransformerLM(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[2]

    return graphdef, abstract, constants()


def _shardings(mesh, abstract) -> dict | None:
    """path -> NamedSharding of each parameter under `mesh` (as the training state's)."""
    if mesh is None:
        return None
    from posattn.train import sharding

    return {
        p: sharding.state_shardings(mesh, jax.ShapeDtypeStruct(v.shape, v.dtype))
        for p, v in nnx.to_flat_state(abstract)
    }


def model_type_of(cfg: ModelConfig) -> str:
    """The Hugging Face `model_type` that computes what `cfg` computes, or ValueError."""
    breaking = [spec.position for spec in cfg.layers if spec.family.normalizer != "softmax"]
    if breaking:
        raise ValueError(
            f"model layers of {breaking[0]!r} attention: transformers has no stick-breaking "
            "attention, so no Hugging Face architecture computes this model"
        )
    contextual = [spec.position for spec in cfg.layers if spec.family.contextual]
    if contextual:
        raise ValueError(
            f"model layers of {contextual[0]!r}: transformers has no contextual position encoding "
            "(CoPE), so no Hugging Face architecture computes this model"
        )
    reflecting = [spec.position for spec in cfg.layers if spec.family.reflections]
    if reflecting:
        raise ValueError(
            f"model layers of {reflecting[0]!r}: transformers has no PaTH attention, so no "
            "Hugging Face architecture computes this model"
        )
    kind = _architecture(cfg)
    if kind == "gemma3_text":
        _gemma3_layers(cfg)
        return kind
    if kind == "llama" and _rope_and_nope_layers(cfg):
        if len({spec.window for spec in cfg.layers if spec.window is not None}) <= 1:
            return "smollm3"  # SmolLM3: RoPE and NoPE layers, one window size on any layers
        raise ValueError(
            f"sliding windows {[spec.window for spec in cfg.layers]} (by layer): a model with "
            "NoPE layers is written as SmolLM3, which has one window size"
        )
    windows = _layer_windows(cfg)
    if all(w is None for w in windows):
        return kind
    sizes = {w for w in windows if w is not None}
    if len(sizes) == 1 and kind in ("qwen2", "qwen3", "gemma2"):
        return kind  # Qwen2, Qwen3 and Gemma 2: one window size, on any layers (layer_types)
    if len(sizes) == 1 and None not in windows and kind == "llama" and cfg.bias == "none":
        return "mistral"  # Mistral: one window on every layer, no biases
    if len(sizes) == 1 and kind == "llama" and cfg.bias == "none":
        return "ministral"  # Ministral: one window size on the layers its layer_types lists
    if len(sizes) == 1 and None not in windows and kind == "phi3":
        return kind  # Phi-3: one window on every layer
    if len(sizes) == 1 and None not in windows and kind in ("gpt_neox", "starcoder2"):
        if not cfg.parallel_residual and cfg.settings.partial_factor == 1:
            return "starcoder2"  # StarCoder2: one window on every layer
    raise ValueError(
        f"sliding windows {list(windows)} (by layer) have no Hugging Face twin for this {kind} "
        "model: save_pretrained writes them as Mistral or Ministral (Llama's shape without "
        "biases), Qwen2 (q/k/v biases) or Qwen3 (query/key norms), one window size on any "
        "layers, or Phi-3 (partial rotary) or StarCoder2 (LayerNorm, sequential residuals, "
        "whole-head rotary), one window on every layer"
    )


def _rope_and_nope_layers(cfg: ModelConfig) -> bool:
    """Whether some layers are NoPE and the others take `model.position`'s RoPE as it is (each
    with or without a window, none with a length temperature): SmolLM3's layers."""
    own = [(spec.position, spec.settings, spec.temperature) for spec in cfg.layers]
    rope = (cfg.position, cfg.settings, False)
    nope = any(p == "nope" and not t for p, _, t in own)
    return nope and all(x == rope or (x[0] == "nope" and not x[2]) for x in own)


def _layer_windows(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window, or ValueError if a layer's positions differ from
    `model.position`'s in any other way (no Hugging Face architecture writes that)."""
    for i, spec in enumerate(cfg.layers):
        if spec.position != cfg.position or spec.settings != cfg.settings or spec.temperature:
            raise ValueError(
                f"layer {i} has positions of its own ({spec.position}, {spec.settings}"
                f"{', a length temperature' if spec.temperature else ''}) where model.position "
                f"is {cfg.position} ({cfg.settings}): save_pretrained writes models whose layers "
                "differ by a sliding window at most"
            )
    return tuple(spec.window for spec in cfg.layers)


def _gemma3_layers(cfg: ModelConfig) -> None:
    """ValueError unless the layers are Gemma 3's two kinds: global ones with model.position's
    RoPE and no window, and local ones that share one window and one RoPE of their own."""
    local = {(s.window, s.settings) for s in cfg.layers if s.window is not None}
    for i, spec in enumerate(cfg.layers):
        own = spec.position != cfg.position or spec.temperature
        if own or (spec.window is None and spec.settings != cfg.settings) or len(local) > 1:
            raise ValueError(
                f"layer {i} ({spec}) is neither of Gemma 3's two kinds: global layers with "
                f"model.position's RoPE ({cfg.settings}) and no window, and local layers that all "
                f"share one window and one RoPE (here {sorted(map(str, local))})"
            )


def _architecture(cfg: ModelConfig) -> str:
    """The `model_type` whose blocks compute what `cfg`'s do, its layers' positions aside."""
    arch = (cfg.norm, cfg.norm_bias, cfg.mlp, cfg.embed_scale, cfg.parallel_residual)
    rope = cfg.position == "rope" and cfg.settings.layout == "half"
    rope = rope and cfg.settings.partial_factor == 1 and cfg.settings.proportion == 1
    block = rope and arch == ("rms", False, "gated", "sqrt_d", False) and cfg.norm_unit_offset
    block = block and cfg.bias == "none" and not cfg.embed_norm  # Gemma's, any activation
    # Gemma 2 and 3 write `hidden_activation`, which their transformers classes read; Gemma's
    # reads only its tanh GELU.
    gemma = block and cfg.activation == "gelu_tanh"
    whole = float(cfg.query_pre_attn_scalar).is_integer()  # transformers takes an int
    if block and cfg.post_norms and cfg.qk_norm and whole:
        if cfg.attn_logit_softcap:
            raise ValueError(
                f"model.attn_logit_softcap={cfg.attn_logit_softcap} on Gemma 3's block "
                "(qk_norm): transformers' Gemma 3 does not cap attention logits, so no Hugging "
                "Face architecture computes this model; Gemma 2 (gemma2) caps them without qk_norm"
            )
        return "gemma3_text"
    if block and cfg.post_norms and whole:
        return "gemma2"
    if cfg.attn_logit_softcap or cfg.final_logit_softcap:
        raise ValueError(
            "model.attn_logit_softcap and model.final_logit_softcap are written only as Gemma "
            "2's or Gemma 3's (gemma2, gemma3_text: post_norms, Gemma's 1 + w RMSNorm, a gated "
            "MLP, RoPE 'half', no biases, a whole query_pre_attn_scalar); this model has "
            f"attn_logit_softcap={cfg.attn_logit_softcap}, final_logit_softcap="
            f"{cfg.final_logit_softcap}"
        )
    llama = rope and arch == ("rms", False, "gated", "one", False)
    llama = llama and not cfg.norm_unit_offset and not cfg.embed_norm
    plain_scale = cfg.query_pre_attn_scalar in (0, cfg.head_dim)
    qwen3_bias = cfg.bias in ("none", "attn")
    if llama and cfg.qk_norm and not cfg.post_norms and plain_scale and qwen3_bias:
        return "qwen3"
    if cfg.post_norms or cfg.qk_norm or not plain_scale:
        raise ValueError(
            "model.post_norms, model.qk_norm and model.query_pre_attn_scalar are written only "
            "as Gemma 3's (gemma3_text: both norms, Gemma's 1 + w RMSNorm, a gated MLP, "
            "RoPE 'half', no biases, a whole query_pre_attn_scalar), Gemma 2's (gemma2: as Gemma "
            "3's without qk_norm) or Qwen3's (qk_norm alone on Llama's block, with no biases or "
            "q/k/v/o's); this model has "
            f"post_norms={cfg.post_norms}, qk_norm={cfg.qk_norm}, query_pre_attn_scalar="
            f"{cfg.query_pre_attn_scalar}"
        )
    if gemma:
        return "gemma"
    if llama:
        return {"none": "llama", "attn": "llama", "all": "llama", "qkv": "qwen2"}[cfg.bias]
    phi3 = cfg.position == "rope" and cfg.settings.layout == "half"
    phi3 = phi3 and cfg.settings.proportion == 1 and cfg.settings.partial_factor < 1
    phi3 = phi3 and arch == ("rms", False, "gated", "one", False) and cfg.bias == "none"
    if phi3 and not cfg.norm_unit_offset and not cfg.embed_norm:
        return "phi3"  # Llama's block with partial rotary
    neox = cfg.position == "rope" and arch[:4] == ("layer", True, "plain", "one")
    neox = neox and cfg.settings.layout == "half" and cfg.settings.proportion == 1
    if neox and not cfg.embed_norm and not cfg.norm_unit_offset:
        whole_heads = cfg.head_dim * cfg.num_heads == cfg.d_model
        if cfg.bias == "all" and cfg.num_kv_heads == cfg.num_heads and whole_heads:
            return "gpt_neox"  # its fused qkv holds N heads of each
        if not cfg.parallel_residual and cfg.settings.partial_factor == 1:
            return "starcoder2"  # grouped-query heads, biases on every projection or none
    if cfg.position == "learned" and arch == ("layer", True, "plain", "one", False):
        if cfg.bias == "all" and not cfg.embed_norm and cfg.tie_embeddings:
            return "gpt2"
    if cfg.position == "alibi" and arch == ("layer", True, "plain", "one", False):
        if cfg.bias == "all" and cfg.embed_norm and cfg.activation == "gelu_tanh":
            return "bloom"
    if cfg.position == "alibi" and arch == ("layer", False, "plain", "one", False):
        plain = cfg.bias == "none" and not cfg.embed_norm and cfg.activation == "gelu"
        if plain and cfg.ff_dim == 4 * cfg.d_model and cfg.settings.slope_scale == 1:
            return "mpt"
    raise ValueError(
        "this model has no Hugging Face architecture that computes the same function; "
        "save_pretrained writes Llama/Mistral/Ministral/Qwen2/Qwen3/Phi-3/SmolLM3/Gemma/Gemma 2/"
        "Gemma 3 "
        "(rope, half layout, RMSNorm, gated MLP), "
        "GPT-NeoX and StarCoder2 (rope, LayerNorm), GPT-2 (learned positions), BLOOM "
        "(ALiBi, biases) and MPT (ALiBi, no biases) models"
    )


def save_pretrained(model: TransformerLM, path) -> None:
    """Writes `path`/config.json and `path`/model.safetensors that `transformers` loads to the
    same logits (and `from_pretrained` back to the same parameters)."""
    from safetensors.numpy import save_file

    cfg = model.cfg
    if cfg.scan_layers:
        raise ValueError("save_pretrained takes the per-layer layout (model.scan_layers=False)")
    remapped = [s for s in cfg.layers if s.family.rotary and s.settings.remap is not None]
    if remapped:
        raise ValueError(
            f"model.rope_remap={remapped[0].settings.remap_dict!r}: transformers has no "
            "ReRoPE/SelfExtend setting, so the saved model would compute another function; "
            "save the model without the remap (model.rope_remap=None: the parameters are the "
            "same) and apply it when reading"
        )
    model_type = model_type_of(cfg)
    hf = hf_config(cfg, model_type)
    if cfg.activation not in ("silu", "gelu", "gelu_tanh", "relu"):
        raise ValueError(f"model.activation={cfg.activation!r} has no Hugging Face name")
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors: dict[str, np.ndarray] = {}
    for rule in mapping.rules(cfg, model_type):
        ours = [np.asarray(jax.device_get(params[p][...])) for p in rule.ours]
        for name, x in zip(rule.hf, rule.save(*ours), strict=True):
            tensors[name] = np.ascontiguousarray(x)
    written = {p for r in mapping.rules(cfg, model_type) for p in r.ours}
    extra = sorted("/".join(map(str, p)) for p in set(params) - written)
    if extra:
        raise ValueError(f"parameters the {model_type} mapping does not write: {_few(extra)}")
    dtypes = {str(x.dtype) for x in tensors.values()}
    hf["dtype"] = "bfloat16" if dtypes == {"bfloat16"} else "float32"
    path = pathlib.Path(path)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
