r"""GRPO on GSM8K for Qwen3-0.6B (dense: 28 layers, tied embeddings), bf16 sampler and learner.

Local files (nothing is downloaded; paths are relative to the working directory):

- `data/gsm8k/train.jsonl`: the GSM8K train split, one JSON object per line with
  `question` and `answer` (`... #### 72`): `grade_school_math/data/train.jsonl` of
  openai/grade-school-math, or the Hugging Face `gsm8k` (`main`) parquet file
  (`--set task.path=data/gsm8k/train-00000-of-00001.parquet`).
- `checkpoints/Qwen3-0.6B`: the Hugging Face checkpoint directory of
  Qwen/Qwen3-0.6B (`config.json`, the safetensors weights, `tokenizer.json`), e.g.
  `huggingface-cli download Qwen/Qwen3-0.6B --local-dir checkpoints/Qwen3-0.6B`.
  The run takes the model from it; the `model` section (the `qwen3-0.6b` preset)
  is what `jaxrl-lp plan` compiles when the directory is not there.

Precision (sampler and learner matched; the default is bf16):

    --set grpo.learner_policy=mxfp8 --set grpo.sampler_policy=mxfp8
    --set grpo.learner_policy=nvfp4 --set grpo.sampler_policy=nvfp4

Scale: `run.mesh=fsdp=8` is one 8-GPU node (docs/scale.md). Plan it first:

    jaxrl-lp plan --config configs/grpo_gsm8k_qwen3_0p6b.py --mesh fsdp=8 --devices 8 --target h100

Each GPU of the 8 holds 8 sequences of a micro-batch (8 micro-batches of the
512 sequences a step makes), which keeps the learner step's activations
within an 80 GB GPU: the plan puts its peak at 59 GB a device. On 64 devices
(eight 8-GPU nodes) a micro-batch needs a sequence on each of them:

    jaxrl-lp plan --config configs/grpo_gsm8k_qwen3_0p6b.py --mesh data=8,fsdp=8 --devices 64 \
        --set grpo.micro_batches=8
"""

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig, TrainConfig

CONFIG = TrainConfig(
    model=get_preset("qwen3-0.6b"),
    task=TaskConfig(kind="gsm8k", path="data/gsm8k/train.jsonl"),
    sft=SFTConfig(steps=0),  # start from the pretrained checkpoint
    grpo=GRPOConfig(
        steps=200, prompts_per_step=64, group_size=8, max_new_tokens=512, lr=1e-6,
        micro_batches=8, learner_policy="bf16", sampler_policy="bf16",
        temperature=1.0),
    run=RunConfig(out_dir="runs/grpo_gsm8k_qwen3_0p6b", eval_every=20, eval_size=256,
                  checkpoint_every=20, mesh="fsdp=8"),
    init_from="checkpoints/Qwen3-0.6B",
)
