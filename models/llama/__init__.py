"""A small Flax NNX Llama with pluggable attention and real-checkpoint loaders."""

from .attention import ATTENTION_NAMES, AttentionSpec
from .config import LlamaConfig
from .model import KVCache, Llama, LowBitCache, new_cache
from .loaders import load_checkpoint

__all__ = ["ATTENTION_NAMES", "AttentionSpec", "KVCache", "Llama", "LlamaConfig", "LowBitCache", "load_checkpoint",
           "new_cache"]
