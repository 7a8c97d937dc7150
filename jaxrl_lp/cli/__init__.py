"""The `jaxrl-lp` command line: train, sft, sample, eval, convert, config,
bench, study (plain `jaxrl-lp` prints help)."""
