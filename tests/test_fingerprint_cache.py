"""`tree_fingerprint`'s identity cache serves only what the uncached computation would return.

- The same live arrays: the cached array, bit-equal to the uncached fingerprint.
- A new array in a leaf (even of the same values), a mutable numpy leaf, a
  tracer: computed, never served.
- A deleted (donated) array is never served from the cache, and an id freed and
  reused by a new array misses (weak references).
- At most `CACHE_SIZE` trees are remembered.
- The CPU form (`CHUNK` elements a loop step) gives the one-reduction form's
  bits, holds no leaf-sized temporary, and GPU and TPU lower the one-reduction form.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.numerics import fingerprint
from jaxrl_lp.numerics.fingerprint import CACHE_SIZE, fingerprint_equal, tree_fingerprint


def _tree(seed=0):
    rng = np.random.RandomState(seed)
    return {"w": jnp.asarray(rng.randn(16, 8), jnp.float32),
            "b": jnp.asarray(rng.randn(8), jnp.bfloat16),
            "codes": jnp.asarray(rng.randint(-1, 2, (8, 4)), jnp.int8)}


def _uncached(tree):
    return np.asarray(fingerprint._fingerprint(tree, fingerprint._spread(jax.tree.leaves(tree))))


@pytest.fixture(autouse=True)
def _empty_cache():
    fingerprint._cache.clear()
    yield
    fingerprint._cache.clear()


def test_hit_returns_the_uncached_value():
    tree = _tree()
    fp = tree_fingerprint(tree)
    again = tree_fingerprint(dict(tree))  # another container of the same arrays
    assert again is fp
    np.testing.assert_array_equal(np.asarray(again), _uncached(tree))


def test_a_new_array_misses_even_with_the_same_values():
    tree = _tree()
    fp = tree_fingerprint(tree)
    copied = {**tree, "w": jnp.copy(tree["w"])}
    got = tree_fingerprint(copied)
    assert got is not fp and fingerprint_equal(got, fp)
    moved = {**tree, "w": tree["w"].at[3, 2].add(1.0)}
    got = tree_fingerprint(moved)
    assert not fingerprint_equal(got, fp)
    np.testing.assert_array_equal(np.asarray(got), _uncached(moved))


def test_a_deleted_array_is_never_served():
    tree = _tree()
    tree_fingerprint(tree)
    tree["w"].delete()  # what donation does to an input
    with pytest.raises(RuntimeError, match="deleted"):
        jax.block_until_ready(tree_fingerprint(tree))


def test_a_freed_and_reused_id_misses():
    tree = _tree()
    stale = tree_fingerprint(tree)
    (_, entry), = fingerprint._cache.items()
    del tree["w"]
    gc.collect()  # the cached "w" is freed: its weak reference is dead
    reused = {**tree, "w": jnp.full((16, 8), 2.0, jnp.float32)}
    # Simulate CPython handing the freed id to the new array: the key now matches.
    leaves, treedef = jax.tree.flatten(reused)
    fingerprint._cache.clear()
    fingerprint._cache[(treedef, tuple(id(x) for x in leaves))] = entry
    got = tree_fingerprint(reused)
    assert got is not stale
    np.testing.assert_array_equal(np.asarray(got), _uncached(reused))


def test_numpy_leaves_and_tracers_bypass():
    host = {"w": np.ones((4, 4), np.float32)}
    before = np.asarray(tree_fingerprint(host))
    host["w"][1, 1] = 2.0  # mutated in place: same object, new value
    after = np.asarray(tree_fingerprint(host))
    assert not np.array_equal(before, after)
    assert not fingerprint._cache
    tree = _tree()
    traced = jax.jit(tree_fingerprint)(tree)
    assert not fingerprint._cache  # the trace's leaves were tracers
    np.testing.assert_array_equal(np.asarray(traced), _uncached(tree))


def test_the_cache_is_bounded():
    trees = [_tree(seed) for seed in range(CACHE_SIZE + 1)]
    fps = [tree_fingerprint(t) for t in trees]
    assert len(fingerprint._cache) == CACHE_SIZE
    assert tree_fingerprint(trees[-1]) is fps[-1]
    assert tree_fingerprint(trees[0]) is not fps[0]  # the oldest was dropped
    np.testing.assert_array_equal(np.asarray(tree_fingerprint(trees[0])), np.asarray(fps[0]))


# ------------------------------------------------------- the CPU form and the one-reduction form
def _forms(tree):
    spread = (False,) * len(jax.tree.leaves(tree))
    chunked = jax.jit(lambda t: fingerprint._tree_sums(t, spread, chunked=True))(tree)
    whole = jax.jit(lambda t: fingerprint._tree_sums(t, spread, chunked=False))(tree)
    return np.asarray(chunked), np.asarray(whole)


def test_the_cpu_form_is_the_one_reduction_forms_bits():
    """Leaves of whole chunks, of chunks and a tail, and under one chunk, of 4, 2 and 1-byte
    dtypes: the same [2] sums; and one flipped bit in the last chunk still moves them."""
    rng = np.random.RandomState(3)
    c = fingerprint.CHUNK
    tree = {"whole": jnp.asarray(rng.randn(4, c // 2), jnp.float32),
            "tail": jnp.asarray(rng.randn(3 * c + 1000), jnp.bfloat16),
            "codes": jnp.asarray(rng.randint(-1, 2, (c + 7,)), jnp.int8),
            "small": jnp.asarray(rng.randn(5), jnp.float32)}
    chunked, whole = _forms(tree)
    np.testing.assert_array_equal(chunked, whole)
    np.testing.assert_array_equal(np.asarray(tree_fingerprint(tree)), whole)
    flipped = dict(tree, whole=tree["whole"].at[3, -1].set(-tree["whole"][3, -1]))
    assert not np.array_equal(_forms(flipped)[0], chunked)


def test_the_cpu_form_holds_no_leaf_sized_temporary():
    """A 64 MiB leaf: the compiled CPU fingerprint's temporaries stay in a few chunks, where
    the one-reduction form writes every hashed element (twice the leaf) before summing."""
    leaf = jnp.zeros((1 << 24,), jnp.float32)
    spread = (False,)

    def temp(chunked):
        fn = jax.jit(lambda t: fingerprint._tree_sums(t, spread, chunked=chunked))
        return fn.lower(leaf).compile().memory_analysis().temp_size_in_bytes

    assert temp(True) < 8 * fingerprint.CHUNK * 4
    assert temp(False) >= leaf.nbytes  # what the CPU form exists to avoid


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gpu_and_tpu_lower_the_one_reduction_form(platform):
    """Lowered for an accelerator, the fingerprint has no loop: the platform picks the form
    (`jax.lax.platform_dependent`), not the host's backend."""
    tree = {"w": jnp.zeros((3 * fingerprint.CHUNK,), jnp.float32)}
    text = fingerprint._fingerprint.trace(tree, (False,)).lower(
        lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" not in text and "stablehlo.reduce" in text
    cpu = fingerprint._fingerprint.trace(tree, (False,)).lower(
        lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.while" in cpu
