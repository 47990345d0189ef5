"""The code's layout: lane folders, no import cycle (imports inside functions count), a short longest import chain, no
module reading another's private names, typer only in the command line, each vocabulary defined once, and no backend
reading a rendered prompt back into parts."""
import ast, re
from functools import lru_cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "medsafe_nb"
LANES = ("items", "models", "mitigate", "run", "metrics", "figures", "construct", "review", "testing")
MAX_CHAIN = 10


def module_name(path:Path)->str:
    "Dotted name inside the package: `models/hf.py` -> `models.hf`; a lane's `__init__.py` -> the lane"
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py") if p.name != "_modidx.py" and p != PKG / "__init__.py"
           and p.name != "__init__.py"}


def _resolve(path:Path, node:ast.ImportFrom)->str:
    "The absolute dotted target (inside the package) of a `from ... import`"
    mod = node.module or ""
    if node.level:
        base = module_name(path).split(".")[:-1] if path.name != "__init__.py" else module_name(path).split(".")
        base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
        return ".".join([*base, *([mod] if mod else [])])
    return mod[len("medsafe_nb."):] if mod.startswith("medsafe_nb.") else ("" if mod == "medsafe_nb" else None)


def import_edges(path:Path)->list:
    "(module, imported name) pairs: every package module this one imports, anywhere in its body"
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(path, node)
            if target is None: continue
            for a in node.names:
                sub = f"{target}.{a.name}" if target else a.name
                if sub in MODULES: out.append((sub, None))
                elif target in MODULES: out.append((target, a.name))
        elif isinstance(node, ast.Import):
            out += [(a.name[len("medsafe_nb."):], None) for a in node.names if a.name[len("medsafe_nb."):] in MODULES]
    return [(m, n) for m, n in out if m != module_name(path)]


@lru_cache
def graph()->dict: return {m: sorted({t for t, _ in import_edges(p)}) for m, p in MODULES.items()}


def test_lanes_are_folders():
    assert all((PKG / lane / "__init__.py").is_file() for lane in LANES)
    top = sorted(m for m in MODULES if "." not in m)
    assert top == ["cli", "conversations", "core", "extract", "harness", "protocols", "report", "tables"], top


def test_no_import_cycle():
    g, state, cycles = graph(), {}, []
    def visit(m, stack):
        state[m] = "open"
        for n in g[m]:
            if state.get(n) == "open": cycles.append(stack[stack.index(n):] + [n])
            elif n not in state: visit(n, stack + [n])
        state[m] = "done"
    for m in sorted(g):
        if m not in state: visit(m, [m])
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def longest_chain()->list:
    "The longest path of module imports (the graph has no cycle)"
    g = graph()
    @lru_cache(None)
    def longest(m): return max(([m, *longest(n)] for n in g[m]), key=len, default=[m])
    return max((longest(m) for m in g), key=len)


def test_longest_import_chain():
    chain = longest_chain()
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def test_no_private_name_crosses_a_module():
    crossings = sorted({f"{module_name(p)} imports {m}.{n}" for p in MODULES.values() for m, n in import_edges(p)
                        if n and n.startswith("_")})
    assert crossings == [], crossings


def test_typer_only_in_the_command_line():
    users = sorted(m for m, p in MODULES.items() if re.search(r"^\s*(import typer|from typer)", p.read_text(), re.M))
    assert users == ["cli"]


def test_each_vocabulary_defined_once():
    names = ("SPLITS", "CONDITIONS", "ALL_CONDITIONS", "STATUSES", "EFFORTS", "MITIGATIONS", "SCORINGS", "PROMPTS", "ENGINES",
             "SEARCH_MODES", "EVIDENCE_POSITIONS", "SEARCH_SPECS", "ANSWER_PREFIX", "FORMATS", "DELIVERIES", "STRUCTURED",
             "FOLLOWUP_CONDITIONS", "FRAME_CONDITIONS")
    for name in names:
        owners = sorted(m for m, p in MODULES.items() if re.search(rf"^{name}\s*=", p.read_text(), re.M))
        assert owners == ["core"], (name, owners)


def test_no_backend_parses_a_prompt():
    "Only the local test server (it stands in for a model that reads) may split a rendered prompt by its section labels"
    readers = sorted(m for m, p in MODULES.items() if re.search(r"\b(CONTEXT|QUESTION|OPTIONS)_LABELS\b", p.read_text()) and m != "protocols")
    assert readers == ["testing.mockscript"]


def test_production_code_never_imports_the_test_doubles():
    users = sorted(m for m in MODULES if not m.startswith("testing") and any(t.startswith("testing") for t in graph()[m]))
    assert users == [], users


def test_no_module_branches_on_a_kind_outside_the_models_lane():
    "A backend kind's facts live in the registry (models.base): no other lane compares a spec's kind with a kind's name"
    from medsafe_nb.models.base import public_kinds
    kinds = "|".join(public_kinds())
    pat = re.compile(rf"""\b(kind|\w+\.kind|parse_spec\([^)]*\)\[0\])\s*(==|!=|in|not in)\s*[\(\[{{]?\s*["']({kinds})["']""")
    users = sorted(m for m, p in MODULES.items() if not m.startswith("models") and pat.search(p.read_text()))
    assert users == [], users


def test_one_model_spec_parser():
    "Only models.base splits a model spec into kind and name"
    owners = sorted(m for m, p in MODULES.items() if re.search(r"^def (parse_spec|model_spec)\b", p.read_text(), re.M))
    assert owners == ["models.base"]


LANE_ORDER = {"core": 0, "tables": 0, "extract": 1, "items": 1, "protocols": 2, "conversations": 2, "models": 3, "mitigate": 4, "metrics": 5, "run": 6,
              "figures": 7, "construct": 7, "review": 7, "harness": 8, "report": 8, "cli": 9, "testing": 10}   # DESIGN.md: lanes in pipeline order


def lane_of(module:str)->str: return module.split(".")[0]


def upward_imports()->list:
    "Every import, at module level or inside a function, from an earlier lane to a later one (testing sits on top of all)"
    return sorted(f"{m} -> {t}" for m, p in MODULES.items() if lane_of(m) != "testing" for t, _ in import_edges(p)
                  if LANE_ORDER[lane_of(t)] > LANE_ORDER[lane_of(m)])


def test_lanes_never_look_up():
    assert set(LANE_ORDER) >= {lane_of(m) for m in MODULES}
    assert upward_imports() == []


def test_the_lane_check_sees_imports_inside_functions():
    "The check is not fooled by an import hidden in a function body: it reads every node of the module"
    src = "def f():\n    from medsafe_nb.run.runner import run\n    return run\n"
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom))
    assert _resolve(PKG / "items" / "x.py", node) == "run.runner" and LANE_ORDER["run"] > LANE_ORDER["items"]


NBS = PKG.parent / "nbs"
MAX_MODULE_LINES = 500


def test_no_module_over_500_lines():
    "A module holds one idea: past 500 lines it is split (the index `_modidx.py` is generated data)"
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_library_notebook_prefixes_are_unique():
    "A library notebook's number names it across every lane (the papermill analyses in `analysis/` number their own steps)"
    seen = {}
    for nb in sorted(NBS.rglob("*.ipynb")):
        if "analysis" in nb.relative_to(NBS).parts or nb.name == "index.ipynb" or ".ipynb_checkpoints" in nb.parts: continue
        seen.setdefault(nb.name.split("_")[0], []).append(str(nb.relative_to(NBS)))
    assert not {p: v for p, v in seen.items() if len(v) > 1}, seen
