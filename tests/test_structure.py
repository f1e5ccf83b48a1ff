"""The house's shape, read from its own imports: no import circle, no module over 400 lines, and
every package imports only what its row of ``ARROWS`` allows; the README's arrows block is this
table, printed.

Every ``import`` counts, also one inside a function (a lazy import still ties two modules
together). Packages are the top-level folders with an ``__init__.py``, tests aside.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 400
#: package -> what of the project's other packages it may import: a package, or one module of it
#: (``availability.spec``: that module only). A row for a sub-package (``deploy.edge``) governs its
#: modules instead of its parent's row. Imports inside one top-level package are free (the
#: circle test guards them). The README's block "Arrows" prints this table (``arrows_block``).
ARROWS: dict[str, frozenset[str]] = {
    "runconfig": frozenset(),
    "flowerlink": frozenset(),
    "availability": frozenset({"runconfig"}),
    "workloads": frozenset({"runconfig", "availability.spec"}),
    "strategies": frozenset({"availability.spec", "runconfig"}),
    "virtualtime": frozenset({"runconfig"}),
    "privacy": frozenset(),
    "client_app": frozenset({"flowerlink", "runconfig", "availability", "workloads", "strategies.protocol"}),
    "server_app": frozenset({"flowerlink", "runconfig", "availability", "workloads", "strategies", "virtualtime",
                             "privacy"}),
    "deploy": frozenset({"flowerlink", "runconfig", "availability", "workloads", "strategies.registry", "client_app", "server_app"}),
    "deploy.edge": frozenset({"runconfig", "workloads", "virtualtime"}),
    "experiments": frozenset({"flowerlink", "runconfig", "availability", "workloads", "strategies", "client_app",
                              "server_app", "deploy"}),
}
NOTHING = "nothing of ours"
README_MARK = "<!-- arrows: generated from ARROWS in tests/test_structure.py"


def modules(root: Path = ROOT) -> dict[str, Path]:
    pkgs = sorted(p.parent.name for p in root.glob("*/__init__.py") if p.parent.name != "tests")
    out = {}
    for pkg in pkgs:
        for f in sorted((root / pkg).rglob("*.py")):
            out[".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = f
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (``from pkg import name`` counts ``pkg.name``
    when that is a module, else ``pkg``)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        parts = m.split(".")
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = parts[:len(parts) - node.level + (1 if is_pkg else 0)] if node.level else []
                mod = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in mods]
                names = subs if subs and len(subs) == len(node.names) else [mod, *subs]
            for name in names:
                while name and name not in mods:  # import a.b.c where only a.b is ours
                    name = name.rpartition(".")[0]
                if name and name != m:
                    graph[m].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
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

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_the_walker_finds_a_circle_and_a_lazy_import(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "x.py").write_text("from .y import f\n")
    (tmp_path / "a" / "y.py").write_text("def f():\n    from a.x import g  # lazy\n")
    (tmp_path / "a" / "z.py").write_text("import a.x\n")
    graph = import_graph(modules(tmp_path))
    assert graph["a.z"] == {"a.x"}
    assert circles(graph) == [["a.x", "a.y"]]


def test_a_package_reexporting_its_modules_is_no_circle(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "__init__.py").write_text("from .m import M\n")
    (tmp_path / "p" / "m.py").write_text("from p.other import O\n")
    (tmp_path / "p" / "other.py").write_text("")
    graph = import_graph(modules(tmp_path))
    assert graph == {"p": {"p.m"}, "p.m": {"p.other"}, "p.other": set()}
    assert circles(graph) == []


def test_no_import_circle():
    found = circles(import_graph(modules()))
    assert not found, "import circles (each a group of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_module_over_the_limit():
    over = sorted((len(f.read_text().splitlines()), m) for m, f in modules().items()
                  if len(f.read_text().splitlines()) > LIMIT)
    assert not over, f"modules over {LIMIT} lines (split by job): " + ", ".join(f"{m} ({n})" for n, m in over)


def row_of(module: str, arrows: dict[str, frozenset[str]] = ARROWS) -> str | None:
    """The row that governs a module: the longest row name that is the module or a package above it."""
    rows = [r for r in arrows if module == r or module.startswith(r + ".")]
    return max(rows, key=len) if rows else None


def covers(arrow: str, module: str) -> bool:
    return module == arrow or module.startswith(arrow + ".")


def crossings(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(module, imported module) for every import that leaves the importer's top-level package."""
    return {(m, d) for m, deps in graph.items() for d in deps if d.split(".")[0] != m.split(".")[0]}


def violations(graph: dict[str, set[str]], arrows: dict[str, frozenset[str]] = ARROWS) -> list[str]:
    """Every cross-package import that its row does not allow, as 'module -> imported'."""
    return sorted(f"{m} -> {d}" for m, d in crossings(graph)
                  if not any(covers(a, d) for a in arrows.get(row_of(m, arrows) or "", ())))


def unused_arrows(graph: dict[str, set[str]], arrows: dict[str, frozenset[str]] = ARROWS) -> list[str]:
    """Arrows of the table that no import takes (the table claims more than the code does)."""
    used = {(row_of(m, arrows), a) for m, d in crossings(graph) for a in arrows.get(row_of(m, arrows) or "", ())
            if covers(a, d)}
    return sorted(f"{row} -> {a}" for row, allowed in arrows.items() for a in allowed if (row, a) not in used)


def arrows_block(arrows: dict[str, frozenset[str]] = ARROWS) -> str:
    """The README's block: one line per row, in the table's order."""
    width = max(map(len, arrows))
    return "\n".join(f"{row:<{width}} -> {', '.join(sorted(allowed)) or NOTHING}" for row, allowed in arrows.items())


def parse_arrows(block: str) -> dict[str, frozenset[str]]:
    out = {}
    for line in filter(str.strip, block.splitlines()):
        row, sep, rest = line.partition("->")
        assert sep, f"an arrows line without '->': {line!r}"
        rest = rest.strip()
        out[row.strip()] = frozenset() if rest == NOTHING else frozenset(a.strip() for a in rest.split(","))
    return out


def readme_arrows(text: str) -> str:
    """The fenced block right after the README's arrows marker."""
    assert README_MARK in text, f"README.md has no arrows block (the line {README_MARK!r} ...)"
    after = text.split(README_MARK, 1)[1]
    start = after.index("```")
    body = after[start:].split("\n", 1)[1]
    return body[:body.index("```")].strip("\n")


def test_the_arrow_check_catches_a_forbidden_and_an_unused_arrow(tmp_path):
    for pkg, src in {"low": "", "mid": "import low.x\n", "top": "def f():\n    from mid import y\n"}.items():
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
        (tmp_path / pkg / "x.py").write_text(src)
    (tmp_path / "mid" / "y.py").write_text("")
    graph = import_graph(modules(tmp_path))
    table = {"low": frozenset(), "mid": frozenset({"low.x"}), "top": frozenset({"mid", "low"})}
    assert violations(graph, table) == []
    assert unused_arrows(graph, table) == ["top -> low"]
    assert violations(graph, {**table, "mid": frozenset({"low.y"})}) == ["mid.x -> low.x"]
    # a sub-package row governs its modules instead of the parent's row
    assert violations(graph, {**table, "top.x": frozenset()}) == ["top.x -> mid.y"]


def test_the_readme_block_round_trips():
    assert parse_arrows(arrows_block()) == ARROWS
    text = f"intro\n{README_MARK} -->\n```text\n{arrows_block()}\n```\nafter\n"
    assert parse_arrows(readme_arrows(text)) == ARROWS


def test_every_package_has_a_row():
    packages = {m.split(".")[0] for m in modules()}
    rows = {r.split(".")[0] for r in ARROWS}
    assert packages == rows, (f"packages without a row in ARROWS: {sorted(packages - rows)}; "
                              f"rows without a package: {sorted(rows - packages)}")
    mods = modules()
    assert all(r in mods for r in ARROWS), f"rows naming no module: {sorted(set(ARROWS) - set(mods))}"


def test_each_package_imports_only_its_row():
    bad = violations(import_graph(modules()))
    assert not bad, ("imports outside the package's row of ARROWS (tests/test_structure.py; "
                     "add the arrow there and in the README, or remove the import):\n" + "\n".join(bad))


def test_every_arrow_is_used():
    unused = unused_arrows(import_graph(modules()))
    assert not unused, "arrows in ARROWS that no import takes (remove them there and in the README): " + ", ".join(unused)


def test_readme_arrows_match_the_table():
    block = readme_arrows((ROOT / "README.md").read_text())
    assert parse_arrows(block) == ARROWS and block == arrows_block(), (
        "README.md's arrows block differs from ARROWS in tests/test_structure.py; paste this:\n" + arrows_block())


# ------------------------------------------------------------ rules: the math, no messages
#: what a rule module may not import from Flower: messages are the base's (strategies.base,
#: strategies.intake, strategies.evaluate_round); a rule declares its extra payloads instead
MESSAGE_TYPES = frozenset({"Message", "MessageType", "RecordDict"})
#: rule modules that still adapt Flower's message API, and why (each one a debt, not a pattern)
MESSAGE_ADAPTERS: dict[str, str] = {}
#: methods that build or read messages: the base's, never a rule's
MESSAGE_METHODS = ("configure_train", "aggregate_train", "parse_reply", "configure_broadcast", "configure_evaluate")
#: classes of ours in a rule's MRO (issue 36 asks for 4; today's deepest: fedadam, FedAdam,
#: _FlowerOptimizer, AvailabilityStrategy, Rule)
MAX_OUR_CLASSES = 4
#: modules of strategies/ that still walk a class's MRO, and why (debts of the rules still written as
#: subclasses of the adapter; issue 48 item 1 removes them with the last such rule)
MRO_WALKS: dict[str, str] = {
    "strategies.registry": "the spec parameters and the oracle flag of a rule class not yet a value (its constructors')",
    "strategies.secure": "a user's subclass of a secure rule: which built-in rule it extends, what it overrides",
}
#: classes of ours a secure variant (built by strategies.secure.secure_class) adds to its rule's
SECURE_EXTRA = 2  # the variant and SecureRound


def message_imports(path: Path) -> set[str]:
    """The names of :data:`MESSAGE_TYPES` a module imports (at any depth)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flwr"):
            found |= {a.name for a in node.names} & MESSAGE_TYPES
    return found


def test_the_message_check_finds_an_import(tmp_path):
    f = tmp_path / "rule.py"
    f.write_text("def f():\n    from flwr.app import ArrayRecord, Message\n")
    assert message_imports(f) == {"Message"}
    f.write_text("from flwr.app import ArrayRecord\n")
    assert message_imports(f) == set()


def test_no_rule_module_imports_message_types():
    offenders = {m: sorted(found) for m, f in modules().items()
                 if m.startswith("strategies.rules.") and (found := message_imports(f)) and m not in MESSAGE_ADAPTERS}
    assert not offenders, f"rule modules importing Flower's message types (declare payloads instead): {offenders}"
    for m in MESSAGE_ADAPTERS:  # an adapter that no longer needs it leaves the list
        assert message_imports(modules()[m]), f"{m} imports no message type any more: drop it from MESSAGE_ADAPTERS"


def test_no_rule_overrides_a_message_method_and_its_mro_is_short():
    """Every registered class, and every class built from one (the SecAgg+ variants)."""
    from strategies import STRATEGIES, AvailabilityStrategy
    from strategies.secure import SECURE_RULES, secure_class

    built = {f"{n}:secure": secure_class(STRATEGIES[n], "secagg+") for n in SECURE_RULES}
    for name, cls in {**STRATEGIES, **built}.items():
        own = [c for c in cls.__mro__ if c.__module__.split(".")[0] == "strategies"]
        limit = MAX_OUR_CLASSES + (SECURE_EXTRA if name in built else 0)
        assert len(own) <= limit, (name, [c.__name__ for c in own])
        rule_classes = [c for c in own[:own.index(AvailabilityStrategy)] if c.__module__.startswith("strategies.rules.")]
        for c in rule_classes:
            overridden = [m for m in MESSAGE_METHODS if m in vars(c)]
            assert not overridden or c.__module__ in MESSAGE_ADAPTERS, (name, c.__name__, overridden)


def test_the_base_is_plain():
    """Issue 36 item 3: the base is Rule and Flower's Strategy, its jobs parts it holds (no
    mixin), and no module of strategies/ rewrites classes as they are created."""
    from flwr.serverapp.strategy import Strategy

    from strategies import AvailabilityStrategy, build_strategy
    from strategies.evaluate_round import Evaluation
    from strategies.intake import ReplyIntake
    from strategies.rule import Rule

    assert AvailabilityStrategy.__bases__ == (Rule, Strategy)
    s = build_strategy("fedavg-active", num_clients=2)
    assert isinstance(s.intake, ReplyIntake) and isinstance(s.evaluation, Evaluation)
    hooks = [m for m, f in modules().items() if m.startswith("strategies")
             and any(isinstance(n, ast.FunctionDef) and n.name == "__init_subclass__"
                     for n in ast.walk(ast.parse(f.read_text())))]
    assert not hooks, hooks


def mro_walks(path: Path) -> list[int]:
    """Lines of ``path`` that walk a class's MRO (``__mro__``, ``.mro()``, ``inspect.getmro``)."""
    return sorted(n.lineno for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, ast.Attribute) and n.attr in ("__mro__", "mro", "getmro"))


def test_the_base_declares_whether_a_round_streams_and_walks_no_mro(tmp_path):
    """Issue 36 item 3: whether a round streams is declared (``streams``), not found by walking
    the MRO; a user's own ``aggregate`` below a streaming rule holds the round so that it runs,
    unless its class declares ``streams = True``; a subclass that writes no math streams."""
    from strategies import FedAvgActive

    f = tmp_path / "walk.py"
    f.write_text("import inspect\nowner = [c for c in type(x).__mro__]\ninspect.getmro(C)\n")
    assert mro_walks(f) == [2, 3]
    walks = {m: lines for m, path in modules().items() if m.startswith("strategies") and (lines := mro_walks(path))}
    assert set(walks) <= set(MRO_WALKS), f"MRO walks outside the listed modules: {walks}"
    for m in MRO_WALKS:  # a module that no longer walks leaves the list
        assert m in walks, f"{m} walks no MRO any more: drop it from MRO_WALKS"

    class Scaled(FedAvgActive):
        def aggregate(self, t, x, reports):
            moved, metrics = super().aggregate(t, x, reports)
            return x + 0.5 * (moved - x), metrics

    class ScaledAndDeclared(Scaled):
        streams = True

    class Renamed(FedAvgActive):
        name = "renamed-fedavg"

    assert FedAvgActive().reason_held() == "" and Renamed().reason_held() == ""
    assert "Scaled writes its own aggregate" in Scaled().reason_held()
    assert ScaledAndDeclared().reason_held() == ""


def math_written_twice(path: Path) -> list[str]:
    """Classes of ``path`` that define ``start_fold`` and an ``aggregate`` that does not call
    ``super().aggregate`` (issue 36 item 2: a rule's math is written once, as its fold; an
    ``aggregate`` beside it only does what a fold cannot, the robust statistic of every reply,
    and hands the rest to the base's default, which folds every report)."""
    out = []
    for cls in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
        if "start_fold" not in methods or "aggregate" not in methods:
            continue
        delegates = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "aggregate"
                        and isinstance(n.func.value, ast.Call) and isinstance(n.func.value.func, ast.Name)
                        and n.func.value.func.id == "super" for n in ast.walk(methods["aggregate"]))
        if not delegates:
            out.append(cls.name)
    return out


def test_the_twice_written_math_check_finds_a_class(tmp_path):
    f = tmp_path / "rule.py"
    f.write_text("class Both:\n    def aggregate(self, t, x, reports):\n        return x, {}\n"
                 "    def start_fold(self, t, x):\n        return None\n"
                 "class Robust:\n    def aggregate(self, t, x, reports):\n"
                 "        return self.robust(reports) if self.combines else super().aggregate(t, x, reports)\n"
                 "    def start_fold(self, t, x):\n        return None\n"
                 "class OtherSuper:\n    def aggregate(self, t, x, reports):\n        return super().start_fold(t, x)\n"
                 "    def start_fold(self, t, x):\n        return None\n"
                 "class FoldOnly:\n    def start_fold(self, t, x):\n        return None\n"
                 "class AggregateOnly:\n    def aggregate(self, t, x, reports):\n        return x, {}\n")
    assert math_written_twice(f) == ["Both", "OtherSuper"]


def test_no_rule_writes_its_math_twice():
    offenders = {m: found for m, f in modules().items()
                 if m.startswith("strategies.rules.") and (found := math_written_twice(f))}
    assert not offenders, ("rule classes with a start_fold and an aggregate of their own (delete the aggregate: "
                           f"the base folds every report; keep only a robust statistic, then super().aggregate): {offenders}")


def test_a_rule_value_is_its_declarations_and_math_and_its_strategy_class_one_line():
    """Issue 48 item 1: each rule value of strategies.rules declares a frozen ``Params``, a ``State``
    whose fields all have defaults (the state before init) and a ``Needs``, and writes ``fold``;
    the Flower Strategy class of a rule value (a RuleStrategy) holds its ``rule`` and nothing else
    (no hook, no declaration: the adapter reads them of the rule)."""
    import dataclasses

    from strategies import STRATEGIES
    from strategies.contract import Needs, Rule
    from strategies.rule_strategy import RuleStrategy

    values = [c for c in STRATEGIES.values() if issubclass(c, RuleStrategy)]
    assert values, "no rule is a value"
    for cls in values:
        rule = cls.rule
        assert isinstance(rule, Rule) and rule.name == cls.name, cls
        assert dataclasses.is_dataclass(rule.Params) and rule.Params.__dataclass_params__.frozen, cls
        assert dataclasses.is_dataclass(rule.State) and rule.State().__class__ is rule.State, cls
        assert isinstance(rule.needs, Needs) and "fold" in {k for c in type(rule).__mro__ for k in vars(c)
                                                             if c is not Rule}, cls
    for m, path in modules().items():
        if not m.startswith("strategies.rules."):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "RuleStrategy"
                                                      for b in node.bases):
                body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
                assert len(body) == 1 and isinstance(body[0], ast.Assign) and \
                    [t.id for t in body[0].targets if isinstance(t, ast.Name)] == ["rule"], (m, node.name)
