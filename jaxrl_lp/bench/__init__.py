"""Benchmarks behind `jaxrl-lp bench TARGET` (see `jaxrl_lp.cli.bench`).

A target is a module here with `add_arguments(parser)` and `run(args) -> dict`
(or `main(args) -> int`). `sampler`: our sampler's tokens/s against Hugging
Face `generate`, and the looped deferred-mode speedup. `hf_ref` builds the
`transformers` reference model from our params (reused by parity tests).
"""

import json

from jaxrl_lp.bench.hf_ref import hf_config, hf_model, hf_state_dict

__all__ = ["emit", "hf_config", "hf_model", "hf_state_dict"]


def emit(result: dict, out: str | None, indent: int = 1) -> None:
    """Prints `result` as JSON, and writes it to `out` too when given (`--out`)."""
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
