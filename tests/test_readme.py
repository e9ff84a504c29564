"""The commands README.md and docs/ give work: federation configs parse as `flwr run` parses them, every run config
passes preflight, every `python -m` command's module exists and accepts its flags, and CI runs the README's own
install-and-test command from the committed lock."""

import argparse
import re
import runpy
import sys
from pathlib import Path

import pytest
from flwr.common.config import parse_config_args  # the parser `flwr run --run-config/--federation-config` uses
from flwr.supercore.utils import simulation_config_from_json

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def _as_flwr_run_reads_it(text: str):
    parsed = parse_config_args([text])
    return parsed, simulation_config_from_json({k.replace("-", "_"): v for k, v in parsed.items()})


def _code_lines(markdown: str) -> list[str]:
    """Shell lines of a page's code: fenced blocks and 4-space indented blocks, backslash continuations joined,
    comments dropped; inline `python -m ...` spans too."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            lines.append(line.strip())
    joined = "\n".join(lines)
    out = []
    for line in joined.replace("\\\n", " ").splitlines():
        line = line.split(" # ")[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    out += re.findall(r"`(python -m [^`]+)`", markdown)
    return out


def test_every_federation_config_parses_as_flwr_run_parses_it():
    found = re.findall(r'--federation-config "([^"]+)"', README + "".join(DOCS.values()))
    assert len(found) >= 4  # the quickstart, the sizing examples, the GPU example
    for text in found:
        parsed, config = _as_flwr_run_reads_it(text)
        assert config.num_supernodes == parsed["num-supernodes"], text
        if "client-resources-num-gpus" in parsed:
            assert config.client_resources_num_gpus == parsed["client-resources-num-gpus"], text


def test_flwr_refuses_the_nested_key_the_readme_once_used():
    with pytest.raises(ValueError, match="Unknown simulation config field"):
        _as_flwr_run_reads_it("num-supernodes=4 backend.client-resources.num-cpus=1")


# the docs' placeholders, each with a value a command can run with
PLACEHOLDERS = {"<run dir>": "runs/x", "<name>": "digits", "<run-id>": "1", "min-clients=M": "min-clients=2"}


def _filled(text: str) -> str:
    for k, v in PLACEHOLDERS.items():
        text = text.replace(k, v)
    return text


def _run_configs() -> list[tuple[str, dict, int]]:
    """(page, run config, number of nodes) of every `flwr run` line in the code of README.md and docs/*.md (on
    Flower's default 2 nodes where the line sets none), and of every inline `--run-config "..."` of the README
    (on the quickstart's 4 nodes)."""
    out = []
    for page, text in {"README.md": README, **DOCS}.items():
        for line in _code_lines(text):
            if "flwr run" in line:
                rc = re.search(r'--run-config "([^"]+)"', _filled(line))
                fc = re.search(r'--federation-config "([^"]+)"', line)
                nodes = parse_config_args([fc.group(1)])["num-supernodes"] if fc else 2
                out.append((page, parse_config_args([rc.group(1)]) if rc else {}, nodes))
    for text in re.findall(r'`--run-config "([^"]+)"`', README):
        out.append(("README.md", parse_config_args([text]), 4))
    return out


def test_every_run_config_in_the_readme_and_docs_passes_preflight(tmp_path):
    """What `fedapp.simulate` checks before Ray starts: keys, values, the prior, the model and the data."""
    from fedapp.simulation import resolve_run_config
    from feddata.validation import ConfigError

    configs = _run_configs()
    assert sum(page == "README.md" for page, _, _ in configs) >= 3  # quickstart, choosing, one-key-away
    assert len({page for page, _, _ in configs}) >= 4
    for page, config, nodes in configs:
        try:
            flat, run_dir = resolve_run_config({**config, "out-dir": str(tmp_path)}, nodes)
        except ConfigError as refusal:  # a hub-id prior on a machine without that model: the one refusal allowed
            assert "/" in str(config.get("prior", "")) and "Hugging Face cache" in str(refusal), (page, refusal)
            continue
        assert all(flat[k] == v for k, v in config.items() if k != "partitioner.name"), (page, config)
        assert run_dir.parent == tmp_path


class _Parsed(Exception):
    """Raised right after a command's argparse parser accepted its arguments: nothing else runs."""


def _module_commands() -> list[tuple[str, str, list[str]]]:
    """(page, module, args) of every `python -m <module> ...` in README.md and docs/*.md, the README's placeholders
    filled; a synopsis with optional parts (`[--flag]`, `...`, `<value>`) is not a command and is left out."""
    out = []
    for page, text in {"README.md": README, **DOCS}.items():
        for line in _code_lines(text):
            for m in re.finditer(r"python -m ([\w.]+)((?:\s+(?!&&|\||;|>)\S+)*)", line):
                args = _filled(m.group(2))
                synopsis = any(mark in args for mark in ("[", "...", "…", "<"))  # usage notation, not a command
                if m.group(1) not in ("pytest", "pip", "venv") and not synopsis:
                    out.append((page, m.group(1), [a.strip("'\"") for a in args.split()]))
    return out


def test_every_python_m_command_in_the_docs_accepts_its_flags(monkeypatch):
    """Each command's own parser reads its arguments (an unknown flag or a bad choice exits with 2); the
    command is stopped right after parsing."""
    commands = _module_commands()
    assert len(commands) >= 60
    assert {"fedapp.reference", "fedapp.config", "fedapp.report", "fedapp.models.prior.tiny"} <= {
        m for page, m, _ in commands if page == "README.md"}
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    refused = []
    for page, module, args in commands:
        monkeypatch.setattr(sys, "argv", [module, *args])
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            refused.append((page, module, args, "ran without parsing its arguments"))
        except _Parsed:
            pass
        except SystemExit as e:
            refused.append((page, module, args, f"exit {e.code}"))
    assert not refused, refused


def _quickstart_commands() -> list[str]:
    section = README[README.index("\n## Quickstart"):]
    block = section[section.index("```bash\n") + 8:]
    return [line for line in block[:block.index("```")].splitlines() if line.strip()]


def test_ci_runs_the_readmes_test_command_from_the_lock():
    """CI proves what a user runs: .ci/run's install-and-test line is the README's second command, both
    install from the committed lock, and the lock pins every package (no resolver choices left)."""
    first, second = _quickstart_commands()
    ci = (ROOT / ".ci" / "run").read_text()
    assert second in ci.splitlines()
    for command in (first, second):
        assert "pip install -r requirements.lock -e ." in command
    assert "PIP_NO_CACHE_DIR=1" in ci and "rm -rf .venv" in ci and "mktemp -d" in ci
    pins = [line for line in (ROOT / "requirements.lock").read_text().splitlines() if line and line[0] != "#"]
    assert len(pins) > 50 and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.+!]+", line) for line in pins), pins
    names = {line.split("==")[0].lower() for line in pins}
    assert {"torch", "flwr", "datasets", "pytest", "pytest-xdist"} <= names
