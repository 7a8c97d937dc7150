"""`jaxrl-lp sample`: generate from a checkpoint directory or a preset, print the text.

    jaxrl-lp sample --checkpoint ckpt/Qwen3-0.6B --prompt "The capital of France is" --greedy
    jaxrl-lp sample --preset tiny-ouro --seed 0 --prompt "12+30=" --num-samples 4 \\
        --exit-rule threshold:0.9 --compute-mode deferred --out rollouts.npz

The model comes from a Hugging Face safetensors directory (`models.from_pretrained`)
or from a preset with random weights (seeded). The tokenizer is the
checkpoint's `tokenizer.json`, or `--tokenizer PATH`, or the built-in character
tokenizer (`--tokenizer char`, the default for presets); prompts may also be
given as token ids. With `--out` the rollouts are written as `.npz`: every
array of the `Rollout` plus its static fields and the decoded texts.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from jaxrl_lp.cli.help import show_defaults
from jaxrl_lp.cli.main import UserError
from jaxrl_lp.numerics.policy import policy_arg

SPECIALS_NOTE = "ids the tokenizer does not know are shown as [#id]"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "sample", help="generate text from a checkpoint directory or a preset",
        description=__doc__.split("\n\n")[0] + " " + SPECIALS_NOTE + ".")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR",
                     help="Hugging Face safetensors directory (config.json + model.safetensors)")
    src.add_argument("--preset", help="a model preset with random weights, e.g. tiny-qwen3, "
                                      "tiny-ouro (see models.PRESETS)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random preset weights and of the sampling key")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json (or its directory), or 'char'; default: the "
                        "checkpoint's tokenizer.json, else the character tokenizer")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the BOS token to text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="completion budget per sample")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt (G)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="logits are divided by it (> 0; log-probs are recorded at it)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--exit-rule", default="model",
                   help="looped models: model (the checkpoint's own read-out: an Ouro "
                        "config's early_exit_step/early_exit_threshold), full, fixed:K or "
                        "threshold:T[:MIN_LOOPS]")
    p.add_argument("--compute-mode", default="dense", choices=("dense", "deferred"),
                   help="looped models: run every loop step, or stop each token at its exit")
    p.add_argument("--policy", default="fp32", type=policy_arg,
                   help="precision policy, e.g. fp32, bf16")
    p.add_argument("--eos-id", type=int, default=None,
                   help="end-of-sequence id (default: the tokenizer's, else the config's; "
                        "-1 for none)")
    p.add_argument("--out", default=None, metavar="FILE.npz", help="write the rollouts here")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion")
    show_defaults(p)
    p.set_defaults(func=run)


def _load_model(args):
    """(cfg, params, where the tokenizer may be found)."""
    import jax

    from jaxrl_lp.models import from_pretrained, get_preset, init_params

    if args.checkpoint:
        model = from_pretrained(args.checkpoint)  # f32 master weights; the policy rounds them
        return model.config, model.params(), args.checkpoint
    cfg = get_preset(args.preset)
    return cfg, init_params(cfg, jax.random.PRNGKey(args.seed)), None


def _load_tokenizer(spec, checkpoint, vocab_size):
    from jaxrl_lp.models.tokenizer import CharTokenizer, HFTokenizer

    if spec is None and checkpoint and os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        spec = checkpoint
    elif spec is None and checkpoint:
        fits = CharTokenizer().vocab_size <= vocab_size
        print(f"jaxrl-lp sample: warning: {checkpoint} has no tokenizer.json; "
              + ("falling back to the built-in character tokenizer" if fits else
                 "the character tokenizer does not fit its vocabulary, so text is shown as [#id]")
              + " (pass --tokenizer PATH/tokenizer.json for the model's own)", file=sys.stderr)
    if spec is None or spec == "char":
        tok = CharTokenizer()
        if tok.vocab_size > vocab_size:
            if spec == "char":
                raise UserError(f"the character tokenizer has {tok.vocab_size} ids but the model "
                                f"only {vocab_size}")
            return None
        return tok
    return HFTokenizer.from_file(spec)


def _decode(tok, ids) -> str:
    """Text of `ids`; ids outside the tokenizer's vocabulary are written [#id]."""
    if tok is None:
        return " ".join(f"[#{int(i)}]" for i in ids)
    out, run = [], []
    for i in map(int, ids):
        if 0 <= i < tok.vocab_size:
            run.append(i)
            continue
        if run:
            out.append(tok.decode(run))
            run = []
        out.append(f"[#{i}]")
    if run:
        out.append(tok.decode(run))
    return "".join(out)


def _prompts(args, tok, vocab_size) -> list[list[int]]:
    prompts = []
    for text in args.prompt:
        if tok is None:
            raise UserError("no tokenizer for text prompts (the model's vocabulary is smaller "
                            "than the character tokenizer's); use --prompt-ids or --tokenizer")
        add_bos = tok.bos_id is not None and not args.no_bos
        prompts.append(tok.encode(text, add_bos=add_bos))
    for spec in args.prompt_ids:
        try:
            prompts.append([int(x) for x in spec.replace(" ", "").split(",") if x])
        except ValueError:
            raise UserError(f"--prompt-ids {spec!r}: expected comma-separated integers") from None
    if not prompts:
        bos = None if tok is None else tok.bos_id
        if bos is None:
            raise UserError("give at least one --prompt or --prompt-ids (the tokenizer has no "
                            "BOS token to start from)")
        prompts = [[bos]]
    return prompts


def run(args) -> int:
    import jax

    from jaxrl_lp.rollout import LoopSpec, SamplingConfig, generate

    cfg, params, ckpt = _load_model(args)
    tok = _load_tokenizer(args.tokenizer, ckpt, cfg.vocab_size)
    prompts = _prompts(args, tok, cfg.vocab_size)
    eos = args.eos_id
    if eos is None:
        eos = tok.eos_id if tok is not None and tok.eos_id is not None else cfg.eos_token_id
    elif eos < 0:
        eos = None
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (
        tok.pad_id if tok is not None and tok.pad_id is not None else 0)
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p)
    loop = LoopSpec(args.exit_rule, args.compute_mode)
    if not cfg.is_looped and (args.exit_rule not in ("model", "full")
                              or args.compute_mode != "dense"):
        raise UserError("--exit-rule and --compute-mode apply to looped models only")
    ro = generate(params, cfg, prompts, policy=args.policy, sampling=sampling,
                  max_new_tokens=args.max_new_tokens, num_samples=args.num_samples, eos_id=eos,
                  pad_id=pad, loop=loop, key=jax.random.PRNGKey(args.seed))
    ro = jax.device_get(ro)
    comp, mask = np.asarray(ro.completion_tokens), np.asarray(ro.completion_mask)
    lps, exits = np.asarray(ro.logprobs), np.asarray(ro.exit_steps)
    g = args.num_samples
    texts = []
    for row in range(comp.shape[0]):
        n = int(mask[row].sum())
        ids = comp[row, :n]
        ended = eos is not None and n > 0 and ids[-1] == eos
        text = _decode(tok, ids[:-1] if ended else ids)
        texts.append(text)
        prompt_ids = prompts[row // g]
        if args.json:
            rec = {"prompt": row // g, "sample": row % g, "prompt_text": _decode(tok, prompt_ids),
                   "completion_text": text, "completion_ids": ids.tolist(), "eos": bool(ended),
                   "logprob": float(lps[row, :n].sum())}
            if cfg.is_looped:
                rec["exit_steps"] = exits[row, :n].tolist()
            print(json.dumps(rec))
        else:
            tail = f"{n} tokens{', EOS' if ended else ''}, logprob {lps[row, :n].sum():.3f}"
            if cfg.is_looped:
                tail += f", mean exit step {exits[row, :n].mean():.2f}"
            print(f"[{row // g}.{row % g}] {_decode(tok, prompt_ids)!r} -> {text!r}  ({tail})")
    if args.out:
        arrays = {k: np.asarray(getattr(ro, k)) for k in (
            "prompt_tokens", "prompt_lengths", "completion_tokens", "completion_mask", "logprobs",
            "exit_steps", "loop_evals", "weights_version")}
        np.savez(args.out, **arrays, policy=np.array(str(ro.policy)), loop=np.array(str(ro.loop)),
                 temperature=np.array(ro.temperature), texts=np.array(texts, dtype=str))
        if not args.json:
            print(f"wrote {comp.shape[0]} rollouts to {args.out}")
    return 0
