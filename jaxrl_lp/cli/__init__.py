"""The `jaxrl-lp` command line: train, sft, sample, eval, convert, bench, study."""
