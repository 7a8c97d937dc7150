"""The embedded default of `jaxrl-lp train` as a config file: copy it to start a new one."""

from jaxrl_lp.train.defaults import default_config

CONFIG = default_config()
