"""No two modules of moe_infer import each other, directly or through others (module-level imports and imports
inside functions alike: a lazy import hides a cycle, it does not remove it). A package importing its own
submodules (and a submodule naming its package to reach a sibling) is not counted."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "moe_infer")

pytestmark = pytest.mark.timeout(60)


def _modules():
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                mod = "moe_infer." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod[:-len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


def import_graph():
    """module -> the moe_infer modules it imports (`from pkg import sub` counts as importing pkg.sub)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe_infer"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("moe_infer"))
        # a package and its own submodules are one unit here
        graph[mod] = {d for d in deps if d in mods and d != mod and not d.startswith(mod + ".")
                      and not mod.startswith(d + ".")}
    return graph


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_check_finds_a_cycle():
    graph = import_graph()
    graph["moe_infer.models.arch"] = graph["moe_infer.models.arch"] | {"moe_infer.models.families"}
    assert ["moe_infer.models.arch", "moe_infer.models.families"] in cycles(graph)
