"""Typed inside, strings at the edge: a policy string is parsed only where it enters.

The boundary is a config (`train.grpo_config`: `GRPOConfig.policies`), a command line
(`numerics.policy.policy_arg`, argparse's `type`, or a module's `__main__` block), and
Hugging Face loading (`models.hf_io.from_pretrained`); everything below takes a `Policy`.

This reads every source file of the package and follows how parsing is reached, whatever
a function is called: `Policy.parse` and a lookup of `numerics.policy.PRESETS` by a name
that is not a constant of the code are parses; a function that calls or hands on a parse is
itself a parser (`policy_arg`, `policy_list_arg`, a wrapper of either), except where a
string enters (a config, a checkpoint). Names are resolved through the imports, aliases and
re-exports (`from jaxrl_lp.numerics import Policy as P`). Every use of a parser outside the
boundary is reported, but handing one to argparse as `type=`: that is the command line.
"""

import ast
from pathlib import Path
from typing import NamedTuple

import jaxrl_lp

ROOT = Path(jaxrl_lp.__file__).parent
PARSE = "jaxrl_lp.numerics.policy.Policy.parse"
PRESETS = "jaxrl_lp.numerics.policy.PRESETS"
LOOKUP = f"{PRESETS}[...]"  # a preset looked up by a name that is not a constant
# Where a policy string may be parsed, and why.
BOUNDARY = {
    PARSE: "the parser itself",
    "jaxrl_lp.numerics.policy.policy_arg": "the command line's type (argparse's `type=`)",
    "jaxrl_lp.numerics.policy.policy_list_arg": "the same, for a list of presets",
    "jaxrl_lp.train.grpo_config.GRPOConfig": "a run's config: `GRPOConfig.policies` and the "
                                             "config's check of its strings (`__post_init__`)",
    "jaxrl_lp.models.hf_io.from_pretrained": "where a checkpoint is loaded",
}
# Of those, where a string enters from a config or a file: calling them is no parse. A name
# stands for itself and what it holds (a class, its methods).
ENTRIES = {"jaxrl_lp.train.grpo_config.GRPOConfig", "jaxrl_lp.models.hf_io.from_pretrained"}
MAIN = ":__main__"  # a module's `if __name__ == "__main__":` block: a command line


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(scope: str, names) -> bool:
    return any(scope == n or scope.startswith(n + ".") for n in names)


def _literal(key: ast.expr, constants: set[str]) -> bool:
    """Whether a `PRESETS[key]` lookup is written in the code: a string, a module's string
    constant, or a choice between such."""
    if isinstance(key, ast.IfExp):
        return _literal(key.body, constants) and _literal(key.orelse, constants)
    return (isinstance(key, ast.Constant) and isinstance(key.value, str)
            or isinstance(key, ast.Name) and key.id in constants)


def _names(module: str, tree: ast.Module) -> tuple[dict[str, str], set[str]]:
    """What each name a module binds stands for (its imports, anywhere in the file, lazy ones
    too, and its own top-level definitions), and its top-level string constants."""
    names, constants = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = module.rsplit(".", node.level)[0] if node.level else ""
            source = ".".join(x for x in (base, node.module or "") if x)
            names.update({a.asname or a.name: f"{source}.{a.name}" for a in node.names})
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = f"{module}.{node.name}"
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)):
            constants.add(node.targets[0].id)
    return names, constants


class Use(NamedTuple):
    module: str
    line: int
    name: str  # what is used, resolved (`jaxrl_lp.numerics.policy.policy_arg`)
    scope: str  # where: a top-level function, a method, a class body, a module
    typed: bool  # handed to argparse as `type=`

    def __str__(self):
        return f"{self.module}:{self.line} {self.name} (in {self.scope})"


class _Uses(ast.NodeVisitor):
    """The names a module uses, resolved, each with its scope (a top-level function, a
    method, a class body, the module, its `__main__` block); and which scopes are functions."""

    def __init__(self, module, names, constants, canonical):
        self.module, self.names, self.constants, self.canonical = module, names, constants, canonical
        self.scope, self.cls, self.types = module, None, set()
        self.uses: list[Use] = []
        self.functions: set[str] = set()

    def _in(self, scope, cls, body):
        saved = self.scope, self.cls
        self.scope, self.cls = scope, cls
        for node in body:
            self.visit(node)
        self.scope, self.cls = saved

    def visit_ClassDef(self, node):
        for expr in (*node.decorator_list, *node.bases):
            self.visit(expr)
        nested = self.scope != self.module  # a class inside a function belongs to it
        self._in(self.scope if nested else f"{self.scope}.{node.name}",
                 self.cls if nested else f"{self.scope}.{node.name}", node.body)

    def visit_FunctionDef(self, node):
        for expr in node.decorator_list:
            self.visit(expr)
        if self.scope in (self.module, self.cls):  # a nested function belongs to its own
            self.functions.add(f"{self.scope}.{node.name}")
            self._in(f"{self.scope}.{node.name}", self.cls, [node.args, *node.body])
        else:
            self._in(self.scope, self.cls, [node.args, *node.body])

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        test = node.test
        if (self.scope == self.module and isinstance(test, ast.Compare)
                and isinstance(test.left, ast.Name) and test.left.id == "__name__"):
            self.visit(test)
            self._in(self.module + MAIN, None, node.body)
            self._in(self.module, None, node.orelse)
        else:
            self.generic_visit(node)

    def visit_Call(self, node):
        self.types |= {id(k.value) for k in node.keywords if k.arg == "type"}
        self.generic_visit(node)

    def _resolve(self, node) -> str | None:
        if isinstance(node, ast.Name):
            if node.id in ("cls", "self") and self.cls:
                return self.cls
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute) and (base := self._resolve(node.value)):
            return f"{base}.{node.attr}"
        return None

    def _use(self, node, name):
        self.uses.append(Use(self.module, node.lineno, name, self.scope, id(node) in self.types))

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and (name := self._resolve(node)):
            self._use(node, self.canonical(name))

    def visit_Attribute(self, node):
        if name := self._resolve(node):
            self._use(node, self.canonical(name))
        else:
            self.generic_visit(node)

    def visit_Subscript(self, node):
        name = self._resolve(node.value)
        if name and self.canonical(name) == PRESETS and not _literal(node.slice, self.constants):
            self._use(node, LOOKUP)
        self.generic_visit(node)


def scan(sources: dict[str, str], boundary=BOUNDARY, entries=ENTRIES) -> tuple[list[Use], set[str]]:
    """The uses of a policy parser outside `boundary` in `sources` (`{module: source}`), and
    the parsers: `Policy.parse`, a `PRESETS` lookup by name, and every function that uses
    one (but for handing it to argparse), but those of `entries`."""
    trees = {m: ast.parse(s) for m, s in sources.items()}
    names = {m: _names(m, t) for m, t in trees.items()}

    def canonical(name: str, depth: int = 0) -> str:
        """`name` where it is defined: through imports, aliases and re-exports."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest module prefix, then its name
            module, head = ".".join(parts[:i]), parts[i]
            if module in names:
                target = names[module][0].get(head)
                if depth > 20 or target in (None, f"{module}.{head}"):
                    return name
                return canonical(".".join([target, *parts[i + 1:]]), depth + 1)
        return name

    uses, functions = [], set()
    for m, tree in trees.items():
        visitor = _Uses(m, *names[m], canonical)
        visitor.visit(tree)
        uses += visitor.uses
        functions |= visitor.functions
    parsers = {PARSE, LOOKUP}
    while grown := {u.scope for u in uses if u.name in parsers and not u.typed
                    and u.scope in functions - parsers and not _within(u.scope, entries)}:
        parsers |= grown
    found = [u for u in uses if u.name in parsers and not u.typed
             and not _within(u.scope, boundary) and not u.scope.endswith(MAIN)]
    return found, parsers


def _package() -> dict[str, str]:
    return {_module_name(p): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_policy_strings_are_parsed_only_at_the_boundary():
    found, parsers = scan(_package())
    assert not found, ("a policy string parsed below the boundary (take a Policy instead, "
                       "parsed once where the string enters):\n" + "\n".join(map(str, found)))
    assert set(BOUNDARY) - ENTRIES <= parsers, set(BOUNDARY) - ENTRIES - parsers
    parses = scan(_package(), boundary={})[0]
    for name in BOUNDARY:  # the boundary is where the parsing is
        assert any(_within(u.scope, [name]) for u in parses), name


# A small package: the parser, its command-line type and a wrapper of it re-exported.
POLICY_SRC = """
class Policy:
    @classmethod
    def parse(cls, spec):
        return cls.parse(spec)
PRESETS = {}
def policy_arg(text):
    return Policy.parse(text)
"""


def _scan_with(module_src: str) -> list[str]:
    sources = {"jaxrl_lp.numerics.policy": POLICY_SRC,
               "jaxrl_lp.numerics": "from jaxrl_lp.numerics.policy import Policy, policy_arg, PRESETS\n",
               "jaxrl_lp.bench.x": module_src}
    boundary = {PARSE: "", "jaxrl_lp.numerics.policy.policy_arg": ""}
    return [f"{u.module}:{u.line} {u.name}" for u in scan(sources, boundary, entries=set())[0]]


def test_the_scan_finds_a_parse_under_any_name():
    head = "from jaxrl_lp.numerics.policy import Policy, PRESETS, policy_arg\n"
    assert _scan_with(head + "def f(s):\n    return Policy.parse(s)\n") == [
        f"jaxrl_lp.bench.x:3 {PARSE}"]
    # Through a wrapper of the command line's type (`bench/kernels.py`'s `_policy_or_auto`),
    # and through the wrapper's own callers.
    assert _scan_with(head + "def g(t):\n    return 'auto' if t == 'auto' else policy_arg(t)\n"
                      "def h(t):\n    return g(t)\n") == [
        "jaxrl_lp.bench.x:3 jaxrl_lp.numerics.policy.policy_arg", "jaxrl_lp.bench.x:5 jaxrl_lp.bench.x.g"]
    # An alias, a re-export, a lazy import, a module attribute.
    assert _scan_with("from jaxrl_lp.numerics import Policy as P\nx = P.parse('bf16')\n") == [
        f"jaxrl_lp.bench.x:2 {PARSE}"]
    assert _scan_with("def f(s):\n    from jaxrl_lp import numerics\n    return numerics.policy_arg(s)\n"
                      ) == ["jaxrl_lp.bench.x:3 jaxrl_lp.numerics.policy.policy_arg"]
    assert _scan_with("import jaxrl_lp.numerics.policy\n"
                      "f = jaxrl_lp.numerics.policy.Policy.parse\n") == [f"jaxrl_lp.bench.x:2 {PARSE}"]
    # A preset looked up by a name that came from outside.
    assert _scan_with(head + "def f(name):\n    return PRESETS[name]\n") == [f"jaxrl_lp.bench.x:3 {LOOKUP}"]


def test_the_scan_leaves_the_typed_forms_alone():
    head = "import argparse\nfrom jaxrl_lp.numerics.policy import Policy, PRESETS, policy_arg\n"
    assert _scan_with(head + "def add(p):\n    p.add_argument('--policy', type=policy_arg)\n") == []
    assert _scan_with(head + "NAME = 'bf16'\nA = PRESETS['fp32']\nB = PRESETS[NAME]\n"
                      "C = Policy(compute_dtype='bf16')\nD = PRESETS['bf16' if A else NAME]\n") == []
    assert _scan_with(head + "if __name__ == '__main__':\n    print(policy_arg('bf16'))\n") == []
    assert _scan_with("from jaxrl_lp.bench.y import parse\nx = parse('full')\n") == []


def test_storage_is_not_an_environment_variable():
    # numerics/policy.py names the retired variable once, to refuse it at import.
    users = [path.relative_to(ROOT).as_posix() for path in sorted(ROOT.rglob("*.py"))
             if "JAXRL_LP_NATIVE_LOW_PRECISION" in path.read_text()]
    assert users == ["numerics/policy.py"], users
