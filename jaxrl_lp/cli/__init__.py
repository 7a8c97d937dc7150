"""The `jaxrl-lp` command line: train, sft, sample, eval, convert, config,
bench, study, plan (plain `jaxrl-lp` prints help).

Its public surface is the command itself (`jaxrl-lp --help`, `jaxrl-lp COMMAND
--help`), not Python names: each subcommand is a module with `add_parser` and
`run`, and the entry point is `jaxrl_lp.cli.main:main`.
"""

__all__: list[str] = []
