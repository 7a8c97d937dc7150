"""Run checkpoints with orbax: params, optimizer, exporter state, data iterators and step.

Orbax writes each checkpoint into a temporary directory and renames it into
place once complete, so a crash or a SIGKILL never leaves a half-written step:
the latest finalized step is what a resumed run restores.

Readers that need only part of a checkpoint (`jaxrl-lp eval`, `convert`) use
`restore_params` / `restore_part`: an orbax partial restore, so they need
neither the optimizers nor the sync settings the run was written with.

A checkpoint damaged after it was written (a truncated or corrupted array
file, a missing metadata file) fails to restore with `DamagedCheckpointError`,
which names the step, its directory and what orbax found. A resuming run sets
it aside (`set_aside`: renamed `<step>.damaged`, never deleted) and falls back
to the newest intact step. A checkpoint that reads back whole but does not fit
the run's state (another program version, say) is a plain ValueError: nothing
is set aside for that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import logging
import os
import re
import shutil
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["CheckpointWriteError", "Checkpointer", "DamagedCheckpointError", "check_model"]


class DamagedCheckpointError(ValueError):
    """A checkpoint's files cannot be read back (truncated, corrupted or missing).

    A ValueError, so the command line reports it as one line (exit 2).
    """

    def __init__(self, step: int, path: Path, reason: str):
        self.step, self.path = step, path
        super().__init__(f"checkpoint step {step} at {path} is damaged: {reason}")


def _first_line(e: BaseException) -> str:
    """What went wrong, in one line: the innermost cause's first line (orbax wraps the
    file-level error of tensorstore in an exception whose own text is a repr)."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


def _attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """`(fn(), None)`, or `(None, why it failed)` for any exception `fn` raises.

    The failure is collected outside the exception handler, so that the reads a
    failed orbax restore leaves behind are dropped quietly.
    """
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise plain Exception
        reason = _first_line(e)
    _drop_orphaned_reads()
    return None, reason


def _drop_orphaned_reads() -> None:
    """Collects the reads a failed orbax restore leaves behind, quietly.

    They are coroutines whose event loop is gone; collected later they would
    print an 'Exception ignored' traceback for the damage already reported.
    """
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _write_reason(e: BaseException) -> str:
    """Why a write failed, as the OS says it ("no space left on device", errno 28), where
    tensorstore wraps the OS error in a message of a few hundred characters."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    code = e.errno if isinstance(e, OSError) and e.errno else None
    if code is None and (m := re.search(r"os_error_code='?(\d+)", str(e))):
        code = int(m.group(1))
    if code:
        return f"{os.strerror(code).lower()}, errno {code}"
    return _first_line(e)


class _DropFailedWrite(logging.Filter):
    """Drops asyncio's reports of the tasks of one failed checkpoint write (its path)."""

    def __init__(self, prefix: Path):
        super().__init__()
        self.prefix = str(prefix)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.prefix not in record.getMessage()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (one line: path, free space, newest intact step).

    An OSError: the command line reports it as one line (exit 2), and a run that
    catches write failures sees it as one.
    """


@contextlib.contextmanager
def _quiet_orbax():
    """Orbax reports a failed write from its worker threads and event loops, traceback by
    traceback (about 400 lines for one full disk); `CheckpointWriteError` says it in one.
    During the write its loggers are muted and what is printed to stderr is held back: it
    is printed after a write that succeeds, and dropped (with the tasks the failure left,
    collected here) after one that fails."""
    loggers = [logging.getLogger(n) for n in ("absl", "orbax", "asyncio")]
    levels = [lg.level for lg in loggers]
    hooks = threading.excepthook, sys.unraisablehook
    stderr, held = sys.stderr, io.StringIO()
    failed = [False]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    threading.excepthook, sys.unraisablehook = (lambda args: None), (lambda u: None)
    sys.stderr = held
    try:
        yield failed
    finally:
        if failed[0]:
            gc.collect()  # the failed write's tasks, with their "never retrieved" logs
        sys.stderr = stderr
        threading.excepthook, sys.unraisablehook = hooks
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)
        if not failed[0] and held.getvalue():
            stderr.write(held.getvalue())


class Checkpointer:
    """Saves and restores `{"state": pytree, "meta": json}` under `<run_dir>/checkpoints`."""

    def __init__(self, run_dir: str | Path, keep: int = 2, *, create: bool = True,
                 subdir: str = "checkpoints"):
        """Opens (with `create`, makes) `<run_dir>/<subdir>`.

        Args:
          run_dir: the run directory.
          keep: checkpoints kept when saving.
          create: False for readers: nothing is written, and a run directory
            without checkpoints is a FileNotFoundError naming it.
          subdir: `checkpoints` (the run's), or `reference` (the KL reference the
            training program writes once, `train.program`).
        """
        self.dir = Path(run_dir).absolute() / subdir
        if not create:
            if not Path(run_dir).is_dir():
                raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
            if not self.dir.is_dir() or not any(p.name.isdigit() for p in self.dir.iterdir()):
                raise FileNotFoundError(
                    f"run directory {str(run_dir)!r} has no checkpoints (no {self.dir}/<step>); "
                    "train first (jaxrl-lp train/sft), or convert hf-to-run")
        self.manager = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=create),
        )
        self._reader = None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Writes checkpoint `step` (atomically: a temporary directory, renamed when complete).

        Raises:
          CheckpointWriteError: the write failed (a full disk, a permission lost):
            one line naming the path, the free space there and the newest intact
            checkpoint; the temporary directory is removed, the earlier
            checkpoints are untouched.
        """
        def write():
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()

        why = None
        with _quiet_orbax() as failed:
            try:
                write()
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise plain Exception
                why = _write_reason(e)
            failed[0] = why is not None
        if why is not None:
            self._fail_write(step, why)

    def _fail_write(self, step: int, why: str) -> None:
        # Orbax's tasks for the failed write may be collected later (under load, after the
        # write returned, or at exit), each logging "Task exception was never retrieved",
        # and its fragment writes that never started each warning "coroutine ... was never
        # awaited": both dropped, the failure is the one line raised here.
        logging.getLogger("asyncio").addFilter(_DropFailedWrite(self.dir / f"{step}.orbax"))
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                message=r"coroutine '.*write_fragment' was never awaited")
        for tmp in self.dir.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(tmp, ignore_errors=True)
        if (self.dir / str(step)).is_dir() and step not in self._finalized():
            shutil.rmtree(self.dir / str(step), ignore_errors=True)
        try:
            free = f"{shutil.disk_usage(self.dir).free / 2**20:.1f} MiB free there"
        except OSError:
            free = "its free space unknown"
        self.reload()
        steps = [s for s in self.steps() if s != step]
        newest = (f"the newest intact checkpoint is step {steps[-1]} ({self.dir / str(steps[-1])})"
                  if steps else "there is no earlier checkpoint")
        raise CheckpointWriteError(
            f"could not write checkpoint step {step} to {self.dir / str(step)} ({why}); {free}; "
            f"{newest}, and the same command resumes from it once the disk has room")

    def _finalized(self) -> set[int]:
        try:
            self.manager.reload()
            return set(self.manager.all_steps())
        except Exception:  # noqa: BLE001 - a listing that fails lists nothing
            return set()

    def latest_meta(self) -> dict:
        """The JSON metadata saved with the latest step."""
        return self.meta()

    def restore(self, state_like: Any, model_config: Any,
                step: int | None = None) -> tuple[Any, dict]:
        """Restores `step` (default: the latest) into the structure of `state_like`.

        Raises:
          ValueError: the checkpoint was written for another model, or its
            state does not have `state_like`'s structure.
          DamagedCheckpointError: its files cannot be read back.
        """
        step = self.resolve_step(step)
        meta = self.meta(step)
        check_model(meta, model_config, self.dir)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        restored, why = _attempt(lambda: self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract))))
        if why is None:
            return restored["state"], meta
        if self._readable(step):
            raise ValueError(
                f"checkpoint {self.dir / str(step)} does not hold the state this run expects "
                f"({why}); it was written by another configuration or version: use another "
                "run.out_dir")
        raise DamagedCheckpointError(step, self.dir / str(step), why)

    def _read_recorded(self, step: int) -> dict:
        """`step`'s whole state in the structure, shapes and dtypes it records."""
        tree = self._read_manager().item_metadata(step)["state"]
        tree = getattr(tree, "tree", tree)
        return self.restore_part(
            jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree), step)

    def _readable(self, step: int) -> bool:
        """Whether every array of `step`'s state reads back in its own recorded structure."""
        return _attempt(lambda: self._read_recorded(step))[1] is None

    def reload(self) -> None:
        """Re-lists the steps on disk (after another process renamed one)."""
        self.manager.reload()
        if self._reader is not None:
            self._reader.reload()

    def set_aside(self, step: int) -> Path:
        """Renames a damaged step's directory to `<step>.damaged` (kept for inspection)."""
        src = self.dir / str(step)
        dst = self.dir / f"{step}.damaged"
        n = 1
        while dst.exists():
            n += 1
            dst = self.dir / f"{step}.damaged-{n}"
        src.rename(dst)
        self.reload()
        return dst

    def steps(self) -> list[int]:
        """The finalized checkpoint steps, ascending."""
        return sorted(self.manager.all_steps())

    def resolve_step(self, step: int | None = None) -> int:
        """`step`, or the latest one when None; errors name the steps there are.

        Raises:
          FileNotFoundError: no checkpoint at all.
          ValueError: no checkpoint at `step`.
        """
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.dir}; train first or point at a "
                                    "run directory")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise ValueError(f"no checkpoint at step {step} in {self.dir}; it has steps {steps}")
        return int(step)

    def meta(self, step: int | None = None) -> dict:
        """The JSON metadata saved with `step` (default: the latest).

        Raises `DamagedCheckpointError` when it cannot be read.
        """
        step = self.resolve_step(step)
        restored, why = _attempt(lambda: self.manager.restore(step, args=ocp.args.Composite(
            meta=ocp.args.JsonRestore())))
        if why is not None:  # a missing or torn metadata file
            raise DamagedCheckpointError(step, self.dir / str(step), why)
        return restored["meta"]

    def _read_manager(self) -> ocp.CheckpointManager:
        """A manager whose `state` handler restores parts of trees (the saving one's cannot)."""
        if self._reader is None:
            registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
            registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler)
            registry.add("meta", ocp.args.JsonRestore, ocp.JsonCheckpointHandler)
            self._reader = ocp.CheckpointManager(
                self.dir, options=ocp.CheckpointManagerOptions(create=False),
                handler_registry=registry)
        return self._reader

    def restore_part(self, like: dict, step: int | None = None) -> dict:
        """Restores only the parts of the saved state that `like` names (orbax partial restore).

        Args:
          like: a tree with some of the state's keys (`{"params": ...}`,
            `{"sync": {"exporter": ...}}`), whose leaves give shapes and dtypes
            (arrays or `jax.ShapeDtypeStruct`s).
          step: the checkpoint step (default: the latest).

        Returns:
          The tree of `like` holding the saved arrays (on this process's first device).

        Raises:
          ValueError: naming a part of `like` the checkpoint does not hold.
        """
        step = self.resolve_step(step)
        # This process's first device: the first of all is another process's under
        # `jax.distributed` (its arrays would have no shard here).
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), like)
        partial = ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True)
        restored = self._read_manager().restore(
            step, args=ocp.args.Composite(state=partial))["state"]
        # A part the checkpoint lacks comes back as its placeholder, not as an error.
        missing = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(restored)
                   if isinstance(x, jax.ShapeDtypeStruct)]
        if missing:
            raise ValueError(f"checkpoint {self.dir}/{step} does not hold {missing[:4]}")
        return restored

    def restore_saved(self, step: int | None = None) -> tuple[dict, dict]:
        """The whole saved state and its metadata, on this process's first device, with the
        shapes and dtypes the checkpoint records, whatever mesh or processes wrote it (a
        reader's view: `restore` resumes a run).

        Returns:
          `(state, meta)`: the checkpointed tree (`RunState.tree()`'s keys) and the step's
          JSON metadata.
        """
        step = self.resolve_step(step)
        state, why = _attempt(lambda: self._read_recorded(step))
        if why is not None:
            raise DamagedCheckpointError(step, self.dir / str(step), why)
        return state, self.meta(step)

    def restore_params(self, step: int | None = None,
                       model_config: Any = None) -> tuple[dict, dict]:
        """The saved params alone, with the shapes and dtypes the checkpoint records.

        Needs no model, optimizer or sync settings, so it reads any run (with or
        without an exporter, warm-start or finished).

        Args:
          step: the checkpoint step (default: the latest).
          model_config: when given, the checkpoint must have been written for it
            (ValueError otherwise).

        Returns:
          `(params, meta)`: the f32 params tree and the step's JSON metadata.

        Examples:
          >>> params, meta = Checkpointer("runs/default", create=False).restore_params()
        """
        step = self.resolve_step(step)
        meta = self.meta(step)
        if model_config is not None:
            check_model(meta, model_config, self.dir)
        def read():
            tree = self._read_manager().item_metadata(step)["state"]
            tree = getattr(tree, "tree", tree)
            like = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype),
                                           tree["params"])}
            return self.restore_part(like, step)["params"]

        params, why = _attempt(read)
        if why is not None:
            raise DamagedCheckpointError(step, self.dir / str(step), why)
        return params, meta

    def close(self) -> None:
        self.manager.close()
        if self._reader is not None:
            self._reader.close()


def check_model(meta: dict, model_config: Any, where: Any = "the checkpoint") -> None:
    """Raises a ValueError unless `meta["model"]` records `model_config`.

    A field the checkpoint does not record (written before the field existed)
    matches its default value.
    """
    want = json.loads(json.dumps(dataclasses.asdict(model_config)))
    have = meta.get("model", {})
    defaults = {f.name: json.loads(json.dumps(f.default)) for f in dataclasses.fields(model_config)
                if f.default is not dataclasses.MISSING}
    diff = {k: (have.get(k), v) for k, v in want.items()
            if (have[k] if k in have else defaults.get(k)) != v}
    if diff:
        raise ValueError(
            f"checkpoint at {where} was written for a different model "
            f"(field: (checkpoint, config) = {diff}); use another --set run.out_dir, "
            "or the config the run was made with (its config.json)")
