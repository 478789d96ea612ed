"""The Walsh–Hadamard rotation along head_dim inside the quantize kernels: the float32
butterfly of ``dma_jax.rotation.hadamard``, stage for stage, so that both round alike.
Kernel code only."""

import triton
import triton.language as tl


@triton.jit
def hadamard_rows(x, T: tl.constexpr, D: tl.constexpr):
    """``x · H`` for every row of a [T, D] float32 tile (D a power of two): at stride
    s = 1, 2, 4, ..., elements i and i + s (i // s even) become (a + b, a − b).
    Each stage views the row as [D / 2s, 2, s] and moves the pair axis last, where
    ``tl.split`` takes it apart."""
    for i in tl.static_range(D.bit_length() - 1):
        # (The stride 2^i is written out: a constexpr cannot be reassigned per stage.)
        pairs = tl.permute(tl.reshape(x, (T, D >> (i + 1), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (T, D))
    return x
