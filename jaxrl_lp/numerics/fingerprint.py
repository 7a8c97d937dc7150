"""A 64-bit identity of a pytree of arrays, computed where the arrays live.

`tree_fingerprint(tree)` reduces every leaf's bit patterns to two uint32
sums, on device and under any sharding: each element's bits (widened to
uint32) are XORed with a key hashed from its position, leaf and lane, mixed
by MurmurHash3's finalizer (a bijection of uint32), and summed with
wrap-around over all elements of all leaves. Integer addition is exact and
associative, so the result does not depend on how the leaves are sharded or
in which order a reduction visits them.

What it promises: two trees that differ in any one element's bits always get
different fingerprints (that element's term is a bijection of its bits), and
trees that differ in many elements collide with probability about 2^-64 (a
linear sum of the bits would not do: flipping the sign of an even number of
elements cancels in it).
The learner compares the fingerprint of the weights it is about to compute
with against the one a rollout recorded (`Rollout.weights_digest`) to decide
whether the sampler's recorded log-probs are its own values (`rl.reuse`). It
is not a cryptographic hash; `sync.layout.hash_served` is, for the files.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["fingerprint_equal", "tree_fingerprint"]

_SEEDS = (np.uint32(0x9E3779B9), np.uint32(0x7F4A7C15))  # one per lane
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 that mixes every bit."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _bits_u32(x: jax.Array) -> jax.Array:
    """The element bit patterns of `x` as uint32 (1, 2 and 4-byte dtypes)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = x.dtype.itemsize
    if size not in _UNSIGNED:
        raise ValueError(f"tree_fingerprint: {x.dtype} ({size} bytes an element) is not "
                         "supported; fingerprints cover 1, 2 and 4-byte dtypes")
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _leaf_sums(x: jax.Array, j: int) -> jax.Array:
    """[2] uint32: per lane, the sum over elements i of fmix(bits_i ^ fmix(i + seed_j))."""
    bits = _bits_u32(jnp.asarray(x)).reshape(-1)
    i = jax.lax.iota(jnp.uint32, bits.shape[0])
    lanes = []
    for seed in _SEEDS:
        key = _fmix(i + seed + np.uint32((j * 0x632BE5AB) & 0xFFFFFFFF))
        lanes.append(jnp.sum(_fmix(bits ^ key), dtype=jnp.uint32))
    return jnp.stack(lanes)


@jax.jit
def tree_fingerprint(tree) -> jax.Array:
    """[2] uint32 fingerprint of every leaf's bits, in tree order (module docstring).

    Jitted (a new tree structure or leaf shape compiles anew); nothing is
    donated; the leaves keep their shardings and the result is replicated.
    Called by the sampler (`generate`, `speculative_generate`) on the weights
    it ran, and by the training program on the weights an update computes with.
    """
    total = jnp.zeros((2,), jnp.uint32)
    for j, leaf in enumerate(jax.tree.leaves(tree)):
        total = total + _leaf_sums(leaf, j)
    return total


def fingerprint_equal(a, b) -> bool:
    """Whether two fingerprints (arrays, or None for unknown) are known to be equal, on the host."""
    if a is None or b is None:
        return False
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
