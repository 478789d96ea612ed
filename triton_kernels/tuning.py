"""Launch settings, as data: block shapes, warps and stages per GPU generation, and
the work per program of the quantize launches. Measured on an H200 with
``benchmarks/tune_attention.py``, ``benchmarks/quantize.py`` and
``benchmarks/profile_attention.py``; docs/performance.md has the sweeps. Plain Python.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DECODE", "DecodeConfig", "LaunchConfig", "SM90_GLUON", "Sm90GluonConfig", "decode_split_len", "k_tile_tokens", "launch_config",
           "mean_chunk"]


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Settings of the Triton attention kernel."""

    block_m: int  # query rows per program; divides geometry.TILE
    block_n: int  # keys per inner step; divides geometry.TILE
    num_warps: int
    num_stages: int


# sm_90, keyed by (head_dim, causal, FP8 P·V). With the FP8 tiles loaded through FP8
# pointers (so that they are pipelined into shared memory), 64 rows x 128 keys in 4
# warps are best at head_dim 128: 2 stages with bf16 V, 3 with the FP8 P·V. At
# head_dim 64, 64 x 64 blocks in 4 warps and 3 stages.
LAUNCH_SM90 = {
    (128, False, False): LaunchConfig(64, 128, 4, 2),
    (128, True, False): LaunchConfig(64, 128, 4, 2),
    (128, False, True): LaunchConfig(64, 128, 4, 3),
    (128, True, True): LaunchConfig(64, 128, 4, 3),
    (64, False, False): LaunchConfig(64, 64, 4, 3),
    (64, True, False): LaunchConfig(64, 64, 4, 3),
    (64, False, True): LaunchConfig(64, 64, 4, 3),
    (64, True, True): LaunchConfig(64, 64, 4, 3),
}
SM90_FALLBACK = LaunchConfig(64, 128, 4, 3)
# The unquantized baseline (bf16 Q·Kᵀ and P·V) on sm_90, keyed by (head_dim, causal)
# (``tune_attention.py --unquantized``).
LAUNCH_SM90_UNQUANTIZED = {
    (128, False): LaunchConfig(128, 128, 8, 3),
    (128, True): LaunchConfig(64, 64, 4, 3),
    (64, False): LaunchConfig(128, 64, 8, 3),
    (64, True): LaunchConfig(64, 64, 4, 3),
}
# DMA with NVFP4's exact bf16 copies (bf16 MMAs for the low tiles) on sm_90, keyed by
# (head_dim, causal) (``tune_attention.py --pv input``, H100, S = 8192): 128 x 64 in 8
# warps, 3 stages, 419 / 416 TFLOP/s non-causal / causal against 306 / 240 with the
# FP8 setting.
LAUNCH_SM90_BF16_LOW = {
    (128, False): LaunchConfig(128, 64, 8, 3),
    (128, True): LaunchConfig(128, 64, 8, 3),
}
# Everything else, sm_100 included: tcgen05's block-scaled MMA needs 128-row tiles
# (a CPU test checks the sm_100 PTX).
DEFAULT_LAUNCH = LaunchConfig(128, 64, 8, 2)


def launch_config(head_dim: int, causal: bool, pv_fp8: bool, capability: tuple[int, int] | None,
                  unquantized: bool = False, lo_bf16: bool = False) -> LaunchConfig:
    """The Triton attention kernel's settings on a GPU of compute ``capability`` (None:
    Triton's interpreter); ``unquantized``: the bf16 baseline; ``lo_bf16``: NVFP4 tiles
    on their bf16 copies."""
    if capability is not None and capability[0] == 9:
        if unquantized:
            return LAUNCH_SM90_UNQUANTIZED.get((head_dim, causal), SM90_FALLBACK)
        if lo_bf16 and not pv_fp8 and (head_dim, causal) in LAUNCH_SM90_BF16_LOW:
            return LAUNCH_SM90_BF16_LOW[(head_dim, causal)]
        return LAUNCH_SM90.get((head_dim, causal, pv_fp8), SM90_FALLBACK)
    return DEFAULT_LAUNCH


@dataclasses.dataclass(frozen=True)
class Sm90GluonConfig:
    """Settings of the Gluon sm_90 attention kernel: 128 query rows per program in two
    consumer warpgroups of 64 plus one loader warpgroup (4 warps each), 216 registers
    per consumer thread and 72 per loader thread (the 3 × 168 of one program of 384
    threads per SM; 64 spilled the loader's offsets with bf16 low copies).
    A third K/V slot measured +3% causal and -8% non-causal (H200, 8k and 16k,
    head_dim 128), hence the stages per causality."""

    block_m: int = 128
    block_n: int = 128
    stages_causal: int = 3
    stages_full: int = 2
    # With NVFP4's bf16 copies K's slots are twice as wide: a third slot (with Q's
    # two copies, 240 KiB) exceeds the 227 KiB of shared memory.
    stages_bf16_low: int = 2
    consumer_regs: int = 216
    loader_regs: int = 72
    num_warps: int = 4  # the default partition: the first consumer warpgroup

    def stages(self, causal: bool, lo_bf16: bool) -> int:
        """K/V slots in the ring for a launch."""
        if lo_bf16:
            return self.stages_bf16_low
        return self.stages_causal if causal else self.stages_full


SM90_GLUON = Sm90GluonConfig()

# Quantize launches: tokens per program step and warps of the dual quantization.
QUANTIZE_BLOCK_T = 16
QUANTIZE_WARPS = 4
# Tokens per program of the channel reductions (smooth-K's sums, V's amax), largest
# first: a short sequence takes smaller chunks so that the launch still has
# MEAN_MIN_PROGRAMS programs (256 tokens are fastest from 2k tokens on, 128 at 1k).
MEAN_CHUNKS = (256, 128, 64)
MEAN_MIN_PROGRAMS = 64
MEAN_BLOCK_T = 64
# Tokens per program of K's per-tile FP8 copies, largest first. Every program passes
# over its whole tile for the scale, so splitting a tile repeats that pass: worth it
# only where whole tiles give too few programs.
K_TILE_TOKENS = (128, 64, 32)
K_TILE_MIN_PROGRAMS = 512
# Tokens per program of V's transposed FP8 copy.
TRANSPOSE_BLOCK_T = 64


def _tokens_per_program(shape: tuple[int, ...], choices: tuple[int, ...], min_programs: int) -> int:
    """The largest of ``choices`` (largest first) that splits x ``[B, L, H, D]`` into at
    least ``min_programs`` programs over (tokens, head, batch), else the smallest."""
    b, length, h, _ = shape
    return next((c for c in choices if -(-length // c) * h * b >= min_programs), choices[-1])


def mean_chunk(shape: tuple[int, ...]) -> int:
    """Tokens per program of the channel reductions of x ``[B, L, H, D]``."""
    return _tokens_per_program(shape, MEAN_CHUNKS, MEAN_MIN_PROGRAMS)


def k_tile_tokens(shape: tuple[int, ...]) -> int:
    """Tokens per program of x ``[B, L, H, D]``'s per-tile FP8 copies."""
    return _tokens_per_program(shape, K_TILE_TOKENS, K_TILE_MIN_PROGRAMS)

@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Settings of the decode kernel (``triton_kernels.decode``): keys per step, warps,
    pipeline stages, and the programs to aim for when splitting the keys (at least
    ``min_blocks`` key blocks per split, so that loading and decoding Q stays small
    next to its keys; at most ``max_splits`` splits, which one program per kv head and
    batch row combines in turn). ``lift_values``: FP8 values decoded by bit moves
    (``decode._e4m3_words``) instead of the conversion instructions where P·V runs in
    bf16; the same numbers either way, and no faster on an H200 (docs/performance.md)."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    programs: int = 1056
    min_blocks: int = 4
    max_splits: int = 64
    lift_values: bool = False


DECODE = DecodeConfig()


def decode_split_len(batch: int, kv_heads: int, capacity: int, launch: DecodeConfig = DECODE) -> int:
    """Keys per program (a multiple of ``launch.block_n``) of a decode step over a cache
    of ``capacity`` positions: enough splits for ``launch.programs`` programs."""
    blocks = -(-capacity // launch.block_n)
    wanted = -(-launch.programs // max(1, batch * kv_heads))
    n_split = max(1, min(wanted, blocks // launch.min_blocks, launch.max_splits))
    return -(-blocks // n_split) * launch.block_n
