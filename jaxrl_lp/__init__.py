"""jaxrl_lp: low-precision RL for dense and looped language models, in JAX.

Importing the package asks XLA to round where the program rounds: it adds
`--xla_allow_excess_precision=false` to `XLA_FLAGS` (unless the flag is set
there already). XLA's default lets a fusion keep a value in f32 where the
program casts it to bf16 and back, and whether it does depends on the fusion,
so the sampler's and the learner's programs could round differently: with the
default, a bf16 replay of 64 sampled rows differed from the sampler by 5.7e-3
in log-prob on CPU, and with the flag it is bit-equal (tests/test_excess_precision.py).
The flag only takes effect if it is set before JAX starts its backend: import
`jaxrl_lp` before running any JAX computation, or set the flag yourself.
"""

import os as _os

__version__ = "0.1.0"

ROUNDING_FLAG = "--xla_allow_excess_precision=false"

if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = f"{_os.environ.get('XLA_FLAGS', '')} {ROUNDING_FLAG}".strip()
