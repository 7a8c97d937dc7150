r"""Multi-turn GRPO on GSM8K with a Python-expression calculator, Qwen3-0.6B on one GPU.

The model writes `<calc>48/2</calc>` and reads `<result>24</result>` before it goes on
(`envs.PythonCalculatorTask`); a turn ends on EOS, on a token ending with `>`, or after
`grpo.max_new_tokens` tokens; an episode has up to `task.max_turns` turns and is rewarded
on its answer (`#### 72`). Every rollout is replayed bit for bit on the verification
steps (docs/design/multiturn.md).

Local files (nothing is downloaded): `data/gsm8k/train.jsonl` (GSM8K's train split,
`question` and `answer` with its `<<48/2=24>>` calculator annotations, which the
warm-start's episodes turn into calls) and `checkpoints/Qwen3-0.6B` (the Hugging Face
checkpoint directory with `tokenizer.json`); see configs/grpo_gsm8k_qwen3_0p6b.py.

Every token ending with `>` ends a turn, so a call costs two turns (`<calc>`, then
`</calc>`); `task.max_turns=8` lets an episode make three calls and answer
(`PythonCalculatorTask.warm_start_turns` counts what the warm-start's episodes need).

Episodes run on one device (a mesh is not composed with them yet): one H200 holds the
model, its optimizer state and the batch below (its KV cache: 256 episodes of about
1,100 slots, some 33 GB in bf16).

    jaxrl-lp train --config configs/grpo_gsm8k_tools_qwen3_0p6b.py
"""

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig, TrainConfig

CONFIG = TrainConfig(
    model=get_preset("qwen3-0.6b"),
    task=TaskConfig(kind="gsm8k_tools", path="data/gsm8k/train.jsonl", max_turns=8),
    sft=SFTConfig(steps=200, batch_size=32, lr=1e-5, warmup_steps=20),
    grpo=GRPOConfig(
        steps=200, prompts_per_step=32, group_size=8, max_new_tokens=96, lr=1e-6,
        micro_batches=8, learner_policy="bf16", sampler_policy="bf16", temperature=1.0,
        verify_every=10),
    run=RunConfig(out_dir="runs/grpo_gsm8k_tools_qwen3_0p6b", eval_every=20, eval_size=256,
                  checkpoint_every=20),
    init_from="checkpoints/Qwen3-0.6B",
)
