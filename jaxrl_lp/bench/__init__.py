"""Benchmarks behind `jaxrl-lp bench TARGET` (see `jaxrl_lp.cli.bench`).

A target is a module here with `add_arguments(parser)` and `run(args) -> dict`
(or `main(args) -> int`). `sampler`: our sampler's tokens/s against Hugging
Face `generate`, and the looped deferred-mode speedup. `hf_ref` builds the
`transformers` reference model from our params (reused by parity tests).
"""

from jaxrl_lp.bench.hf_ref import hf_config, hf_model, hf_state_dict

__all__ = ["hf_config", "hf_model", "hf_state_dict"]
