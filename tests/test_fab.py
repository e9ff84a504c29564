"""The app bundle (FAB) that `flwr run` and `flwr build` make, and that the ServerApp and every deployed client
message install: the packages the two apps import and pyproject.toml ([tool.flwr.app] fab-include), none of
docs/, experiments/, benchmarks/, tests/ or presets/.

The bundle is built with Flower's own function (the one both commands call) and installed with Flower's own
installer, which checks every file's hash, as a SuperNode does."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("fedapp", "strategies", "clients", "feddata")  # the packages the ServerApp and ClientApp import
LEFT_OUT = ("docs", "experiments", "benchmarks", "tests", "presets")
# a stored zip entry beyond its bytes: its local header (30) and central-directory record (46), each with the
# name, and room for extra fields; plus the end-of-archive record
ZIP_ENTRY = 128
ZIP_END = 22


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """(the FAB's bytes, the folder Flower installed it into, its files relative to that folder)."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.install import install_from_fab

    with warnings.catch_warnings():  # Flower's own use of a deprecated pathspec pattern class
        warnings.simplefilter("ignore", DeprecationWarning)
        fab = build_fab_from_disk(ROOT)
    home = tmp_path_factory.mktemp("flwr-home")
    (home / "app.fab").write_bytes(fab)
    app = install_from_fab(fab, install_dir=home, skip_prompt=True)
    files = {p.relative_to(app).as_posix() for p in app.rglob("*") if p.is_file()}
    return fab, app, files


def bundleable(paths) -> set[str]:
    """Of `paths`, those Flower's fixed rules let into any FAB (text types: .py, .json, ...)."""
    from flwr.cli.utils import build_pathspec
    from flwr.common.constant import FAB_EXCLUDE_PATTERNS, FAB_INCLUDE_PATTERNS

    with warnings.catch_warnings():  # as in the fixture
        warnings.simplefilter("ignore", DeprecationWarning)
        include, exclude = build_pathspec(FAB_INCLUDE_PATTERNS), build_pathspec(FAB_EXCLUDE_PATTERNS)
        return {p for p in paths if include.match_file(p) and not exclude.match_file(p)}


def tracked(*folders: str) -> set[str]:
    """The files git tracks under `folders`."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    out = subprocess.run(["git", "ls-files", "--", *folders], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_bundle_holds_every_runtime_file_byte_for_byte_and_nothing_else(bundle):
    _, app, files = bundle
    expected = bundleable(tracked(*RUNTIME))
    assert expected and not expected - files, sorted(expected - files)[:5]
    assert {f for f in files if f.split("/")[0] in LEFT_OUT} == set()
    assert {f for f in files if f.split("/")[0] not in RUNTIME} == {"pyproject.toml"}
    assert all((app / f).read_bytes() == (ROOT / f).read_bytes() for f in expected)
    components = [_toml(d / "pyproject.toml")["tool"]["flwr"]["app"]["components"] for d in (app, ROOT)]
    assert components[0] == components[1]


def test_only_the_packaged_priors_weights_stay_out_and_pip_installs_those(bundle):
    """Flower bundles text files only: the runtime packages' other tracked files are the packaged prior's
    safetensors, which fedapp/models/prior/tiny/packaged.py reads where pip installed fedapp
    (tests/test_packaged_prior.py)."""
    _, _, files = bundle
    outside = tracked(*RUNTIME) - files
    assert outside and all(f.startswith("fedapp/models/prior/tiny/packaged/") and f.endswith(".safetensors")
                           for f in outside), sorted(outside)


def test_the_bundle_is_no_larger_than_its_runtime_files_stored(bundle):
    """Bounded by the runtime packages' bundleable files on disk and pyproject.toml, each stored uncompressed
    with its zip headers, and the manifest Flower adds (a line of path, sha256 and size per file)."""
    fab, _, _ = bundle
    on_disk = bundleable(p.relative_to(ROOT).as_posix() for pkg in RUNTIME for p in (ROOT / pkg).rglob("*")
                         if p.is_file()) | {"pyproject.toml"}
    manifest = sum(len(f) + 1 + 64 + 1 + 20 + 1 for f in on_disk)
    bound = sum((ROOT / f).stat().st_size + ZIP_ENTRY for f in on_disk) + manifest + ZIP_ENTRY + ZIP_END
    assert len(fab) <= bound, (len(fab), bound)


def _toml(path: Path) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())


def _top_imports(source: str) -> set[str]:
    """The top-level names of every absolute import in `source`, those inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_import_of_this_project_in_the_bundle_names_a_bundled_package(bundle):
    """Static, so that an import inside a function counts: a module of the bundle that imported experiments/
    (or any other folder of this repository) would find it only beside the source tree, never on a node."""
    from fedapp import registry

    _, app, files = bundle
    project = {p.stem for p in ROOT.iterdir() if p.is_dir() or p.suffix == ".py"}
    imported = set().union(*(_top_imports((app / f).read_text()) for f in files if f.endswith(".py")))
    assert imported & project == set(RUNTIME)
    named = {p.partition(":")[0] for s in registry.METHODS.values()
             for p in (s.protocol, s.strategy, s.client, s.options, s.preflight) if p}
    missing = {m for m in named if not {f"{m.replace('.', '/')}.py", f"{m.replace('.', '/')}/__init__.py"} & files}
    assert missing == set()


def test_the_apps_load_from_the_installed_bundle(bundle):
    """As Flower loads them (the installed folder first on sys.path), the ServerApp, the ClientApp and FedAvg's
    strategy and client come from the bundle, not from the source tree."""
    _, app, _ = bundle
    code = ("import json, sys\n"
            f"sys.path.insert(0, {str(app)!r})\n"
            "import fedapp.server_app, fedapp.client_app\n"
            "from fedapp import registry\n"
            "registry.strategy_class('fedavg'), registry.client_handlers('fedavg')\n"
            f"tops = {RUNTIME + LEFT_OUT!r}\n"
            "print(json.dumps({n: getattr(m, '__file__', None) for n, m in list(sys.modules.items())"
            " if n.split('.')[0] in tops}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=app.parent, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert {"fedapp.server_app", "fedapp.client_app", "strategies.fedavg", "clients.classify"} <= set(loaded)
    outside = {n: f for n, f in loaded.items() if f is not None and not Path(f).is_relative_to(app)}
    assert outside == {}


def test_the_install_benchmark_sets_the_bundle_against_the_whole_project(bundle):
    """benchmarks/fab_install.py's baseline is what Flower bundles without fab-include: this project's every
    bundleable file, docs/ and the rest included, less docs/results/ (past Flower's 10 MB limit on its own); its
    app bundle is the one `flwr run` sends."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fab_install
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import io
    import zipfile

    fabs = fab_install.bundles()
    assert fabs["fab-include"] == bundle[0]
    whole = set(zipfile.ZipFile(io.BytesIO(fabs["whole project"])).namelist())
    assert {f.split("/")[0] for f in whole} >= set(RUNTIME + LEFT_OUT)
    assert bundleable(tracked(*RUNTIME, *LEFT_OUT)) - bundleable(tracked("docs/results")) <= whole
    assert not any(f.startswith("docs/results/") for f in whole)
    assert len(fabs["fab-include"]) < len(fabs["whole project"])
