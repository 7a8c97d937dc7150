"""Typed inside, strings at the edge: a policy string is parsed only where it enters.

The boundary is a config (`train.grpo_config`: `GRPOConfig.policies`), a command line
(`numerics.policy.policy_arg`, argparse's `type`), and Hugging Face loading
(`models.hf_io.from_pretrained`); everything below takes a `Policy`. This reads every
source file of the package for calls of `Policy.parse`.
"""

import ast
from pathlib import Path

import jaxrl_lp

ROOT = Path(jaxrl_lp.__file__).parent
# Where a policy string may be parsed, and why.
BOUNDARY = {
    "numerics/policy.py": "the parser itself and `policy_arg`, the command line's type",
    "train/grpo_config.py": "a run's config: `GRPOConfig.policies`",
    "models/hf_io.py": "`from_pretrained`, where a checkpoint is loaded",
}


def parse_calls(source: str) -> list[int]:
    """Line numbers of the calls `Policy.parse(...)` in `source`."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "parse" and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "Policy"]


def test_policy_strings_are_parsed_only_at_the_boundary():
    found = [f"{path.relative_to(ROOT)}:{line}"
             for path in sorted(ROOT.rglob("*.py"))
             if path.relative_to(ROOT).as_posix() not in BOUNDARY
             for line in parse_calls(path.read_text())]
    assert not found, ("Policy.parse below the boundary (take a Policy instead):\n"
                       + "\n".join(found))
    for name in BOUNDARY:  # the boundary is where the parsing is
        assert parse_calls((ROOT / name).read_text()), name


def test_the_scan_finds_a_parse():
    assert parse_calls("from x import Policy\np = Policy.parse('bf16')\n") == [2]
    assert parse_calls("LoopSpec.parse('full')\nPolicy('bf16')\n") == []


def test_storage_is_not_an_environment_variable():
    # numerics/policy.py names the retired variable once, to refuse it at import.
    users = [path.relative_to(ROOT).as_posix() for path in sorted(ROOT.rglob("*.py"))
             if "JAXRL_LP_NATIVE_LOW_PRECISION" in path.read_text()]
    assert users == ["numerics/policy.py"], users
