"""The sampler's Gumbel noise: `jax.random.gumbel`'s bits, with the Threefry rounds unrolled.

`jax.random` hashes counters with Threefry-2x32 (20 rounds). On CPU, JAX
lowers the hash as a loop of 5 iterations to keep compile times short; XLA
then runs each decode step's noise ([B, V] = 8 x 32000 on the small preset)
as a loop that copies its state between iterations, and the draw cannot fuse
with the logits. Written out as array operations, the same hash is one fused
pass, several times faster a decode step (`benchmarks/sampler_draw.py`'s
`noise_in_scan_ms` times both; its figures: docs/design/exact_logprobs.md,
"Gumbel noise with the Threefry rounds unrolled"). GPU and TPU lower JAX's hash
unrolled already; this is the same arithmetic there.

The noise is the same bits as `jax.random.gumbel(key, shape, float32)`
wherever JAX's defaults hold: a Threefry key (typed, or a raw `uint32[2]`
under the default implementation), `jax_threefry_partitionable` on (JAX's
default), low-range Gumbel (`jax_high_dynamic_range_gumbel` off,
the default), float32, fewer than 2^32 values. Elsewhere `gumbel` calls
`jax.random.gumbel` itself, so the values are JAX's whichever path runs.
`tests/test_sampling_draw.py` compares the bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["gumbel", "threefry_bits"]

# Threefry-2x32's rotation schedule (Salmon et al., SC'11): rounds alternate between the two rows.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _rotate_left(x: jax.Array, bits: int) -> jax.Array:
    return (x << np.uint32(bits)) | (x >> np.uint32(32 - bits))


def _threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array):
    """Threefry-2x32 of the counter pair (x1, x2) under key (k1, k2): 20 rounds, unrolled."""
    ks = (k1, k2, k1 ^ k2 ^ _PARITY)
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):  # 5 groups of 4 rounds, a key injection after each
        for r in _ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = _rotate_left(x2, r) ^ x1
        x1 = x1 + ks[(i + 1) % 3]
        x2 = x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x1, x2


def _key_words(key: jax.Array) -> jax.Array | None:
    """The key's two uint32 words where it is a Threefry key, else None."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape or str(jax.random.key_impl(key)) != "threefry2x32":
            return None
        return jax.random.key_data(key)
    if key.shape != (2,) or key.dtype != jnp.uint32:
        return None
    if jax.config.jax_default_prng_impl != "threefry2x32":
        return None
    return key


def _ours(key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array | None:
    """The key's words where this module reproduces JAX's bits for it, else None."""
    if (jnp.dtype(dtype) != jnp.float32 or not shape or math.prod(shape) >= 2**32
            or not jax.config.jax_threefry_partitionable
            or jax.config.jax_high_dynamic_range_gumbel):
        return None
    return _key_words(key)


def threefry_bits(words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 `shape`: `jax.random.bits(key, shape)` for a Threefry key's `words` (partitionable).

    Counter i (the row-major flat index, high word 0 below 2^32 values) hashes
    to a pair, and the value is the pair's XOR, as JAX's partitionable bits.
    """
    flat = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):  # the flat index from per-axis iotas (shardable)
        flat = flat + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride)
        stride *= shape[axis]
    hi, lo = _threefry2x32(words[0], words[1], jnp.zeros(shape, jnp.uint32), flat)
    return hi ^ lo


def gumbel(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """`jax.random.gumbel(key, shape, dtype)`, bit for bit, one fused pass where it can be.

    The uniform in [tiny, 1) from the bits' top 23 as a float's mantissa, then
    -log(-log(u)): `jax.random.uniform`'s and `gumbel`'s own arithmetic.
    """
    shape = tuple(shape)
    words = _ours(key, shape, dtype)
    if words is None:
        return jax.random.gumbel(key, shape, dtype)
    bits = threefry_bits(words, shape)
    one = jnp.float32(1.0)
    mantissa = (bits >> np.uint32(32 - 23)) | np.uint32(np.float32(1.0).view(np.uint32))
    floats = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - one
    tiny = jnp.float32(jnp.finfo(jnp.float32).tiny)
    u = jax.lax.max(tiny, floats * (one - tiny) + tiny)
    return -jnp.log(-jnp.log(u))
