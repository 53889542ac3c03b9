"""No import cycles inside `jaxtrain/` at module level: each module can be imported on its own,
and a package layer (models, parallel, data) never needs one that depends on it.

Imports inside functions (deferred on purpose, e.g. the data pipeline's lazy jax) are not
module-level and do not count; imports under a module-level `if`/`try` do.
"""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def _module_level_imports(name: str, path: str, known: set[str]) -> set[str]:
  """The modules of `known` that `name` imports at module level."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  imported = set()
  for statement in tree.body:
    nodes = ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement]
    for node in nodes:
      if isinstance(node, ast.Import):
        imported.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        for alias in node.names:  # `from pkg import module` imports pkg.module
          imported.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
  return {m for m in imported if m in known and m != name}


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


def test_the_cycle_finder_finds_a_cycle():
  assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycles_inside_jaxtrain():
  modules = _modules("jaxtrain")
  assert "jaxtrain.parallel.mesh" in modules and "jaxtrain.dryrun.measure" in modules
  graph = {name: _module_level_imports(name, path, set(modules))
           for name, path in modules.items()}
  # The model reaches parallelism through the layer-stack hook (and the mesh's annotations, and
  # the MoE layer's shard_map and all-to-all).
  models = {name: imports for name, imports in graph.items() if name.startswith("jaxtrain.models")}
  reached = set().union(*models.values())
  assert {"jaxtrain.parallel.mesh", "jaxtrain.parallel.layer_stack"} <= reached
  assert {n for n in reached if n.startswith("jaxtrain.parallel")} <= {
      "jaxtrain.parallel.mesh", "jaxtrain.parallel.layer_stack",
      "jaxtrain.parallel.context_parallel", "jaxtrain.parallel.expert_parallel"}
  cycles = find_cycles(graph)
  assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_parallel_never_imports_the_model():
  modules = _modules("jaxtrain")
  for name, path in modules.items():
    if name.startswith("jaxtrain.parallel"):
      imported = _module_level_imports(name, path, set(modules))
      assert not any(n.startswith("jaxtrain.models") for n in imported), name


def test_a_family_module_imports_only_the_features():
  """A family is a record of switches: its module needs nothing but models.features."""
  modules = _modules("jaxtrain")
  from jaxtrain.models import registry  # pylint: disable=import-outside-toplevel
  for family in registry.NAMES:
    name = f"jaxtrain.models.{family}"
    assert _module_level_imports(name, modules[name], set(modules)) == {
        "jaxtrain.models.features"}, name
