"""Data for training: the arithmetic task, GSM8K-format files, rewards and grain pipelines.

A task (`ArithmeticTask`, `GSM8KTask`) has `train` / `heldout` splits,
`prompt_ids(record)` for rollouts, `sft_example(record)` for the warm-start,
and `reward(completion_text, record)` / `rewards(completion_tokens_BxN, records)`.
`prompt_loader` and `sft_loader` turn a split into checkpointable grain batches.
"""

from jaxrl_lp.data.arithmetic import OPS, ArithmeticProblem, ArithmeticSplit, ArithmeticTask
from jaxrl_lp.data.gsm8k import GSM8KTask, load_gsm8k
from jaxrl_lp.data.pipeline import (
    SFTBatch,
    hash_fraction,
    in_heldout,
    prompt_loader,
    sft_batch,
    sft_loader,
)
from jaxrl_lp.data.rewards import (
    completion_text,
    completion_texts,
    exact_match_reward,
    extract_answer,
    gsm8k_reward,
    normalize_number,
    score_completions,
)

__all__ = [
    "OPS",
    "ArithmeticProblem",
    "ArithmeticSplit",
    "ArithmeticTask",
    "GSM8KTask",
    "SFTBatch",
    "completion_text",
    "completion_texts",
    "exact_match_reward",
    "extract_answer",
    "gsm8k_reward",
    "hash_fraction",
    "in_heldout",
    "load_gsm8k",
    "normalize_number",
    "prompt_loader",
    "score_completions",
    "sft_batch",
    "sft_loader",
]
