"""Test-session setup: CPU only, and a persistent XLA compilation cache.

Many tests compile the same programs (the training tests run the same short
run three times: uninterrupted, killed, resumed); a compilation cache shared
by the session and its subprocesses turns the repeats into cache hits.
"""

import os
import tempfile

import jax

_CACHE = os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxrl_lp_test_xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
