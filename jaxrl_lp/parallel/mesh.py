"""Device meshes: a `MeshSpec` (`data=2,fsdp=2,tensor=2`) and the `jax.sharding.Mesh` it names.

Three named axes, outermost first:

- `data`: data parallelism; parameters are replicated along it.
- `fsdp`: fully sharded data parallelism; the batch is split along it too, and
  parameters (and their optimizer state) are sharded along it, gathered per
  layer when used.
- `tensor`: tensor (model) parallelism; attention heads, MLP columns and the
  vocabulary are split along it.

The batch of sequences is split over `data` x `fsdp` (the "data shards"). A
spec's size must equal the number of devices it is laid over: `jax.devices()`
(every process's devices, in a multi-process run), so one `--set run.mesh=...`
means the same thing whether the devices sit in one process or many.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = ["AXES", "BATCH_AXES", "MeshSpec", "make_mesh"]

# The mesh axes, outermost first: data parallel, fully sharded data parallel, tensor parallel.
AXES: tuple[str, ...] = ("data", "fsdp", "tensor")
# The axes a batch's rows are split over (its data shards).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The size of each mesh axis; the string form is `data=D,fsdp=F,tensor=T` (1s omitted).

    Examples:
      >>> MeshSpec.parse("fsdp=8")
      MeshSpec(data=1, fsdp=8, tensor=1)
      >>> str(MeshSpec.parse("tensor=2,data=2"))
      'data=2,tensor=2'
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis in AXES:
            n = getattr(self, axis)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"mesh axis {axis}={n!r} must be a positive integer")

    @classmethod
    def parse(cls, spec: str | MeshSpec | None) -> MeshSpec:
        """Reads `data=2,fsdp=2,tensor=2` (any order, axes omitted are 1); '' is one device."""
        if isinstance(spec, MeshSpec):
            return spec
        sizes: dict[str, int] = {}
        for part in (spec or "").replace(" ", "").split(","):
            if not part:
                continue
            name, sep, value = part.partition("=")
            if not sep or name not in AXES:
                raise ValueError(f"mesh {spec!r}: {part!r} is not AXIS=SIZE with AXIS one of "
                                 f"{list(AXES)} (e.g. fsdp=8 or data=2,fsdp=2,tensor=2)")
            if name in sizes:
                raise ValueError(f"mesh {spec!r}: axis {name!r} is given twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"mesh {spec!r}: {name}={value!r} is not an integer") from None
        return cls(**sizes)

    def __str__(self) -> str:
        return ",".join(f"{a}={getattr(self, a)}" for a in AXES if getattr(self, a) != 1) or "data=1"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_shards(self) -> int:
        """How many ways the batch is split (`data` x `fsdp`)."""
        return self.data * self.fsdp


def make_mesh(spec: str | MeshSpec | None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The `Mesh` of `spec` over `devices` (default: every device of every process).

    Devices are laid out by `jax.make_mesh`, which follows the physical
    topology on TPU and GPU (the tensor axis innermost, on the fastest links).

    Raises:
      ValueError: the spec's size is not the number of devices.
    """
    spec = MeshSpec.parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    if spec.size != len(devices):
        raise ValueError(
            f"run.mesh={str(spec)!r} has {spec.size} devices but there are {len(devices)} "
            f"({devices[0].platform}, {jax.process_count()} process(es)); choose axis sizes whose "
            f"product is {len(devices)}")
    # Auto axes: XLA's partitioner propagates shardings from the inputs and the
    # `constrain` points (jax.make_mesh would make them Explicit).
    auto = (AxisType.Auto,) * len(AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(spec.shape, AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices).reshape(spec.shape), AXES, axis_types=auto)
