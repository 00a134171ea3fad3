"""The package's shape (docs/architecture.md): imports that flow one way, files a reader
can hold in mind, one module for each step of the server's round."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MODULES = {
    ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): path
    for path in sorted((SRC / "fedpeft").rglob("*.py"))
}


def module_of(name: str) -> str | None:
    """The module of ``src/`` that importing ``name`` loads (a name inside a module: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path) -> set[str]:
    """The fedpeft modules ``path`` imports: at module level, inside functions, and under
    ``if TYPE_CHECKING:`` (an import for annotations only ties two modules as much as any)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {
                module_of(f"{node.module}.{alias.name}") or module_of(node.module) for alias in node.names
            }
        elif isinstance(node, ast.Import):
            found |= {module_of(alias.name) for alias in node.names}
    return {m for m in found if m is not None}


def import_circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_spans_more_than_two_modules():
    graph = {name: imports_of(path) - {name} for name, path in MODULES.items()}
    assert len(graph) > 100 and sum(map(len, graph.values())) > 300  # the graph was read
    circles = [sorted(c) for c in import_circles(graph) if len(c) > 2]
    assert not circles, f"import circles: {circles}"


def test_imports_for_annotations_are_counted():
    """``engines/local`` names what it calls of a method (``hooks.LocalMethod``) rather than
    importing ``methods.base`` under ``TYPE_CHECKING``; the finder sees such imports."""
    assert "fedpeft.config" in imports_of(MODULES["fedpeft.engines.local.jobs"])  # TYPE_CHECKING only
    local = [imports_of(path) for name, path in MODULES.items() if name.startswith("fedpeft.engines.local")]
    assert not {m for found in local for m in found if m.startswith("fedpeft.methods")}


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [{"a", "b", "c"}]


def test_no_source_file_is_over_600_lines():
    long = {
        str(p.relative_to(SRC)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"files over 600 lines: {long}"


@pytest.mark.parametrize(
    "call", ["server_step(", "guard.check_aggregate(", "privacy.server_side(", "scaffold.update_control("]
)
def test_each_step_of_the_servers_round_is_called_from_one_module(call):
    """The round pipeline (``engines/round.py``) calls them; every engine calls it."""
    callers = sorted(
        name
        for name, path in MODULES.items()
        if any(call in line and "def " not in line for line in path.read_text().splitlines())
    )
    assert callers == ["fedpeft.engines.round"]


def test_no_engine_sets_a_methods_round_settings():
    """The round's settings reach a method with each job (``Job.context``); nothing outside
    ``fedpeft.methods`` assigns a method's ``train``, ``sample_dp`` or ``mean`` (the server's
    rule comes with its construction, ``methods.build_method``)."""
    assignment = re.compile(r"\b(?:method|self\.method|setup\.method)\.(train|sample_dp|mean)\s*=[^=]")
    found = [
        f"{name}:{i}"
        for name, path in MODULES.items()
        if not name.startswith("fedpeft.methods")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if assignment.search(line)
    ]
    assert not found, f"a method's round settings assigned from outside: {found}"
    assert assignment.search("self.method.train = step.train")  # what it looks for


def test_every_document_a_source_file_cites_is_in_the_repository():
    """A comment or message in ``src/`` that sends the reader to a document names one the
    repository holds (``docs/x.md``, ``README.md``): the planning notes fedpeft was built
    from are not part of it, and a reader cannot open them."""
    root = SRC.parent
    missing = []
    for path in MODULES.values():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            named = re.findall(r"[\w./-]+\.md\b", line) + re.findall(r"\bDESIGN\b", line)
            for name in named:
                if not name.endswith(".md") or not any((root / d / name).is_file() for d in (".", "docs")):
                    missing.append(f"{path.relative_to(root)}:{number}: {name}")
    assert not missing, missing


ARCHITECTURE = SRC.parent / "docs" / "architecture.md"
#: a row's folder (``engines/local/``) or module (``tensors.py``), written in backquotes
ROW_NAME = re.compile(r"`([\w/]+/|[\w/]+\.py)`")


def layer_table() -> dict[str, set[str]]:
    """docs/architecture.md's table "The layers, and what each may import": each row's
    folders or modules -> the rows named in its last column (what it may import from)."""
    section = ARCHITECTURE.read_text().split("## The layers, and what each may import", 1)[1]
    table = {}
    for line in section.split("\n## ", 1)[0].splitlines():
        cells = line.strip().strip("|").split("|")
        if len(cells) == 3 and ROW_NAME.search(cells[0]):
            for name in ROW_NAME.findall(cells[0]):
                table[name] = set(ROW_NAME.findall(cells[2]))
    return table


def row_of(module: str, table: dict[str, set[str]]) -> str | None:
    """The row of ``table`` a module of ``src/fedpeft`` is in: the module's own, or the
    innermost folder holding it."""
    path = MODULES[module].relative_to(SRC / "fedpeft").as_posix()
    rows = [row for row in table if path == row or (row.endswith("/") and path.startswith(row))]
    return max(rows, key=len, default=None)


def test_the_layer_table_places_every_module():
    """Every module of ``src/fedpeft`` is in a row; each row holds a module, and its last
    column names rows."""
    table = layer_table()
    assert {"config/", "engines/", "engines/local/", "tensors.py", "cli/"} <= set(table)  # it was read
    unplaced = sorted(m for m in MODULES if row_of(m, table) is None)
    assert not unplaced, f"modules in no row of docs/architecture.md's layer table: {unplaced}"
    empty = sorted(row for row in table if not any(row_of(m, table) == row for m in MODULES))
    assert not empty, f"rows of docs/architecture.md's layer table that hold no module: {empty}"
    unknown = {row: sorted(names - set(table)) for row, names in table.items() if names - set(table)}
    assert not unknown, f"the layer table names rows it does not have: {unknown}"


def test_each_layer_imports_only_what_the_layer_table_says():
    """docs/architecture.md's layer table against the code: every import (in functions and
    for annotations too) stays in its row or reaches a row the table lets it."""
    table = layer_table()
    wrong = []
    for name, path in MODULES.items():
        row = row_of(name, table)
        for imported in sorted(imports_of(path)):
            target = row_of(imported, table)
            if row is not None and target not in table[row] | {row}:
                wrong.append(f"{name} imports {imported} ({row} -> {target})")
    assert not wrong, f"imports docs/architecture.md's layer table does not allow: {wrong}"


def test_the_layer_table_reader_sees_a_wrong_import():
    table = {"config/": set(), "data/": {"config/"}, "engines/local/": set(), "engines/": {"data/"}}
    assert row_of("fedpeft.engines.local.loop", table) == "engines/local/"
    assert row_of("fedpeft.engines.round", table) == "engines/"
    assert row_of("fedpeft.data.split", table) == "data/"
    assert row_of("fedpeft.experiment", table) is None


@pytest.mark.parametrize(
    "step",
    [
        r"\bclose_record\(",  # the round's record completed
        r"checkpoints\.save\(",  # the run's checkpoint written
        r"checkpoints\.clear\(",  # a fresh start
        r"\binit_server\(",  # the method's initial state
        r"%\s*[\w.]*every\b",  # the evaluation cadence
        r">=\s*[\w.]*max_skipped_rounds",  # stopping after skipped rounds
    ],
)
def test_each_step_of_the_run_loop_is_taken_in_one_module(step):
    """The run loop (``engines/run_loop.py``) takes every step around the round pipeline;
    the in-process engine, its ranks and Flower's ServerApp are its backends."""
    pattern = re.compile(step)
    callers = sorted(
        name
        for name, path in MODULES.items()
        if any(pattern.search(line) and "def " not in line for line in path.read_text().splitlines())
    )
    assert callers == ["fedpeft.engines.run_loop"]


READERS = {
    "fedpeft.methods.capabilities": {"refusal", "shares_nothing"},
    "fedpeft.composition": {"declined", "shares_nothing"},
}


def reader_names(tree: ast.AST) -> set[str]:
    """The names a module binds to the reader of a method's declared refusals."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in READERS
        for alias in node.names
        if alias.name in READERS[node.module]
    }


def string_literals(tree: ast.AST) -> str:
    """Every string a module writes, an f-string's fields as NUL, one a line."""
    parts = lambda node: "".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values)  # noqa: E731
    return "\n".join(
        node.value if isinstance(node, ast.Constant) else parts(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))
    )


def decides_composition(function: ast.AST, readers: set[str]) -> bool:
    """Whether ``function`` both reads a method's declared refusals and raises."""
    calls = {ast.unparse(node.func) for node in ast.walk(function) if isinstance(node, ast.Call)}
    reads = any(c in readers or c in ("capabilities.refusal", "capabilities.shares_nothing") for c in calls)
    return reads and any(isinstance(node, ast.Raise) for node in ast.walk(function))


def test_what_composes_with_what_is_decided_in_one_module():
    """``fedpeft.composition`` alone decides it (docs/composition.md): no other module
    defines a ``check_composes``, writes the words of one of its refusals, or has a
    function that reads a method's declared refusals (``capabilities.refusal``,
    ``shares_nothing``) and raises; the others call ``composition.refusal`` and raise
    what it returns, or read a declaration to describe a method (``fedpeft methods``)."""
    from fedpeft.composition import RULES, template_words

    # a refusal's longest literal run: its own words, where that is more than a key's name
    words = {rule.name: w for rule in RULES if len(w := template_words(rule)) >= 24}
    assert len(words) >= len(RULES) - 5, sorted(words)
    found = []
    for name, path in MODULES.items():
        if name == "fedpeft.composition":
            continue
        text = path.read_text()
        tree = ast.parse(text)
        readers = reader_names(tree)
        found += [f"{name}: {node.name}" for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef)
                  and (node.name == "check_composes" or decides_composition(node, readers))]  # fmt: skip
        written = string_literals(tree)
        found += [f"{name}: the words of rule {rule}" for rule, w in words.items() if w in written]
    assert not found, found
    decides = ast.parse("def f(m):\n    if refusal(m, 'fp16'):\n        raise ValueError\n").body[0]
    assert decides_composition(decides, {"refusal"})  # what it looks for


# ---------------------------------------------------------------- a method in one home (issue 73)

TESTS = Path(__file__).resolve().parent


def method_names() -> set[str]:
    from fedpeft.methods import REGISTRY

    return set(REGISTRY)


def listed_methods(node: ast.AST, names: set[str]) -> list[str]:
    """The method names of a list, tuple or set literal of two or more of them."""
    if not isinstance(node, ast.List | ast.Tuple | ast.Set):
        return []
    found = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
    return found if len(found) >= 2 else []


def names_a_method(parent: ast.AST, node: ast.Constant) -> bool:
    """Whether string ``node`` (a method's name) is written as one where ``parent`` holds it:
    compared with a ``name`` (``method.name == "x"``, ``name in ("x", ...)``), the value of a
    ``name`` key, keyword or assignment (``{"name": "x"}``, ``name = "x"``, the ``Literal``
    of a ``name`` field), an argument of a call of a ``..method...`` function
    (``register_method_config("x")``) or a key of ``REGISTRY``/``CONFIGS``."""

    def ends_in_name(e: ast.AST) -> bool:
        return isinstance(e, ast.Name | ast.Attribute) and (getattr(e, "id", None) or e.attr).endswith("name")

    if isinstance(parent, ast.Compare):
        return any(ends_in_name(e) for e in [parent.left, *parent.comparators] if e is not node)
    if isinstance(parent, ast.Dict):
        keys = [k for k, v in zip(parent.keys, parent.values, strict=True) if v is node]
        return any(isinstance(k, ast.Constant) and k.value == "name" for k in keys)
    if isinstance(parent, ast.keyword):
        return parent.arg == "name"
    if isinstance(parent, ast.Assign | ast.AnnAssign):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return any(ends_in_name(t) for t in targets)
    if isinstance(parent, ast.Call):
        func = parent.func
        return "method" in (getattr(func, "id", None) or getattr(func, "attr", ""))
    if isinstance(parent, ast.Subscript):
        of = getattr(parent.value, "id", None) or getattr(parent.value, "attr", "")
        return of in ("REGISTRY", "CONFIGS", "Literal")
    return False


def method_names_written(tree: ast.AST, names: set[str]) -> set[str]:
    """The method names ``tree`` writes as method names (:func:`names_a_method`) or lists."""
    found: set[str] = set()
    for parent in ast.walk(tree):
        found.update(listed_methods(parent, names))
        for child in ast.iter_child_nodes(parent):
            if isinstance(child, ast.Constant) and child.value in names and names_a_method(parent, child):
                found.add(child.value)
    return found


def test_no_method_name_is_written_in_more_than_two_files_under_src():
    """A method's name lives in its config leaf (its registration and ``Literal``); its
    class takes it from the registration, and no other code tests for it by name. At most
    one more module may name it (``config/experiment.py``'s default method). Counted: the
    ``.py`` files of ``src/`` that write it as a method's name (:func:`names_a_method`) or in
    a list of methods; a name that is also another option's value (``privacy.mode: local``)
    counts only as a method's. The default configs (``src/fedpeft/configs/*.yaml``), whose
    content names a method, are not code and are not counted."""
    names = method_names()
    homes: dict[str, list[str]] = {name: [] for name in names}
    for module, path in MODULES.items():
        for name in method_names_written(ast.parse(path.read_text()), names):
            homes[name].append(module)
    assert not {name: where for name, where in homes.items() if len(where) > 2}
    leaf = "fedpeft.config.methods."
    assert not [name for name, where in homes.items() if not any(m.startswith(leaf) for m in where)]


def test_no_test_outside_tests_methods_lists_methods_by_hand():
    """A test's list of methods is read from the registry (with a capability as its
    filter); a literal list, tuple or set of two or more method names is a list by hand.
    tests/methods/ (the methods' own tests and the conformance suite's claims) may name
    them; a scenario naming one method, or a mapping giving each method its own options or
    reason, is not a list."""
    names = method_names()
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.relative_to(TESTS).parts[0] == "methods" or path == Path(__file__).resolve():
            continue  # the methods' tests; this file's examples of what is found
        for node in ast.walk(ast.parse(path.read_text())):
            if listed := listed_methods(node, names):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}: {listed}")
    assert not found, found


def test_the_method_name_finder_sees_each_way_of_writing_one():
    names = {"fedlr", "local"}
    written = {
        'if method.name == "fedlr": pass': {"fedlr"},
        'x = {"name": "fedlr"}': {"fedlr"},
        'build(name="fedlr")': {"fedlr"},
        "class C:\n    name = 'fedlr'": {"fedlr"},
        '@register_method_config("fedlr")\nclass C: pass': {"fedlr"},
        'REGISTRY["fedlr"]': {"fedlr"},
        'METHODS = ("fedlr", "local")': {"fedlr", "local"},
        'if mode == "local": pass': set(),
        'MODES = ("user", "local")': set(),
        'out["local"] = 1': set(),
    }
    for source, want in written.items():
        assert method_names_written(ast.parse(source), names) == want, source
