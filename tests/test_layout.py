"""The code's layout as the architecture pass left it: no import cycle (imports inside functions count), typer only in the
command line, each vocabulary defined once, and no backend reading a rendered prompt back into parts."""
import ast, re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "medsafe_nb"
MODULES = {p.stem: p for p in PKG.glob("*.py") if p.stem not in ("_modidx", "__init__")}


def imports(path:Path)->set:
    "The package modules a module imports anywhere in its body, top level or inside functions"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level == 1: out.add(mod.split(".")[0] if mod else None)
            elif mod.startswith("medsafe_nb."): out.add(mod.split(".")[1])
            elif mod == "medsafe_nb": out.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("medsafe_nb."))
    return {m for m in out if m in MODULES and m != path.stem}


def test_no_import_cycle():
    graph = {m: imports(p) for m, p in MODULES.items()}
    state, cycles = {}, []
    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open": cycles.append(stack[stack.index(n):] + [n])
            elif n not in state: visit(n, stack + [n])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state: visit(m, [m])
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def test_typer_only_in_the_command_line():
    users = sorted(m for m, p in MODULES.items() if re.search(r"^\s*(import typer|from typer)", p.read_text(), re.M))
    assert users == ["cli"]


def test_each_vocabulary_defined_once():
    names = ("SPLITS", "CONDITIONS", "ALL_CONDITIONS", "STATUSES", "EFFORTS", "MITIGATIONS", "SCORINGS", "PROMPTS", "ENGINES")
    for name in names:
        owners = sorted(m for m, p in MODULES.items() if re.search(rf"^{name}\s*=", p.read_text(), re.M))
        assert owners == ["core"], (name, owners)


def test_no_backend_parses_a_prompt():
    "Only the local test server (it stands in for a model that reads) may split a rendered prompt by its section labels"
    readers = sorted(m for m, p in MODULES.items() if re.search(r"\b(CONTEXT|QUESTION|OPTIONS)_LABELS\b", p.read_text()) and m != "protocols")
    assert readers == ["mockserver"]
