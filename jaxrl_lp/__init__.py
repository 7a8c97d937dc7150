"""jaxrl_lp: low-precision RL for dense and looped language models, in JAX."""

__version__ = "0.1.0"
