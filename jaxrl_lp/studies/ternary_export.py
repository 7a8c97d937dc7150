"""Ternary export study: which export path serves the codes the model was trained with?

A small model is trained (the supervised warm-start of `jaxrl-lp train`, no
GRPO) with a learner policy that quantizes every matmul weight to ternary
(BitNet b1.58: `gamma = mean|W|`, codes in {-1, 0, 1}) with straight-through
gradients to f32 latent weights (`TERNARY_POLICY`). The trained latents are
then exported by the three paths of `jaxrl_lp.sync.ternary` (docs/design/sync.md, "Weight export and sync"):

- `bf16_then_quantize`: the legacy path (bf16 latents, bf16 quantizer);
- `direct_codes`: the training quantizer's own codes and scale;
- `bf16_fixed_point`: bf16 latents nudged until a bf16 consumer's quantizer
  gives the training codes.

Per path: `code_disagreement`, the fraction of codes that differ from the
training quantizer's, over all exported tensors (weighted by element count;
`per_tensor` has each tensor's fraction); and `accuracy`, the greedy held-out
accuracy of the served model as a consumer runs it, with an f32 policy and no
matmul format (the served weights already hold ternary values). For
`bf16_fixed_point` the consumer is the legacy bf16 quantizer (the codes and
scale it derives from the bf16 values); `code_disagreement_training_consumer`
also gives the codes the f32 training quantizer derives from them.
`reference_accuracy` is the trained model under the training quantizer itself.

The training policy quantizes the output projection too (every matmul goes
through the policy), so an untied `lm_head` is exported as ternary as well; a
tied head (the embedding) cannot be, and is then served in f32 (noted in the
result).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from jaxrl_lp.studies.common import QUICK_OVERRIDES, make_config, remove_outputs, restore_state

__all__ = ["DEFAULT_SFT_STEPS", "TERNARY_POLICY", "run_ternary_export"]

# The learner policy of the study: every matmul weight ternary (BitNet b1.58), straight-through.
TERNARY_POLICY = "p=f32,c=f32,mm=ternary,bwd=reuse,f32=rope+swiglu+norm+residual+softmax"
# Ternary learns slower than f32: its warm-start runs longer than the default run's (the
# measurements behind 2000: docs/design/studies.md, "Numerics studies").
DEFAULT_SFT_STEPS = 2000


def _consumer_view(served, include_lm_head: bool):
    """What a bf16 consumer serves: bf16 matmul weights replaced by its legacy ternary codes."""
    from jaxrl_lp.numerics.qarray import QArray
    from jaxrl_lp.sync.export import map_with_path
    from jaxrl_lp.sync.layout import is_qarray, matmul_axes
    from jaxrl_lp.sync.ternary import legacy_ternary_quantize

    def one(path, x):
        axes = matmul_axes(path, include_lm_head)
        if axes is None or is_qarray(x):
            return x
        codes, scale = legacy_ternary_quantize(x, axes[1])
        return QArray(codes, scale, "ternary", axes[0], axes[1])

    return map_with_path(one, served)


def _weighted(rates: dict[str, float], sizes: dict[str, int]) -> float:
    total = sum(sizes[p] for p in rates)
    return float(sum(rates[p] * sizes[p] for p in rates) / total)


def run_ternary_export(out_dir: str | Path = "runs/study-ternary-export", *,
                       sft_steps: int | None = None, overrides: tuple[str, ...] = (),
                       quick: bool = False, progress: bool = False) -> dict:
    """Trains the ternary model and measures the three export paths (module docstring).

    Args:
      out_dir: the study directory (`sft/` run directory, `ternary_export.json`);
        those two are replaced if present, nothing else there is touched.
      sft_steps: warm-start steps (default `DEFAULT_SFT_STEPS`, or the quick
        preset's with `quick`).
      overrides: extra `a.b=c` config overrides (applied after the defaults).
      quick: a tiny model and task (`common.QUICK_OVERRIDES`) for a smoke run.
      progress: show the training progress bar.

    Returns:
      The JSON-able result (also in `ternary_export.json`).
    """
    from jaxrl_lp.numerics.policy import FP32
    from jaxrl_lp.rollout.step import LoopSpec
    from jaxrl_lp.sync import EmptyState, served_params_for_forward
    from jaxrl_lp.sync.layout import flatten_served, matmul_weight_paths
    from jaxrl_lp.sync.ternary import TERNARY_PATHS, code_disagreement, ternary
    from jaxrl_lp.train.evaluation import evaluate
    from jaxrl_lp.train.program import run_train

    t0 = time.time()
    out = Path(out_dir)
    remove_outputs(out, ("sft", "ternary_export.json"))
    out.mkdir(parents=True, exist_ok=True)
    settings = [*(QUICK_OVERRIDES if quick else [f"sft.steps={DEFAULT_SFT_STEPS}"]), *overrides,
                f"run.progress={'true' if progress else 'false'}", "grpo.steps=0",
                f"grpo.learner_policy={TERNARY_POLICY}", f"grpo.sampler_policy={TERNARY_POLICY}"]
    if sft_steps is not None:
        settings.append(f"sft.steps={sft_steps}")
    cfg = make_config([*settings, f"run.out_dir={out / 'sft'}"])
    summary = run_train(cfg)
    t_train = time.time() - t0

    state, _, task, mcfg, _ = restore_state(cfg)
    latents = state["params"]
    head = not mcfg.tie_embeddings
    g = cfg.grpo
    loop = LoopSpec(g.exit_rule, g.compute_mode)
    size, max_new = cfg.run.eval_size, g.max_new_tokens or task.max_completion_tokens

    def acc(params, policy):
        return evaluate(params, mcfg, task, policy, loop, size, max_new)

    flat = flatten_served(latents)
    sizes = {p: int(np.size(flat[p])) for p in matmul_weight_paths(latents, head)}
    paths = {}
    for path in TERNARY_PATHS:
        served, _ = ternary(path, include_lm_head=head).apply(latents, EmptyState())
        rates = code_disagreement(latents, served, include_lm_head=head)
        entry = {"code_disagreement": _weighted(rates, sizes),
                 "codes_differing": int(round(sum(rates[p] * sizes[p] for p in rates)))}
        if path == "bf16_fixed_point":
            t_rates = code_disagreement(latents, served, consumer="training", include_lm_head=head)
            entry["code_disagreement_training_consumer"] = _weighted(t_rates, sizes)
            served = _consumer_view(served, head)
        entry["accuracy"] = acc(served_params_for_forward(served), FP32)
        entry["per_tensor"] = rates
        paths[path] = entry

    result = {
        "study": "ternary-export",
        "paths": paths,
        "reference_accuracy": acc(latents, cfg.grpo.policies.learner),
        "latent_f32_accuracy": acc(latents, FP32),
        "setup": {
            "sft_steps": cfg.sft.steps, "sft_lr": cfg.sft.lr, "learner_policy": TERNARY_POLICY,
            "eval_size": size, "quick": quick, "overrides": settings,
            "model": {k: getattr(mcfg, k) for k in
                      ("family", "hidden_size", "num_layers", "loop_steps", "intermediate_size")},
            "lm_head_exported": head, "exported_elements": int(sum(sizes.values())),
            "sft_final_accuracy": summary["final_accuracy"],
        },
        "timings": {"train_seconds": round(t_train, 1),
                    "total_seconds": round(time.time() - t0, 1)},
    }
    (out / "ternary_export.json").write_text(json.dumps(result, indent=2))
    return result
