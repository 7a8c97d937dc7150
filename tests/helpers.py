"""Shared settings of the tests' short training runs, and shared references (imported by the test modules)."""

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


# One-digit sums after a longer warm-start at a high rate, 64 sequences a step: a batch of 32
# has groups whose rewards vary from the first GRPO step, so GRPO updates move the weights
# (with no signal at all a fresh Adam's step is 0 and nothing moves). At 16 sequences a step
# the warm-start's sampled reward was 0 at the first two GRPO steps on a Zen 3 EPYC (every
# group alike, nothing moved); at 64 it is 0.19 there (the first GRPO record's `reward_mean`
# in `tests/test_kl_reference.py`'s run).
# A test that needs motion whatever the rewards uses a KL to another model instead.
LEARNS = ["sft.steps=300", "sft.lr=1e-2", "sft.batch_size=64", "task.max_digits=1",
          "grpo.prompts_per_step=8", "grpo.group_size=4"]


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
# After 2 warm-start steps every reward of FINISHED is 0, so is every advantage, and the
# GRPO updates alone move nothing (grad norm 0.0: the params and Adam's moments stand
# still). A KL term to the GRPO start, computed on the served copy, gives them a gradient
# (grad norm 1e-4 to 2e-3, served progress about 1 at every step), so what a resume
# inside GRPO must restore has moved.
GRPO_MOVES = ["loss.kl_beta=0.05"]


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


def checkpoints(run_dir) -> dict:
    """`{step: {"state", "meta"}}`: every kept checkpoint of a run, whole, on this process's
    first device (`Checkpointer.restore_saved`: whatever mesh or processes wrote it)."""
    from jaxrl_lp.train.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir, create=False)
    try:
        return {s: dict(zip(("state", "meta"), ckpt.restore_saved(s), strict=True))
                for s in ckpt.steps()}
    finally:
        ckpt.close()


def assert_bit_equal(a, b):
    """Equal pytrees: the same structure, and each leaf of the same dtype, shape and bytes."""
    import jax
    import numpy as np

    (la, ta), (lb, tb) = jax.tree.flatten_with_path(a), jax.tree.flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), where
        assert x.tobytes() == y.tobytes(), where


def bits_equal(a, b) -> bool:
    """Whether `assert_bit_equal(a, b)` holds."""
    try:
        assert_bit_equal(a, b)
    except AssertionError:
        return False
    return True


def latest_checkpoint(run_dir):
    """`(steps, params)`: a run directory's finalized checkpoint steps and its latest params."""
    from jaxrl_lp.train.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir)
    try:
        return ckpt.steps(), ckpt.manager.restore(ckpt.latest_step())["state"]["params"]
    finally:
        ckpt.close()


def grpo_loss_reference(learner, old, sampler, adv, mask, loss_cfg, max_tokens=None):
    """The GRPO step's loss, its gradient in the learner's log-probs and its metrics, by hand.

    numpy in f64, token-level ratio, no KL, written from the GRPO formulas and the
    docstrings of `rl.loss` / `rl.corrections`, not from their code: the correction ratio is
    `rho = exp(old - sampler)` (its geometric mean over a row for `seq_*`), the PPO ratio
    `r = exp(learner - anchor)` with `anchor = sampler` or `old` (`loss_cfg.ratio_anchor`),
    `l = -w min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A)` on the kept tokens over the
    aggregation's denominator. Returns a dict: `loss`, `grad` [B, N], `keep` [B, N] and every
    metric of `correction_weights` and `policy_loss` (`pg_loss`, `ratio_mean`,
    `clip_frac_low`, `clip_frac_high`, `is_weight_mean`, `frac_truncated`, `frac_masked`,
    `mismatch_*`).
    """
    import numpy as np

    learner, old, sampler, mask = (np.asarray(x, np.float64) for x in (learner, old, sampler,
                                                                         mask))
    a = np.asarray(adv, np.float64)[:, None]
    live = mask > 0
    cap, corr = float(loss_cfg.correction_cap), loss_cfg.correction
    log_rho = np.where(live, old - sampler, 0.0)
    if corr.startswith("seq_"):
        log_rho = np.broadcast_to(log_rho.sum(1, keepdims=True)
                                  / np.maximum(mask.sum(1, keepdims=True), 1), mask.shape)
    rho = np.exp(log_rho)
    truncated = np.zeros_like(mask)
    if corr == "none":
        keep, w = mask, mask
    elif corr in ("tis", "seq_tis"):
        keep, w = mask, np.minimum(rho, cap) * mask
        truncated = np.where(rho > cap, mask, 0.0)
    else:  # mis, seq_mis: outside [1/C, C] the token (the row) leaves the loss and its count
        keep = np.where((rho >= 1 / cap) & (rho <= cap), mask, 0.0)
        w = rho * keep
    anchor = sampler if loss_cfg.ratio_anchor == "sampler" else old
    kept = keep > 0
    r = np.exp(np.where(kept, learner - anchor, 0.0))
    lo, hi = 1 - loss_cfg.eps_low, 1 + loss_cfg.eps_high
    unclipped, clipped = r * a, np.clip(r, lo, hi) * a
    tokens = max(keep.sum(), 1.0)
    len_b = keep.sum(1)
    seqs = max((len_b > 0).sum(), 1.0)
    denom = {"token_mean": np.full(len(keep), tokens),
             "seq_mean_token_mean": seqs * np.maximum(len_b, 1.0),
             "seq_mean_token_sum_norm": np.full(len(keep), seqs * (max_tokens or mask.shape[1]))
             }[loss_cfg.aggregation][:, None]
    loss = np.sum(np.where(kept, -w * np.minimum(unclipped, clipped), 0.0) / denom)
    # d/dr of min(r A, clip(r) A) is A where the unclipped term is the smaller, else 0.
    grad = np.where(kept & (unclipped <= clipped), -w * a * r, 0.0) / denom
    d = np.where(live, old - sampler, 0.0)
    real = max(mask.sum(), 1.0)
    mean = lambda x: np.sum(np.where(live, x, 0.0)) / real
    return {
        "loss": loss, "grad": grad, "keep": keep, "pg_loss": loss,
        "ratio_mean": np.sum(r * keep) / tokens,
        "clip_frac_low": np.sum(keep * ((a < 0) & (r < lo))) / tokens,
        "clip_frac_high": np.sum(keep * ((a > 0) & (r > hi))) / tokens,
        "is_weight_mean": np.sum(w * keep) / tokens,
        "frac_truncated": truncated.sum() / real,
        "frac_masked": (mask.sum() - keep.sum()) / real,
        "mismatch_k1": mean(-d), "mismatch_k3": mean(np.exp(d) - 1 - d),
        "mismatch_max_abs_dlogp": np.max(np.abs(d)[live]),
        "mismatch_prob_err": mean(np.exp(np.abs(d))),
    }


def assert_same_sgd_step(many, one, params) -> None:
    """Two GRPO steps' `(params, metrics)` agree (f32: loss and grad norm within 1e-5 relative,
    each parameter within 1e-5 relative + 1e-7), and the step moved the parameters (> 1e-4).

    For steps taken with SGD (with momentum): the update is proportional to the gradient, so
    the parameters compare the gradients (Adam divides near-zero gradients by their own size,
    which turns last-bit differences of a gradient of 1e-9 into differences of the update).
    """
    import jax
    import numpy as np

    (p_many, m_many), (p_one, m_one) = many, one
    np.testing.assert_allclose(float(m_many["loss"]), float(m_one["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m_many["grad_norm"]), float(m_one["grad_norm"]), rtol=1e-5)
    moved = 0.0
    for a, b, p in zip(jax.tree.leaves(p_many), jax.tree.leaves(p_one), jax.tree.leaves(params),
                       strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        moved = max(moved, float(np.abs(np.asarray(b) - np.asarray(p)).max()))
    assert moved > 1e-4  # the step moved the parameters


def assert_hybrid_minibatches_are_the_samplers_bits(cfg, params, loop, ro, policy) -> None:
    """A hybrid GRPO step given no value replays its rows first (`make_grpo_step`'s prepare):
    at the sampler's weights that value is the sampler's log-probs bit for bit on every 2-row
    minibatch of `ro` (`train.behaviour.bit_mismatch`: no token under the mask differs in any
    bit), and the step, each minibatch split into two micro-batches, runs on it at ratio 1.

    Bits, not `ratio_mean == 1.0`: the ratio is `exp(dlogp)`, and an f32 mean of it over 16
    tokens rounds a one-ulp `dlogp` away (and `exp` of one is itself 1.0 where |logp| < 0.5)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jaxrl_lp.rl.loss import LossConfig
    from jaxrl_lp.rl.train_step import make_grpo_step
    from jaxrl_lp.rollout.generate import take_rows
    from jaxrl_lp.train.behaviour import bit_mismatch

    step = make_grpo_step(cfg, policy, LossConfig(), optax.sgd(0.0), loop=loop, micro_batches=2)
    adv = jnp.asarray([1.0, -1.0])
    for i in range(0, ro.completion_tokens.shape[0], 2):
        rows = take_rows(ro, np.arange(i, i + 2))
        copy = jax.tree.map(jnp.copy, params)
        args = (copy, optax.sgd(0.0).init(copy), rows, adv, rows.logprobs)
        value = step.prepare(args)[7]  # what the step computes with, as its call would
        differ, tokens, worst = bit_mismatch(value, rows.logprobs, rows.completion_mask)
        assert tokens > 0 and (differ, worst) == (0, 0.0), (i, differ, tokens, worst)
        _, _, m = step(*args, None, None, value)
        assert float(m["ratio_mean"]) == 1.0, (i, float(m["ratio_mean"]))
