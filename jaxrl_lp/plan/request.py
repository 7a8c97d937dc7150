"""What a plan is asked for: the model and sizes it compiles at, checked before jax starts.

`check_request(cfg, mesh, devices, target)` reads no data and no weights and
touches no device, so `jaxrl-lp plan` answers a bad request (a mesh whose size
is not the device count, an unknown axis or target, a dimension the mesh does
not divide, a batch that does not split over the data shards) with one line
before it starts jax or a child process. The model is `init_from`'s
`config.json` when that directory exists, else the `model` section (with the
character tokenizer's vocabulary for the generated arithmetic task); a GSM8K
prompt is `GSM8K_PROMPT_TOKENS` slots, the sampler's padded bucket.
"""

from __future__ import annotations

import os
import types
from typing import NamedTuple

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.parallel.mesh import AXES, MeshSpec
from jaxrl_lp.parallel.rules import check_divisible
from jaxrl_lp.plan.targets import Target, get_target
from jaxrl_lp.rollout.generate import bucket_length
from jaxrl_lp.train.config import TrainConfig

__all__ = ["GSM8K_PROMPT_TOKENS", "PlanShapes", "check_request", "plan_model", "plan_shapes"]

# GSM8K questions in the prompt template are under 256 tokens with the Qwen3 and
# Ouro tokenizers (the longest test question is about 210), so the sampler pads
# prompts to the 256 bucket.
GSM8K_PROMPT_TOKENS = 256


class PlanShapes(NamedTuple):
    """The sizes a plan compiles at."""

    prompt_len: int  # P, padded prompt slots
    max_new: int  # N, completion slots
    rows: int  # sequences per optimizer update (a minibatch)
    micro_rows: int  # sequences per micro-batch
    decode_batch: int  # sequences the sampler decodes at once


def plan_model(cfg: TrainConfig) -> ModelConfig:
    """The model a plan compiles (module docstring)."""
    if cfg.init_from and os.path.isdir(cfg.init_from):
        from jaxrl_lp.models.hf_io import read_hf_config

        return read_hf_config(cfg.init_from)
    if cfg.task.kind == "arithmetic":  # generated: its tokenizer sets the vocabulary
        from jaxrl_lp.train.validate import build_task, model_config

        return model_config(cfg, build_task(cfg))
    return cfg.model


def plan_shapes(cfg: TrainConfig, mcfg: ModelConfig, prompt_len: int | None = None) -> PlanShapes:
    """The sizes of `cfg`'s GRPO minibatch and sampler batch (`prompt_len` overrides P)."""
    g = cfg.grpo
    max_new = g.max_new_tokens
    if cfg.task.kind == "arithmetic":
        from jaxrl_lp.train.validate import build_task

        task = build_task(cfg)
        max_new = max_new or task.max_completion_tokens
        longest = task.max_sequence_length - task.max_completion_tokens
        prompt_len = prompt_len or min(bucket_length(longest),
                                       mcfg.max_position_embeddings - max_new)
    elif not max_new:
        raise ValueError("grpo.max_new_tokens=0 takes the completion budget from the data, "
                         "which plan does not read; set grpo.max_new_tokens")
    prompt_len = prompt_len or GSM8K_PROMPT_TOKENS
    if prompt_len + max_new > mcfg.max_position_embeddings:
        raise ValueError(f"a prompt of {prompt_len} slots plus grpo.max_new_tokens={max_new} "
                         f"exceeds the model's context of {mcfg.max_position_embeddings}")
    batch = g.prompts_per_step * g.group_size
    rows = batch // g.minibatches
    return PlanShapes(prompt_len, max_new, rows, rows // g.micro_batches, batch)


def check_request(cfg: TrainConfig, mesh: str, devices: int, target: str,
                  prompt_len: int | None = None
                  ) -> tuple[MeshSpec, Target, ModelConfig, PlanShapes]:
    """Checks a plan request without touching jax's devices; each bad input is one line.

    Returns:
      `(MeshSpec, Target, ModelConfig, PlanShapes)`.

    Raises:
      ValueError: an unknown target or mesh axis, a mesh whose size is not
        `devices`, a model dimension the mesh does not divide, or a batch that
        does not split over the data shards.
    """
    tgt = get_target(target)
    spec = MeshSpec.parse(mesh)
    if spec.size != devices:
        raise ValueError(f"--mesh {spec} has {spec.size} devices but --devices is {devices}; "
                         f"choose axis sizes whose product is {devices}")
    mcfg = plan_model(cfg)
    # The sizes are all a divisibility check reads of a mesh.
    check_divisible(mcfg, types.SimpleNamespace(shape=dict(zip(AXES, spec.shape, strict=True))))
    shapes = plan_shapes(cfg, mcfg, prompt_len)
    d, g = spec.data_shards, cfg.grpo
    if g.prompts_per_step % d:
        raise ValueError(f"grpo.prompts_per_step={g.prompts_per_step} does not split over the "
                         f"mesh {spec}'s {d} data shards (data x fsdp); make it a multiple of {d}")
    if shapes.micro_rows % d:
        raise ValueError(f"grpo.micro_batches={g.micro_batches}: a micro-batch of "
                         f"{shapes.micro_rows} sequences does not split over the mesh {spec}'s "
                         f"{d} data shards (data x fsdp); use fewer micro-batches, so that one "
                         f"holds a multiple of {d} sequences")
    return spec, tgt, mcfg, shapes
