"""Conversions between run checkpoints, Hugging Face directories and served copies.

- `run_to_hf`: a run's params (latest or a given step) as a Hugging Face
  directory (`config.json`, `model.safetensors`, the tokenizer): dense models
  load in `transformers.AutoModelForCausalLM`, looped ones with the Ouro code.
- `hf_to_run`: a run directory whose step-0 checkpoint holds a Hugging Face
  checkpoint's weights, written by the training program itself, so
  `jaxrl-lp train/eval/sample` continue from it.
- `run_to_served`: the served copy of a run's params under an exporter, in
  the served layout (`jaxrl_lp.sync.served_io`, docs/served_layout.md).
- `run_to_peft`: a LoRA run's adapters as a PEFT adapter directory
  (`jaxrl_lp.lora.peft`), with the base it adapts. (`run_to_hf` writes a LoRA
  run merged: `W + A B alpha/r` in f32.)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxrl_lp.models.hf_config import config_to_hf, read_hf_config
from jaxrl_lp.models.hf_io import SINGLE_FILE, save_hf_checkpoint
from jaxrl_lp.models.lora import merge_adapters
from jaxrl_lp.train.checkpoint import Checkpointer
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.run_io import model_config_of, run_config, save_tokenizer, served_export
from jaxrl_lp.train.sync_hooks import make_exporter

__all__ = ["hf_to_run", "run_to_hf", "run_to_peft", "run_to_served"]


def _model_params(cfg: TrainConfig, params, meta: dict, run_dir):
    """The model's params of a checkpoint's params: a low-bit run (`sft.optimizer`) holds
    its train tree (e.g. int8 codes and scales), which is materialized here; a LoRA run's
    adapters are put on their base (rebuilt and checked, `train.lora_run`), composed."""
    from jaxrl_lp.lora import LoraWeights
    from jaxrl_lp.optim import OptimizerSpec
    from jaxrl_lp.train.lora_run import read_lora_params

    weights = OptimizerSpec.parse(cfg.sft.optimizer, "sft.optimizer").weights()
    params = params if weights is None else weights.materialize(params)
    params, lora = read_lora_params(run_dir, params, meta, model_config_of(meta), cfg.init_from)
    return params if lora is None else LoraWeights(lora, model_config_of(meta)).materialize(params)


def _read(run_dir, step):
    """`(step, params, meta)` of a checkpoint, the params as saved (`restore_params`)."""
    ckpt = Checkpointer(run_dir, create=False)
    try:
        step = ckpt.resolve_step(step)
        params, meta = ckpt.restore_params(step)
    finally:
        ckpt.close()
    return step, params, meta


def _restore(run_dir, step):
    step, params, meta = _read(run_dir, step)
    return step, _model_params(run_config(run_dir), params, meta, run_dir), meta


def run_to_hf(run_dir: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None,
              dtype: str = "f32") -> dict:
    """Writes a run's params as a Hugging Face checkpoint directory.

    Args:
      run_dir: the run directory.
      out: the output directory (created; earlier weight files are replaced).
      step: the checkpoint step (default: the latest).
      dtype: dtype of the saved weights, `f32` (exact), `bf16` or `f16` (round to nearest even).

    Returns:
      A summary: run, step, out, model_type, dtype, files.

    Examples:
      >>> run_to_hf("runs/default", "out/default-hf")
      >>> from_pretrained("out/default-hf")  # or OuroForCausalLM.from_pretrained(...)
    """
    cfg = run_config(run_dir)  # the tokenizer depends on the run's task
    step, params, meta = _restore(run_dir, step)
    mcfg = model_config_of(meta)
    config_to_hf(mcfg, "4", dtype)  # refuses a bad dtype or model before anything is written
    save_hf_checkpoint(out, mcfg, merge_adapters(params), dtype=dtype)  # LoRA: W + A B s
    files = ["config.json", SINGLE_FILE, *save_tokenizer(cfg, out)]
    return {"run": str(run_dir), "step": step, "out": str(out),
            "model_type": config_to_hf(mcfg)["model_type"], "dtype": dtype, "files": files}


def hf_to_run(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, cfg: TrainConfig) -> dict:
    """Makes a run directory whose step-0 checkpoint holds a Hugging Face checkpoint.

    The run is what `jaxrl-lp train --set init_from=HF_DIR --set run.out_dir=OUT_DIR`
    starts from, written by that program (`run_train(..., stop_after=0)`):
    `config.json`, and a checkpoint with the f32 params (`load_hf_params`, exact
    for f32/bf16/f16 weights), fresh optimizer and exporter states and the
    data iterators at their start. `init_from` is recorded as an absolute path;
    a GSM8K run reads its tokenizer from there.

    Args:
      hf_dir: the Hugging Face checkpoint directory.
      out_dir: the run directory to make; it must not hold checkpoints yet.
      cfg: the run's config (task, optimizers, sync...); its `init_from` and
        `run.out_dir` are replaced.

    Returns:
      A summary: run, step (0), init_from, model_type.
    """
    from jaxrl_lp.train.program import run_train

    hf_dir = Path(hf_dir).absolute()
    mcfg = read_hf_config(hf_dir)  # a missing or unsupported checkpoint fails before any write
    ckpts = Path(out_dir) / "checkpoints"
    if ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir()):
        raise ValueError(f"{str(out_dir)!r} already holds a run (checkpoints in {ckpts}); "
                         "convert into a new directory")
    cfg = dataclasses.replace(cfg, init_from=str(hf_dir),
                              run=dataclasses.replace(cfg.run, out_dir=str(out_dir)))
    run_train(cfg, stop_after=0)
    step, _, _ = _restore(out_dir, 0)
    return {"run": str(out_dir), "step": step, "init_from": str(hf_dir),
            "model_type": config_to_hf(mcfg)["model_type"]}


def run_to_served(run_dir: str | os.PathLike, out: str | os.PathLike, *,
                  exporter: str | None = None, step: int | None = None) -> dict:
    """Writes the served copy of a run's params under an exporter (docs/served_layout.md).

    Args:
      run_dir: the run directory.
      out: the output directory (`config.json`, `model.safetensors`, tokenizer files).
      exporter: a `sync.exporter` spec (`bf16:stochastic`, `fmt:nvfp4`,
        `ternary:direct_codes`...); None for the run's own, whose state is read
        from the checkpoint so the export continues the run.
      step: the checkpoint step (default: the latest).

    Returns:
      A summary: run, step, out, exporter, exporter_state, files.

    Examples:
      >>> run_to_served("runs/fair", "out/served-mxfp8", exporter="fmt:mxfp8")
      >>> served = read_served("out/served-mxfp8")
    """
    from jaxrl_lp.sync.served_io import write_served

    if exporter is not None:
        make_exporter(exporter)  # an unknown spec fails before anything is read or written
    cfg = run_config(run_dir)
    ckpt = Checkpointer(run_dir, create=False)
    try:
        step = ckpt.resolve_step(step)
        params, meta = ckpt.restore_params(step)
        served, info = served_export(ckpt, _model_params(cfg, params, meta, run_dir), meta, step,
                                     exporter)
    finally:
        ckpt.close()
    facts = {"run": str(Path(run_dir).absolute()), "step": step,
             "exporter_state": info["exporter_state"]}
    files = write_served(out, served, model_config_of(meta), exporter=info["exporter"], info=facts)
    files += save_tokenizer(cfg, out)
    return {"run": str(run_dir), "step": step, "out": str(out), **info, "files": files}


def run_to_peft(run_dir: str | os.PathLike, out: str | os.PathLike, *,
                step: int | None = None) -> dict:
    """Writes a LoRA run's adapters as a PEFT adapter directory that `peft` loads onto its base.

    `out/adapter_config.json` and `out/adapter_model.safetensors` (PEFT's key
    names, `jaxrl_lp.lora.peft`). The base they adapt is named by
    `base_model_name_or_path`: the run's `init_from` checkpoint when the run
    held it in f32 (the same weights), else the base as the run held it (its
    own warm-start, or bf16 / dequantized FP8-FP4 values) written in f32 to
    `out/base` with the run's tokenizer, so that the logits PEFT computes are
    the ones the run's learner computed.

    Returns:
      A summary: run, step, out, base_model, rank, alpha, target_modules, files.

    Raises:
      ValueError: the checkpoint is not of a LoRA phase (no adapters).
    """
    from jaxrl_lp.lora.peft import save_peft
    from jaxrl_lp.train.lora_run import read_lora_params

    cfg = run_config(run_dir)
    step, params, meta = _read(run_dir, step)
    rec = meta.get("lora")
    if rec is None:
        raise ValueError(f"checkpoint step {step} of {run_dir} holds no LoRA adapters (a full "
                         "model's params, or a LoRA run's warm-start before its GRPO phase); "
                         "convert run-to-hf writes those")
    mcfg = model_config_of(meta)
    lora, spec = read_lora_params(run_dir, params, meta, mcfg, cfg.init_from)
    src = rec["base_source"]
    files = []
    if src["kind"] == "init_from" and spec.base_format == "f32":
        base_model = str(Path(cfg.init_from or src["path"]).absolute())
    else:  # the held base, exactly, in f32
        base_dir = Path(out) / "base"
        save_hf_checkpoint(base_dir, mcfg, merge_adapters(lora.base), dtype="f32")
        save_tokenizer(cfg, base_dir)
        base_model, files = str(base_dir.absolute()), ["base/config.json", f"base/{SINGLE_FILE}"]
    files = save_peft(out, mcfg, lora.adapters, spec, base_model) + files
    return {"run": str(run_dir), "step": step, "out": str(out), "base_model": base_model,
            "rank": spec.rank, "alpha": spec.alpha, "target_modules": sorted(lora.adapters["layers"]),
            "files": files}
