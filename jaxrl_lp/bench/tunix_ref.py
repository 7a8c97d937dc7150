"""Tunix's GRPO policy update on a Hugging Face checkpoint: the reference the learner bench races.

Tunix (`google-tunix`, the optional `bench` extra) is not a dependency of
the library; everything here imports it lazily and `unavailable()` says why
it cannot be used. Nothing of Tunix is reimplemented: the model is loaded by
Tunix's own Qwen3 safetensors loader (`tunix.models.qwen3.params`), and the
update is the jitted train step of Tunix's RL trainer (`tunix.rl.trainer.
Trainer`, a `PeftTrainer`: `nnx.value_and_grad` of the loss, global norm,
`nnx.Optimizer.update`), with the loss wired exactly as `GRPOLearner`
wires it: the registered `grpo` policy loss (`tunix.rl.algo_core.
grpo_loss_fn`) called with the learner's `GRPOConfig`, pad and EOS ids. What
the learner adds around that step (rollouts, rewards, advantages, metric
buffering) is left out, as it is on our side.

`TunixIteration` is Tunix's whole GRPO iteration (rollout, advantages, updates,
weight sync), the side `jaxrl-lp bench iteration` races against ours.

Tunix runs its model at its config's `dtype` (compute) with `param_dtype`
parameters; we map our policy's compute dtype onto the first and keep f32
parameters, as our learner does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.train.behaviour import PhaseTimer

__all__ = ["AGGREGATIONS", "IdTokenizer", "TunixIteration", "ids_text", "tunix_model_config",
           "tunix_rollout", "tunix_train_example", "tunix_update", "unavailable"]

# Our loss aggregation names -> Tunix's `loss_agg_mode`.
AGGREGATIONS = {"token_mean": "token-mean", "seq_mean_token_mean": "sequence-mean-token-mean"}


def unavailable() -> str | None:
    """None when Tunix's GRPO path imports, else the reason (one line)."""
    try:
        import tunix.models.qwen3.params  # noqa: F401
        import tunix.rl.grpo.grpo_learner  # noqa: F401
        import tunix.rl.trainer  # noqa: F401
    except Exception as e:  # a missing package, or one of its dependencies failing to import
        return f"{type(e).__name__}: {e}"
    return None


def tunix_version() -> str:
    from importlib.metadata import version

    return version("google-tunix")


def tunix_model_config(cfg: ModelConfig, compute_dtype):
    """Tunix's Qwen3 `ModelConfig` of our dense Qwen3 architecture."""
    from tunix.models.qwen3 import model as qwen3_model

    if cfg.is_looped or not cfg.qk_norm or cfg.attention_bias:
        raise ValueError("tunix_model_config: only dense Qwen3 architectures (QK-norm, no "
                         "attention bias) have a Tunix Qwen3 counterpart")
    return qwen3_model.ModelConfig(
        num_layers=cfg.num_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.hidden_size,
        hidden_dim=cfg.intermediate_size, num_heads=cfg.num_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_kv_heads, rope_theta=cfg.rope_theta, norm_eps=cfg.rms_eps,
        use_tied_embedding=cfg.tie_embeddings, dtype=compute_dtype, param_dtype=jnp.float32)


def tunix_update(ckpt_dir: str, cfg: ModelConfig, optimizer, *, compute_dtype,
                 aggregation: str, epsilon: float, num_generations: int, pad_id: int,
                 eos_id: int, temperature: float = 1.0):
    """Loads `ckpt_dir` with Tunix and returns its jitted GRPO update `step(example)`.

    Args:
      ckpt_dir: a Hugging Face directory (`config.json`, `*.safetensors`).
      cfg: the architecture saved there (our config; Tunix gets the same shapes).
      optimizer: an optax transformation (the one our step uses).
      compute_dtype: the model's compute dtype (`jnp.float32` or `jnp.bfloat16`).
      aggregation: our aggregation name (`AGGREGATIONS`).
      epsilon: PPO clip range (both sides).
      num_generations: samples per prompt (G), as `GRPOConfig` requires it.
      pad_id, eos_id: the rollout's ids (Tunix masks attention on `pad_id`).
      temperature: the rollout's temperature.

    Returns:
      `(step, model)`: `step(train_example) -> (loss, aux, grad_norm)` updates
      the model and optimizer state in place (the optimizer is donated), as
      `PeftTrainer.train` calls it.
    """
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import function_registry
    from tunix.rl import trainer as rl_trainer
    from tunix.rl.grpo import grpo_learner
    from tunix.sft import peft_trainer

    model = qwen3_params.create_model_from_safe_tensors(
        ckpt_dir, tunix_model_config(cfg, compute_dtype), mesh=None)
    algo = grpo_learner.GRPOConfig(num_generations=num_generations, num_iterations=1, beta=0.0,
                                   epsilon=epsilon, loss_agg_mode=AGGREGATIONS[aggregation])
    algo.temperature = temperature  # GRPOLearner sets it from the rollout config
    trainer = rl_trainer.Trainer(
        model, optimizer, peft_trainer.TrainingConfig(eval_every_n_steps=1 << 30),
        custom_checkpoint_metadata_fn=dict)
    policy_loss_fn = function_registry.get_policy_loss_fn(algo.policy_loss_fn)
    # GRPOLearner.__init__'s wiring, word for word in effect.
    trainer.with_loss_fn(lambda model, train_example, algo_config: policy_loss_fn(
        model, train_example, algo_config=algo, pad_id=pad_id, eos_id=eos_id), has_aux=True)
    trainer.with_gen_model_input_fn(lambda x: {"train_example": x, "algo_config": algo})
    step, _ = trainer.jit_train_and_eval_step(skip_jit=False, cache_nnx_graph=True)
    return step, trainer.model


def tunix_train_example(ro, adv_B, old_logp_BxN=None):
    """Tunix's GRPO `TrainExample` of our rollout: same tokens, masks and advantages.

    Tunix reads left-padded prompts and right-padded completions with one pad id,
    as our rollouts are laid out; `old_logp_BxN` (our PPO anchor) becomes its
    `old_per_token_logps`.
    """
    from tunix.rl.grpo import grpo_learner

    prompt = jnp.asarray(ro.prompt_tokens)
    p = prompt.shape[1]
    prompt_mask = jnp.arange(p)[None] >= (p - jnp.asarray(ro.prompt_lengths))[:, None]
    return grpo_learner.TrainExample(
        prompt_ids=prompt, prompt_mask=prompt_mask,
        completion_ids=jnp.asarray(ro.completion_tokens),
        completion_mask=jnp.asarray(ro.completion_mask) > 0,
        ref_per_token_logps=None, advantages=jnp.asarray(adv_B, jnp.float32),
        old_per_token_logps=None if old_logp_BxN is None else jnp.asarray(old_logp_BxN))


def weights_agree(model, cfg: ModelConfig, params: dict) -> float:
    """Max |Tunix embedding - ours|: a check that the checkpoint loaded into Tunix is ours."""
    from flax import nnx

    emb = nnx.state(model)["embedder"]["input_embedding"]
    return float(np.max(np.abs(np.asarray(emb[...]) - np.asarray(params["embed"], np.float32))))


class IdTokenizer:
    """A tokenizer for Tunix's sampler whose text is the token ids, space-separated.

    Tunix's `Sampler` takes prompt strings; the benchmarks' prompts are token
    ids, so its text round-trips them exactly. No BOS is added (`bos_id` 0 is
    falsy to Tunix's tokenize).
    """

    def __init__(self, pad_id: int, eos_id: int):
        self._pad, self._eos = pad_id, eos_id

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return ids_text(ids)

    def bos_id(self) -> int:
        return 0

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


def ids_text(ids) -> str:
    """`IdTokenizer`'s text of token ids."""
    return " ".join(str(int(t)) for t in ids)


def tunix_rollout(model, cfg: ModelConfig, *, pad_id: int, eos_id: int, prompt_len: int,
                  new_tokens: int, temperature: float = 1.0):
    """Tunix's vanilla rollout engine on `model` and its `RolloutConfig`: `(rollout, config)`.

    The KV cache holds exactly `prompt_len + new_tokens` slots; `top_p=1.0`
    and no top-k is Tunix's plain categorical draw.
    """
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    cache = base_rollout.CacheConfig(cache_size=prompt_len + new_tokens,
                                     num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                                     head_dim=cfg.head_dim)
    rollout = vanilla_rollout.VanillaRollout(model, IdTokenizer(pad_id, eos_id), cache)
    config = base_rollout.RolloutConfig(
        max_tokens_to_generate=new_tokens, temperature=temperature, top_p=1.0, top_k=None,
        max_prompt_length=prompt_len, kv_cache_size=prompt_len + new_tokens,
        eos_tokens=[eos_id])
    return rollout, config


class TunixIteration:
    """Tunix's whole GRPO iteration on its own model, as `jaxrl-lp bench iteration` races it
    (that module's docstring): its vanilla rollout, the completion padding and masks its
    GRPO learner builds, its `grpo` advantage estimator, its jitted update per minibatch
    and its weight sync to the rollout. Each call runs one iteration and returns its
    seconds by phase (`timing_s/<phase>`).

    `loss` (our `LossConfig`: aggregation, epsilon), `pad_id`, `eos_id` and `reward`
    (completions [B, N] -> rewards [B]) are the race's, so both sides do the same work.
    """

    def __init__(self, ckpt, cfg: ModelConfig, policy, prompts, optimizer, *, group: int,
                 new_tokens: int, minibatches: int, seed: int, loss, pad_id: int, eos_id: int,
                 reward):
        self.update, self.model = tunix_update(
            ckpt, cfg, optimizer, compute_dtype=policy.compute_dtype,
            aggregation=loss.aggregation, epsilon=loss.epsilon, num_generations=group,
            pad_id=pad_id, eos_id=eos_id)
        prompt_len = len(prompts[0])
        self.rollout, self.rollout_config = tunix_rollout(
            self.model, cfg, pad_id=pad_id, eos_id=eos_id, prompt_len=prompt_len,
            new_tokens=new_tokens)
        # GRPO repeats each prompt G times before the rollout (prompt-major, as ours).
        self.texts = [ids_text(p) for p in prompts for _ in range(group)]
        self.group, self.new_tokens, self.minibatches = group, new_tokens, minibatches
        self.seed, self.count, self.pad_id, self.reward = seed, 0, pad_id, reward

    def __call__(self) -> dict:
        from flax import nnx
        from tunix.generate import utils
        from tunix.rl import function_registry
        from tunix.rl.grpo import grpo_learner

        timer, i = PhaseTimer(), self.count
        self.count += 1
        with timer("sample"):
            config = dataclasses.replace(self.rollout_config, seed=jax.random.fold_in(
                jax.random.PRNGKey(self.seed), i))
            out = self.rollout.generate(self.texts, config)
            # `_generate_and_compute_advantage`: completions right-padded, masks from pad ids.
            completion = np.array([utils.pad_to_length(t, target_length=self.new_tokens,
                                                       pad_value=self.pad_id, left=False)
                                   for t in out.tokens])
            prompt_ids = jnp.array(out.left_padded_prompt_tokens)
            prompt_mask = prompt_ids != self.pad_id
            completion_ids = jnp.array(completion)
            completion_mask = jnp.array(completion != self.pad_id)
            jax.block_until_ready(completion_ids)
        with timer("score"):
            estimator = function_registry.get_advantage_estimator("grpo")
            adv = estimator(rewards=self.reward(completion), num_generations=self.group)
            adv = jax.block_until_ready(jax.device_put(adv))
        size = completion.shape[0] // self.minibatches
        with timer("update"):
            for k in range(self.minibatches):
                sl = slice(k * size, (k + 1) * size)
                example = grpo_learner.TrainExample(
                    prompt_ids=prompt_ids[sl], prompt_mask=prompt_mask[sl],
                    completion_ids=completion_ids[sl], completion_mask=completion_mask[sl],
                    ref_per_token_logps=None, advantages=adv[sl], old_per_token_logps=None)
                loss, _, _ = self.update(example)
            jax.block_until_ready(loss)
        with timer("sync"):  # RLCluster.sync_weights: the actor's params into the rollout
            # (without its `filter_types`: Tunix's reshard needs a mesh, which one device lacks)
            self.rollout.update_params(nnx.state(self.model, nnx.Param))
            jax.block_until_ready(jax.tree.leaves(self.rollout.model()))
        return timer.metrics()
