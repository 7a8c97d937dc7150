r"""GRPO on GSM8K for Ouro-1.4B (looped: 24 layers x 4 loop steps), bf16 sampler and learner.

Local files (nothing is downloaded; paths are relative to the working directory):

- `data/gsm8k/train.jsonl`: the GSM8K train split, one JSON object per line with
  `question` and `answer` (`... #### 72`): `grade_school_math/data/train.jsonl` of
  openai/grade-school-math, or the Hugging Face `gsm8k` (`main`) parquet file
  (`--set task.path=data/gsm8k/train-00000-of-00001.parquet`).
- `checkpoints/Ouro-1.4B`: the Hugging Face checkpoint directory of
  ByteDance/Ouro-1.4B (`config.json`, the safetensors weights, `tokenizer.json`), e.g.
  `huggingface-cli download ByteDance/Ouro-1.4B --local-dir checkpoints/Ouro-1.4B`.
  The run takes the model from it; the `model` section (the `ouro-1.4b` preset)
  is what `jaxrl-lp plan` compiles when the directory is not there.

Precision (sampler and learner matched; the default is bf16):

    --set grpo.learner_policy=mxfp8 --set grpo.sampler_policy=mxfp8
    --set grpo.learner_policy=nvfp4 --set grpo.sampler_policy=nvfp4

Scale: `run.mesh=fsdp=8` is one 8-GPU node (docs/scale.md). Plan it first:

    jaxrl-lp plan --config configs/grpo_gsm8k_ouro_1p4b.py --mesh fsdp=8 --devices 8 --target h100

A step samples 64 prompts x 8 (512 sequences). Ouro keeps a KV cache per loop
step, so its sampler cache and the learner's activations take about 4x those
of a dense model of its width: the learner recomputes layer activations in the
backward pass (`grpo.remat=layers`) and takes the step in 32 micro-batches (two
sequences a GPU at a time), and the behaviour log-probs go one micro-batch at
a time, which keeps the learner within 19 GB a device (the sampler's cache of
the 512 sequences needs 47 GB). On 64 devices (eight 8-GPU nodes) a
micro-batch needs a sequence for each of them:

    jaxrl-lp plan --config configs/grpo_gsm8k_ouro_1p4b.py --mesh data=8,fsdp=8 --devices 64 \
        --set grpo.micro_batches=8
"""

from jaxrl_lp.models.config import get_preset
from jaxrl_lp.train.config import GRPOConfig, RunConfig, SFTConfig, TaskConfig, TrainConfig

CONFIG = TrainConfig(
    model=get_preset("ouro-1.4b"),
    task=TaskConfig(kind="gsm8k", path="data/gsm8k/train.jsonl"),
    sft=SFTConfig(steps=0),  # start from the pretrained checkpoint
    grpo=GRPOConfig(
        steps=200, prompts_per_step=64, group_size=8, max_new_tokens=512, lr=1e-6,
        micro_batches=32, remat="layers", learner_policy="bf16", sampler_policy="bf16",
        exit_rule="model", compute_mode="dense", temperature=1.0),
    run=RunConfig(out_dir="runs/grpo_gsm8k_ouro_1p4b", eval_every=20, eval_size=256,
                  checkpoint_every=20, mesh="fsdp=8"),
    init_from="checkpoints/Ouro-1.4B",
)
