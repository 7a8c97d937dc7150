"""Tests for jaxrl_lp.data: the arithmetic task, GSM8K loading and rewards, grain pipelines."""

import json

import grain
import numpy as np
import pytest

from jaxrl_lp.data import (
    ArithmeticProblem,
    ArithmeticTask,
    GSM8KTask,
    SFTBatch,
    completion_text,
    exact_match_reward,
    extract_answer,
    gsm8k_reward,
    load_gsm8k,
    normalize_number,
    prompt_loader,
    sft_batch,
    sft_loader,
)
from jaxrl_lp.models.tokenizer import CharTokenizer

TOK = CharTokenizer()


# --- arithmetic task -------------------------------------------------------------------------


def test_problem_text_and_answers():
    assert ArithmeticProblem(23, "+", 58).prompt == "23+58="
    assert ArithmeticProblem(23, "+", 58).answer == "81"
    assert ArithmeticProblem(23, "-", 58).answer == "-35"
    assert ArithmeticProblem(23, "*", 58).answer == "1334"


def test_generator_is_deterministic_given_seed():
    a, b = ArithmeticTask(seed=3), ArithmeticTask(seed=3)
    assert list(a.train[:100]) == list(b.train[:100])
    assert list(a.heldout[:100]) == list(b.heldout[:100])
    other = ArithmeticTask(seed=4)
    assert list(other.train[:100]) != list(a.train[:100])
    # The seed orders the splits; which problems are held out does not depend on it.
    assert set(other.heldout) == set(a.heldout)


def test_sampled_space_is_deterministic_and_disjoint():
    a = ArithmeticTask(ops="+-*", max_digits=5, seed=1)
    b = ArithmeticTask(ops="+-*", max_digits=5, seed=1)
    assert len(a.train) == a.sampled_size
    assert [a.train[i] for i in (0, 7, 12345)] == [b.train[i] for i in (0, 7, 12345)]
    assert a.train[-1] == a.train[len(a.train) - 1]
    train, heldout = set(a.train[:2000]), set(a.heldout[:200])
    assert not train & heldout
    assert {p.op for p in train} == {"+", "-", "*"}
    assert all(0 <= p.a < 10**5 and 0 <= p.b < 10**5 for p in train)
    with pytest.raises(IndexError):
        a.train[len(a.train)]


def test_sampled_and_enumerated_splits_agree():
    enumerated = ArithmeticTask(ops="+-", max_digits=2)
    sampled = ArithmeticTask(ops="+-", max_digits=2, max_enumerate=0, sampled_size=300)
    assert len(sampled.heldout) == 300
    assert set(sampled.heldout) <= set(enumerated.heldout)
    assert set(sampled.train) <= set(enumerated.train)


def test_train_and_heldout_are_disjoint_and_cover_the_space():
    task = ArithmeticTask(ops="+-", max_digits=2)
    train, heldout = set(task.train), set(task.heldout)
    assert len(train) == len(task.train) and len(heldout) == len(task.heldout)  # no repeats
    assert not train & heldout
    assert len(train) + len(heldout) == 2 * 100 * 100
    frac = len(heldout) / (len(train) + len(heldout))
    assert abs(frac - task.heldout_fraction) < 0.02, frac


def test_sft_example_format():
    task = ArithmeticTask()
    problem = ArithmeticProblem(23, "+", 58)
    prompt, completion = task.sft_example(problem)
    assert prompt[0] == TOK.bos_id and TOK.decode(prompt) == "23+58="
    assert completion[-1] == TOK.eos_id and TOK.decode(completion) == "81"
    assert task.prompt_ids(problem) == prompt
    longest = max(len(p) + len(c) for p, c in map(task.sft_example, task.train))
    assert longest == task.max_sequence_length
    assert max(len(task.sft_example(p)[1]) for p in task.train) == task.max_completion_tokens
    mixed = ArithmeticTask(ops="-*", max_digits=2)
    assert mixed.max_completion_tokens == len("9801") + 1


@pytest.mark.parametrize("kwargs, field", [
    ({"ops": "/"}, "ops"), ({"ops": "++"}, "ops"), ({"max_digits": 0}, "max_digits"),
    ({"heldout_fraction": 1.0}, "heldout_fraction"), ({"format_reward": 1.0}, "format_reward"),
])
def test_task_validates_its_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTask(**kwargs)


# --- rewards ---------------------------------------------------------------------------------


def test_completion_text_stops_at_eos_and_needs_one():
    assert completion_text(TOK.encode("81", add_eos=True) + [TOK.pad_id] * 3, TOK) == "81"
    assert completion_text(TOK.encode("81"), TOK) is None
    assert completion_text([TOK.eos_id], TOK) == ""


def test_arithmetic_reward_is_exact():
    task = ArithmeticTask()
    p = ArithmeticProblem(23, "+", 58)

    def score(ids):
        return task.reward(completion_text(ids, TOK), p)

    assert score(TOK.encode("81", add_eos=True)) == 1.0
    assert score(TOK.encode("82", add_eos=True)) == 0.0
    for extra in ("81 ", " 81", "810", "81.", "+81", "081"):
        assert score(TOK.encode(extra, add_eos=True)) == 0.0, extra
    assert score(TOK.encode("81")) == 0.0  # never emitted EOS: truncated
    assert score([TOK.encode("8")[0], TOK.pad_id, TOK.encode("1")[0], TOK.eos_id]) == 0.0
    # Everything after the first EOS is ignored.
    assert score(TOK.encode("81", add_eos=True) + TOK.encode("99", add_eos=True)) == 1.0


def test_format_reward_and_batched_rewards():
    assert exact_match_reward("82", "81", format_reward=0.1) == pytest.approx(0.1, abs=0)
    assert exact_match_reward("8x", "81", format_reward=0.1) == 0.0
    assert exact_match_reward(None, "81", format_reward=0.1) == 0.0
    task = ArithmeticTask()
    problems = [ArithmeticProblem(1, "+", 2), ArithmeticProblem(5, "+", 5),
                ArithmeticProblem(9, "+", 9)]
    rows = [TOK.encode("3", add_eos=True), TOK.encode("11", add_eos=True), TOK.encode("18")]
    tokens = np.full((3, 4), TOK.pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    r = task.rewards(tokens, problems)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, np.array([1.0, 0.0, 0.0], np.float32))


@pytest.mark.parametrize("text, want", [
    ("She pays 2 * 617 = 1234 dollars.\n#### 1,234", "1234"),
    ("The answer is $5.", "5"),
    ("#### 72\n", "72"),
    ("#### 72", "72"),
    ("no number here", None),
    ("", None),
    (None, None),
    ("The temperature drops to -3 degrees.", "-3"),
    ("#### -12", "-12"),
    ("It costs $3.50 in total.", "3.5"),
    ("#### 0.25", "0.25"),
    ("#### 5.00", "5"),
    ("#### $1,000,000", "1000000"),
    ("first 3, then 7 #### 10 and later 99", "10"),
    ("#### no number but 41 earlier... then 42", "42"),
    ("items 1,2,3", "3"),
    ("10 - 5 = 5", "5"),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want


def test_normalize_number():
    assert normalize_number("$1,234.50") == "1234.5"
    assert normalize_number("-007") == "-7"
    assert normalize_number("-0") == "0"
    assert normalize_number("3.") == "3"
    assert normalize_number("abc") is None


def test_gsm8k_reward_compares_numbers():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert gsm8k_reward("48 + 24 = 72. #### 72", gold) == 1.0
    assert gsm8k_reward("So the answer is 72.00", gold) == 1.0
    assert gsm8k_reward("#### 71", gold) == 0.0
    assert gsm8k_reward("I don't know", gold) == 0.0
    assert gsm8k_reward(None, gold) == 0.0
    assert gsm8k_reward("#### 1,234", "#### 1234") == 1.0
    with pytest.raises(ValueError, match="gold answer"):
        gsm8k_reward("#### 1", "no final answer")


# --- GSM8K loading ---------------------------------------------------------------------------

RECORDS = [
    {"question": "What is 2+3?", "answer": "2+3=5\n#### 5"},
    {"question": "Tom has 4 apples and eats 1. How many are left?", "answer": "4-1=3\n#### 3"},
    {"question": "What is 6*7?", "answer": "#### 42", "extra": 1},
]


def _write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_load_gsm8k_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [json.dumps(r) for r in RECORDS] + [""])
    records = load_gsm8k(path)
    assert records == [{"question": r["question"], "answer": r["answer"]} for r in RECORDS]
    assert [extract_answer(r["answer"]) for r in records] == ["5", "3", "42"]


def test_load_gsm8k_missing_and_empty(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_gsm8k(missing)
    with pytest.raises(FileNotFoundError, match="directory"):
        load_gsm8k(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*no examples"):
        load_gsm8k(empty)
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        (tmp_path / "data.csv").write_text("question,answer\n")
        load_gsm8k(tmp_path / "data.csv")


@pytest.mark.parametrize("bad_line, what", [
    ('{"question": "q", "answer": ', "invalid JSON"),
    ('{"question": "q"}', "missing key 'answer'"),
    ('["q", "a"]', "expected a JSON object"),
    ('{"question": "q", "answer": 5}', "'answer' must be a string"),
])
def test_load_gsm8k_names_the_bad_line(tmp_path, bad_line, what):
    good = json.dumps(RECORDS[0])
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, "", bad_line, good])
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 3: " + what):
        load_gsm8k(path)


def test_load_gsm8k_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([dict(r, extra=0) for r in RECORDS[:2]]), path)
    assert load_gsm8k(path) == RECORDS[:2]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q"], "solution": ["#### 1"]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet.*missing column.*'answer'"):
        load_gsm8k(bad)
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"question": ["q", "r"], "answer": ["#### 1", None]}), nulls)
    with pytest.raises(ValueError, match=r"nulls\.parquet: row 2: 'answer' must be a string"):
        load_gsm8k(nulls)


def test_gsm8k_task(tmp_path):
    records = load_gsm8k(_write_jsonl(tmp_path / "t.jsonl", [json.dumps(r) for r in RECORDS]))
    task = GSM8KTask(records, TOK, heldout_records=records[:1])
    assert task.train == records and task.heldout == records[:1]
    prompt, completion = task.sft_example(records[0])
    assert prompt[0] == TOK.bos_id and TOK.decode(prompt) == "Question: What is 2+3?\nAnswer:"
    assert completion[-1] == TOK.eos_id and completion_text(completion, TOK) == " 2+3=5\n#### 5"
    assert task.reward(completion_text(completion, TOK), records[0]) == 1.0
    assert task.reward("#### 6", records[0]) == 0.0
    split = GSM8KTask(records * 20, TOK, heldout_fraction=0.5)
    assert split.train and split.heldout
    assert not {r["question"] for r in split.train} & {r["question"] for r in split.heldout}


# --- pipelines -------------------------------------------------------------------------------


def test_prompt_loader_state_round_trip():
    task = ArithmeticTask()
    it = iter(prompt_loader(task.train, batch_size=8, seed=7))
    batches, state = [], None
    for i in range(5):
        batches.append(next(it))
        if i == 1:
            state = it.get_state()
    assert all(len(b) == 8 and isinstance(b[0], ArithmeticProblem) for b in batches)
    json.dumps(state)  # a checkpoint can store it as plain JSON
    resumed = iter(prompt_loader(task.train, batch_size=8, seed=7))
    resumed.set_state(state)
    assert [next(resumed) for _ in range(3)] == batches[2:]


def test_prompt_loader_prefetching_gives_the_same_batches():
    records = list(range(100))
    sync = iter(prompt_loader(records, 8, seed=3))
    threaded = iter(prompt_loader(records, 8, seed=3, read_options=grain.ReadOptions(
        num_threads=2, prefetch_buffer_size=4)))
    assert [next(sync) for _ in range(20)] == [next(threaded) for _ in range(20)]
    state = threaded.get_state()
    resumed = iter(prompt_loader(records, 8, seed=3))
    resumed.set_state(state)
    assert next(resumed) == next(threaded)


def test_prompt_loader_epochs_and_order():
    records = list(range(10))
    one_epoch = list(prompt_loader(records, batch_size=4, seed=0, shuffle=False, num_epochs=1))
    assert one_epoch == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    shuffled = list(prompt_loader(records, 5, seed=1, num_epochs=2))
    epoch0, epoch1 = shuffled[0] + shuffled[1], shuffled[2] + shuffled[3]
    assert sorted(epoch0) == sorted(epoch1) == records
    assert epoch0 != records and epoch1 != epoch0  # reshuffled every epoch
    assert list(prompt_loader(records, 5, seed=1, num_epochs=2)) == shuffled
    with pytest.raises(ValueError, match="no records"):
        prompt_loader([], 4, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        prompt_loader(records, 0, seed=0)


def test_sft_batch_pads_and_masks():
    b = sft_batch([([1, 5, 6], [7, 2]), ([1, 5], [2])], pad_id=0, seq_len=6)
    assert isinstance(b, SFTBatch)
    assert b.tokens_BxL.dtype == np.int32 and b.loss_mask_BxL.dtype == np.float32
    np.testing.assert_array_equal(b.tokens_BxL, [[1, 5, 6, 7, 2, 0], [1, 5, 2, 0, 0, 0]])
    np.testing.assert_array_equal(b.loss_mask_BxL, [[0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0]])
    assert sft_batch([([1], [2])], pad_id=0).tokens_BxL.shape == (1, 2)
    with pytest.raises(ValueError, match="seq_len=4"):
        sft_batch([([1, 5, 6], [7, 2])], pad_id=0, seq_len=4)
    with pytest.raises(ValueError, match="empty prompt"):
        sft_batch([([], [7, 2])], pad_id=0)


def test_sft_batch_takes_a_per_token_loss_mask_and_pairs_stay_as_they_were():
    pairs = [([1, 5, 6], [7, 2]), ([1, 5], [2])]
    masked = [([1, 5], [7, 8, 2], [1.0, 0.0, 1.0]), ([1], [3, 2])]
    b = sft_batch(masked + pairs, pad_id=0, seq_len=6)
    np.testing.assert_array_equal(b.tokens_BxL, [[1, 5, 7, 8, 2, 0], [1, 3, 2, 0, 0, 0],
                                                 [1, 5, 6, 7, 2, 0], [1, 5, 2, 0, 0, 0]])
    np.testing.assert_array_equal(b.loss_mask_BxL, [[0, 0, 1, 0, 1, 0], [0, 1, 1, 0, 0, 0],
                                                    [0, 0, 0, 1, 1, 0], [0, 0, 1, 0, 0, 0]])
    assert b.tokens_BxL.dtype == np.int32 and b.loss_mask_BxL.dtype == np.float32
    # A batch of pairs is what it was before masks existed, bit for bit: a mask of ones.
    alone = sft_batch(pairs, pad_id=0, seq_len=6)
    ones = sft_batch([(p, c, [1.0] * len(c)) for p, c in pairs], pad_id=0, seq_len=6)
    for x in (alone, ones):
        assert x.tokens_BxL.tobytes() == b.tokens_BxL[2:].tobytes()
        assert x.loss_mask_BxL.tobytes() == b.loss_mask_BxL[2:].tobytes()
    with pytest.raises(ValueError, match="example 0 has 3 completion tokens and a loss mask of 2"):
        sft_batch([([1], [7, 8, 2], [1.0, 0.0])], pad_id=0)


def test_sft_loader_keeps_a_multi_turn_tasks_observations_out_of_the_loss():
    from jaxrl_lp.envs import CalculatorTask

    task = CalculatorTask(tool_fraction=1.0)  # every episode calls the calculator
    it = iter(sft_loader(task.train, task.sft_example, 8, seed=0, pad_id=TOK.pad_id,
                         seq_len=task.max_sequence_length))
    batch = next(it)
    for row, mask in zip(batch.tokens_BxL, batch.loss_mask_BxL, strict=True):
        text = TOK.decode(row)
        prompt, episode = text.split("=", 1)
        a, b = (int(x) for x in prompt.split("*"))
        value = str(a * b)
        assert episode == f"{a}*{b}?{value};{value}"
        start = len(TOK.encode(prompt + "=", add_bos=True))
        n = len(TOK.encode(episode, add_eos=True))
        call, observation = len(f"{a}*{b}?"), len(value) + 1
        expected = [0.0] * start + [1.0] * call + [0.0] * observation + [1.0] * (n - call
                                                                                 - observation)
        assert mask.tolist() == expected + [0.0] * (len(row) - start - n)


def test_sft_loader_shapes_and_state():
    task = ArithmeticTask()

    def loader():
        return iter(sft_loader(task.train, task.sft_example, 16, seed=2,
                               pad_id=TOK.pad_id, seq_len=task.max_sequence_length))

    it = loader()
    first = next(it)
    state = it.get_state()
    second = next(it)
    assert first.tokens_BxL.shape == (16, task.max_sequence_length)
    # Every row holds its answer then EOS under the mask.
    for row, mask in zip(first.tokens_BxL, first.loss_mask_BxL, strict=True):
        target = row[mask == 1]
        assert target[-1] == TOK.eos_id
        prompt = TOK.decode(row[:np.argmax(mask)])
        a, b = prompt[:-1].split("+")
        assert TOK.decode(target) == str(int(a) + int(b))
    resumed = loader()
    resumed.set_state(state)
    again = next(resumed)
    np.testing.assert_array_equal(again.tokens_BxL, second.tokens_BxL)
    np.testing.assert_array_equal(again.loss_mask_BxL, second.loss_mask_BxL)
