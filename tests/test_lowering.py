"""Every kernel and every program lowers for CUDA and TPU from this CPU, with its kernels in it.

What a GPU or TPU compiler would be handed is checked here, on abstract inputs
(nothing allocated) at the Qwen3-0.6B, Qwen3-4B and Ouro-1.4B presets' sizes,
in native bf16 and under the MXFP8 and NVFP4 policies, with JAX's defaults
(`jaxrl_lp.bench.lowering`, `jaxrl-lp bench lowering`): each cell must lower and
carry the Pallas kernel families its program should (`expected_kernels`:
Mosaic custom calls for `tpu`; none for `cuda`, whose versions are retired,
`kernels.dispatch.RETIRED`). One traced program
lowers for every platform; lowered for `cpu` under `kernels=auto` it carries no
kernel (the references). The device compilers' own passes are not run here
(`kernels.lowering`'s docstring); `tests/test_kernels_compiled.py` runs the
kernels on a device.
"""

import json

import pytest

from jaxrl_lp.bench.lowering import KERNEL_CASES, kernel_family, report
from jaxrl_lp.cli.main import main
from jaxrl_lp.kernels.dispatch import unretired
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.plan.programs import PROGRAMS

PRESETS = ("qwen3-0.6b", "qwen3-4b", "ouro-1.4b")
POLICIES = ("bf16", "mxfp8", "nvfp4")
# CI lowers the dense preset in NVFP4 and the looped one in bf16 (the code
# paths: dense, looped, the MX kernels) at the presets' widths with 2 decoder layers (each
# layer traces the same program; full depth cost 70-100 s a cell on 2 cores; NVFP4 at 2
# layers 47 s and bf16 26 s on the 2-core Zen 3); the dense one in bf16 and MXFP8 at 2 layers
# and every cell at full depth run in the `slow` tier, and `jaxrl-lp bench lowering` covers
# all nine.
DEFAULT_CELLS = {("qwen3-0.6b", "nvfp4"), ("ouro-1.4b", "bf16")}
# 20-28 s cold; NVFP4's cell runs the same quantize kernels' code with its own scales.
SHALLOW_CELLS = {("qwen3-0.6b", "bf16"), ("qwen3-0.6b", "mxfp8")}
SHALLOW = 2
# NVFP4's cell (47-53 s) runs in CI's slow tier (`slow and ci`), off the default suite's
# 15 minutes; the looped bf16 one stays in the default suite.
CELLS = [pytest.param(preset, policy, SHALLOW, id=f"{preset}-{policy}-{SHALLOW}layers",
                      marks=[pytest.mark.slow, pytest.mark.ci] if policy == "nvfp4" else [])
         for preset, policy in sorted(DEFAULT_CELLS)]
CELLS += [pytest.param(preset, policy, SHALLOW, id=f"{preset}-{policy}-{SHALLOW}layers",
                       marks=pytest.mark.slow)
          for preset, policy in sorted(SHALLOW_CELLS)]
CELLS += [pytest.param(preset, policy, None, id=f"{preset}-{policy}",
                       marks=pytest.mark.slow)
          for preset in PRESETS for policy in POLICIES]


def _assert_cells(row: dict, platforms=("cuda", "tpu")):
    for prog, cell in row.items():
        assert "trace_error" not in cell, (prog, cell)
        for p in platforms:
            c = cell[p]
            assert c["lowers"], (prog, p, c.get("error"))
            assert not c["missing_families"], (prog, p, c)


@pytest.mark.parametrize(("preset", "policy", "layers"), CELLS)
def test_every_program_lowers_for_cuda_and_tpu_with_its_kernels(preset, policy, layers):
    out = report([preset], [Policy.parse(policy)], ("cuda", "tpu"), kernel_rows=False, layers=layers)
    want_layers = layers or get_preset(preset).num_layers
    assert out["layers"] == {preset: want_layers}
    row = out["programs"][preset][policy]
    assert set(row) == set(PROGRAMS)
    _assert_cells(row)
    # The kernels a program carries are the ones its policy asks for: no fused log-prob under
    # a quantized matmul format (the lm head's matmul stays on the plain path), the block
    # quantizer wherever a forward runs under MXFP8 / NVFP4. On cuda none: our GPU versions
    # are retired (`kernels.dispatch.RETIRED`), XLA's own run there.
    fams = {prog: {kernel_family(k) for k in cell["tpu"]["kernels"]} for prog, cell in row.items()}
    assert ("logprob" in fams["grpo_step_hybrid"]) == (policy == "bf16")
    assert "logprob" not in fams["sampler_decode"]  # it samples from the logits it has
    assert ("quantize" in fams["grpo_step_hybrid"]) == (policy in ("mxfp8", "nvfp4"))
    assert not any(cell["cuda"]["kernels"] for cell in row.values())
    assert out["summary"]["lowered"] == out["summary"]["cells"] == 2 * len(PROGRAMS)


def test_the_cpu_lowering_of_the_same_trace_carries_no_kernel():
    out = report(["qwen3-0.6b"], [Policy.parse("bf16")], ("cpu", "cuda", "tpu"),
                 ["grpo_step_hybrid", "sampler_decode", "replay"], kernel_rows=False,
                 layers=SHALLOW)
    for prog, cell in out["programs"]["qwen3-0.6b"]["bf16"].items():
        assert cell["cpu"]["lowers"] and not cell["cpu"]["expected_families"], prog
        assert cell["tpu"]["kernels"] and not cell["cuda"]["kernels"], prog  # cuda: retired


def test_the_kernels_alone_lower_under_kernels_on():
    """The rows of the issue's table: each kernel alone, `kernels=on` (no fallback): lowered
    for tpu, refused for cuda with the retirement (`kernels.dispatch.RETIRED`)."""
    out = report([], [], ("cuda", "tpu"))
    assert set(out["kernels"]) == set(KERNEL_CASES)
    for case, cells in out["kernels"].items():
        assert cells["tpu"]["lowers"], (case, cells["tpu"].get("error"))
        assert cells["tpu"]["kernels"] and not cells["tpu"]["missing_families"], case
        assert not cells["cuda"]["lowers"] and cells["cuda"]["retired"], (case, cells["cuda"])
    assert out["summary"]["with_expected_kernels"] == out["summary"]["cells"]


def test_the_retired_kernels_lower_for_cuda_inside_unretired_only():
    """Inside `kernels.dispatch.unretired` (what `jaxrl-lp bench kernels --kernels retired`
    compiles on a GPU) each kernel alone under `kernels=on` lowers for cuda with its Triton
    kernels again (Triton's verifier run on each); traced again outside, the same calls are
    refused: the kernels traced once per shape (`dispatch.once_per_shape`) are not served
    from a trace made inside."""
    with unretired():
        inside = report([], [], ("cuda",))
    outside = report([], [], ("cuda",))
    assert set(inside["kernels"]) == set(outside["kernels"]) == set(KERNEL_CASES)
    for case in KERNEL_CASES:
        cell = inside["kernels"][case]["cuda"]
        assert cell["lowers"] and cell["kernels"], (case, cell.get("error"))
        assert not outside["kernels"][case]["cuda"]["lowers"], case
        assert outside["kernels"][case]["cuda"]["retired"], case


def test_bench_lowering_prints_the_table(capsys, tmp_path):
    path = tmp_path / "lowering.json"
    assert main(["bench", "lowering", "--presets", "ouro-1.4b", "--policies", "bf16",
                 "--programs", "sampler_decode,exporter", "--out", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(path.read_text()) == out
    assert out["summary"]["cells"] == 2 * (2 + len(KERNEL_CASES))
    # Every cell but the kernels alone on cuda (retired: they refuse) lowers.
    assert out["summary"]["lowered"] == out["summary"]["cells"] - len(KERNEL_CASES)
    assert out["summary"]["with_expected_kernels"] == out["summary"]["cells"]
    table = out["table"].splitlines()
    assert table[0] == "| program | CUDA | TPU |"
    assert "| sampler_decode ouro-1.4b bf16 | lowers (no kernel) | lowers (decode_attention) |" \
        in out["table"]
    assert any(line.startswith("| kernel mxfp8_quantize (k=on) | retired |")
               and line.endswith("| lowers (quantize) |") for line in table)
    assert main(["bench", "lowering", "--presets", "ouro-1.4b", "--policies", "bf16",
                 "--programs", "exporter", "--no-kernel-rows", "--markdown"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == \
        "| exporter ouro-1.4b bf16 | lowers (no kernel) | lowers (no kernel) |"
    assert main(["bench", "lowering", "--programs", "nope"]) == 2
    assert "unknown program 'nope'" in capsys.readouterr().err


def test_expected_kernels_follow_the_model_and_the_policy():
    from jaxrl_lp.bench.lowering import expected_kernels

    ouro, qwen = get_preset("ouro-1.4b"), get_preset("qwen3-0.6b")
    assert expected_kernels("sft_step", qwen, Policy.parse("bf16")) == {"logprob"}
    assert expected_kernels("sft_step", ouro, Policy.parse("bf16")) == set()  # the expected read-out
    assert expected_kernels("replay", qwen, Policy.parse("nvfp4")) == {"decode_attention", "quantize"}
    assert expected_kernels("replay", qwen, Policy.parse("bf16,k=off")) == set()


@pytest.mark.parametrize(("preset", "policy"), [("qwen3-0.6b", "bf16"), ("ouro-1.4b", "bf16"),
                                               ("qwen3-0.6b", "bf16,k=off")])
def test_the_samplers_decode_loop_carries_the_attention_kernel(preset, policy):
    """The program `generate` compiles (prefill, then its `while_loop` of decode steps), not
    a decode step built apart (`plan.programs`): lowered for cuda and tpu at the presets'
    sizes (dense, and looped in its own exit rule) it calls the decode attention kernel when
    its policy picks it (on tpu: the GPU versions are retired), and never the
    log-prob kernel (it samples from the logits it has). The prefill's 64-token queries take
    the plain attention (`models.blocks`: the kernel is for one query per sequence), so the
    kernel is the loop's. Under `k=off` there is none: what the assertion fails on."""
    import jax
    import jax.numpy as jnp

    from jaxrl_lp.bench.lowering import kernel_family
    from jaxrl_lp.kernels.lowering import kernel_calls, lower_for
    from jaxrl_lp.models.model import init_params
    from jaxrl_lp.numerics.policy import Policy
    from jaxrl_lp.plan.programs import native
    from jaxrl_lp.rollout.generate import Forced, sampler_program
    from jaxrl_lp.rollout.sampling import SamplingConfig
    from jaxrl_lp.rollout.step import LoopSpec

    cfg = get_preset(preset)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
    rows, prompt = 8, 64
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    forced = Forced(ints(rows, 64), ints(rows, 64), jax.ShapeDtypeStruct((), jnp.bool_))
    traced = sampler_program.trace(
        params, ints(rows, prompt), ints(rows, prompt), ints(rows), jax.random.PRNGKey(0),
        ints(), forced,
        cfg=cfg, policy=native(Policy.parse(policy)), loop=LoopSpec().resolve(cfg),
        sampling=SamplingConfig(temperature=1.0), max_new_tokens=64, eos_id=cfg.eos_token_id,
        pad_id=cfg.pad_token_id)
    for platform in ("cuda", "tpu"):
        families = {kernel_family(k) for k in kernel_calls(lower_for(traced, platform),
                                                           platform)}
        # GPU versions are retired from compiled use (`kernels.dispatch.RETIRED`).
        want = {"decode_attention"} if policy == "bf16" and platform == "tpu" else set()
        assert families == want, (platform, families)
