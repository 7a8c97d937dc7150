"""Our Mosaic GPU kernels compiled for a Hopper GPU on a host without one: what ptxas says of
each (registers, spills), at the shapes the models run them.

`plan.cuda_aot`'s deviceless compile runs a Mosaic GPU kernel's compile to the end (its PTX
to a cubin by ptxas for `sm_90a`), so a kernel that lowers but would not compile, or that
spills registers, shows here before a GPU session spends its minutes on it. Cells (`CELLS`):

- `fixed_tile_<K>x<N>`: `kernels.fixed_tile`'s product at Qwen3-0.6B's projection widths, a
  decode's 32 rows, bf16;
- `fixed_tile_scores`: its batched product at the attention's scores shape (32 sequences x 8
  kv heads, 16 query rows of width 128 against 512 cache slots);
- `logprob_fwd_<preset>`: the fused log-prob's forward (`kernels.logprob_mgpu`, through
  `tiled_readout(forward="mosaic")`) at the preset's read-out, 4,096 rows, bf16;
- `decode_step_fixed_tiles_qwen3-0.6b`, `learner_forward_fixed_tiles_qwen3-0.6b`: whole
  programs in the invariant forms' fixed tiles at Qwen3-0.6B's widths (2 layers, 32 rows;
  the learner's of 32 + 32 tokens), XLA's part and every Mosaic kernel compiled.

Each cell: ptxas's report of every Mosaic kernel in the program (`cuda_aot.mosaic_kernels`)
and the compile's seconds. Nothing runs on a GPU: whether the kernels are correct and fast
there is `SUITE=kernels` / `SUITE=invariant` of `benchmarks/gpu.sh`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

__all__ = ["CELLS", "build", "fixed_tiles_programs", "run"]

# cell -> spec (`build`'s)
CELLS: dict[str, dict] = {
    **{f"fixed_tile_{k}x{n}": {"kind": "fixed_tile", "x": [32, k], "w": [k, n]}
       for k, n in ((1024, 2048), (1024, 3072), (3072, 1024), (2048, 1024))},
    "fixed_tile_scores": {"kind": "fixed_tile", "x": [32, 8, 16, 128], "w": [32, 8, 128, 512]},
    **{f"logprob_fwd_{preset}": {"kind": "logprob_fwd", "t": 4096, "d": d, "v": v,
                                  "policy": "bf16,s=native"}  # by name: parsed in the child
       for preset, d, v in (("qwen3-0.6b", 1024, 151936), ("ouro-1.4b", 2048, 49152))},
    # The invariant forms in fixed tiles (`InvariantForm(tiles="compiled")`), whole programs at
    # Qwen3-0.6B's widths (2 of its layers): what `SUITE=invariant`'s model cell runs.
    **{f"{kind}_fixed_tiles_qwen3-0.6b": {"kind": kind, "preset": "qwen3-0.6b", "layers": 2,
                                          "rows": 32, "policy": "bf16,s=native"}
       for kind in ("decode_step", "learner_forward")},
}


def build(spec: dict, sharding):
    """The traced program of one cell (`plan.cuda_aot`'s `build` contract; a cell's policy
    arrives parsed)."""
    from jaxrl_lp.kernels.fixed_tile import fixed_tile_product
    from jaxrl_lp.kernels.logprob import tiled_readout

    arg = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(tuple(shape), dtype,
                                                                 sharding=sharding)
    if spec["kind"] == "fixed_tile":
        return jax.jit(lambda x, w: fixed_tile_product(x, w)).trace(arg(spec["x"]),
                                                                      arg(spec["w"]))
    if spec["kind"] in ("decode_step", "learner_forward"):
        return _in_fixed_tiles(spec, sharding)
    t, d, v, policy = spec["t"], spec["d"], spec["v"], spec["policy"]
    readout = lambda h, w, tokens, mask: tiled_readout(h, w, tokens, mask, 1.0, policy,
                                                       forward="mosaic")
    return jax.jit(readout).trace(arg((t, d)), arg((d, v)), arg((t,), jnp.int32),
                                  arg((t,), jnp.bool_))


def run(plugin_dir: str, targets: list[str], cells: list[str]) -> dict:
    """`{"targets": {target: {cell: {"kernels": [...], "compile_s"}}}}` (module docstring);
    a cell whose compile fails records its error beside the others."""
    from jaxrl_lp.plan.cuda_aot import mosaic_kernels

    out: dict = {}
    for target in targets:
        row = out.setdefault(target, {})
        for cell in cells:
            t0 = time.perf_counter()
            try:
                kernels = mosaic_kernels(f"{__name__}:build", CELLS[cell], target, plugin_dir)
                row[cell] = {"kernels": kernels,
                             "compile_s": round(time.perf_counter() - t0, 1)}
            except RuntimeError as e:
                row[cell] = {"error": str(e)[-1500:]}
    return {"targets": out}


def fixed_tiles_programs(cfg, policy, rows: int) -> dict:
    """`{"decode_step": (fn, args), "learner_forward": (fn, args)}`: a decode step of `rows`
    rows, and the learner's invariant forward of a rollout of `rows` x (32 + 32) tokens, with
    every product in fixed tiles (`numerics.invariant`, `InvariantForm(tiles="compiled")`),
    on abstract inputs: what `SUITE=invariant`'s model cell runs, compiled here and lowered
    in tests/test_fixed_tile.py."""
    import dataclasses

    from jaxrl_lp.numerics.invariant import InvariantForm, invariant_forms, opaque_zero
    from jaxrl_lp.plan.programs import ProgramShapes, _params, _rollout, _sampler_state
    from jaxrl_lp.rl.logprobs import learner_logprobs
    from jaxrl_lp.rollout.step import LoopSpec, decode_step, fused_readout, step_logits

    loop = LoopSpec().resolve(cfg)
    form = InvariantForm(0, None, "compiled")
    shapes = ProgramShapes(rows=rows, prompt_len=32, max_new=32)

    def step(params, tokens_B, positions_B, cache, index):
        with invariant_forms(opaque_zero(index), form):
            out = decode_step(params, cfg, policy, loop, tokens_B, positions_B, cache, index,
                              hidden=fused_readout(policy))[0]
            return step_logits(params, cfg, policy, out)

    params, cache = _sampler_state(cfg, policy, shapes)
    positions = jax.ShapeDtypeStruct((rows,), jnp.int32)
    rollout = dataclasses.replace(_rollout(cfg, policy, loop, shapes), decode_layout="invariant",
                                  invariant_form=form)
    forward = lambda p, r: learner_logprobs(p, cfg, policy, r, "invariant", loop=loop)[0]
    return {"decode_step": (step, (params, positions, positions, cache,
                                   jax.ShapeDtypeStruct((), jnp.int32))),
            "learner_forward": (forward, (_params(cfg), rollout))}


def _in_fixed_tiles(spec: dict, sharding):
    """`fixed_tiles_programs`' program of `spec["kind"]`, its inputs placed by `sharding`."""
    from jaxrl_lp.models.config import get_preset

    cfg = get_preset(spec["preset"]).replace(num_layers=spec["layers"])
    fn, args = fixed_tiles_programs(cfg, spec["policy"], spec["rows"])[spec["kind"]]
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          args)
    return jax.jit(fn).trace(*placed)
