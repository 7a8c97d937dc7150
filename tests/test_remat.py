"""`grpo.remat` (`models.remat`): what each choice saves for the backward, and that it changes no value.

On the tiny dense model and the tiny looped one (4 loop steps), with an MLP
width (96) and a sequence length (11) no other dimension shares, so a saved
array's shape says what it is: `[..., 11, 11]` attention probabilities,
`[..., 96]` the MLP's product outputs. The gradients of every choice are
compared with `none`'s: recomputation runs the same maths, but XLA:CPU fuses
the recomputed forward with the backward and rounds a few sums otherwise, so
each leaf's largest difference is held to 1e-5 of its largest gradient
(`pytest -s` prints it: 4e-7 to 7e-7 here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.models.model import forward, init_params
from jaxrl_lp.models.remat import Remat
from jaxrl_lp.numerics.policy import Policy

T, MLP = 11, 96


def _model(name):
    cfg = get_preset(name).replace(intermediate_size=MLP)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T), 0, cfg.vocab_size)
    return cfg, params, tokens


def _loss(cfg, tokens, remat):
    policy = Policy.parse("fp32")

    def loss(params):
        logits, _, _ = forward(params, cfg, policy, tokens, remat=remat)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0])
    return loss


def _saved_shapes(name, remat):
    """The shapes of what the backward reads saved: the residuals `jax.vjp` keeps."""
    cfg, params, tokens = _model(name)
    _, backward = jax.vjp(_loss(cfg, tokens, remat), params)
    return [tuple(x.shape) for x in jax.tree.leaves(backward)]


def test_remat_of_reads_names_and_the_old_flag():
    assert Remat.of("dots") is Remat.DOTS and Remat.of(Remat.LAYERS) is Remat.LAYERS
    assert Remat.of(True) is Remat.LAYERS and Remat.of(False) is Remat.NONE
    with pytest.raises(ValueError, match="remat must be one of .*'none', 'layers', 'dots'"):
        Remat.of("attention")


# The looped model (its layers are the dense model's) by default; the dense one by hand.
@pytest.mark.parametrize("name", [pytest.param("tiny-qwen3", marks=pytest.mark.slow), "tiny-ouro"])
def test_each_choice_saves_what_it_says(name):
    def probs(shapes):  # attention probabilities (or scores): two axes of T
        return [s for s in shapes if s.count(T) >= 2]

    def mlp(shapes):  # the MLP's products: an axis of 96 and one of T or B x T (weights: none)
        return [s for s in shapes if MLP in s and (T in s or 2 * T in s)]

    none, dots, layers = (_saved_shapes(name, r) for r in (Remat.NONE, Remat.DOTS, Remat.LAYERS))
    assert probs(none) and mlp(none)
    assert not probs(dots), dots  # recomputed from the saved projections
    assert mlp(dots), dots  # the weight products' outputs are kept
    assert not probs(layers) and not mlp(layers), layers  # only the layers' inputs


# The looped model (its layers are the dense model's) by default; the dense one by hand.
@pytest.mark.parametrize("name", [pytest.param("tiny-qwen3", marks=pytest.mark.slow), "tiny-ouro"])
def test_gradients_do_not_depend_on_the_choice(name):
    cfg, params, tokens = _model(name)
    grads = {r: jax.jit(jax.grad(_loss(cfg, tokens, r)))(params) for r in Remat}
    tiny = np.finfo(np.float32).tiny  # a leaf whose gradient is 0 must stay 0
    for r in (Remat.DOTS, Remat.LAYERS):
        worst = max(float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), tiny))
                    for ref, got in zip(jax.tree.leaves(grads[Remat.NONE]),
                                        jax.tree.leaves(grads[r]), strict=True))
        print(f"{name} {r.value}: largest difference / the leaf's largest gradient {worst:.1e}")
        assert worst <= 1e-5, (r.value, worst)
