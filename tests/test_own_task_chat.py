"""A user's own task on a checkpoint that chats, and a multi-turn environment of one's own,
through the trainer.

The checkpoint is a tiny random model in the Hugging Face layout with a Qwen-style
tokenizer and the verbatim Qwen3 chat template (`tests/chat_helpers.py`): the dataset
task's prompts are the template's rendering, equal to `transformers`' ids, and its tool
results are tool messages, appended token by token. The environment written here (a
number to guess, with hints) is no calculator: its episodes end at different turns, and
every verified step's replay is the sampler's bits.
"""

import json

import jax
import numpy as np
import pytest
from chat_helpers import make_chat_checkpoint_tokenizer
from helpers import sets

from jaxrl_lp.cli.main import main as cli_main
from jaxrl_lp.envs import StepResult, Turn
from jaxrl_lp.models import get_preset, init_params
from jaxrl_lp.models.hf_io import save_hf_checkpoint
from jaxrl_lp.models.tokenizer import HFTokenizer
from jaxrl_lp.train import apply_overrides, default_config, run_train
from jaxrl_lp.train.task_source import build_task

transformers = pytest.importorskip("transformers")


def chat_checkpoint(path, template="qwen3"):
    """A tiny random qwen3-shaped checkpoint whose tokenizer carries `template`."""
    make_chat_checkpoint_tokenizer(path, template)
    tok = HFTokenizer.from_file(path)
    mcfg = get_preset("tiny-qwen3").replace(vocab_size=tok.vocab_size, bos_token_id=None,
                                            eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    save_hf_checkpoint(path, mcfg, init_params(mcfg, jax.random.PRNGKey(0)))
    return path


def write_questions(path, n=60):
    """Half the prompts a string, half a chat `messages` list."""
    with open(path, "w") as f:
        for i in range(n):
            q = f"What is {i} plus {i % 7}?"
            prompt = q if i % 2 else [{"role": "user", "content": q}]
            f.write(json.dumps({"prompt": prompt, "answer": str(i + i % 7)}) + "\n")
    return path


TOOLS = '''
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b
'''


@pytest.fixture
def chat_dir(tmp_path, monkeypatch):
    d = tmp_path / "user"
    d.mkdir()
    chat_checkpoint(d / "ckpt")
    write_questions(d / "questions.jsonl")
    (d / "mytools.py").write_text(TOOLS)
    monkeypatch.syspath_prepend(str(d))
    return d


def _chat_sets(d, *more):
    return ["task.kind=dataset", f"task.path={d / 'questions.jsonl'}", f"init_from={d / 'ckpt'}",
            "task.system_prompt=Answer with a number.",
            "task.template_options=enable_thinking=false", "sft.steps=1", "sft.batch_size=4",
            "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
            "grpo.max_new_tokens=8", "grpo.verify_every=1", "run.eval_size=4",
            "run.progress=false", *more]


def test_prompts_are_the_checkpoints_template_as_transformers_renders_it(chat_dir, tmp_path):
    cfg = apply_overrides(default_config(), _chat_sets(chat_dir, f"run.out_dir={tmp_path / 'r'}"))
    task = build_task(cfg)
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_dir / "ckpt"))
    for record in task.train[:4]:
        prompt = record["prompt"]
        messages = [{"role": "system", "content": "Answer with a number."},
                    *([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                      else prompt)]
        want = hf.apply_chat_template(messages, add_generation_prompt=True,
                                      enable_thinking=False, tokenize=True, return_dict=False)
        assert task.prompt_ids(record) == list(want)
    # the warm-start's completion ends with the template's end of turn: the EOS the sampler
    # stops on
    _, completion = task.sft_example(task.train[0])
    assert completion[-1] == hf.convert_tokens_to_ids("<|im_end|>")


def test_a_dataset_task_trains_from_a_chat_checkpoint_exactly(chat_dir, tmp_path):
    run = tmp_path / "run"
    assert cli_main(["train", *sets(*_chat_sets(chat_dir, f"run.out_dir={run}"))]) == 0
    grpo = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in grpo if r["phase"] == "grpo"]
    assert len(grpo) == 2 and all("reward/exact_match" in r for r in grpo)
    assert all(r["replay_verified"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0 for r in grpo)


def test_a_tool_call_is_answered_by_a_tool_message_token_by_token(chat_dir, tmp_path):
    """`task.tools`: the turn that stops on </tool_call> is read for calls, each answered by a
    tool message, which the template renders exactly as a conversation holding it."""
    cfg = apply_overrides(default_config(), _chat_sets(chat_dir, f"run.out_dir={tmp_path / 'r'}",
                                                       "task.tools=mytools:add"))
    task = build_task(cfg)
    tok = task.tokenizer
    assert task.stop_token_ids == (tok.encode("</tool_call>")[0],)
    record = task.train[0]
    env = task.make_env()
    prompt_ids = env.reset(record)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    ids = tok.encode(call)
    result = env.step(Turn(tuple(ids), tok.decode(ids), "stop"))
    assert result.messages == ({"role": "tool", "content": "5"},) and result.info["tool_ok"]
    observation = task.observation_ids(result, "stop")
    # transformers: the prompt as it renders it (the tool schema in its system message), and
    # the conversation with the call and its tool message, which ends with the call then the
    # observation (a re-render drops the empty think block enable_thinking=false put in the
    # first generation prompt: the sampler's context keeps what it was given, token by token).
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_dir / "ckpt"))
    messages = [{"role": "system", "content": "Answer with a number."},
                *([{"role": "user", "content": record["prompt"]}]
                  if isinstance(record["prompt"], str) else record["prompt"])]
    render = lambda m, **kw: hf.apply_chat_template(m, tools=list(task.tools),
                                                    add_generation_prompt=True,
                                                    enable_thinking=False, **kw)
    assert prompt_ids == list(render(messages, tokenize=True, return_dict=False))
    text = render([*messages, {"role": "assistant", "content": call},
                   {"role": "tool", "content": "5"}], tokenize=False)
    shown = tok.decode(observation, skip_special=False)
    assert text.endswith(call + shown) and shown.startswith("<|im_end|>")
    assert observation == hf.encode(shown, add_special_tokens=False)
    mul = tok.encode('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    bad = env.step(Turn(tuple(mul), tok.decode(mul), "stop"))
    assert bad.info["tool_ok"] is False and "no tool 'mul'" in bad.messages[0]["content"]


GUESS = '''
from jaxrl_lp.envs import StepResult

TURNS = {}  # episode -> the turns it took, read by the test


class Guess:
    """Guess the hidden digit: a digit then EOS ends the episode, rewarded 1 if right; any
    other turn (a guess ended by "?", or cut by the turn limit) gets a hint and goes on."""

    def reset(self, record):
        self.digit, self.turns = int(record["answer"]), 0

    def step(self, turn):
        self.turns += 1
        TURNS[id(self)] = self.turns
        text = turn.text.rstrip("?")
        if turn.ended_by == "eos":
            return StepResult(reward=float(text == str(self.digit)), done=True)
        if not text.isdigit():
            return StepResult(observation="digit;")
        return StepResult(observation="higher;" if int(text) < self.digit else "lower;")


def make_env():
    return Guess()
'''


def test_an_environment_of_ones_own_trains_with_every_step_exact(tmp_path, monkeypatch):
    d = tmp_path / "user"
    d.mkdir()
    (d / "guess.py").write_text(GUESS)
    with open(d / "digits.jsonl", "w") as f:
        for i in range(80):
            f.write(json.dumps({"prompt": f"guess {i}:", "answer": str(i * 7 % 10)}) + "\n")
    monkeypatch.syspath_prepend(str(d))
    import guess

    run = tmp_path / "run"
    overrides = ["model.family=qwen3", "model.loop_steps=1", "model.hidden_size=32",
                 "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1",
                 "model.head_dim=16", "model.intermediate_size=64", "model.max_position_embeddings=128",
                 "task.kind=dataset",
                 f"task.path={d / 'digits.jsonl'}", "task.env=guess:make_env", "task.stop=?",
                 "task.max_turns=4", "task.max_turn_tokens=3", "task.max_observation_tokens=8",
                 "sft.steps=20", "sft.lr=1e-2", "sft.batch_size=16", "grpo.steps=3",
                 "grpo.prompts_per_step=4",
                 "grpo.group_size=4", "grpo.verify_every=1", "grpo.temperature=2.0",
                 "run.eval_size=4", "run.progress=false", f"run.out_dir={run}"]
    summary = run_train(apply_overrides(default_config(), overrides))
    assert summary["steps"] == 23
    grpo = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in grpo if r["phase"] == "grpo"]
    assert len(grpo) == 3
    assert all(r["replay_verified"] == 1.0 and r["mismatch_max_abs_dlogp"] == 0.0 for r in grpo)
    turns = sorted(guess.TURNS.values())  # episodes end at different turns
    assert len(set(turns)) > 1, turns
    assert any(r["env_tokens"] > 0 for r in grpo)  # hints were read


def test_an_observation_the_tokenizer_cannot_encode_fails_its_episode_not_the_run():
    from jaxrl_lp.envs import EnvRunner
    from jaxrl_lp.models.tokenizer import CharTokenizer
    from jaxrl_lp.train.episodes import _observation

    class Task:
        tokenizer = CharTokenizer("0123456789")

    runner = EnvRunner(failure_reward=-1.0)
    ids, res = _observation(Task(), StepResult(observation="12"), "stop", runner)
    assert ids == tuple(Task.tokenizer.encode("12")) and not res.done
    ids, res = _observation(Task(), StepResult(observation="1x"), "stop", runner)
    assert ids == () and res.done and res.reward == -1.0
    assert res.info["failed"].startswith("error: observation: ValueError")
    assert runner.failures["error"] == 1
    np.testing.assert_equal(_observation(Task(), StepResult(
        messages=({"role": "tool", "content": "1"},)), "stop", runner)[1].reward, -1.0)


def test_an_episodes_text_is_scored_by_the_reward_functions_when_it_ends():
    """`EnvDatasetTask` with reward functions: the episode's turns and observations, joined,
    are scored when the environment ends it or at the turn limit's turn (which the sampler
    would otherwise end unscored), added to the environment's reward."""
    from jaxrl_lp.tasks import EnvDatasetTask, RewardFunction, char_tokenizer_for

    class Echo:  # never ends an episode itself; 0.5 for a turn ended by EOS
        def step(self, turn):
            return StepResult(reward=0.5, done=True) if turn.ended_by == "eos" else \
                StepResult(observation="!")

    def has_answer(completions, answer, **kwargs):
        return [float(answer_ in c) for c, answer_ in zip(completions, answer, strict=True)]

    records = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    tok = char_tokenizer_for(["q0123456789!"])
    task = EnvDatasetTask(records, tok, [RewardFunction("has_answer", has_answer, 2.0)],
                          env_factory=Echo, max_turns=3, stop=("?",))
    record = task.train[0]
    turn = lambda text, how: Turn(tuple(tok.encode(text)), text, how)
    env = task.make_env()
    assert env.reset(record) == tok.encode(record["prompt"], add_bos=True)
    assert env.step(turn("x?", "stop")).observation == "!"
    assert not env.step(turn("y?", "stop")).done
    last = env.step(turn(record["answer"] + "?", "stop"))  # the limit's turn: scored
    assert last.done and last.reward == 2.0 and last.info["reward_parts"] == {"has_answer": 1.0}
    env.reset(record)
    ended = env.step(turn("no", "eos"))
    assert ended.done and ended.reward == 0.5 and ended.info["reward_parts"] == {"has_answer": 0.0}
