"""`jaxrl-lp bench kernels`: the CLI end to end on tiny shapes, and the JSON it prints.

On CPU the kernels run interpreted (correctness only); the `max_rel_diff`
bounds are the kernel tests' own tolerances (quantization bit-equal), and the
log-prob's XLA read-out (`tiled_readout`, what a GPU program runs) within the
same bound. Where Pallas compiles (a TPU) a test runs the compiled kernels
(`k=on`) on the `small` shapes against their references with the same bounds
(fp32 policy); on a GPU `--kernels retired` compiles the retired versions
(`benchmarks/gpu.sh`, `SUITE=kernels`), and off a GPU it is one clear error.
"""

import json

import jax
import numpy as np
import pytest

from jaxrl_lp.bench.kernels import INTERPRET_NOTE, _logprob_cases
from jaxrl_lp.cli.main import main
from jaxrl_lp.kernels import kernel_backend
from jaxrl_lp.numerics.policy import Policy

IMPL_KEYS = {"compile_s", "memory"}
TIMED_KEYS = {"time_s", "runs", "launches_per_run"}
MEMORY_KEYS = {"argument", "output", "alias", "temp", "generated_code", "peak"}
# Largest kernel-vs-reference difference, relative to the reference's largest value.
REL_TOL = {"logprob": 1e-4, "decode_attention": 1e-5, "quantize": 0.0, "dequantize": 0.0}


def _bench(tmp_path, capsys, *argv) -> dict:
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", *argv, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    return printed


def _tol(case: str) -> float:
    return next(t for prefix, t in REL_TOL.items() if case.startswith(prefix))


def _check_case(case: str, res: dict, *, timed: bool) -> None:
    assert "error" not in res, res
    logprob = case.startswith("logprob")
    impls = ["plain", "reference", "tiled", "kernel"] if logprob else ["reference", "kernel"]
    for impl in impls:
        keys = IMPL_KEYS | (TIMED_KEYS if timed else set())
        assert keys <= set(res[impl]), (case, impl, res[impl])
        assert set(res[impl]["memory"]) == MEMORY_KEYS and res[impl]["memory"]["peak"] > 0
    if timed:
        assert res["kernel"]["time_s"] > 0 and res["kernel_speedup_vs_reference"] > 0
        assert res["kernel"]["max_rel_diff"] <= _tol(case), (case, res["kernel"])
        if logprob:  # XLA's read-out a GPU program runs: the figure a GPU kernel must beat
            assert res["kernel_speedup_vs_tiled"] > 0
            assert res["tiled"]["max_rel_diff"] <= _tol(case), (case, res["tiled"])
    else:
        assert "time_s" not in res["kernel"]


def test_tiny_shapes_timed(tmp_path, capsys):
    # Interpreted everywhere (the tiny vocabulary fits no compiled tile), f32 for the tolerances.
    where = [] if kernel_backend() is None else ["--kernels", "interpret", "--policy", "fp32"]
    out = _bench(tmp_path, capsys, "--shapes", "tiny", "--repeats", "1", "--min-time", "0",
                 "--cases", "logprob,quantize_nvfp4,decode", *where)
    assert out["target"] == "kernels"
    assert out["kernel_mode"] == INTERPRET_NOTE and "memory_note" in out
    assert out["policy"].endswith("k=interpret")
    tiny = out["tiny"]
    assert tiny["timed"] and set(tiny["shapes"]) == {"logprob", "quantize", "decode"}
    cases = {"logprob_fwd_bwd", "logprob_fwd", "quantize_nvfp4", "decode_attention"}
    assert set(tiny) - {"shapes", "timed"} == cases
    assert out["mosaic"].startswith("not run: compiled on a GPU only")
    for case in sorted(cases):
        _check_case(case, tiny[case], timed=True)
        assert f"tiny/{case}" in out["summary"]
    assert tiny["logprob_fwd_bwd"]["tiles"]["block_v"] > 0


def test_the_mosaic_readout_is_raced_where_its_operands_fit():
    """What `--kernels retired` races on a GPU, interpreted here at a shape that fits it:
    `tiled_readout` with the Mosaic GPU forward against XLA's, forward alone and with the
    gradients (bf16 operands, so the forward's products are bf16's, summed otherwise), and
    no Mosaic impl where the operands do not fit (f32 carried)."""
    native = Policy.parse("bf16,s=native")
    cases = _logprob_cases(64, 64, 256, native, "interpret", mosaic="mosaic-interpret")
    for case, (_, inputs, fns, extra) in cases.items():
        assert {"tiled", "mosaic"} <= set(fns) and "mosaic" not in extra, case
        arrays = inputs()
        want, got = fns["tiled"](*arrays), fns["mosaic"](*arrays)
        if case == "logprob_fwd":
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
        else:  # the backward is XLA's either way; the gradients bf16, from the residuals
            np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
            for a, b in zip(got[1], want[1], strict=True):
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                           atol=2e-3, rtol=1e-2)
    carried = _logprob_cases(64, 64, 256, Policy.parse("bf16"), "interpret", mosaic="mosaic")
    assert all("mosaic" not in fns and extra["mosaic"].startswith("not run: its operands")
               for _, _, fns, extra in carried.values())


def test_full_shapes_memory_only_on_cpu(tmp_path, capsys):
    """Interpreted, the production shapes are compiled for their memory, not run, and say so."""
    if kernel_backend() is not None:
        pytest.skip("a Pallas backend times the full shapes")
    out = _bench(tmp_path, capsys, "--shapes", "full", "--cases", "dequantize_mxfp8")
    assert out["full_shapes"].startswith("memory analysis only, not run")
    assert not out["full"]["timed"]
    _check_case("dequantize_mxfp8", out["full"]["dequantize_mxfp8"], timed=False)
    assert out["full"]["dequantize_mxfp8"]["kernel"]["memory"]["output"] == 1024 * 3072 * 4


def test_bad_shape_set_is_one_clear_error(capsys):
    assert main(["bench", "kernels", "--shapes", "huge"]) == 2
    assert "--shapes: unknown ['huge']" in capsys.readouterr().err


@pytest.mark.skipif(kernel_backend() is None, reason="needs a backend that compiles Pallas")
def test_compiled_kernels_match_their_references(tmp_path, capsys):
    out = _bench(tmp_path, capsys, "--shapes", "small", "--kernels", "on", "--policy", "fp32",
                 "--repeats", "1", "--min-time", "0", "--inner", "1")
    assert out["kernel_mode"] == "compiled (k=on)"
    for case, res in out["small"].items():
        if case not in ("shapes", "timed"):
            _check_case(case, res, timed=True)


@pytest.mark.skipif(kernel_backend() is not None, reason="a Pallas backend compiles kernels")
def test_kernels_on_without_a_pallas_backend_is_one_clear_error(capsys):
    assert main(["bench", "kernels", "--shapes", "tiny", "--kernels", "on"]) == 2
    assert "--kernels on: the cpu backend cannot compile Pallas kernels" in capsys.readouterr().err


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU compiles the retired kernels")
def test_retired_kernels_off_a_gpu_is_one_clear_error(capsys):
    assert main(["bench", "kernels", "--shapes", "tiny", "--kernels", "retired"]) == 2
    err = capsys.readouterr().err
    assert "--kernels retired compiles our retired GPU versions, on a GPU host" in err, err
    assert "--kernels interpret" in err
