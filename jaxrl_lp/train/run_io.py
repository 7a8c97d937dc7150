"""Reading a run directory: its recorded config, model, params, served copy and tokenizer.

A run directory (written by `jaxrl-lp train`) holds `config.json` (the
`TrainConfig` it was started with) and orbax checkpoints whose JSON metadata
records the model config and the sync settings each step was written with.
`jaxrl-lp eval` and `jaxrl-lp convert` read runs through these functions, and
restore only what they need (`Checkpointer.restore_params`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.lora import merge_adapters
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.config_files import apply_overrides, load_config
from jaxrl_lp.train.sync_hooks import make_exporter

__all__ = ["TOKENIZER_FILES", "model_config_of", "run_config", "save_tokenizer", "served_export"]

# The files of a Hugging Face tokenizer that are copied along with it.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
)


def run_config(run_dir: str | os.PathLike, config: str | None = None,
               overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The config a run was started with (its `config.json`), with `overrides` applied.

    Args:
      run_dir: the run directory; `run.out_dir` is set to it (the run may have moved).
      config: another config file to use instead of the run's `config.json`.
      overrides: `section.field=value` strings, as `--set` takes them.

    Returns:
      The `TrainConfig`.

    Raises:
      FileNotFoundError: no such directory, or no `config.json` in it (and no `config`).
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if config is None:
        config = run / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{str(run_dir)!r} is not a run directory: it has no "
                                    "config.json (jaxrl-lp train writes one); pass --config")
    cfg = apply_overrides(load_config(str(config)), list(overrides))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(run_dir)))


def model_config_of(meta: dict) -> ModelConfig:
    """The `ModelConfig` a checkpoint was written for (its metadata's `model`)."""
    if not isinstance(meta.get("model"), dict):
        raise ValueError("checkpoint metadata records no model config; it was not written by "
                         "jaxrl-lp train")
    return ModelConfig(**meta["model"])


def served_export(ckpt: Checkpointer, params: Any, meta: dict, step: int,
                  exporter: str | None = None) -> tuple[Any, dict]:
    """The served copy of `params` under an exporter, as the run's sampler would get it next.

    With the run's own exporter (the default) the exporter state saved in the
    checkpoint is used, so a stochastic or error-feedback export continues the
    run: this is the export `run_train` scores as `final_accuracy_served`
    (the saved state is not advanced). Another exporter starts from its
    initial state.

    Args:
      ckpt: the run's checkpoints.
      params: the params of checkpoint `step` (`ckpt.restore_params(step)`; a LoRA
        run's adapters on their base, composed: they are merged first).
      meta: that step's metadata.
      step: the checkpoint step.
      exporter: a `sync.exporter` spec; None for the run's own.

    Returns:
      `(served tree, info)`, `info` naming the exporter and where its state came
      from (`checkpoint` or `initial`).

    Raises:
      ValueError: an unknown spec, or no exporter at all (`none`).
    """
    saved = meta.get("sync") or {}
    own = saved.get("exporter", "none")
    spec = own if exporter is None else exporter
    ex = make_exporter(spec, int(saved.get("seed", 0)))
    lora = meta.get("lora") or {}
    if ex is None and lora.get("serve") == "merged":
        # A LoRA run serving its merge without a sync.exporter: rounded to the base's format.
        from jaxrl_lp.lora.export import merged_exporter, served_format_exporter

        ex = merged_exporter(served_format_exporter(lora["base_format"]))
        spec = f"lora-merged:{lora['base_format']}"
    params = merge_adapters(params)  # a LoRA run's adapters on their base: W + A B s
    if ex is None:
        raise ValueError(f"the run in {ckpt.dir.parent} has no exporter (sync.exporter={own}): "
                         "its sampler serves the master params; name an exporter with "
                         "--exporter SPEC, e.g. bf16:nearest or fmt:mxfp8")
    like = jax.eval_shape(ex.init, params)
    source = "initial"
    if spec == own and jax.tree.leaves(like):
        state = ckpt.restore_part({"sync": {"exporter": like}}, step)["sync"]["exporter"]
        source = "checkpoint"
    else:
        state = ex.init(params)
    # Jitted, as `SyncHooks.export` runs it in the training program.
    served, _ = jax.jit(ex.apply)(params, state)
    return served, {"exporter": spec, "exporter_state": source}


def save_tokenizer(cfg: TrainConfig, out_dir: str | os.PathLike) -> list[str]:
    """Writes the tokenizer a run's data used into `out_dir`, as Hugging Face files.

    A GSM8K or dataset run with `init_from` read its tokenizer from there: those files
    are copied (its chat template included). The generated tasks always use the
    built-in `CharTokenizer` (also when the weights came from `init_from`); a dataset
    task trained from scratch, the `CharTokenizer` of its data's characters
    (`tasks.char_tokenizer_for`): either is written with `CharTokenizer.save`.

    Returns:
      The file names written.
    """
    from jaxrl_lp.models.tokenizer import CharTokenizer

    os.makedirs(out_dir, exist_ok=True)
    if cfg.task.kind == "dataset" and not cfg.init_from:
        from jaxrl_lp.train.task_source import build_task

        return build_task(cfg).tokenizer.save(out_dir)
    if cfg.task.kind not in ("gsm8k", "gsm8k_tools", "dataset"):
        return CharTokenizer().save(out_dir)
    src = Path(cfg.init_from)
    files = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if "tokenizer.json" not in files:
        raise FileNotFoundError(f"the run's tokenizer ({src}/tokenizer.json, from init_from) "
                                "is gone; the run cannot be exported with its tokenizer")
    for f in files:
        shutil.copyfile(src / f, Path(out_dir) / f)
    return files
