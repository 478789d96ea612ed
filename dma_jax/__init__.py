"""dma-jax: Diagonal-Tiled Mixed-Precision Attention (arXiv 2604.03950) for JAX."""

from .config import DMAConfig
from .decode import decode_attention
from .formats import FORMATS, Quantized, dequantize, quantize
from .kv_cache import LowBitKVCache
from .primitive import attention
from .reference import exact_attention, reference_attention
from .torch_frontend import torch_attention, torch_decode_attention
from . import bridge

__all__ = [
    "DMAConfig",
    "FORMATS",
    "LowBitKVCache",
    "Quantized",
    "attention",
    "decode_attention",
    "dequantize",
    "exact_attention",
    "quantize",
    "reference_attention",
    "torch_attention",
    "torch_decode_attention",
    "bridge",
]
__version__ = "0.1.0"
