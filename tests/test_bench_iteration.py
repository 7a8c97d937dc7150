"""`jaxrl-lp bench iteration` end to end on the tiny preset (timing figures are not asserted).

The roofline (`bench.roofline`): the machine's rates are measured in the same run, and each
entry's bounds follow from them and from the compiled programs' FLOPs; with a Tunix entry
(Tunix is not installed here: a recorded one stands in) its fractions and the best ratio the
bounds allow follow from the same bounds.
"""

import json

import jax
import numpy as np
import pytest

from jaxrl_lp.cli.main import main
from jaxrl_lp.rollout.step import cpu_layout


@pytest.mark.slow
def test_bench_iteration_reports_phases_and_which_updates_replayed(capsys):
    assert main(["bench", "iteration", "--size", "tiny", "--looped-size", "", "--batch", "4",
                 "--group", "2", "--prompt-len", "4", "--new-tokens", "4",
                 "--minibatches", "1,2", "--methods", "hybrid,traced,products,invariant",
                 "--repeats", "1",
                 "--no-tunix"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["target"] == "iteration" and res["tunix"] == {"available": False,
                                                             "reason": "--no-tunix"}
    tiny = res["tiny-qwen3"]
    assert tiny["tokens_per_iteration"] == 4 * 4
    one, two = tiny["hybrid_mb1"], tiny["hybrid_mb2"]
    # At mu = 1 and one minibatch nothing is replayed: the behaviour log-probs and the
    # hybrid's value are the rollout's. With two minibatches exactly the second replays.
    assert one["decode_layout"] == two["decode_layout"] == cpu_layout()  # CPU weights
    assert (one["replayed_updates"], one["behaviour_recomputed"]) == (0, 0)
    assert (two["replayed_updates"], two["behaviour_recomputed"]) == (1, 0)
    # `products`: the update on the sampler's weights reads its products (the first), the
    # replaying one computes its forward; its first program has fewer FLOPs than hybrid's.
    p1, p2 = tiny["products_mb1"], tiny["products_mb2"]
    assert [(r["reused_forward_updates"], r["replayed_updates"]) for r in (p1, p2)] == [
        (1, 0), (1, 1)]
    assert one["reused_forward_updates"] == two["reused_forward_updates"] == 0
    # `traced`: the second update takes the traced replay's value (the mechanism off); its
    # programs are counted as hybrid's.
    traced = tiny["traced_mb2"]
    assert traced["replayed_updates"] == 1 and traced["compiled_flops"] == two["compiled_flops"]
    assert p1["compiled_flops"]["updates"][0] < one["compiled_flops"]["updates"][0]
    # `invariant`: sampled in the invariant layout, no update replays, each one forward.
    inv = tiny["invariant_mb2"]
    assert inv["decode_layout"] == "invariant" and inv["replayed_updates"] == 0
    assert inv["behaviour_recomputed"] == 0
    assert inv["compiled_flops"]["updates"][1] < two["compiled_flops"]["updates"][1]
    assert p2["compiled_flops"]["updates"][1] == two["compiled_flops"]["updates"][1]
    for r in (one, two):
        assert r["page_faults"] >= 0 and r["kernel_cpu_s"] >= 0 and r["user_cpu_s"] > 0
        phases = sum(r[p] for p in ("sample", "score", "behaviour", "update"))
        assert phases == pytest.approx(r["iteration_s"], rel=1e-3, abs=1e-3)
        assert r["tokens_per_s"] > 0 and r["verify_replay_s"] > 0
        assert "vs_tunix" not in r and "max_ratio_vs_tunix_at_bound" not in r
    assert res["targets_met"] == {}
    # The machine's rates, measured before and after the race; the bounds take the better.
    m = res["machine"]
    for when in ("before_race", "after_race"):
        ws = m[when]["weight_stream"]
        assert ws["batch"] == 4 and set(ws["forms"]) == {"dot_in_out", "weights_major_out_in",
                                                         "reduce_out_in"}
        assert ws["gb_per_s"] == max(f["gb_per_s"] for f in ws["forms"].values()) > 0
        assert m[when]["matmul"]["rows"] == 4 * (4 + 4) and m[when]["matmul"]["gflop_per_s"] > 0
    assert m["weight_stream_gb_per_s"] == max(m[w]["weight_stream"]["gb_per_s"]
                                              for w in ("before_race", "after_race"))
    # The sample bound: every sampled token one pass over the weights a decode step reads
    # (tiny-qwen3: 2 layers and the head, f32; its embedding is gathered, not streamed).
    from jaxrl_lp.bench.sampler import weight_bytes
    from jaxrl_lp.models import get_preset, init_params

    cfg = get_preset("tiny-qwen3")
    nbytes = weight_bytes(cfg, init_params(cfg, jax.random.PRNGKey(0)))
    for r in (one, two):
        assert r["bounds"]["sample_s"] == pytest.approx(
            4 * nbytes / (m["weight_stream_gb_per_s"] * 1e9), rel=1e-3)
        flops = r["compiled_flops"]["updates"]
        assert len(flops) == len(r["compiled_flops"]["xla_cost_analysis_updates"])
        # Loop-aware: XLA counts a loop body once, the walk by its trip count.
        assert all(f >= x > 0 for f, x in zip(flops, r["compiled_flops"][
            "xla_cost_analysis_updates"], strict=True))
        for phase in ("sample", "update"):
            assert r["fraction_of_bound"][phase] == pytest.approx(
                r["bounds"][f"{phase}_s"] / r[phase], rel=2e-3)
    # The second minibatch replays: its program holds the replay's decode loop too.
    assert two["compiled_flops"]["updates"][1] > two["compiled_flops"]["updates"][0]
    assert two["compiled_flops"]["updates"][0] < one["compiled_flops"]["updates"][0]  # 2 rows
    rate = m["matmul_gflop_per_s"] * 1e9
    stream = 4 * nbytes / (m["weight_stream_gb_per_s"] * 1e9)
    assert one["bounds"]["update_s"] == pytest.approx(
        one["compiled_flops"]["updates"][0] / rate, rel=1e-3)
    assert two["bounds"]["update_s"] == pytest.approx(
        two["compiled_flops"]["updates"][0] / rate
        + max(two["compiled_flops"]["updates"][1] / rate, stream), rel=1e-3)


class _Recorded:
    """An iteration object with fixed compiled FLOPs (what `bench.roofline.add_bounds` reads of one)."""

    def __init__(self, params, minibatches, updates, replays, method="hybrid"):
        self.params, self.minibatches, self.method = params, minibatches, method
        self._flops = {"updates": updates, "replays": replays, "behaviour": 0.0,
                       "xla_updates": updates}

    def compiled_flops(self):
        return self._flops


def test_bounds_put_tunix_and_ours_against_the_same_work():
    """A Tunix entry gets the bounds of our first update's work, k times; the best ratio the
    bounds allow is Tunix's measured iteration over our bound iteration."""
    from jaxrl_lp.bench.roofline import add_bounds
    from jaxrl_lp.bench.sampler import weight_bytes
    from jaxrl_lp.models import get_preset, init_params

    cfg = get_preset("tiny-qwen3")
    params = init_params(cfg, jax.random.PRNGKey(0))
    nbytes = weight_bytes(cfg, params)
    machine = {"weight_stream_gb_per_s": 10.0, "matmul_gflop_per_s": 100.0}
    # A `products` entry's first update (no forward) is not the work Tunix's stands for.
    ours = {"products_mb2": _Recorded(params, 2, [3e9, 6e9], [False, True], "products"),
            "hybrid_mb2": _Recorded(params, 2, [4e9, 6e9], [False, True])}
    res = {"params": 1, "hybrid_mb2": {"iteration_s": 2.0, "sample": 1.0, "update": 0.9,
                                       "behaviour": 0.0, "score": 0.1},
           "products_mb2": {"iteration_s": 1.8, "sample": 1.0, "update": 0.7,
                            "behaviour": 0.0, "score": 0.1},
           "tunix_mb2": {"iteration_s": 3.0, "sample": 1.5, "update": 1.4, "score": 0.1}}
    add_bounds(res, ours, cfg, 50, [2], machine)
    sample = 50 * nbytes / 10e9
    b = res["hybrid_mb2"]["bounds"]
    assert b["sample_s"] == pytest.approx(sample, rel=1e-3)
    # The replaying update: its FLOPs (0.06 s) or its decode loop's stream, the larger.
    assert b["update_s"] == pytest.approx(0.04 + max(0.06, sample), rel=1e-3)
    t = res["tunix_mb2"]["bounds"]
    assert t["sample_s"] == b["sample_s"] and t["update_s"] == pytest.approx(0.08, rel=1e-3)
    assert res["tunix_mb2"]["fraction_of_bound"]["update"] == pytest.approx(0.08 / 1.4, rel=2e-3)
    assert res["hybrid_mb2"]["max_ratio_vs_tunix_at_bound"] == pytest.approx(
        3.0 / b["iteration_s"], rel=2e-3)
    assert np.isclose(res["hybrid_mb2"]["fraction_of_bound"]["iteration"],
                      b["iteration_s"] / 2.0, rtol=2e-3)


def test_bench_iteration_refuses_bad_arguments(capsys):
    assert main(["bench", "iteration", "--size", "tiny", "--minibatches", "3", "--no-tunix"]) == 2
    assert "--minibatches" in capsys.readouterr().err
    assert main(["bench", "iteration", "--size", "tiny", "--decode-layouts", "columns",
                 "--no-tunix"]) == 2
    assert "--decode-layouts" in capsys.readouterr().err
    assert main(["bench", "iteration", "--size", "tiny", "--methods", "sparse",
                 "--no-tunix"]) == 2
    assert "--methods" in capsys.readouterr().err
    assert main(["bench", "iteration", "--size", "tiny", "--methods", "dense",
                 "--invariant-tiles", "compiled", "--no-tunix"]) == 2
    assert "add invariant to --methods" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ci
def test_bench_iteration_takes_model_presets_by_name(capsys):
    """`--size` and `--looped-size` take model presets by name (`benchmarks/gpu.sh` races
    qwen3-0.6b and ouro-1.4b)."""
    assert main(["bench", "iteration", "--size", "tiny-qwen3", "--looped-size", "tiny-ouro",
                 "--batch", "2", "--group", "2", "--prompt-len", "4", "--new-tokens", "2",
                 "--minibatches", "1", "--methods", "hybrid", "--repeats", "1", "--no-tunix",
                 "--no-roofline"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tiny-qwen3"]["hybrid_mb1"]["tokens_per_s"] > 0
    assert res["tiny-ouro"]["hybrid_mb1"]["tokens_per_s"] > 0


def test_bench_iteration_refuses_a_preset_of_the_other_kind(capsys):
    assert main(["bench", "iteration", "--size", "tiny-ouro", "--no-tunix"]) == 2
    assert "pass it to --looped-size" in capsys.readouterr().err
    assert main(["bench", "iteration", "--looped-size", "tiny-qwen3", "--no-tunix"]) == 2
    assert "pass it to --size" in capsys.readouterr().err
    assert main(["bench", "iteration", "--size", "qwen9", "--no-tunix"]) == 2
    assert "unknown model preset 'qwen9'" in capsys.readouterr().err
