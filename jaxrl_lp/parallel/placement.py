"""Where the learner and the sampler run: one mesh for both, or two disjoint device groups.

`run.mesh` lays one mesh over every device and the sampler and the learner
take turns on it. `run.learner_mesh` and `run.sampler_mesh` instead give each
its own group of devices, so that an off-policy run (`grpo.max_staleness > 0`)
samples the next batch while the learner updates on this one. A group is a
`MeshSpec` with an optional first device: `fsdp=4` or `data=4@4` (the four
devices from index 4 of `jax.devices()`). Groups without `@` are laid out in
order: the learner's first, the sampler's right after it (or from device 0 when
the learner's is placed further on).

A group of one device is not a mesh: that side runs as a single-device
program on that device (`DeviceGroup.device`), exactly as a run without a mesh
does, so `learner_mesh=data=1` and `sampler_mesh=data=1` put the learner on
device 0 and the sampler on device 1.

    >>> p = parse_placement("fsdp=4", "data=4")
    >>> p.learner.first, p.sampler.first
    (0, 4)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from jaxrl_lp.parallel.mesh import MeshSpec, make_mesh

__all__ = ["DeviceGroup", "Placement", "parse_group", "parse_placement"]


@dataclasses.dataclass(frozen=True)
class DeviceGroup:
    """A mesh over `spec.size` consecutive devices from index `first` of `jax.devices()`."""

    spec: MeshSpec
    first: int

    @property
    def stop(self) -> int:
        return self.first + self.spec.size

    def __str__(self) -> str:
        return f"{self.spec}@{self.first}"

    def devices(self, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
        """This group's devices, from `devices` (default: every process's)."""
        devices = list(jax.devices() if devices is None else devices)
        return devices[self.first:self.stop]

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh | None:
        """The group's `Mesh`, or None for a one-device group (see `device`)."""
        if self.spec.size == 1:
            return None
        return make_mesh(self.spec, self.devices(devices))

    def device(self, devices: Sequence[jax.Device] | None = None) -> jax.Device:
        """The device of a one-device group."""
        return self.devices(devices)[0]


def parse_group(key: str, text: str, default_first: int) -> DeviceGroup:
    """`MESH` or `MESH@FIRST` (e.g. `data=4@4`); errors name `key`."""
    mesh, at, first = text.replace(" ", "").partition("@")
    try:
        spec = MeshSpec.parse(mesh)
    except ValueError as e:
        raise ValueError(f"{key}={text!r}: {e}") from None
    if not mesh:
        raise ValueError(f"{key}={text!r}: give a mesh such as fsdp=4 or data=4@4")
    if not at:
        return DeviceGroup(spec, default_first)
    try:
        index = int(first)
    except ValueError:
        index = -1
    if index < 0:
        raise ValueError(f"{key}={text!r}: the first device after '@' must be an index >= 0 "
                         "into jax.devices(), e.g. data=4@4")
    return DeviceGroup(spec, index)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The learner's and the sampler's device groups (disjoint)."""

    learner: DeviceGroup
    sampler: DeviceGroup

    def check(self, num_devices: int) -> None:
        """Raises unless both groups fit in `num_devices` devices and do not overlap."""
        for key, g in (("run.learner_mesh", self.learner), ("run.sampler_mesh", self.sampler)):
            if g.stop > num_devices:
                raise ValueError(
                    f"{key}={g} needs devices {g.first}..{g.stop - 1} but there are "
                    f"{num_devices}; make the learner's and the sampler's meshes fit in "
                    f"{num_devices} devices together")
        lo, hi = sorted((self.learner, self.sampler), key=lambda g: g.first)
        if hi.first < lo.stop:
            raise ValueError(
                f"run.learner_mesh={self.learner} (devices {self.learner.first}.."
                f"{self.learner.stop - 1}) and run.sampler_mesh={self.sampler} (devices "
                f"{self.sampler.first}..{self.sampler.stop - 1}) overlap: the sampler and the "
                "learner each need their own devices (set run.mesh instead to share them)")


def parse_placement(learner: str, sampler: str) -> Placement:
    """The placement of `run.learner_mesh` and `run.sampler_mesh` (both given).

    Checks the strings only; `Placement.check` checks them against the devices.
    """
    lg = parse_group("run.learner_mesh", learner, 0)
    # Without '@' the sampler follows the learner (or takes the front, before a learner
    # placed further on).
    return Placement(lg, parse_group("run.sampler_mesh", sampler, lg.stop if lg.first == 0 else 0))
