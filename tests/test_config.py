"""Config validation and what a user sees: every key refused fast, in one line, before any write.

The walk over every field is derived from `dataclasses.fields(TrainConfig)`:
a new field without a bad value in `BAD` fails `test_every_field_has_a_bad_value`.
The other side, that every valid non-default value also runs, is `test_config_reach.py`.
"""

import dataclasses
import json
import time
import typing

import pytest

import jaxrl_lp.train.program  # noqa: F401 - imported once here, so the timings measure validation
from jaxrl_lp.cli.help import config_keys, field_docs
from jaxrl_lp.cli.main import main
from jaxrl_lp.kernels import kernel_backend
from jaxrl_lp.train import TrainConfig, apply_overrides, default_config, load_config

FILE = "<a file>"  # replaced by the path of an existing regular file
DATA = "<data>"  # replaced by the path of a user's JSONL: {"prompt": "1+2=", "answer": "3"} lines
DATASET = ["task.kind=dataset", f"task.path={DATA}"]

# key -> bad values; a value may be (value, [other overrides it needs]).
BAD = {
    "model.family": ["abc"],
    "model.vocab_size": ["0", "abc"],
    "model.hidden_size": ["0", "abc"],
    "model.num_layers": ["0"],
    "model.num_heads": ["0"],
    "model.num_kv_heads": ["0"],
    "model.head_dim": ["0", "15"],
    "model.intermediate_size": ["-3"],
    "model.rope_theta": ["0", "nan", "abc"],
    "model.rms_eps": ["-1e-6"],
    "model.tie_embeddings": ["abc"],
    "model.qk_norm": ["maybe"],
    "model.attention_bias": ["2"],
    "model.max_position_embeddings": ["0", "8"],  # 8: the task's prompt + answer do not fit
    "model.loop_steps": ["0"],
    "model.bos_token_id": ["abc"],  # any integer: the task's tokenizer sets them
    "model.eos_token_id": ["1.5"],
    "model.pad_token_id": ["x"],
    "model.init_std": ["0", "inf"],
    "model.exit_rule": ["abc", "fixed:9"],
    "task.kind": ["abc"],
    "task.ops": ["/", "++", ""],
    "task.max_digits": ["0", "10", "abc"],
    "task.reverse_answer": ["abc"],
    "task.pad_operands": ["yes"],
    "task.path": ["data.jsonl", ("", ["task.kind=gsm8k"])],
    "task.seed": ["-1", "abc"],
    "task.second_digits": ["0", "abc"],
    "task.max_turns": ["0", "abc"],
    "task.tool_fraction": ["-0.1", "1.5", "abc"],
    "task.env_timeout_s": ["0", "abc"],
    "task.failure_reward": ["abc", "nan"],
    # a dataset task's keys: without task.kind=dataset; a column the records lack; a reward,
    # an environment or tools that do not import; a stop string of two tokens
    "task.prompt_key": ["", ("question", DATASET)],
    "task.answer_key": [("solution", DATASET)],
    "task.completion_key": [("reasoning", DATASET)],
    "task.heldout": ["test.jsonl", ("/nonexistent/test.jsonl", DATASET)],
    "task.heldout_fraction": ["0", "1", "abc"],
    "task.rewards": ["exact_match", ("no_such_reward", DATASET), ("nomodule:fn", DATASET)],
    "task.format_regex": ["^x$", ("(", [*DATASET, "task.rewards=regex_format"])],
    "task.reward_timeout_s": ["0", "abc"],
    "task.system_prompt": ["Be brief."],
    "task.chat_template": ["jinja"],
    "task.template_options": ["enable_thinking=false", ("nothing", DATASET)],
    "task.env": ["mymod:make_env", ("nomodule:make_env", DATASET),
                ("json:loads", [*DATASET, "task.tools=json:dumps"])],
    "task.tools": ["json:dumps", ("nomodule:add", DATASET)],
    "task.stop": ["?", ("ab", [*DATASET, "task.env=collections:Counter"])],
    "task.max_turn_tokens": ["-1", "abc"],
    "task.max_observation_tokens": ["0", "abc"],
    "sft.steps": ["-5", "abc"],
    "sft.batch_size": ["0"],
    "sft.lr": ["0", "-1e-3", "nan", "abc"],
    "sft.warmup_steps": ["-1"],
    "sft.optimizer": ["sgd", "", "error_diffusion:binary:k=9", "error_diffusion:ternary:k=1",
                      "latent_ste:quaternary", "error_diffusion:binary:k=4:lr=0",
                      ("error_diffusion:binary:k=4", ["sync.bf16_start=true"])],
    "grpo.steps": ["-1"],
    "grpo.prompts_per_step": ["0"],
    "grpo.group_size": ["1"],
    "grpo.max_new_tokens": ["-1", "100"],  # 100: beyond the model's context of 64
    "grpo.lr": ["0", "nan"],
    "grpo.mu": ["0"],
    "grpo.minibatches": ["0", "3"],
    "grpo.micro_batches": ["0", "3"],
    "grpo.advantage": ["abc"],
    "grpo.logprobs": ["abc"],
    "grpo.replay": ["sometimes"],
    # a name it has not (the GPU interpreter is for kernel checks, not runs); tiles without
    # the invariant forms; compiled on this CPU
    "grpo.invariant_tiles": ["abc", ("interpret-gpu", ["grpo.logprobs=invariant"]),
                             "interpret-tpu", ("compiled", ["grpo.logprobs=invariant"])],
    "grpo.verify_every": ["-1", "abc"],
    "grpo.start_probe": ["abc"],
    # k=on: compiled kernels, which a CPU host has none of (a run executes here).
    "grpo.learner_policy": ["abc", *(["bf16,k=on"] if kernel_backend() is None else [])],
    "grpo.sampler_policy": ["p=f99", *(["fp32,k=on"] if kernel_backend() is None else [])],
    "grpo.exit_rule": ["abc", "fixed:0", "fixed:3"],  # fixed:3: the model has 2 loop steps
    "grpo.compute_mode": ["abc"],
    "grpo.temperature": ["0", "-1", "nan"],
    # speculative rollouts draw by Gumbel-max only
    "grpo.draw": ["gumble", ("inverse_cdf", ["grpo.speculative=self:loops=1,k=4"])],
    "grpo.dynamic_sampling": ["abc"],
    "grpo.max_refill_rounds": ["-1", "abc"],
    # 9 > max_new_tokens=8; 5 > the default task's answer length (max_new_tokens=0: 4 tokens)
    "grpo.overlong_buffer": ["-1", ("9", ["grpo.max_new_tokens=8"]), "5"],
    "grpo.overlong_penalty": ["-1", "nan"],
    "grpo.max_nonfinite_in_row": ["0"],
    "loss.epsilon": ["0", "1", "abc"],
    "loss.epsilon_high": ["0"],
    "loss.dual_clip": ["1"],
    "loss.aggregation": ["abc"],
    "loss.ratio_level": ["abc"],
    "loss.kl_beta": ["-1"],
    "loss.kl_estimator": ["k4"],
    # beta 0: the reference would be ignored; a missing directory; a file
    "loss.reference": ["/nonexistent/ref", ("/nonexistent/ref", ["loss.kl_beta=0.01"]),
                       (FILE, ["loss.kl_beta=0.01"])],
    "loss.correction": ["abc"],
    "loss.correction_cap": ["1"],
    "loss.ratio_anchor": ["abc"],
    "sync.exporter": ["abc", "bf16:sideways"],
    "sync.loss_on_served": ["abc", "true"],  # true: there is no served copy (exporter none)
    "sync.check_every": ["-1", "5"],
    "sync.bf16_start": ["abc"],
    "sync.seed": ["-1"],
    # -1; 65: above min(in, out) of every matrix of the default model (64 wide); 0 with
    # another LoRA key set (it would do nothing)
    # another LoRA key set (it would do nothing); error diffusion keeps no latent for an
    # adapter to sit beside
    "lora.rank": ["-1", "65", ("0", ["lora.serve=merged"]),
                  ("8", ["sft.optimizer=error_diffusion:binary:k=4"])],
    "lora.alpha": ["0", "nan"],
    "lora.targets": ["q,qkv", "q,q"],  # an unknown target; one twice
    # not a base format; a quantized base on a mesh
    "lora.base_format": ["ternary", ("nvfp4", ["lora.rank=8", "run.mesh=fsdp=8"])],
    # unmerged serving exports nothing: an exporter there would be ignored
    "lora.serve": ["both", ("unmerged", ["lora.rank=8", "sync.exporter=bf16:nearest"])],
    "run.out_dir": ["", FILE, f"{FILE}/run"],
    "run.seed": ["-1", "abc"],
    "run.eval_every": ["0"],
    "run.eval_size": ["0"],
    "run.checkpoint_every": ["0"],
    "run.keep_checkpoints": ["0"],
    "run.progress": ["abc"],
    "grpo.remat": ["abc", "true"],  # a name, not the flag it was
    # not a bool; on the default (looped) model; with every update replayed
    "grpo.reuse_products": ["abc", "true", ("true", ["model.family=qwen3", "model.loop_steps=1",
                                                     "grpo.replay=always"])],
    "grpo.speculative": ["abc", "self:loops=1,k=0", "dense:/nonexistent/drafter,k=4",
                         ("self:loops=1,k=4", ["grpo.compute_mode=deferred"]),
                         "self:loops=2,k=4",  # the default model has 2 loop steps
                         ("self:loops=1,k=4", ["run.mesh=fsdp=8"])],
    "run.mesh": ["batch=8", "fsdp=0", "fsdp=3"],  # unknown axis, size 0, 3 != 8 devices
    "run.save_on_signal": ["sometimes"],
    "run.wandb": ["maybe"],
    "run.wandb_project": [" "],
    "run.wandb_mode": ["cloud"],
    # unknown; `none` combined; twice (`jaxrl_lp.xla_flags`)
    "run.xla_gpu_flags": ["graphs", "none,decode_graphs", "scheduler,scheduler"],
    # without the sampler's; with run.mesh; overlapping the sampler's; not a mesh
    "run.learner_mesh": ["fsdp=4", ("fsdp=4", ["run.mesh=fsdp=8", "run.sampler_mesh=data=4"]),
                         ("fsdp=4", ["run.sampler_mesh=data=4@2"]),
                         ("batch=4", ["run.sampler_mesh=data=4"]),
                         ("fsdp=4", ["run.sampler_mesh=data=4",
                                     "distributed.coordinator=localhost:1234",
                                     "distributed.num_processes=2", "distributed.process_id=0"])],
    # without the learner's; past the 8 devices; a bad first device; 32 prompts over 3
    # replicas
    "run.sampler_mesh": ["data=4", ("data=8", ["run.learner_mesh=fsdp=4"]),
                         ("data=4@x", ["run.learner_mesh=fsdp=4"]),
                         ("data=3", ["run.learner_mesh=fsdp=4"])],
    "grpo.max_staleness": ["-1", "abc", ("1", ["lora.rank=8"])],  # LoRA: synchronous only
    # by turn on a single-turn task; a discount above 1, or set without turn credit
    "grpo.turn_credit": ["abc", "reward_to_go"],
    "grpo.turn_discount": ["-0.1", "1.5", "nan", "0.9"],
    "distributed.coordinator": ["nohost", "host:port"],
    "distributed.num_processes": ["0", "abc"],
    "distributed.process_id": ["-2", "abc"],
    "distributed.timeout_s": ["0"],
    "init_from": ["/nonexistent/checkpoint", FILE],
}


def _keys(cls: type, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def test_every_field_has_a_bad_value():
    assert sorted(_keys(TrainConfig)) == sorted(BAD)


CASES = [(key, bad) for key, values in BAD.items() for bad in values]


@pytest.mark.parametrize("key, bad", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_bad_value_is_one_line_naming_the_key_and_nothing_is_written(tmp_path, capsys, key, bad):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+2=", "answer": str(a + 2)}) + "\n"
                            for a in range(40)))
    value, extra = bad if isinstance(bad, tuple) else (bad, [])
    value = value.replace(FILE, str(afile))
    args = ["train", "--set", f"run.out_dir={tmp_path / 'run'}"]
    for o in [*extra, f"{key}={value}"]:
        args += ["--set", o.replace(DATA, str(data))]
    t0 = time.perf_counter()
    assert main(args) == 2
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxrl-lp train: error:") and "\n" not in err, err
    assert key in err, err
    assert elapsed < 5.0, f"{elapsed:.1f}s"  # validation compiles and loads nothing heavy
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "data.jsonl"]  # no write
    assert afile.read_text() == "not a directory"


def test_the_default_config_and_the_test_configs_are_valid(tmp_path):
    from jaxrl_lp.train.validate import validate

    plan = validate(apply_overrides(default_config(), [f"run.out_dir={tmp_path / 'run'}"]))
    assert plan.max_new_tokens == plan.task.max_completion_tokens
    assert str(plan.loop) == "full/dense"  # `model`: the model's own default exit rule
    assert not (tmp_path / "run").exists()


def test_overlong_buffer_is_checked_against_the_resolved_completion_budget(tmp_path):
    from jaxrl_lp.train.validate import validate

    cfg = lambda *o: apply_overrides(default_config(), [f"run.out_dir={tmp_path / 'run'}", *o])
    budget = validate(cfg()).max_new_tokens  # grpo.max_new_tokens=0: the task's answer length
    assert validate(cfg(f"grpo.overlong_buffer={budget}")).max_new_tokens == budget
    with pytest.raises(ValueError, match=rf"grpo.overlong_buffer={budget + 1} is longer than the "
                                         rf"completion budget of {budget} tokens.*at most {budget}"):
        validate(cfg(f"grpo.overlong_buffer={budget + 1}"))
    with pytest.raises(ValueError, match=r"grpo.max_refill_rounds must be an integer >= 0 "
                                         r"\(further prompt batches .*0: mask"):
        cfg("grpo.max_refill_rounds=-1")
    assert not (tmp_path / "run").exists()


def test_config_file_with_a_syntax_error_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text("from jaxrl_lp.train import default_config\n\nCONFIG = default_config(\n")
    assert main(["train", "--config", str(bad), "--set", f"run.out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxrl-lp train: error: config file") and "\n" not in err
    assert "bad.py" in err and "line 3" in err and "syntax error" in err


def test_config_file_that_raises_names_the_file_line_and_key(tmp_path, capsys):
    bad = tmp_path / "raises.py"
    bad.write_text("import dataclasses\nfrom jaxrl_lp.train import SFTConfig, default_config\n\n"
                   "CONFIG = dataclasses.replace(default_config(), sft=SFTConfig(steps=-5))\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "raises.py" in err and "line 4" in err and "sft.steps" in err and "\n" not in err


def test_config_command_prints_the_resolved_config_which_loads_back(tmp_path, capsys):
    assert main(["config", "--set", "grpo.lr=0.5", "--set", "model.loop_steps=3"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["grpo"]["lr"] == 0.5 and printed["model"]["loop_steps"] == 3
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(printed))
    want = apply_overrides(default_config(), ["grpo.lr=0.5", "model.loop_steps=3"])
    assert load_config(str(path)) == want
    assert main(["config", "--set", "run.checkpoint_every=0"]) == 2
    assert "run.checkpoint_every" in capsys.readouterr().err


def test_plain_jaxrl_lp_prints_help_instead_of_running(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxrl-lp") and "train" in out and "config" in out
    assert list(tmp_path.iterdir()) == []  # no run started


def _show(value):
    """A default as the help writes it (as `--set` takes it)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    return str(value) if value != "" else "''"


@pytest.mark.parametrize("command", ["train", "sft", "config", "eval"])
def test_help_lists_every_config_key_with_its_default(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for section in ("model", "task", "sft", "grpo", "loss", "sync", "run"):
        assert f"\n  {section}: " in out
    for key, value, doc in config_keys(default_config()):
        assert f"    {key} = {_show(value)} " in out or f"    {key} = {_show(value)}\n" in out, key
        assert doc, f"{key} has no description"


def test_every_config_field_is_documented():
    from jaxrl_lp.models.config import ModelConfig
    from jaxrl_lp.rl.loss import LossConfig
    from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig
    from jaxrl_lp.train.sync_hooks import SyncConfig

    for cls in (TrainConfig, ModelConfig, TaskConfig, SFTConfig, GRPOConfig, LossConfig,
                SyncConfig, RunConfig):
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__}: no Attributes entry for {missing}"


@pytest.mark.parametrize("command", [["sample"], ["bench", "sampler"], ["study"]])
def test_program_flags_show_their_defaults(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "(default: " in out
    if command == ["sample"]:
        assert "completion budget per sample (default: 32)" in " ".join(out.split())
