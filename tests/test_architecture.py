"""The layering the README's Architecture section promises, checked on the source tree:
no import circle, nothing in fedapp/ importing strategies/ or clients/ (the registry loads them by
name), no record key spelled outside fedapp/protocols/, and no upload array name spelled outside its
protocol module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedapp", "strategies", "clients", "feddata")
RECORD_ATTRS = {"array_records", "config_records", "metric_records"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its body (top level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _is_parent(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import circles, counting every import (module level and inside functions) and a package's imports of
    its own submodules (re-exports in __init__: importing the package runs them). A submodule's import of its
    own parent package is not counted: Python resolves it against the package already initialising."""
    graph = {m: {d for d in deps if not _is_parent(d, m)} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_circle_anywhere_in_the_tree():
    assert _circles(_graph()) == []


def test_a_circle_through_a_packages_re_export_is_found():
    """The shape of a circle that once hid here: a module imports a package, whose __init__ re-exports a
    submodule that (inside a function) imports the first module back."""
    graph = {"a.classifier": {"a.prior"}, "a.prior": {"a.prior.spec"}, "a.prior.spec": {"a.classifier", "a.prior"}}
    assert _circles(graph) == [["a.classifier", "a.prior", "a.prior.spec", "a.classifier"]]


def test_the_classifier_sits_below_the_priors_and_their_evaluation():
    graph = _graph()
    assert not {d for d in graph["fedapp.models.classifier"] if d.startswith("fedapp.models.prior")}
    prior_modules = [m for m in graph if m.startswith("fedapp.models.prior") and not m.endswith(".__main__")]
    assert not {d for m in prior_modules for d in graph[m] if d in ("fedapp.readers", "fedapp.prior_evaluation")}
    assert "fedapp.prior_evaluation" in graph["fedapp.models.prior.tiny.__main__"]  # the CLI, above both


def test_fedapp_never_imports_strategies_or_clients():
    bad = {m: sorted(d for d in deps if d.split(".")[0] in ("strategies", "clients"))
           for m, deps in _graph().items() if m.startswith("fedapp")}
    assert {m: d for m, d in bad.items() if d} == {}
    assert not any(d.startswith(("strategies", "clients")) for d in _graph()["fedapp.registry"])  # by name only


def _record_key_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals used as record keys: x.array_records["k"], x.config_records.get("k"),
    RecordDict({"k": ...}), ctx.state["k"] and content["k"] = ..."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in RECORD_ATTRS | {"state", "content"}:
            hits.append((node.lineno, node.slice.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "__contains__") and isinstance(node.func.value, ast.Attribute) \
                and node.func.value.attr in RECORD_ATTRS and isinstance(node.args[0], ast.Constant):
            hits.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "RecordDict" \
                and node.args and isinstance(node.args[0], ast.Dict):
            hits += [(k.lineno, k.value) for k in node.args[0].keys if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and isinstance(node.left.value, str) \
                and any(isinstance(c, ast.Attribute) and c.attr in RECORD_ATTRS for c in node.comparators):
            hits.append((node.lineno, node.left.value))
    return hits


def test_no_record_key_literal_outside_protocol_modules():
    offenders = {}
    for name, path in _modules().items():
        if name.startswith("fedapp.protocols") or name.startswith("feddata"):
            continue
        hits = _record_key_literals(ast.parse(path.read_text()))
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert offenders == {}


def test_the_literal_check_catches_what_it_should():
    src = 'r.content.array_records["upload"]; m.metric_records.get("metrics"); RecordDict({"x": a}); ctx.state["k"]'
    assert [k for _, k in _record_key_literals(ast.parse(src))] == ["upload", "metrics", "x", "k"]


def _array_name_literals(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where `names` (a protocol's ARRAY_NAMES) are spelled: a string constant equal to one (a subscript,
    a dict key, a .get argument), or a keyword of dict(...), .update(...) or ArrayRecord(...)."""
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            hits.append((node.lineno, node.value))
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in ("dict", "update", "ArrayRecord"):
                hits += [(node.lineno, k.arg) for k in node.keywords if k.arg in names]
    return hits


def _protocol_array_names() -> dict[str, set[str]]:
    """protocol module -> the names inside its ArrayRecords (its ARRAY_NAMES), for each that declares them."""
    import importlib

    out = {}
    for name in _modules():
        if name.startswith("fedapp.protocols."):
            names = getattr(importlib.import_module(name), "ARRAY_NAMES", ())
            if names:
                out[name] = set(names)
    return out


def test_no_upload_array_name_literal_outside_its_protocol_module():
    """An upload's array names are spelled once, in its protocol module: a module that imports the protocol
    uses its constants (a misspelt name then fails at import, not as every upload rejected). Scoped to the
    importers, so that generic names ("x", "y") stay free for other dicts elsewhere."""
    graph, mods, declared = _graph(), _modules(), _protocol_array_names()
    assert {"fedapp.protocols.espresso", "fedapp.protocols.pfdm", "fedapp.protocols.dcfm"} <= set(declared)
    offenders = {}
    for name, deps in graph.items():
        for proto in sorted(set(deps) & set(declared) - {name}):
            hits = _array_name_literals(ast.parse(mods[name].read_text()), declared[proto])
            if hits:
                offenders[f"{mods[name].relative_to(ROOT)} ({proto})"] = hits
    assert offenders == {}


def test_the_array_name_check_catches_what_it_should():
    from fedapp.protocols import espresso

    src = ('u["gmm_means"]; RecordDict({"embeddings": e}); up.get("class_counts"); out.update(gmm_class=c); '
           'u[P.GMM_WEIGHTS]; d["other"]; """gmm_means (G, M, dim)"""')
    hits = _array_name_literals(ast.parse(src), set(espresso.ARRAY_NAMES))
    assert sorted(k for _, k in hits) == ["class_counts", "embeddings", "gmm_class", "gmm_means"]


def _hard_coded_cpu(tree: ast.AST) -> list[int]:
    """Lines that pin work to the CPU: a call with device="cpu" or .to("cpu") (a parameter's default
    is fine: callers pass the run's device; .cpu() to serialise a result is fine)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if any(k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value == "cpu"
                   for k in node.keywords):
                lines.append(node.lineno)
            if isinstance(node.func, ast.Attribute) and node.func.attr == "to" and node.args \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value == "cpu":
                lines.append(node.lineno)
    return lines


def test_no_code_path_pins_work_to_the_cpu():
    """device = "auto" puts every model and tensor on CUDA when present: no server or client path may
    name the CPU itself (fedapp/config.py resolves "auto"; that is the one place)."""
    offenders = {}
    for name, path in _modules().items():
        if name in ("fedapp.config",) or name.startswith("feddata"):
            continue
        lines = _hard_coded_cpu(ast.parse(path.read_text()))
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}
    assert _hard_coded_cpu(ast.parse('f(x, device="cpu"); m.to("cpu"); g(device=d); h(x.cpu())')) == [1, 1]


def test_options_is_the_ground_floor():
    """feddata/validation.py (what a config value may be, and the one error a bad one raises) imports nothing of
    the project, fedapp/options.py nothing but it: every layer can declare options without a loop; the method
    protocols take `opt` and `ConfigError` from fedapp/options.py, not from fedapp/config.py."""
    graph = _graph()
    assert graph["feddata.validation"] == set()
    assert graph["fedapp.options"] == {"feddata.validation"}
    protocols = [m for m in graph if m.startswith("fedapp.protocols.")]
    assert protocols and not any("fedapp.config" in graph[m] for m in protocols)


def test_max_upload_bytes_is_the_megabytes_in_bytes():
    from fedapp.config import all_defaults, parse_run_config

    cfg = parse_run_config({**all_defaults(), "max-upload-mb": 1.5})
    assert cfg.max_upload_bytes == 1572864 and isinstance(cfg.max_upload_bytes, int)


PRODUCTION = ("fedapp", "strategies", "clients", "feddata")  # what a run executes


def _patches_of_production(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, target) of every assignment, augmented assignment, `del` or setattr() whose target is an attribute
    of a name bound by importing from a production package (`from clients import espresso as client` ->
    `client.learn_conditions = ...`; `import fedapp.progress` -> `fedapp.progress.X = ...`;
    `from fedapp.server import ServerRun` -> `ServerRun.f = ...`): a run-time patch of production code."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name.split(".")[0]) for a in node.names
                      if a.name.split(".")[0] in PRODUCTION}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in PRODUCTION:
            bound |= {a.asname or a.name for a in node.names}

    def root(expr: ast.AST) -> str | None:
        while isinstance(expr, (ast.Attribute, ast.Subscript)):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    def flat(targets):
        for t in targets:
            if isinstance(t, (ast.Tuple, ast.List)):
                yield from flat(t.elts)
            elif isinstance(t, ast.Starred):
                yield from flat([t.value])
            else:
                yield t

    hits = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = list(flat(node.targets))
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(flat(node.targets))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and root(node.args[0]) in bound:
            hits.append((node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, ...)"))
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and root(t) in bound:
                hits.append((node.lineno, ast.unparse(t)))
    return sorted(hits)


def test_experiments_and_benchmarks_never_patch_production_code():
    """A research variant is an option of the method or lives in experiments/ and is passed in (e.g.
    espresso_upload(learner=...)): nothing in experiments/ or benchmarks/ assigns to an attribute of a module
    or object it imported from fedapp/, strategies/, clients/ or feddata/."""
    offenders = {}
    for folder in ("experiments", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            hits = [target for _, target in _patches_of_production(ast.parse(path.read_text()))]
            if hits:
                offenders[str(path.relative_to(ROOT))] = hits
    assert offenders == {}  # the FedDifRC tables switch the target memo through clients.feddifrc.share_targets
    # the check sees the patch experiments/espresso_conditions.py once made, and the other spellings
    patched = _patches_of_production(ast.parse(
        "from clients import espresso as client\nimport strategies.espresso\nfrom fedapp.server import ServerRun\n"
        "import torch\nfrom experiments.common import prog\n"
        "real, client.learn_conditions = client.learn_conditions, learner\n"
        "strategies.espresso.P.x = 1\nServerRun.f += 1\nsetattr(client, 'a', 1)\ndel client.b\n"
        "torch.x = 1\nprog.y = 2\nm = client.f()\nm.w = 3\n"))
    assert patched == [(6, "client.learn_conditions"), (7, "strategies.espresso.P.x"), (8, "ServerRun.f"),
                       (9, "setattr(client, ...)"), (10, "client.b")]
