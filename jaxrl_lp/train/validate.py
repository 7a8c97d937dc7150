"""Checks a whole training config before a run writes anything: `validate(cfg)`.

Each config section checks its own fields when it is made (`__post_init__`).
What needs several sections, the file system or the data is checked here, by
building every object a run builds from its config: the task (reading its
data), the model config (from `init_from`'s `config.json` or the `model`
section), the precision policies, the resolved loop spec, the sampler
settings, the exporter and the optimizers. Nothing is compiled and nothing is
written, so a bad value costs the user a fraction of a second and one line:

    >>> validate(apply_overrides(default_config(), ["run.out_dir=/etc/passwd"]))
    Traceback (most recent call last):
    ValueError: run.out_dir='/etc/passwd' is a file, not a directory; choose another run.out_dir
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax

from jaxrl_lp.fields import user_key
from jaxrl_lp.models.config import ModelConfig
from jaxrl_lp.models.loop import LoopSpec
from jaxrl_lp.numerics.policy import Policy
from jaxrl_lp.rollout.sampling import SamplingConfig
from jaxrl_lp.train.config import TrainConfig
from jaxrl_lp.train.optimizers import make_optimizers
from jaxrl_lp.train.sync_hooks import make_exporter
from jaxrl_lp.train.task_source import build_task

__all__ = ["RunPlan", "build_task", "check_out_dir", "model_config", "validate"]


class RunPlan(NamedTuple):
    """The objects a run builds from its config (what `validate` checked)."""

    task: Any                        # the task (`tasks.Task`): built from `cfg.task`, or given
    model: ModelConfig               # the model trained (tokenizer ids filled in)
    max_new_tokens: int              # the GRPO completion budget
    seq_len: int                     # warm-start sequence length (prompt + answer)
    learner_policy: Policy
    sampler_policy: Policy
    loop: LoopSpec                   # resolved against `model`
    sampling: SamplingConfig         # the GRPO sampler's settings
    exporter: Any                    # the sync exporter, or None
    optimizers: tuple                # (warm-start, GRPO) optax transforms
    mesh: Any = None                 # the device mesh (`run.mesh`), or None: one device
    weights: Any = None              # the train tree's representation (`sft.optimizer`;
                                     # `optim.weights`; LoRA from step 0), or None: the
                                     # model's f32 params
    sampler: Any = None              # where the sampler runs (`train.rollout_queue.SamplerSide`);
                                     # None: on the learner's devices (`mesh`)
    lora: Any = None                 # `train.lora_run.LoraPlan` (`lora.rank > 0`), or None
    logprobs: Any = None             # `train.logprobs_choice.LogprobsChoice`: the learner's
                                     # log-prob method (`grpo.logprobs=auto` resolved)


def _named(key: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`, with any error it raises on bad input named by `key`."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, OSError, TypeError) as e:
        text = " ".join(str(e).split())
        raise ValueError(text if text.startswith(key) else f"{key}: {text}") from None


def check_out_dir(path: str) -> None:
    """Raises unless `path` is a directory, or can be created as one, that we may write into."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"run.out_dir={path!r} is a file, not a directory; choose another "
                         "run.out_dir")
    parent = p
    while not parent.exists():  # terminates: `.` and `/` exist
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"run.out_dir={path!r} cannot be created: {str(parent)!r} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"run.out_dir={path!r}: no permission to write in {str(parent)!r}")


def model_config(cfg: TrainConfig, task) -> ModelConfig:
    """The model a run trains: `init_from`'s config, else `cfg.model` with the tokenizer's ids."""
    tok = task.tokenizer
    if cfg.init_from:
        from jaxrl_lp.models.hf_io import read_hf_config

        mcfg = _named("init_from", read_hf_config, cfg.init_from)
        if tok.vocab_size > mcfg.vocab_size:
            raise ValueError(f"init_from: the checkpoint's vocabulary ({mcfg.vocab_size} ids) is "
                             f"smaller than the task's tokenizer ({tok.vocab_size} ids)")
        return mcfg
    try:
        return cfg.model.replace(vocab_size=tok.vocab_size, bos_token_id=tok.bos_id,
                                 eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    except ValueError as e:
        raise ValueError(user_key(str(e), "ModelConfig", "model")) from None


def _check_kernels_run_here(*policies: tuple[str, Policy]) -> None:
    """A run executes on this host: `kernels=on` needs a GPU or TPU here (its programs would
    fail to lower for this CPU at their first compile, after the run directory is made)."""
    from jaxrl_lp.kernels import kernel_backend

    for key, policy in policies:
        if policy.kernels == "on" and kernel_backend() is None:
            raise ValueError(
                f"{key}={policy}: kernels=on runs the compiled Pallas kernels, which this host "
                f"({jax.default_backend()}) has none of (they compile for GPU and TPU); use "
                "k=auto (the jnp references here), or k=interpret to run the kernels "
                "interpreted")


def validate(cfg: TrainConfig, task: Any = None) -> RunPlan:
    """Builds every object a run of `cfg` needs, without compiling or writing anything.

    Raises ValueError with one line naming the key (`run.out_dir`,
    `grpo.exit_rule`, ...) and what it allows. `run_train` calls it first.

    Args:
      cfg: the run's config.
      task: the task object to train (`tasks.Task`); None builds `cfg.task`'s.

    Returns:
      The `RunPlan` of what was built.
    """
    check_out_dir(cfg.run.out_dir)
    if cfg.run.wandb:  # an extra: a missing package is named before anything is written
        from jaxrl_lp.train.logger import import_wandb

        import_wandb()
    task = build_task(cfg, task)
    mcfg = model_config(cfg, task)
    g = cfg.grpo
    lpol, spol = g.policies
    _check_kernels_run_here(("grpo.learner_policy", lpol), ("grpo.sampler_policy", spol))
    try:
        loop = LoopSpec(g.exit_rule, g.compute_mode).resolve(mcfg)
    except ValueError as e:
        raise ValueError(f"grpo.exit_rule={g.exit_rule!r}, grpo.compute_mode={g.compute_mode!r}: "
                         f"{e} (model: {mcfg.family}, loop_steps={mcfg.loop_steps})") from None
    sampling = _named("grpo.temperature", SamplingConfig, temperature=g.temperature)
    exporter = _named("sync.exporter", make_exporter, cfg.sync.exporter, cfg.sync.seed)

    seq_len, answer = task.max_sequence_length, task.max_completion_tokens
    max_new = g.max_new_tokens or answer
    prompt = seq_len - answer
    ctx = mcfg.max_position_embeddings
    if max(seq_len, prompt + max_new) > ctx:
        where = "the init_from checkpoint's context" if cfg.init_from else \
            "model.max_position_embeddings"
        raise ValueError(
            f"{where}={ctx} cannot hold the task's longest prompt ({prompt} tokens) plus "
            f"{max(max_new, answer)} completion tokens; raise model.max_position_embeddings to at "
            f"least {prompt + max(max_new, answer)} or lower grpo.max_new_tokens")
    if g.overlong_buffer > max_new:  # grpo.max_new_tokens=0: the task's answer length
        raise ValueError(
            f"grpo.overlong_buffer={g.overlong_buffer} is longer than the completion budget of "
            f"{max_new} tokens (grpo.max_new_tokens=0: the task's answer length); set "
            f"grpo.overlong_buffer to at most {max_new}, or raise grpo.max_new_tokens")
    from jaxrl_lp.train.lora_run import lora_plan

    lora = lora_plan(cfg, mcfg)  # before `_weights`: LoRA names its own clash with sft.optimizer
    weights = _weights(cfg)
    if lora is not None and lora.start == 0:  # on a pretrained base: LoRA from the first step
        weights = lora.weights
    _speculative(cfg, mcfg)
    _reuse_products(cfg, mcfg, weights)
    _reference(cfg, mcfg)
    _multiturn(cfg, task, mcfg, weights)
    mesh, sampler = _placement(cfg, mcfg) if cfg.run.learner_mesh else (_mesh(cfg, mcfg), None)
    _invariant_tiles(cfg, mesh, weights if lora is None else lora.weights)
    _invariant_formats(cfg)
    from jaxrl_lp.tasks.protocol import is_multiturn
    from jaxrl_lp.train.logprobs_choice import choose_logprobs

    logprobs = choose_logprobs(cfg, multiturn=is_multiturn(task), mesh=mesh,
                               weights=weights if lora is None else lora.weights)
    return RunPlan(task=task, model=mcfg, max_new_tokens=max_new, seq_len=seq_len,
                   learner_policy=lpol, sampler_policy=spol, loop=loop, sampling=sampling,
                   exporter=exporter, optimizers=make_optimizers(cfg), mesh=mesh,
                   weights=weights, sampler=sampler, lora=lora, logprobs=logprobs)


def _weights(cfg: TrainConfig):
    """The weight representation of `sft.optimizer`, checked against the rest of the run.

    A low-bit train tree runs on one device (its codes and scales have no
    sharding rules yet) and has no f32 master to round to bf16.
    """
    from jaxrl_lp.optim import OptimizerSpec

    spec = OptimizerSpec.parse(cfg.sft.optimizer, "sft.optimizer")
    weights = spec.weights()
    if weights is not None:
        if cfg.run.mesh:
            raise ValueError(f"sft.optimizer={cfg.sft.optimizer!r} runs on one device: set "
                             f"run.mesh='' (got run.mesh={cfg.run.mesh!r}) or sft.optimizer=adamw")
        if cfg.run.learner_mesh:
            from jaxrl_lp.parallel.placement import parse_placement

            if parse_placement(cfg.run.learner_mesh, cfg.run.sampler_mesh).learner.spec.size > 1:
                raise ValueError(
                    f"sft.optimizer={cfg.sft.optimizer!r} runs on one device: set "
                    f"run.learner_mesh to one device, e.g. data=1 (got "
                    f"{cfg.run.learner_mesh!r}), or sft.optimizer=adamw")
        if cfg.sync.bf16_start:
            raise ValueError(f"sync.bf16_start rounds an f32 master, which "
                             f"sft.optimizer={cfg.sft.optimizer!r} does not have; set "
                             "sync.bf16_start=false or sft.optimizer=adamw")
    return weights


def _multiturn(cfg: TrainConfig, task, mcfg: ModelConfig, weights) -> None:
    """A multi-turn task's run checked against what its episodes support.

    Its episodes run with the plain sampler (`rollout.multiturn`) on the learner's devices
    (one, or `run.mesh`) and in one process (the host steps the environments), on the
    weights of the step they are dispatched at (`grpo.max_staleness` steps before the one
    that learns from them; a dynamic-sampling step's refills on the same), each call
    replayed whole; the options below compose with it not yet, each refused with the key
    to change.
    """
    from jaxrl_lp.train.episodes import is_multiturn, turn_limits

    what = f"task.kind={cfg.task.kind!r}" if _built(cfg, task) else \
        f"the task ({type(task).__name__})"
    if not is_multiturn(task):
        if cfg.grpo.turn_credit != "episode":
            raise ValueError(
                f"grpo.turn_credit={cfg.grpo.turn_credit!r} credits the turns of multi-turn "
                f"episodes, and {what} samples single-turn completions; set "
                "grpo.turn_credit=episode or a multi-turn task (task.kind=calculator, "
                "gsm8k_tools, or dataset with task.env or task.tools)")
        return
    g = cfg.grpo
    why = None
    if cfg.run.learner_mesh or cfg.distributed.num_processes > 1:
        why = ("are sampled and learned from on the same devices, by one process: set "
               "run.learner_mesh='' (run.mesh shards both) and distributed.num_processes=1")
    elif g.overlong_buffer:
        why = "end by their turn limits, not a completion budget: set grpo.overlong_buffer=0"
    elif g.speculative:
        why = "decode with the plain sampler: set grpo.speculative=''"
    elif g.reuse_products:
        why = "record no weight products: set grpo.reuse_products=false"
    elif g.logprobs == "invariant":
        why = "replay each call by their own programs: set grpo.logprobs=hybrid"
    elif weights is not None:
        why = "train plain weights: set sft.optimizer=adamw"
    if why:
        raise ValueError(f"{what}: multi-turn episodes {why}")
    limits = turn_limits(task)
    width = max(len(task.prompt_ids(task.train[i])) for i in range(min(64, len(task.train))))
    from jaxrl_lp.rollout.request import bucket_length

    need = limits.cache_slots(bucket_length(width))
    if need > mcfg.max_position_embeddings:
        raise ValueError(
            f"{what}: an episode may use {need} cache slots (prompt, "
            f"{limits.max_turns} turns of {limits.max_turn_tokens} tokens, observations) but "
            f"the model's context is {mcfg.max_position_embeddings}; raise "
            "model.max_position_embeddings or lower task.max_turns")


def _invariant_formats(cfg: TrainConfig) -> None:
    """`grpo.logprobs=invariant`: the policies' products have an invariant form (none, or a
    `matmul_format` of `kernels.fake_quant.INVARIANT_FORMATS`)."""
    from jaxrl_lp.kernels.fake_quant import INVARIANT_FORMATS

    g = cfg.grpo
    if g.logprobs != "invariant":
        return
    for name, policy in zip(("grpo.learner_policy", "grpo.sampler_policy"), g.policies, strict=True):
        fmt = policy.matmul_format
        if fmt is not None and fmt not in INVARIANT_FORMATS:
            raise ValueError(
                f"grpo.logprobs=invariant: {name}={policy}: {fmt} products have no invariant "
                "form (its scale is a mean, summed in each program's order); set "
                "grpo.logprobs=hybrid (exact, by the replay) or a policy in "
                f"{', '.join(INVARIANT_FORMATS)}")


def _invariant_tiles(cfg: TrainConfig, mesh, weights) -> None:
    """`grpo.invariant_tiles`: one device, plain weights, and products the named version
    can take here (compiled: a GPU or TPU; on a GPU bf16 or f16 arrays)."""
    g = cfg.grpo
    tiles = g.invariant_tiles
    if not tiles:
        return
    key = f"grpo.invariant_tiles={tiles}"
    if mesh is not None:
        raise ValueError(f"{key}: the invariant forms run on one device; set run.mesh=''")
    if weights is not None:
        raise ValueError(f"{key}: the invariant forms multiply plain weights; drop LoRA and "
                         "set sft.optimizer=adamw")
    backend = jax.default_backend()
    if tiles == "compiled" and backend not in ("gpu", "tpu"):
        raise ValueError(f"{key}: the kernels compile for a GPU or TPU, and this host is "
                         f"{backend}; use interpret-tpu to run them interpreted here")
    if tiles == "compiled" and backend == "gpu":
        learner, sampler = g.policies
        for name, policy in (("grpo.sampler_policy", sampler), ("grpo.learner_policy", learner)):
            if policy.matmul_format is not None:
                raise ValueError(
                    f"{key}: the GPU kernel multiplies bf16 or f16 arrays, and {name}={policy} "
                    f"multiplies the f32 values of {policy.matmul_format} codes; set "
                    "grpo.invariant_tiles='' (the updates then replay the decode) or a bf16 "
                    "policy")
            if policy.compute_dtype.name not in ("bfloat16", "float16") or not policy.native:
                raise ValueError(
                    f"{key}: the GPU kernel multiplies bf16 or f16 arrays (Hopper's wgmma "
                    f"reads f32 as tf32), and {name}={policy} computes in "
                    f"{policy.compute_dtype.name}"
                    + ("" if policy.native else " stored in f32")
                    + "; set it to bf16 (stored natively: s=auto or s=native)")


def _built(cfg: TrainConfig, task) -> bool:
    """Whether `task` is the one `cfg.task` describes (messages then name its keys)."""
    from jaxrl_lp.data import ArithmeticTask, GSM8KTask
    from jaxrl_lp.envs import CalculatorTask, PythonCalculatorTask
    from jaxrl_lp.tasks.dataset import DatasetTask

    return isinstance(task, (ArithmeticTask, GSM8KTask, CalculatorTask, PythonCalculatorTask,
                             DatasetTask))


def _reuse_products(cfg: TrainConfig, mcfg: ModelConfig, weights) -> None:
    """`grpo.reuse_products` checked against the model and where the run computes."""
    g = cfg.grpo
    if not g.reuse_products:
        return
    why = None
    if mcfg.is_looped:
        why = (f"a dense model's (got a looped {mcfg.family} model; a dense one: "
               "model.family=qwen3 and model.loop_steps=1)")
    elif cfg.run.mesh or cfg.run.learner_mesh:
        why = "one device's: set run.mesh='' and run.learner_mesh=''"
    elif g.speculative:
        why = "a plain sampler's: set grpo.speculative=''"
    elif g.max_staleness:
        why = ("a synchronous loop's (an off-policy rollout's weights are not the update's): "
               "set grpo.max_staleness=0")
    elif weights is not None or cfg.lora.enabled:
        why = "plain weights': set sft.optimizer=adamw and lora.rank=0"
    elif not g.policies.matched:
        why = ("a learner matched to its sampler's: set grpo.learner_policy equal to "
               "grpo.sampler_policy")
    if why:
        raise ValueError(f"grpo.reuse_products=true: the recorded weight products are {why}, "
                         "or set grpo.reuse_products=false")


# Fields a KL reference checkpoint may differ in from the trained model: token ids.
_REFERENCE_FREE = ("bos_token_id", "eos_token_id", "pad_token_id")


def _reference(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    """`loss.reference` (a Hugging Face directory) checked against the model trained."""
    path = cfg.loss.reference
    if not path:
        return
    if not os.path.isdir(path):
        raise ValueError(f"loss.reference={path!r} is not a directory; pass a Hugging Face "
                         "checkpoint directory (config.json + model.safetensors), or '' for the "
                         "GRPO phase's starting weights")
    from jaxrl_lp.models.hf_config import read_hf_config

    ref = _named("loss.reference", read_hf_config, path)
    if ref.vocab_size != mcfg.vocab_size:
        raise ValueError(f"loss.reference={path!r} has a vocabulary of {ref.vocab_size} ids and "
                         f"the model trained {mcfg.vocab_size}; a KL reference scores the same "
                         "tokens: pass a checkpoint of the same vocabulary")
    have, want = dataclasses.asdict(ref), dataclasses.asdict(mcfg)
    diff = {k: (have[k], v) for k, v in want.items() if k not in _REFERENCE_FREE and have[k] != v}
    if diff:
        raise ValueError(f"loss.reference={path!r} is another architecture than the model trained "
                         f"(field: (reference, model) = {diff}); pass a checkpoint of the same "
                         "architecture, or '' for the GRPO phase's starting weights")
    if not any(Path(path).glob("*.safetensors")):
        raise ValueError(f"loss.reference={path!r} has no *.safetensors weights")


def _speculative(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    """`grpo.speculative` checked against the model (and the dense drafter's checkpoint)."""
    from jaxrl_lp.rollout.spec_config import SpecConfig

    spec = SpecConfig.parse(cfg.grpo.speculative)
    if spec is None:
        return
    where = f"grpo.speculative={cfg.grpo.speculative!r}"
    if cfg.run.mesh:
        raise ValueError(f"{where} samples on one device: set run.mesh='' "
                         f"(got run.mesh={cfg.run.mesh!r}) or grpo.speculative=''")
    if cfg.run.learner_mesh:
        raise ValueError(f"{where} samples on the learner's one device: set "
                         f"run.learner_mesh='' and run.sampler_mesh='' (got "
                         f"{cfg.run.learner_mesh!r}, {cfg.run.sampler_mesh!r}) or "
                         "grpo.speculative=''")
    drafter_cfg = None
    if spec.drafter == "dense":
        from jaxrl_lp.models.hf_config import read_hf_config

        drafter_cfg = _named(where, read_hf_config, spec.path)
    _named(where, spec.resolve, mcfg, drafter_cfg)


def _check_rows(cfg: TrainConfig, spec, key: str) -> None:
    """The batches split evenly over the data shards of the mesh `spec` (named by `key`)."""
    d, g = spec.data_shards, cfg.grpo
    rows = g.prompts_per_step * g.group_size // (g.minibatches * g.micro_batches)
    for name, n, what in (
        ("grpo.prompts_per_step", g.prompts_per_step, "prompts per step"),
        ("grpo.micro_batches", rows, "sequences per micro-batch"),
        ("sft.batch_size", cfg.sft.batch_size, "warm-start sequences per step"),
    ):
        if n % d:
            raise ValueError(f"{name}: {n} {what} do not split over {key}={spec}'s {d} data "
                             f"shards (data x fsdp); make it a multiple of {d}")


def _placement(cfg: TrainConfig, mcfg: ModelConfig):
    """`(learner mesh, SamplerSide)` of `run.learner_mesh` / `run.sampler_mesh`, checked
    against the devices (when they are known), the model and the batch sizes."""
    import jax

    from jaxrl_lp.parallel import check_divisible
    from jaxrl_lp.parallel.placement import parse_placement
    from jaxrl_lp.train.rollout_queue import SamplerSide

    placement = parse_placement(cfg.run.learner_mesh, cfg.run.sampler_mesh)
    _check_rows(cfg, placement.learner.spec, "run.learner_mesh")
    if cfg.distributed.coordinator and not jax.distributed.is_initialized():
        return None, None  # the devices are not known yet: the spec alone is checked
    devices = jax.devices()
    placement.check(len(devices))
    meshes = {}
    for key, group in (("run.learner_mesh", placement.learner),
                       ("run.sampler_mesh", placement.sampler)):
        meshes[key] = _named(key, group.mesh, devices)
        if meshes[key] is not None:
            _named(key, check_divisible, mcfg, meshes[key])
    learner, sampler = meshes["run.learner_mesh"], meshes["run.sampler_mesh"]
    spec = placement.sampler.spec
    # A data-only sampler mesh runs as replicas (`SamplerSide`): each samples a share of the
    # prompts.
    replicas = tuple(placement.sampler.devices(devices)) if spec.data == spec.size > 1 else ()
    if replicas and cfg.grpo.prompts_per_step % len(replicas):
        raise ValueError(f"grpo.prompts_per_step: {cfg.grpo.prompts_per_step} prompts do not "
                         f"split over run.sampler_mesh={cfg.run.sampler_mesh!r}'s "
                         f"{len(replicas)} sampler replicas; make it a multiple of "
                         f"{len(replicas)}")
    side = SamplerSide(
        mesh=None if replicas else sampler, replicas=replicas,
        device=None if sampler is not None else placement.sampler.device(devices),
        learner_mesh=learner,
        learner_device=None if learner is not None else placement.learner.device(devices),
        model=mcfg, separate=True)
    return learner, side


def _mesh(cfg: TrainConfig, mcfg: ModelConfig):
    """The run's mesh, checked against the devices, the model and the batch sizes.

    The batch splits over the data shards (`data` x `fsdp`): a prompt's G
    samples stay on one shard when the prompts divide by the shards, and every
    micro-batch and warm-start batch must split evenly. Before the processes
    of a multi-process run have joined, only the spec is checked (the devices
    are not known yet).
    """
    if not cfg.run.mesh:
        return None
    import jax

    from jaxrl_lp.parallel import MeshSpec, check_divisible, make_mesh

    spec = MeshSpec.parse(cfg.run.mesh)
    _check_rows(cfg, spec, "run.mesh")
    if cfg.distributed.coordinator and not jax.distributed.is_initialized():
        return None
    mesh = _named("run.mesh", make_mesh, spec)
    _named("run.mesh", check_divisible, mcfg, mesh)
    return mesh
