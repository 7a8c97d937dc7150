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

import collections
import functools
import weakref

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
    """The element bit patterns of `x` as uint32 (4-bit floats by their f32 values; 1, 2 and
    4-byte dtypes by their bits)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 8:
        # Sub-byte floats (FP4 codes of a quantized LoRA base) have no integer bitcast; their
        # f32 values are exact and distinct for distinct codes (the two zeros included).
        x = x.astype(jnp.float32)
    size = x.dtype.itemsize
    if size not in _UNSIGNED:
        raise ValueError(f"tree_fingerprint: {x.dtype} ({size} bytes an element) is not "
                         "supported; fingerprints cover 1, 2 and 4-byte dtypes")
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[size]).astype(jnp.uint32)


def _lane_sums(bits: jax.Array, start, j: int) -> jax.Array:
    """[2] uint32: per lane, the sum over the 1-D `bits` (elements `start`, `start` + 1, ...
    of leaf `j`) of fmix(bits_i ^ fmix(i + seed_j))."""
    i = jax.lax.iota(jnp.uint32, bits.shape[0]) + start
    lanes = []
    for seed in _SEEDS:
        key = _fmix(i + seed + np.uint32((j * 0x632BE5AB) & 0xFFFFFFFF))
        lanes.append(jnp.sum(_fmix(bits ^ key), dtype=jnp.uint32))
    return jnp.stack(lanes)


def _leaf_sums(x: jax.Array, j: int) -> jax.Array:
    """Leaf `j`'s [2] lane sums in one reduction (GPU and TPU fuse the hash into it)."""
    return _lane_sums(_bits_u32(jnp.asarray(x)).reshape(-1), np.uint32(0), j)


CHUNK = 1 << 16  # elements a step of the CPU form hashes (256 KiB a lane: in cache)


def _leaf_sums_chunked(x: jax.Array, j: int) -> jax.Array:
    """The same sums, `CHUNK` elements a loop step, then the tail (the CPU form).

    XLA:CPU rewrites a long reduction into a tree of windows that no elementwise
    producer fuses into, so the one-reduction form writes and reads every hashed
    element (two lanes: twice the weights' bytes of fresh memory a call). Slicing
    the leaf in a loop keeps each step's hash in cache. Integer sums wrap exactly
    and in any order, so both forms give the same bits. A leaf of 2^31 elements or
    more (past an int32 slice start) takes the one-reduction form.
    """
    flat = jnp.asarray(x).reshape(-1)
    n = flat.shape[0]
    rows = n // CHUNK if n < 2**31 else 0
    out = jnp.zeros((2,), jnp.uint32)
    if rows:
        def step(k, acc):
            chunk = jax.lax.dynamic_slice_in_dim(flat, k * CHUNK, CHUNK)
            return acc + _lane_sums(_bits_u32(chunk), k.astype(jnp.uint32) * np.uint32(CHUNK), j)
        out = jax.lax.fori_loop(0, rows, step, out)
    if rows * CHUNK < n:
        out = out + _lane_sums(_bits_u32(flat[rows * CHUNK:]), np.uint32(rows * CHUNK), j)
    return out


def _tree_sums(tree, spread: tuple[bool, ...], chunked: bool) -> jax.Array:
    total = jnp.zeros((2,), jnp.uint32)
    for j, (leaf, many) in enumerate(zip(jax.tree.leaves(tree), spread, strict=True)):
        total = total + (_leaf_sums_chunked if chunked and not many else _leaf_sums)(leaf, j)
    return total


@functools.partial(jax.jit, static_argnames="spread")
def _fingerprint(tree, spread: tuple[bool, ...]) -> jax.Array:
    """The jitted fingerprint. Static: `spread` (per leaf, whether it may lie on several
    devices: those take the one-reduction form everywhere, which the partitioner
    splits; a loop of slices would gather them); nothing is donated. Traced by
    `tree_fingerprint`. The CPU form is chosen by the platform lowered for
    (`jax.lax.platform_dependent`), not by the host's backend."""
    return jax.lax.platform_dependent(
        tree, cpu=lambda t: _tree_sums(t, spread, chunked=True),
        default=lambda t: _tree_sums(t, spread, chunked=False))


def _spread(leaves) -> tuple[bool, ...]:
    """Per leaf, whether it may lie on several devices (a tracer's placement is unknown)."""
    return tuple(isinstance(x, jax.core.Tracer)
                 or (isinstance(x, jax.Array) and len(x.sharding.device_set) > 1)
                 for x in leaves)


CACHE_SIZE = 8  # trees remembered: the sampler's copy and the master, with room to spare
# (treedef, leaf ids) -> (weak references to the leaves, the fingerprint), oldest first.
_cache: collections.OrderedDict = collections.OrderedDict()


def _cacheable(leaves) -> bool:
    """Concrete, live jax.Arrays only: a tracer has no value, a numpy array can change."""
    return bool(leaves) and all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                                and not x.is_deleted() for x in leaves)


def _cached(key, leaves):
    hit = _cache.get(key)
    if hit is None:
        return None
    refs, fp = hit
    # An id is only an identity while its object lives: check each leaf is the one cached.
    if fp.is_deleted() or any(r() is not x for r, x in zip(refs, leaves, strict=True)):
        del _cache[key]
        return None
    _cache.move_to_end(key)
    return fp


def tree_fingerprint(tree) -> jax.Array:
    """[2] uint32 fingerprint of every leaf's bits, in tree order (module docstring).

    Jitted (a new tree structure or leaf shape compiles anew); nothing is
    donated; the leaves keep their shardings and the result is replicated.
    Called by the sampler (`generate`, `speculative_generate`) on the weights
    it ran, and by the training program on the weights an update computes with.
    A tree of the same live array objects as one of the last `CACHE_SIZE`
    returns that call's result without reading the weights again (module
    docstring); inside a trace it is the jitted computation.

    Examples:
      >>> fp = tree_fingerprint(params)   # [2] uint32
      >>> tree_fingerprint(params) is fp  # the same arrays: served from the cache
      True
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not _cacheable(leaves):
        return _fingerprint(tree, _spread(leaves))
    key = (treedef, tuple(id(x) for x in leaves))
    fp = _cached(key, leaves)
    if fp is None:
        fp = _fingerprint(tree, _spread(leaves))
        _cache[key] = (tuple(weakref.ref(x) for x in leaves), fp)
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return fp


def fingerprint_equal(a, b) -> bool:
    """Whether two fingerprints (arrays, or None for unknown) are known to be equal, on the host."""
    if a is None or b is None:
        return False
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))
