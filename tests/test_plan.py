"""`jaxrl-lp plan`: compiled per-device figures, the loop-aware cost walk, configs, bad input.

The default suite plans the small default config on the session's 8 simulated
CPU devices (tests/conftest.py) and checks the figures against what the shapes
and shardings say; the full-size configs on 8 and 64 devices are `slow`.
"""

import contextlib
import io
import json
import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_lp.cli.main import main
from jaxrl_lp.models.config import get_preset
from jaxrl_lp.plan import check_request, hlo_cost, simulated_env, use_simulated_devices
from jaxrl_lp.plan.targets import TARGETS
from jaxrl_lp.train import apply_overrides, load_config

ROOT = Path(__file__).resolve().parents[1]
# On 64 devices a micro-batch (and Ouro's prompts) must hold one sequence per data shard.
AT_64 = {"configs/grpo_gsm8k_ouro_1p4b.py": ["grpo.micro_batches=8"],
         "configs/grpo_gsm8k_qwen3_0p6b.py": ["grpo.micro_batches=8"],
         "configs/grpo_gsm8k_qwen3_4b.py": ["grpo.micro_batches=8"]}
FULL = {"configs/grpo_gsm8k_ouro_1p4b.py": "ouro-1.4b",
        "configs/grpo_gsm8k_qwen3_0p6b.py": "qwen3-0.6b",
        "configs/grpo_gsm8k_qwen3_4b.py": "qwen3-4b"}


@pytest.fixture(scope="module")
def tiny_plan() -> dict:
    """The default config planned through the CLI on the session's 8 devices (in-process)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--mesh", "data=2,fsdp=2,tensor=2", "--devices", "8",
                     "--target", "h100", "--set", "grpo.micro_batches=2"]) == 0
    return json.loads(out.getvalue())


def test_tiny_plan_memory_follows_shapes_and_shardings(tiny_plan):
    per = tiny_plan["per_device_bytes"]
    params = per["params"]
    # The default model's f32 weights split 4 ways (fsdp x tensor); the norms and the
    # exit gate only 2 (fsdp).
    total = tiny_plan["model"]["params"] * 4
    assert total / 4 <= params <= total / 4 * 1.01
    assert per["optimizer_state"] == pytest.approx(2 * params, abs=64)  # Adam's two moments
    shp = tiny_plan["shapes"]
    assert shp["rows"] == 256 and shp["micro_rows"] == 128
    step = tiny_plan["grpo_step"]["memory"]
    assert step["argument"] >= params + per["optimizer_state"] + per["rollout"]
    assert step["alias"] > 0  # params and optimizer state are donated
    assert step["peak"] == step["argument"] + step["output"] - step["alias"] + step["temp"] \
        + step["generated_code"]
    assert tiny_plan["decode_step"]["memory"]["argument"] >= per["kv_cache"]


def test_tiny_plan_kv_cache_is_split_by_batch_and_kv_heads(tiny_plan):
    from jaxrl_lp.train import default_config
    from jaxrl_lp.train.validate import build_task, model_config

    cfg = default_config()
    m = model_config(cfg, build_task(cfg))
    shp = tiny_plan["shapes"]
    slots = shp["prompt_len"] + shp["max_new"]
    kv = 2 * m.loop_steps * m.num_layers * shp["decode_batch"] * m.num_kv_heads * slots \
        * m.head_dim * 4  # f32 (the default policy), k and v
    pos = shp["decode_batch"] * slots * 4
    # Rows over data x fsdp (4 shards), KV heads over tensor (2).
    assert tiny_plan["per_device_bytes"]["kv_cache"] == kv // 8 + pos // 4


def test_tiny_plan_roofline_and_summary(tiny_plan):
    tgt = TARGETS["h100"]
    for name in ("grpo_step", "grpo_step_recorded", "behaviour_logprobs", "decode_step"):
        prog = tiny_plan[name]
        walk, xla, roof = prog["loop_aware"], prog["xla_cost_analysis"], prog["roofline"]
        assert walk["unknown_trip_loops"] == 0
        assert walk["flops"] >= xla["flops"] * 0.9 > 0  # loops counted at least once
        assert roof["compute_s"] == pytest.approx(walk["flops"] / tgt.peak_flops, rel=1e-9)
        assert roof["memory_s"] == pytest.approx(walk["bytes"] / tgt.hbm_bandwidth, rel=1e-9)
        assert roof["time_s"] == max(roof["compute_s"], roof["memory_s"])
    s = tiny_plan["summary"]
    assert s["fits"] is True
    assert s["decode_tokens_per_s"] == pytest.approx(
        tiny_plan["shapes"]["decode_batch"] / tiny_plan["decode_step"]["roofline"]["time_s"])
    assert tiny_plan["mesh"] == "data=2,fsdp=2,tensor=2" and tiny_plan["devices"] == 8


def test_tiny_plan_offpolicy_estimate(tiny_plan):
    """Per split of the 8 devices: the sampler's k replicas decode decode_batch / k rows each,
    reading the whole model per step; the learner's programs scale by 8 / (8 - k); overlapped
    is the longer of the two, synchronous on the split their sum."""
    tgt = TARGETS["h100"]
    off, s = tiny_plan["summary"]["offpolicy"], tiny_plan["summary"]
    assert off["synchronous_s"] == s["iteration_s"]
    splits = {x["sampler_devices"]: x for x in off["splits"]}
    assert sorted(splits) == [k for k in range(1, 8) if tiny_plan["shapes"]["decode_batch"] % k == 0]
    # A stale rollout (the default config: mu = 1, one minibatch): the behaviour log-probs
    # every step, plus the replay at the rollout's own weights on the verification steps,
    # handed to the one update as its value (the recorded program).
    assert off["stale_updates"] == pytest.approx(
        {"recorded": 1, "replaying": 0, "dense": 0, "behaviour": 1.1})
    behaviour = tiny_plan["behaviour_logprobs"]["roofline"]["time_s"]
    recorded = tiny_plan["grpo_step_recorded"]["roofline"]["time_s"]
    stale, sync = 1.1 * behaviour + recorded, 0.1 * behaviour + recorded
    for k, x in splits.items():
        assert x["learner_devices"] == 8 - k
        assert x["learn_s"] == pytest.approx(stale * 8 / (8 - k), rel=1e-9)
        assert x["overlapped_s"] == max(x["sample_s"], x["learn_s"])
        assert x["synchronous_split_s"] == pytest.approx(x["sample_s"] + sync * 8 / (8 - k))
    # Fewer replicas hold more rows each: never a shorter sampling phase.
    assert splits[1]["sample_s"] >= splits[2]["sample_s"] >= splits[4]["sample_s"]
    # A replica holds the whole model: the per-device params times the fsdp x tensor split.
    assert splits[4]["sampler_replica_bytes"] >= tiny_plan["per_device_bytes"]["params"] * 4
    assert off["best"] == min((x for x in off["splits"] if x["fits"]),
                              key=lambda x: x["overlapped_s"])
    assert off["speedup"] == pytest.approx(s["iteration_s"] / off["best"]["overlapped_s"])
    assert splits[4]["fits"] == (splits[4]["sampler_replica_bytes"] <= tgt.hbm_bytes)


def test_tiny_plan_prices_the_updates_the_program_runs(tiny_plan):
    """The default config (hybrid, `grpo.replay=auto`, mu = 1, one minibatch, no exporter):
    its one update takes the rollout's log-probs (`grpo_step_recorded`, no replay in it), the
    behaviour log-probs run only on the verification steps (1 in `grpo.verify_every` = 10),
    and the iteration is priced so; the replaying step is reported beside it."""
    s = tiny_plan["summary"]
    rec, rep = tiny_plan["grpo_step_recorded"], tiny_plan["grpo_step"]
    assert s["updates"] == {"recorded": 1} and s["behaviour_passes"] == pytest.approx(0.1)
    # The recorded step is the replaying one without the replay's decode loop.
    assert rec["loop_aware"]["flops"] < rep["loop_aware"]["flops"]
    assert rec["roofline"]["time_s"] < rep["roofline"]["time_s"]
    assert s["update_s"] == {"recorded": rec["roofline"]["time_s"]}
    shp = tiny_plan["shapes"]
    assert s["iteration_s"] == pytest.approx(
        shp["max_new"] * tiny_plan["decode_step"]["roofline"]["time_s"]
        + 0.1 * tiny_plan["behaviour_logprobs"]["roofline"]["time_s"]
        + rec["roofline"]["time_s"], rel=1e-9)
    assert s["learner_tokens_per_s"] == pytest.approx(
        shp["rows"] * (shp["prompt_len"] + shp["max_new"]) / rec["roofline"]["time_s"])
    # The peak of the programs it runs: the replaying step does not run here.
    per = tiny_plan["per_device_bytes"]
    assert s["learner_peak_bytes"] == max(
        rec["memory"]["peak"],
        per["optimizer_state"] + tiny_plan["behaviour_logprobs"]["memory"]["peak"])


@pytest.mark.parametrize("sets,counts", [
    ([], {"recorded": 1, "replaying": 0, "dense": 0, "behaviour": 0.1}),
    (["grpo.mu=2", "grpo.minibatches=4"],
     {"recorded": 1, "replaying": 7, "dense": 0, "behaviour": 0.1}),
    (["grpo.minibatches=2", "grpo.replay=always"],
     {"recorded": 0, "replaying": 2, "dense": 0, "behaviour": 1.0}),
    (["grpo.minibatches=2", "grpo.logprobs=dense"],
     {"recorded": 0, "replaying": 0, "dense": 2, "behaviour": 1.0}),
    (["grpo.minibatches=2", "grpo.verify_every=0"],
     {"recorded": 1, "replaying": 1, "dense": 0, "behaviour": 0.0}),
    (["grpo.learner_policy=bf16"], {"recorded": 0, "replaying": 1, "dense": 0, "behaviour": 1.0}),
    # The served copy's loss: the copy does not move within a step, no update replays; the
    # sync diagnostics take the master's log-probs every step.
    (["grpo.minibatches=2", "sync.exporter=bf16:error_feedback", "sync.loss_on_served=true"],
     {"recorded": 2, "replaying": 0, "dense": 0, "behaviour": 1.1}),
    # An exporter without it: the master the loss reads is not what the sampler ran.
    (["sync.exporter=bf16:error_feedback"],
     {"recorded": 0, "replaying": 1, "dense": 0, "behaviour": 1.0}),
])
def test_iteration_updates_follow_the_replay_rule(sets, counts):
    """`plan.iteration_updates` decides as `train.grpo_iteration` does (tests/test_replay_reuse.py
    checks it against the runs' `replayed_updates`)."""
    from jaxrl_lp.plan import iteration_updates
    from jaxrl_lp.train import default_config

    assert iteration_updates(apply_overrides(default_config(), sets)) == pytest.approx(counts)


@pytest.mark.parametrize("sets,counts", [
    ([], {"recorded": 1, "replaying": 0, "dense": 0, "behaviour": 1.1}),
    (["grpo.mu=2", "grpo.minibatches=4"],
     {"recorded": 1, "replaying": 7, "dense": 0, "behaviour": 1.1}),
    (["grpo.minibatches=2", "grpo.replay=always", "grpo.verify_every=0"],
     {"recorded": 0, "replaying": 2, "dense": 0, "behaviour": 1.0}),
    (["grpo.minibatches=2", "grpo.logprobs=dense"],
     {"recorded": 0, "replaying": 0, "dense": 2, "behaviour": 1.1}),
    (["grpo.minibatches=2", "sync.exporter=bf16:error_feedback", "sync.loss_on_served=true"],
     {"recorded": 2, "replaying": 0, "dense": 0, "behaviour": 2.1}),
    (["sync.exporter=bf16:error_feedback"],
     {"recorded": 1, "replaying": 0, "dense": 0, "behaviour": 2.1}),
])
def test_stale_iteration_updates(sets, counts):
    """A rollout sampled on an earlier export (`grpo.max_staleness`): no update is on the
    sampler's weights; the behaviour log-probs run every step and are the first update's
    value under `grpo.replay=auto` (tests/test_offpolicy.py checks the runs' counts)."""
    from jaxrl_lp.plan import iteration_updates
    from jaxrl_lp.train import default_config

    cfg = apply_overrides(default_config(), sets)
    assert iteration_updates(cfg, stale=True) == pytest.approx(counts)


def test_hlo_cost_counts_loop_bodies_by_trip_count():
    mesh = jax.make_mesh((8,), ("d",))

    def scanned(x, w):
        return jax.lax.scan(lambda c, wl: (jnp.tanh(c @ wl), None), x, w)[0]

    def unrolled(x, w):
        for i in range(w.shape[0]):
            x = jnp.tanh(x @ w[i])
        return x

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    w = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32, sharding=NamedSharding(mesh, P()))
    per_device = 2 * 64 * 256 * 256 * 4 / 8
    costs = {}
    for name, fn in (("scan", scanned), ("unrolled", unrolled)):
        compiled = jax.jit(fn).lower(x, w).compile()
        costs[name] = hlo_cost(compiled.as_text())
        assert costs[name].flops == per_device
    # Without loops it is XLA's own count; with one, XLA counts the body once.
    compiled = jax.jit(unrolled).lower(x, w).compile()
    assert costs["unrolled"].bytes == pytest.approx(compiled.cost_analysis()["bytes accessed"],
                                                    rel=1e-6)
    # A scan reads one layer of the stacked weights per iteration, not all of them.
    assert costs["scan"].bytes == pytest.approx(costs["unrolled"].bytes, rel=0.02)


@pytest.mark.parametrize("path,preset", sorted(FULL.items()))
def test_full_size_configs_load_and_take_their_policy_lines(path, preset):
    cfg = load_config(str(ROOT / path))
    assert cfg.model == get_preset(preset)
    assert cfg.task.kind == "gsm8k" and cfg.task.path and cfg.init_from
    assert cfg.grpo.learner_policy == cfg.grpo.sampler_policy == "bf16"
    assert cfg.grpo.max_new_tokens == 512 and cfg.run.mesh == "fsdp=8"
    assert cfg.grpo.prompts_per_step * cfg.grpo.group_size >= 256
    text = (ROOT / path).read_text()
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip().startswith("--set grpo.learner_policy=")]
    assert len(lines) == 2
    for line in lines:
        sets = re.findall(r"--set (\S+)", line)
        fmt = sets[0].split("=")[1]
        assert fmt in ("mxfp8", "nvfp4")
        c = apply_overrides(cfg, sets)
        assert c.grpo.learner_policy == c.grpo.sampler_policy == fmt
    # Planned without the data or the checkpoint, on 8 and on 64 devices.
    check_request(cfg, "fsdp=8", 8, "h100")
    check_request(apply_overrides(cfg, AT_64[path]), "data=8,fsdp=8", 64, "tpu-v5p")
    # The docstring's 64-device command says the same.
    assert all(f"--set {item}" in text for item in AT_64[path])


@pytest.mark.parametrize("argv,expected", [
    (["--mesh", "fsdp=4", "--devices", "8"], "--mesh fsdp=4 has 4 devices but --devices is 8"),
    (["--mesh", "tensor=32", "--devices", "32"], "model.num_heads=16 does not divide"),
    (["--mesh", "pipeline=8", "--devices", "8"], "'pipeline=8' is not AXIS=SIZE"),
    (["--mesh", "fsdp=8", "--devices", "8", "--target", "a100"], "unknown target 'a100'"),
    (["--mesh", "fsdp=64", "--devices", "64", "--set", "grpo.prompts_per_step=64"],
     "grpo.micro_batches=32: a micro-batch of 16 sequences does not split over the mesh"),
    (["--mesh", "fsdp=64", "--devices", "64", "--set", "grpo.prompts_per_step=32"],
     "grpo.prompts_per_step=32 does not split"),
])
def test_bad_input_is_one_line(capsys, argv, expected):
    config = str(ROOT / "configs/grpo_gsm8k_ouro_1p4b.py")
    assert main(["plan", "--config", config, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and err.startswith("jaxrl-lp plan: error: ") and expected in err


def test_simulated_devices_in_and_out_of_process():
    env = simulated_env(64, {"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"})
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=64"
    assert env["JAX_PLATFORMS"] == "cpu"
    # jax has started in this session with 8 devices: 8 are there, 64 need a child process.
    assert use_simulated_devices(8) is True
    assert use_simulated_devices(64) is False
    assert math.prod(np.shape(jax.devices())) == 8


# The slow tier plans the cell that holds the promise, Ouro-1.4B under fsdp=8 within one
# 80 GB H100 (70 s on 2 shared cores); the other five (62-78 s each) run with `-m slow`.
CI_PLAN = ("configs/grpo_gsm8k_ouro_1p4b.py", "fsdp=8")


@pytest.mark.parametrize("path,mesh,devices", [
    pytest.param(path, mesh, devices, marks=pytest.mark.slow
                 if (path, mesh) == CI_PLAN else pytest.mark.slow)
    for path in sorted(FULL) for mesh, devices in (("fsdp=8", 8), ("data=8,fsdp=8", 64))])
def test_full_size_plans(capfd, path, mesh, devices):
    """Every full-size config plans on 8 and 64 devices; Ouro-1.4B under fsdp=8 fits 80 GB.

    On 8 devices the plan runs in this process (the session's 8 CPU devices);
    64 are more than it has, so the CLI runs itself again in a child process
    with them (`plan.devices.rerun`), whose output reaches the same stdout.
    """
    argv = ["plan", "--config", str(ROOT / path), "--mesh", mesh, "--devices", str(devices),
            "--target", "h100"]
    if devices == 64:
        argv += [a for item in AT_64[path] for a in ("--set", item)]
    assert main(argv) == 0
    out = json.loads(capfd.readouterr().out)
    assert out["devices"] == devices and out["summary"]["decode_tokens_per_s"] > 0
    assert out["grpo_step"]["loop_aware"]["unknown_trip_loops"] == 0
    if FULL[path] == "ouro-1.4b" and mesh == "fsdp=8":
        assert out["summary"]["fits"] is True
        assert out["summary"]["learner_peak_bytes"] < 80e9


@pytest.mark.slow
# 27 s, and 26 s for `tiny_plan` where no default test shares it (2 shared cores)
def test_tiny_lora_plan_trains_the_adapters_only(tiny_plan):
    """LoRA rank 4 (bf16 base) on the same mesh: the adapters are what the optimizer holds,
    split over fsdp like the weights; the base is half the f32 master's bytes."""
    from jaxrl_lp.lora import adapter_shapes
    from jaxrl_lp.train import default_config
    from jaxrl_lp.train.validate import build_task, model_config

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--mesh", "data=2,fsdp=2,tensor=2", "--devices", "8",
                     "--target", "h100", "--set", "grpo.micro_batches=2", "--set", "lora.rank=4",
                     "--set", "lora.base_format=bf16"]) == 0
    lora_plan = json.loads(out.getvalue())
    lo, full = lora_plan["lora"], tiny_plan["per_device_bytes"]
    cfg = default_config()
    m = model_config(cfg, build_task(cfg))
    trained = sum(math.prod(s) for s in jax.tree.leaves(
        adapter_shapes(m, apply_overrides(cfg, ["lora.rank=4"]).lora),
        is_leaf=lambda x: isinstance(x, tuple)))
    assert lo["trained_params"] == trained and lo["full_trained_params"] == m.param_count()
    assert lo["full_fine_tuning_per_device_bytes"] == {
        "params": full["params"], "optimizer_state": full["optimizer_state"]}
    # Adam's two f32 moments of the adapters, each split at least over fsdp (2 ways).
    opt = lora_plan["per_device_bytes"]["optimizer_state"]
    assert opt <= 2 * 4 * trained / 2 + 64 and lo["optimizer_state_vs_full"] < 0.2
    assert lora_plan["grpo_step"]["memory"]["argument"] < tiny_plan["grpo_step"]["memory"]["argument"]
