"""`LlamaConfig`: the hyper-parameters of Llama 2/3/3.1/3.2 and SmolLM-style models."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3.1 style frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or None.
    rope_llama3: tuple[float, float, float, int] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict (transformers 4 or 5)."""
        if cfg.get("model_type", "llama") != "llama":
            raise ValueError(f"not a Llama config: model_type={cfg.get('model_type')!r}")
        # transformers 5 keeps theta and scaling in `rope_parameters`; 4 in
        # `rope_theta` and `rope_scaling`.
        rope = dict(cfg.get("rope_parameters") or {})
        rope.update({k: v for k, v in (cfg.get("rope_scaling") or {}).items() if v is not None})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]),
                      float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
        elif kind == "default":
            llama3 = None
        else:
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(theta), rope_llama3=llama3,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        )
