"""`jaxrl-lp convert`: run checkpoints <-> Hugging Face directories, and the served copy.

    jaxrl-lp convert run-to-hf --run runs/default --out out/default-hf [--step N] [--dtype bf16]
    jaxrl-lp convert hf-to-run --hf ckpt/Qwen3-0.6B --out runs/qwen [--config C] [--set k=v]
    jaxrl-lp convert served --run runs/fair --out out/served [--exporter fmt:nvfp4] [--step N]
    jaxrl-lp convert run-to-peft --run runs/lora --out out/adapter [--step N]

`run-to-hf` writes a LoRA run merged (`W + A B alpha/r`, f32); `run-to-peft` writes its
adapters as a PEFT directory (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained` loads onto the base it names.

Each prints a JSON summary of what it wrote. The served layout is described in
docs/served_layout.md; `jaxrl_lp.sync.served_io.read_served` reads it back.
"""

from __future__ import annotations

import json

from jaxrl_lp.cli.train import add_common


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="run checkpoint <-> Hugging Face directory; the served "
                                       "copy under an exporter",
                       description=__doc__.split("\n\n")[0])
    forms = p.add_subparsers(dest="form", metavar="FORM")

    q = forms.add_parser("run-to-hf", help="a run's params as a Hugging Face directory "
                                           "(config.json, model.safetensors, tokenizer)")
    q.add_argument("--run", required=True, metavar="RUN_DIR", help="the run directory")
    q.add_argument("--out", required=True, metavar="DIR", help="the Hugging Face directory to write")
    q.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    q.add_argument("--dtype", default="f32", choices=("f32", "bf16", "f16"),
                   help="dtype of the saved weights (f32 is exact; others round to nearest even)")
    q.set_defaults(form_func=_run_to_hf)

    q = forms.add_parser("hf-to-run", help="a run directory whose step-0 checkpoint holds a "
                                           "Hugging Face checkpoint's weights")
    q.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face checkpoint directory")
    q.add_argument("--out", required=True, metavar="RUN_DIR", help="the new run directory")
    add_common(q)
    q.set_defaults(form_func=_hf_to_run)

    q = forms.add_parser("served", help="the served copy of a run's params under an exporter "
                                        "(docs/served_layout.md)")
    q.add_argument("--run", required=True, metavar="RUN_DIR", help="the run directory")
    q.add_argument("--out", required=True, metavar="DIR", help="the served directory to write")
    q.add_argument("--exporter", default=None, metavar="SPEC",
                   help="bf16:ROUNDING, f16:ROUNDING (nearest|stochastic|error_feedback), "
                        "fmt:FORMAT (fp8|fp8_e5m2|mxfp8|mxfp4|nvfp4|ternary|binary) or "
                        "ternary:PATH (bf16_then_quantize|direct_codes|bf16_fixed_point); "
                        "default: the run's own sync.exporter, continuing its saved state")
    q.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    q.set_defaults(form_func=_served)

    q = forms.add_parser("run-to-peft", help="a LoRA run's adapters as a PEFT adapter directory "
                                             "(adapter_config.json, adapter_model.safetensors)")
    q.add_argument("--run", required=True, metavar="RUN_DIR", help="the LoRA run directory")
    q.add_argument("--out", required=True, metavar="DIR", help="the adapter directory to write "
                   "(and DIR/base, the base as the run held it, unless that is init_from's f32)")
    q.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    q.set_defaults(form_func=_run_to_peft)

    p.set_defaults(func=run, parser=p)


def run(args) -> int:
    """Runs the chosen form; without one, prints the help (exit status 2)."""
    if getattr(args, "form_func", None) is None:
        args.parser.print_help()
        return 2
    return args.form_func(args)


def _print(summary: dict) -> int:
    print(json.dumps(summary, indent=2))
    return 0


def _run_to_hf(args) -> int:
    from jaxrl_lp.train.convert import run_to_hf

    return _print(run_to_hf(args.run, args.out, step=args.step, dtype=args.dtype))


def _hf_to_run(args) -> int:
    from jaxrl_lp.cli.train import load
    from jaxrl_lp.train.convert import hf_to_run

    return _print(hf_to_run(args.hf, args.out, load(args)))


def _served(args) -> int:
    from jaxrl_lp.train.convert import run_to_served

    return _print(run_to_served(args.run, args.out, exporter=args.exporter, step=args.step))


def _run_to_peft(args) -> int:
    from jaxrl_lp.train.convert import run_to_peft

    return _print(run_to_peft(args.run, args.out, step=args.step))
