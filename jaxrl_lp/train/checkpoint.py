"""Run checkpoints with orbax: params, optimizer, exporter state, data iterators and step.

Orbax writes each checkpoint into a temporary directory and renames it into
place once complete, so a crash or a SIGKILL never leaves a half-written step:
the latest finalized step is what a resumed run restores.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves and restores `{"state": pytree, "meta": json}` under `<run_dir>/checkpoints`."""

    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.dir = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def latest_meta(self) -> dict:
        """The JSON metadata saved with the latest step."""
        step = self.latest_step()
        return self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, state_like: Any, model_config: Any) -> tuple[Any, dict]:
        """Restores the latest step into the structure of `state_like`.

        Raises a ValueError when the checkpoint was written for another model.
        """
        step = self.latest_step()
        meta = self.latest_meta()
        want = json.loads(json.dumps(dataclasses.asdict(model_config)))
        if meta.get("model") != want:
            diff = {k: (meta.get("model", {}).get(k), v) for k, v in want.items()
                    if meta.get("model", {}).get(k) != v}
            raise ValueError(
                f"checkpoint at {self.dir} was written for a different model "
                f"(field: (checkpoint, config) = {diff}); use another --set run.out_dir "
                "or the matching model config")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract)))
        return restored["state"], meta

    def close(self) -> None:
        self.manager.close()
