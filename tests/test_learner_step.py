"""The learner-step builders return one kind of object whatever their options.

`make_grpo_step` and `make_sft_step` return a `LearnerStep` on one device,
packed, and on a mesh of 8 simulated devices (packed by default too); each
lowers on the arguments it is called with, and a packed step at fixed row
counts lowers on abstract ones.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxrl_lp.bench.exactness import exactness_model, exactness_rollout
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.parallel import make_mesh
from jaxrl_lp.rl import LossConfig, make_grpo_step, make_sft_step
from jaxrl_lp.rl.learner_step import LearnerStep

PROMPTS = ((1, 5, 7), (2, 9, 4, 11, 3, 8), (6,), (12, 13, 14, 15))  # 4 prompts x G=2 = 8 rows
OPTIONS = {"one device": {"pack_buckets": 0}, "packed": {"pack_buckets": 16},
           "mesh": {"mesh": "fsdp=8"}}


@functools.cache
def _inputs():
    cfg, params, loop = exactness_model("dense")
    ro = exactness_rollout(params, cfg, Policy.parse("fp32"), loop, prompts=PROMPTS,
                           num_samples=2, max_new_tokens=8)
    return cfg, params, loop, ro


def _options(name):
    opts = dict(OPTIONS[name])
    if "mesh" in opts:
        if jax.device_count() < 8:
            pytest.skip("needs 8 (simulated) devices")
        opts["mesh"] = make_mesh(opts["mesh"])
    return opts


@pytest.mark.parametrize("name", list(OPTIONS))
def test_grpo_step_is_one_kind_of_object_and_lowers(name):
    cfg, params, loop, ro = _inputs()
    opt = optax.sgd(0.1)
    step = make_grpo_step(cfg, Policy.parse("fp32"), LossConfig(), opt, loop=loop,
                          method="dense", **_options(name))
    assert type(step) is LearnerStep
    assert step.packs == (name != "one device")
    adv = jnp.linspace(-1.0, 1.0, ro.logprobs.shape[0])
    text = step.lower(params, opt.init(params), ro, adv, ro.logprobs).as_text()
    assert "func.func public @main" in text
    with pytest.raises(TypeError, match="at most 9 arguments"):
        step.lower(params, opt.init(params), ro, adv, ro.logprobs, None, None, None, None, None)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_sft_step_is_one_kind_of_object_and_lowers(name):
    cfg, params, _, ro = _inputs()
    opt = optax.sgd(0.1)
    step = make_sft_step(cfg, Policy.parse("fp32"), opt, **_options(name))
    assert type(step) is LearnerStep
    assert step.packs == (name != "one device")
    tokens = jnp.concatenate([ro.prompt_tokens, ro.completion_tokens], axis=1)
    mask = jnp.concatenate([jnp.ones(ro.prompt_tokens.shape), ro.completion_mask], axis=1)
    assert "func.func public @main" in step.lower(params, opt.init(params), tokens,
                                                  mask).as_text()


def test_a_packed_step_at_fixed_rows_lowers_on_abstract_arguments():
    """What `plan.programs` builds: the largest bucket, with nothing allocated."""
    cfg, params, _, _ = _inputs()
    opt = optax.sgd(0.1)
    step = make_sft_step(cfg, Policy.parse("fp32"), opt, pack_buckets=16)
    b, l = 2, 8
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    args = (abstract(params), abstract(opt.init(params)), jax.ShapeDtypeStruct((b, l), jnp.int32),
            jax.ShapeDtypeStruct((b, l), jnp.float32))
    fixed = step.with_packed_rows((b * l, b * (l - 1)))
    assert type(fixed) is LearnerStep
    assert f"tensor<1x{b * l}x{cfg.hidden_size}xf32>" in fixed.trace(*args).lower().as_text()
    with pytest.raises(ValueError, match="packs no rows"):
        make_sft_step(cfg, Policy.parse("fp32"), opt, pack_buckets=0).with_packed_rows((1, 1))
