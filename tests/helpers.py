"""Shared settings of the tests' short training runs (imported by the test modules)."""

# A model small enough to compile and train in seconds on 2 cores.
TINY_MODEL = [
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
    "model.head_dim=16", "model.intermediate_size=64", "model.loop_steps=2",
]


def short_run(sft_steps: int = 6, grpo_steps: int = 6, checkpoint_every: int = 2) -> list[str]:
    """`--set` values of a short run: the tiny model, small batches, frequent checkpoints."""
    return [*TINY_MODEL, f"sft.steps={sft_steps}", "sft.batch_size=16",
            f"grpo.steps={grpo_steps}", "grpo.prompts_per_step=4", "grpo.group_size=2",
            "run.eval_every=3", "run.eval_size=8", f"run.checkpoint_every={checkpoint_every}",
            "run.progress=false"]


# One-digit sums after a longer warm-start at a high rate: a batch of 32 has groups whose
# rewards vary, so GRPO updates move the weights (with no signal at all a fresh Adam's step
# is 0 and nothing moves).
LEARNS = ["sft.steps=300", "sft.lr=1e-2", "task.max_digits=1", "grpo.prompts_per_step=8",
          "grpo.group_size=4"]


def sets(*overrides: str) -> list[str]:
    """Command-line `--set` arguments for `overrides`."""
    return [a for o in overrides for a in ("--set", o)]


# The finished runs the session shares (`finished_runs` in conftest.py): 2 warm-start and
# 6 GRPO steps, a checkpoint every 2 steps (the last two, 6 and 8, kept).
FINISHED = short_run(sft_steps=2, grpo_steps=6)
FINISHED_STEPS = 8
# Fair Cast: bf16 error-feedback export (its residual, non-zero from the first export of an
# f32 master, is checkpointed), the loss on the served copy, the seven sync checks every 2
# GRPO steps.
FAIR_CAST = ["sync.exporter=bf16:error_feedback", "sync.loss_on_served=true",
             "sync.check_every=2"]


def exactness_grads(cfg, policy, ro, loop):
    """`grads(params)` of the exactness cells: ((hybrid gradient, hybrid log-probs), (dense
    gradient, dense log-probs), replay log-probs) of a fixed random weighting of the rollout's
    learner log-probs (`learner_logprobs`), to be jitted by the caller."""
    import jax
    import jax.numpy as jnp

    from jaxrl_lp.rl.logprobs import learner_logprobs

    w = jax.random.normal(jax.random.PRNGKey(7), ro.logprobs.shape)

    def f(params, method):
        logp, _ = learner_logprobs(params, cfg, policy, ro, method, loop=loop)
        return jnp.sum(logp * ro.completion_mask * w), logp

    def grads(params):
        return (jax.grad(f, has_aux=True)(params, "hybrid"),
                jax.grad(f, has_aux=True)(params, "dense"),
                learner_logprobs(params, cfg, policy, ro, "replay", loop=loop)[0])

    return grads


def latest_checkpoint(run_dir):
    """`(steps, params)`: a run directory's finalized checkpoint steps and its latest params."""
    from jaxrl_lp.train.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir)
    try:
        return ckpt.steps(), ckpt.manager.restore(ckpt.latest_step())["state"]["params"]
    finally:
        ckpt.close()
