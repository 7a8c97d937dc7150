"""Scale-out: device meshes, logical-axis sharding rules and activation constraints."""

from jaxrl_lp.parallel.context import constrain, current_mesh, use_mesh
from jaxrl_lp.parallel.mesh import AXES, BATCH_AXES, MeshSpec, make_mesh
from jaxrl_lp.parallel.placement import DeviceGroup, Placement, parse_placement
from jaxrl_lp.parallel.rules import (
    DEFAULT_RULES,
    ShardingRules,
    check_divisible,
    param_logical_axes,
    param_shardings,
    spec_for,
)

__all__ = [
    "AXES",
    "BATCH_AXES",
    "DEFAULT_RULES",
    "DeviceGroup",
    "MeshSpec",
    "Placement",
    "ShardingRules",
    "check_divisible",
    "constrain",
    "current_mesh",
    "make_mesh",
    "param_logical_axes",
    "param_shardings",
    "parse_placement",
    "spec_for",
    "use_mesh",
]
