"""The decode step as the GPU compiler is handed it (`plan.decode_step`, `jaxrl-lp bench decode`).

No weight is sliced, copied or converted inside the sampler's decode loop: the
layers are unstacked and rounded to the matmul inputs once per call, before it.
Each check is also run on the bad forms it must catch, planted into the sampler:
the layers kept stacked (a scan over them inside each step slices every weight,
XLA does not hoist it), and the weights left in f32 (each step converts them).
With the CUDA PJRT plugin (`JAXRL_LP_CUDA_PLUGIN`, `plan.cuda_aot`) the same is read
from XLA:GPU's own optimized program for an H200.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxrl_lp.bench.decode import lowered_text, report
from jaxrl_lp.cli.main import main
from jaxrl_lp.models.blocks import decode_weights
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.plan.cuda_aot import PLUGIN_ENV, plugin_from_env, target_config
from jaxrl_lp.plan.decode_step import decode_step_ops
from jaxrl_lp.rollout.sampling import first_argmax, gumbel_max

BF16 = Policy.parse("bf16")
# Each cell its own row count: a planted form is traced afresh, not taken from jit's cache.
SPEC = {"preset": "tiny-qwen3", "policy": BF16, "layers": None, "rows": 2, "prompt_len": 8,
        "new_tokens": 4}
_GENERATE = "jaxrl_lp.rollout.generate"


def _cuda_hlo(fn, *args) -> str:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.compiler_ir("hlo").get_hlo_module().to_string()


def test_the_reader_finds_a_sliced_a_converted_and_a_clean_weight():
    """The checks can fail: a stacked weight sliced in the loop, a weight converted in it."""
    w = jax.ShapeDtypeStruct((2, 16, 16), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((4, 16), jnp.float32)

    def loop(step):
        return lambda w, x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1,
                                               step(w, c[1])), (0, x))[1]

    per_layer = jax.ShapeDtypeStruct((16, 16), jnp.bfloat16)
    clean = decode_step_ops(_cuda_hlo(loop(lambda w, x: jnp.dot(
        x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)), per_layer, x),
        16 * 16, compiled=False)
    assert clean.weight_ops == () and clean.products == 1 and clean.nested_loops == 0
    assert clean.weight_bytes == {"bf16": 16 * 16 * 2}

    def sliced(w, x, i=1):
        return jnp.dot(x.astype(jnp.bfloat16), jax.lax.dynamic_index_in_dim(w, i, 0, False),
                       preferred_element_type=jnp.float32)

    got = decode_step_ops(_cuda_hlo(loop(sliced), w, x), 16 * 16, compiled=False)
    assert [line.split(" = ")[1].split("[")[0] for line in got.weight_ops] == ["dynamic-slice"]

    f32 = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    got = decode_step_ops(_cuda_hlo(loop(lambda w, x: jnp.dot(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)),
        f32, x), 16 * 16, compiled=False)
    assert got.weight_bytes == {"f32": 16 * 16 * 4}
    assert len(got.weight_ops) == 1 and "convert" in got.weight_ops[0]


def test_the_decode_loop_reads_its_weights_as_they_are():
    got = report(SPEC)
    low = got["lowered"]
    assert got["ok"] and low["weight_ops"] == () and low["nested_loops"] == 0, got["problems"]
    assert set(low["weight_bytes"]) == {"bf16"}
    # Per layer q, k, v, scores, values, o, gate, up, down; then the head.
    assert low["products"] == 2 * 9 + 1
    assert "skipped" in got["compiled"]  # the plugin is asked for by name, not found


def test_layers_kept_stacked_are_sliced_in_every_step(monkeypatch):
    """The plant: the sampler scans stacked layers inside the loop (no `unstack_layers`)."""
    generate = sys.modules[_GENERATE]
    monkeypatch.setattr(generate, "unstack_layers",
                        lambda params, transpose=False, policy=None: decode_weights(params, policy))
    monkeypatch.setattr(generate, "unstack_cache", lambda cache, cfg: cache)
    got = report({**SPEC, "rows": 3})
    low = got["lowered"]
    assert not got["ok"] and low["nested_loops"] == 1
    assert low["weight_ops"] and all("dynamic-slice" in line for line in low["weight_ops"])


def test_weights_left_in_f32_are_converted_in_every_step(monkeypatch):
    """The plant: the weights enter the loop as the f32 master (no `decode_weights`)."""
    monkeypatch.setattr(sys.modules["jaxrl_lp.models.blocks"], "decode_weights",
                        lambda params, policy: params)
    got = report({**SPEC, "rows": 5})
    low = got["lowered"]
    assert not got["ok"] and low["weight_bytes"] == {"f32": low["weight_bytes"]["f32"]}
    assert low["weight_ops"] and all("convert" in line for line in low["weight_ops"])


def test_argmax_is_one_reduction_on_gpu_and_two_on_cpu():
    """The draw's argmax (`first_argmax`): one pass over [B, V] on GPU and TPU, where the noise
    fuses into it; the two plain reductions XLA:CPU runs faster; the same index (see
    tests/test_sampling_draw.py)."""
    key = jax.random.key(0)
    logits = jax.ShapeDtypeStruct((4, 1000), jnp.float32)

    def reduces(platform):
        lowered = jax.jit(gumbel_max).trace(key, logits).lower(lowering_platforms=(platform,))
        return lowered.as_text().count("stablehlo.reduce")

    assert reduces("cuda") == 1 and reduces("tpu") == 1 and reduces("cpu") == 2
    x = jax.random.normal(jax.random.key(1), (8, 333))
    x = x.at[3].set(-jnp.inf).at[5, [7, 11]].set(x[5].max() + 1)
    assert first_argmax(x).tolist() == jnp.argmax(x, axis=-1).tolist()


def test_bench_decode_cli(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--preset", "tiny-qwen3", "--rows", "2", "--prompt-len",
                 "8", "--new-tokens", "4", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["ok"] and got["lowered"]["products"] == 19 and got["preset"] == "tiny-qwen3"
    capsys.readouterr()
    assert main(["bench", "decode", "--preset", "tiny-qwen3", "--rows", "0"]) == 2
    assert "--rows must be >= 1" in capsys.readouterr().err
    assert main(["bench", "decode", "--preset", "tiny-qwen3", "--target", "a100"]) == 2
    assert "--target must be one of h100, h200" in capsys.readouterr().err
    assert main(["bench", "decode", "--preset", "tiny-qwen3", "--xla-gpu-flags", "graphs"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown preset 'graphs'" in err
    assert main(["bench", "decode", "--cuda-plugin", str(tmp_path)]) == 2
    assert "no jax_plugins/xla_cuda*" in capsys.readouterr().err


def test_target_configs_name_the_gpu():
    text = target_config("h200")
    assert 'name: "NVIDIA H200 141GB HBM3e"' in text and "memory_bandwidth: 4800000000000" in text
    with pytest.raises(ValueError, match="one of h100, h200"):
        target_config("a100")


@pytest.mark.skipif(not os.environ.get(PLUGIN_ENV), reason=f"no CUDA PJRT plugin (${PLUGIN_ENV})")
def test_xla_gpu_compiles_the_decode_step_without_a_weight_copy():
    """XLA:GPU's optimized program for an H200 (deviceless): no weight copied, sliced or
    converted; one product kernel per projection group; the logits written once and read by
    the log-softmax's two reductions, the argmax and the log-prob's gather."""
    # At Qwen3-0.6B's widths (2 layers): at tiny-qwen3's XLA:GPU concatenates q, k and v's
    # weights for its merged product inside the loop, a copy each step (`docs/design/hot_path.md`).
    spec = {**SPEC, "preset": "qwen3-0.6b", "layers": 2, "rows": 8, "prompt_len": 16}
    got = report(spec, "h200", plugin_from_env(), ("none", "decode_graphs"))
    assert got["ok"], got["problems"]
    for name in ("none", "decode_graphs"):
        step = got["compiled"][name]
        assert step["weight_ops"] == () and step["nested_loops"] == 0
        assert step["products"] == 2 * 6 + 1  # qkv, scores, values, o, gate+up, down; head
        assert step["logits_passes"] == {"reads": 4, "writes": 1}, step
    assert got["compiled"]["none"]["total"] == got["compiled"]["decode_graphs"]["total"]
    # The draw alone: Gumbel-max and greedy read the logits three times (the log-softmax's max
    # and sum, the argmax with the noise fused in) and write no [B, V] array.
    for draw in ("gumbel", "greedy"):
        assert got["compiled"]["draws"][draw]["logits_passes"] == {"reads": 3, "writes": 0}


def test_lowered_text_is_the_sampler_for_cuda():
    text = lowered_text({**SPEC, "rows": 2})
    assert text.startswith("HloModule") and " while(" in text
