"""The house rules of `jaxtrain/` (docs/architecture.md), checked on the source with `ast`:

- no import circle between its modules, counting imports inside functions (a deferred import
  still ties two modules together) and the package `__init__` every import runs first;
- imports go one way through the layers below (a package may import its own layer and the ones
  beneath it);
- at most 10 imports of jaxtrain modules inside functions, each with a comment saying why (an
  entry point that must not import JAX, or the trainer, before it has set the process up);
- at most 12 modules at the top of `jaxtrain/`.

A file's `if __name__ == "__main__":` block runs only when the file is a script (`python -m`),
as the module `__main__`: its imports are no edge of the importable module, but they are
counted and commented like the function-level ones.
"""

import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lowest first. A module of one layer imports modules of its own layer or of lower ones only.
LAYERS = (
    # Ground floor: config defaults and flags, the chip table, the process, paths and URLs.
    ("compat", "config", "cli_flags", "hardware", "platforms", "distributed", "host_memory",
     "storage"),
    ("ops", "parallel"),  # numerics, and the mesh with what the rules cannot say
    ("models", "peft"),  # the layers hold adapters; peft/state.py reads the model
    ("data",),
    ("checkpointing",),
    ("interop",),  # Hugging Face directories and a run's weights as a plain model
    ("generate",),  # the sampler the RL rollouts use, and its CLI
    ("objectives",),
    ("validation",),  # asks the objectives and families what they need
    ("train",),
    ("dryrun",),
    ("command",),
    ("main",),
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_FUNCTION_LEVEL_IMPORTS = 10
MAX_TOP_LEVEL_MODULES = 12


def _modules(root: str) -> dict[str, str]:
  """{dotted module name: path} of every .py file under `root` (a package directory)."""
  found = {}
  for directory, _, files in os.walk(os.path.join(REPO, root)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
        found[dotted.removesuffix(".__init__")] = path
  return found


def _script_block(tree) -> set[int]:
  """ids of the nodes inside the module's `if __name__ == "__main__":` block."""
  inside = set()
  for statement in tree.body:
    if isinstance(statement, ast.If) and "__main__" in ast.unparse(statement.test):
      inside.update(id(node) for node in ast.walk(statement))
  return inside


def _in_functions(tree) -> set[int]:
  inside = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
  return inside


def _targets(node, name: str, path: str, known: set[str]) -> set[str]:
  """The modules of `known` an import statement runs: the named module and its packages."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  named = set()
  if isinstance(node, ast.Import):
    named.update(alias.name for alias in node.names)
  else:
    base = node.module or ""
    if node.level:
      parts = package.split(".")
      base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
    for alias in node.names:  # `from pkg import module` imports pkg.module
      named.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
  found = set()
  for module in named:
    while module and module != "jaxtrain":  # importing a.b.c runs a/__init__ and a/b/__init__
      if module in known and module != name and not name.startswith(module + "."):
        found.add(module)
      module = module.rpartition(".")[0]
  return found


def import_graph(root: str = "jaxtrain"):
  """({module: modules it imports, wherever the import stands}, [(module, line, source line)]
  of every function-level or script-block import of a jaxtrain module)."""
  modules = _modules(root)
  known = set(modules)
  graph, deferred = {}, []
  for name, path in modules.items():
    with open(path, encoding="utf-8") as f:
      source = f.read()
    tree = ast.parse(source)
    script, functions = _script_block(tree), _in_functions(tree)
    lines = source.splitlines()
    graph[name] = set()
    for node in ast.walk(tree):
      if not isinstance(node, (ast.Import, ast.ImportFrom)):
        continue
      targets = _targets(node, name, path, known)
      if targets and (id(node) in functions or id(node) in script):
        deferred.append((name, node.lineno, lines[node.lineno - 1]))
      if id(node) not in script:
        graph[name] |= targets
  return graph, deferred


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every cycle a depth-first walk of `graph` meets, as [a, b, ..., a]."""
  state, stack, cycles = {}, [], []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for target in sorted(graph.get(node, ())):
      if state.get(target) == "open":
        cycles.append(stack[stack.index(target):] + [target])
      elif target not in state:
        visit(target)
    stack.pop()
    state[node] = "done"

  for node in sorted(graph):
    if node not in state:
      visit(node)
  return cycles


def _layer(module: str) -> int:
  top = module.split(".")[1] if module != "jaxtrain" else ""
  assert top in LAYER_OF, (f"{module}: its package {top!r} has no place in LAYERS; add it "
                           f"(and to docs/architecture.md)")
  return LAYER_OF[top]


def test_the_cycle_finder_finds_a_cycle():
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_imports_and_package_inits(tmp_path, monkeypatch):
  """A function-level import is an edge, and so is the __init__ of the package it names."""
  package = tmp_path / "jaxtrain"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("from jaxtrain import b\n")
  (package / "sub" / "leaf.py").write_text("")
  (package / "a.py").write_text("def f():\n  from jaxtrain.sub import leaf\n")
  (package / "b.py").write_text("import jaxtrain.a\nif __name__ == '__main__':\n"
                                "  from jaxtrain import sub\n")
  monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
  graph, deferred = import_graph()
  assert graph["jaxtrain.a"] == {"jaxtrain.sub", "jaxtrain.sub.leaf"}
  assert graph["jaxtrain.b"] == {"jaxtrain.a"}  # the script block is no edge of the module
  assert sorted((m, line) for m, line, _ in deferred) == [("jaxtrain.a", 2), ("jaxtrain.b", 3)]
  assert find_cycles(graph) == [["jaxtrain.a", "jaxtrain.sub", "jaxtrain.b", "jaxtrain.a"]]


def test_no_import_cycles_inside_jaxtrain_counting_deferred_imports():
  graph, _ = import_graph()
  assert "jaxtrain.parallel.mesh" in graph and "jaxtrain.dryrun.command" in graph
  cycles = find_cycles(graph)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_go_down_the_layers():
  graph, _ = import_graph()
  upward = sorted(f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
                  for name, targets in graph.items() if name != "jaxtrain"
                  for target in targets if _layer(target) > _layer(name))
  assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_few_function_level_imports_each_saying_why():
  _, deferred = import_graph()
  assert len(deferred) <= MAX_FUNCTION_LEVEL_IMPORTS, "\n".join(
      f"{m}:{line}: {text.strip()}" for m, line, text in deferred)
  # The reason is on the line, after the pylint marker, or on the comment line above.
  for module, line, text in deferred:
    path = _modules("jaxtrain")[module]
    with open(path, encoding="utf-8") as f:
      above = f.read().splitlines()[line - 2].strip()
    reason = text.split("import-outside-toplevel", 1)[-1].strip(" #")
    assert reason or above.startswith("#"), f"{module}:{line}: say why it is deferred"


def test_few_modules_at_the_top_of_the_package():
  top = sorted(n for n in os.listdir(os.path.join(REPO, "jaxtrain")) if n.endswith(".py"))
  assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_parallel_never_imports_the_model():
  graph, _ = import_graph()
  for name, imported in graph.items():
    if name.startswith("jaxtrain.parallel"):
      assert not any(n.startswith("jaxtrain.models") for n in imported), name


def test_the_model_reaches_parallelism_through_its_hooks():
  """The layer-stack hook, the mesh's annotations, and the MoE layer's shard_map and
  all-to-all: nothing else of parallel/."""
  graph, _ = import_graph()
  reached = set().union(*(imports for name, imports in graph.items()
                          if name.startswith("jaxtrain.models")))
  assert {"jaxtrain.parallel.mesh", "jaxtrain.parallel.layer_stack"} <= reached
  assert {n for n in reached if n.startswith("jaxtrain.parallel.")} <= {
      "jaxtrain.parallel.mesh", "jaxtrain.parallel.layer_stack",
      "jaxtrain.parallel.context_parallel", "jaxtrain.parallel.expert_parallel"}


def test_a_family_module_imports_only_the_features():
  """A family is a record of switches: its module needs nothing but models.features."""
  graph, _ = import_graph()
  from jaxtrain.models import registry  # pylint: disable=import-outside-toplevel
  for family in registry.NAMES:
    assert graph[f"jaxtrain.models.{family}"] - {"jaxtrain.models"} == {
        "jaxtrain.models.features"}, family
