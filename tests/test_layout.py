"""The repository's shape: imports run one way between the packages, the README's commands are the console
script's, and the docs and code describe the product as it is (no work history, no document outside the
repository)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["decoding", "frontend", "pipeline", "deploy", "jobs", "bench", "training", "specbatch", "tools"]

# What each package must never import (its own top-level name or a submodule of it).
FORBIDDEN = {
    "decoding": {"ray", "frontend", "pipeline", "deploy", "jobs", "bench", "training", "specbatch", "tools"},
    "frontend": {"pipeline", "deploy", "jobs", "bench", "training", "specbatch", "tools"},
    "pipeline": {"deploy", "jobs", "bench", "training", "specbatch", "tools"},
    "deploy": {"pipeline", "jobs", "bench", "training", "specbatch", "tools"},
    "bench": {"pipeline", "deploy", "jobs", "training", "specbatch", "tools"},
    "training": {"pipeline", "deploy", "jobs", "bench", "specbatch", "tools"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every absolute import of a file, at any depth (function-level imports included), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            found.append((node.lineno, str(node.args[0].value)))
    return found


def import_violations(package: str, forbidden: set[str]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line} imports {module}"
            for path in sorted((REPO / package).rglob("*.py"))
            for line, module in imported_modules(path) if module.split(".")[0] in forbidden]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package: str) -> None:
    assert (REPO / package / "__init__.py").is_file()
    assert import_violations(package, FORBIDDEN[package]) == []


def test_the_import_check_finds_imports_at_any_depth(tmp_path: Path) -> None:
    module = tmp_path / "example.py"
    module.write_text("import os\n\ndef f():\n    from ray.data import Dataset\n    import pipeline.job as job\n"
                      "    return importlib.import_module('deploy.server')\n")
    assert [name for _, name in imported_modules(module)] == ["os", "ray.data", "pipeline.job", "deploy.server"]


# decoding's sub-packages, lowest first: each imports only those before it (and decoding's top-level modules).
# The pool and its attention sit with the model; the engine uses all of them.
DECODING_LAYERS = ["model", "verification", "constraints", "drafting", "engine"]


def runtime_imports(path: Path) -> list[tuple[int, str]]:
    """``imported_modules`` less those under ``if TYPE_CHECKING:`` (annotations only: nothing loads at run time)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
                   and isinstance(guard.test, ast.Name) and guard.test.id == "TYPE_CHECKING"
                   for statement in guard.body for node in ast.walk(statement)}
    kept = {node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom | ast.Call) and id(node) not in typing_only}
    return [(line, module) for line, module in imported_modules(path) if line in kept]


def upward_imports(root: Path) -> list[str]:
    found = []
    for rank, layer in enumerate(DECODING_LAYERS):
        above = {f"decoding.{name}" for name in DECODING_LAYERS[rank + 1:]}
        for path in sorted((root / "decoding" / layer).rglob("*.py")):
            found += [f"{path.relative_to(root)}:{line} imports {module}" for line, module in runtime_imports(path)
                      if any(module == name or module.startswith(name + ".") for name in above)]
    return found


def test_decoding_s_packages_import_downward_only() -> None:
    assert sorted(p.name for p in (REPO / "decoding").iterdir() if (p / "__init__.py").is_file()) \
        == sorted(DECODING_LAYERS)
    assert upward_imports(REPO) == []


def test_the_layer_check_finds_an_upward_import(tmp_path: Path) -> None:
    for layer in DECODING_LAYERS:
        (tmp_path / "decoding" / layer).mkdir(parents=True)
    (tmp_path / "decoding" / "model" / "forward.py").write_text(
        "from typing import TYPE_CHECKING\nfrom decoding.verification import tree\n"
        "if TYPE_CHECKING:\n    from decoding.engine.sequence import Sequence\n")
    (tmp_path / "decoding" / "engine" / "step.py").write_text("import decoding.model.forward\n")
    (tmp_path / "decoding" / "constraints" / "masks.py").write_text(
        "def f():\n    from decoding.drafting import drafters\n")
    assert upward_imports(tmp_path) == ["decoding/model/forward.py:2 imports decoding.verification",
                                        "decoding/constraints/masks.py:2 imports decoding.drafting"]


def test_every_command_of_the_readme_is_the_console_script_s() -> None:
    from jobs.cli import COMMANDS

    script = Path(sys.executable).parent / "specbatch"
    shown = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    listed = re.findall(r"^  (\S+)\s", shown, re.M)
    assert listed == list(COMMANDS)
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("## Commands"):readme.index("## Configuration")]
    first_cells = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| `")]
    named = [code.removeprefix("specbatch ").split()[0]
             for cell in first_cells for code in re.findall("`([^`]*)`", cell)]
    assert sorted(named) == sorted(COMMANDS)


# Work history has no place in the product's text: issue numbers, rounds of work, dated logs, "superseded"
# sections, or citations of a contract document the repository does not hold.
HISTORY = [
    (re.compile(r"\bissues?[\s-]*#?\d+", re.I), "an issue number"),
    (re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                r"thirteenth|last|this|next|previous|earlier|later) session\b", re.I), "a session of work"),
    (re.compile(r"\bsuperseded\b", re.I), "a superseded section"),
    (re.compile(r"^#+ .*\b20\d\d-\d\d-\d\d\b", re.M), "a dated section heading"),
    (re.compile(r"\bSPEC\b|SPEC\.md"), "the contract document outside the repository"),
]


def product_text_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "jobs" / "configs").glob("*"))]
    for package in [*PACKAGES, "tests"]:
        files += sorted(p for p in (REPO / package).rglob("*") if p.suffix in (".py", ".md", ".sh", ".cpp"))
    return [path for path in files if path != Path(__file__).resolve()]  # this file's examples of history


def history_in(text: str) -> list[str]:
    found = []
    for pattern, what in HISTORY:
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"line {line}: {what} ({match.group(0).strip()!r})")
    return found


def test_docs_and_code_describe_the_product_not_its_history() -> None:
    files = product_text_files()
    assert REPO / "docs" / "reference.md" in files and REPO / "decoding" / "engine" / "engine.py" in files
    problems = [f"{path.relative_to(REPO)} {problem}" for path in files for problem in history_in(path.read_text())]
    assert problems == []


@pytest.mark.parametrize(("text", "found"), [
    ("as issue 14 asks", True), ("Issue #3's numbers", True), ("one row per issue-6 question", True),
    ("in the twelfth session", True),
    ("### Current engine, 2026-11-24 (CPU)", True), ("superseded by the table above", True),
    ('(SPEC "Input")', True), ("see SPEC.md", True),
    ("SPECBATCH_COMPILE=0", False), ("an HTTP session", False), ("spec_decode", False),
    ("measured 2026-11-26 at commit 298f046", False), ("the issue is the cache", False),
])
def test_the_history_check_tells_history_from_product_text(text: str, found: bool) -> None:
    assert bool(history_in(text)) == found


def section(markdown: str, heading: str) -> str:
    """The text of the ``## heading`` section, up to the next section of that level."""
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end != -1 else None]


def test_the_reference_names_every_configuration_field_output_column_and_route() -> None:
    """docs/reference.md is written from the code: a field, column or route added to the code must appear there."""
    from decoding.config import Config, SamplingParams, SpeculativeConfig
    from pipeline.schema import OUTPUT_SCHEMA, SPEC_DECODE, TOKEN_STATS_SCHEMA

    reference = (REPO / "docs" / "reference.md").read_text()
    configuration = section(reference, "Configuration")
    fields = [*Config.model_fields, *SpeculativeConfig.model_fields, *SamplingParams.model_fields]
    assert [name for name in fields if f"`{name}`" not in configuration] == []
    output = section(reference, "Output directory")
    columns = [*OUTPUT_SCHEMA.names, *(field.name for field in SPEC_DECODE), *TOKEN_STATS_SCHEMA.names]
    assert [name for name in columns if f"`{name}`" not in output] == []
    server = ast.parse((REPO / "deploy" / "server.py").read_text())
    routes = [f"{decorator.func.attr.upper()} {decorator.args[0].value}" for node in ast.walk(server)
              if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) for decorator in node.decorator_list
              if isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
              and decorator.func.attr in ("get", "post") and isinstance(decorator.func.value, ast.Name)
              and decorator.func.value.id == "api"]
    assert len(routes) >= 6
    http = section(reference, "HTTP API")
    assert [route for route in routes if f"`{re.sub(r'{[^}]*}', '{id}', route)}`" not in http] == []


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation but ``-`` and ``_`` dropped, spaces -> ``-``."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_the_docs_resolve() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command, its options) for every ``specbatch <command>`` or ``python -m jobs.<module>`` that README.md
    and docs/*.md show, in code blocks (continuation lines joined) and inline code."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        blocks = [re.sub(r"\\\n\s*", " ", block) for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S)]
        lines = [line for block in blocks for line in block.splitlines()]
        lines += [" ".join(span.split()) for span in
                  re.findall(r"(?<!`)`([^`]+)`(?!`)", re.sub(r"```.*?```", "", text, flags=re.S))]
        for line in lines:
            for match in re.finditer(r"(?:^|&& |\b)(specbatch [a-z][a-z-]*|python -m jobs\.\w+)([^#&|]*)", line):
                options = re.findall(r"(?<![\w-])--([a-z][\w.-]*)", match.group(2))
                found.append((page.name, match.group(1), [option for option in options if option != "a.b"]))
    return found  # ``--a.b VALUE`` is how the docs write "any dotted override"


def accepts(model: type, dotted: str) -> bool:
    """Whether ``--dotted VALUE`` names a field of ``model`` (a pydantic model; sections nest with dots)."""
    from pydantic import BaseModel

    for key in dotted.replace("-", "_").split("."):
        field = model.model_fields.get(key) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return False
        model = field.annotation
        if getattr(model, "__origin__", None) is not None or not isinstance(model, type):  # X | None: its model
            model = next((arg for arg in getattr(model, "__args__", ()) if isinstance(arg, type)
                          and issubclass(arg, BaseModel)), model)
    return True


def test_every_documented_command_line_uses_options_the_command_takes() -> None:
    """Each option a README or docs command line passes is one of that command's own (``--help``) or, for the
    commands that take configuration overrides, a field of that command's configuration."""
    from decoding.config import Config
    from jobs.cli import COMMANDS
    from training.distill import DraftTrainingConfig
    from training.signals import SignalTrainingConfig

    overrides = {"jobs.train_draft": DraftTrainingConfig, "jobs.train_head": SignalTrainingConfig,
                 "jobs.train_decision": SignalTrainingConfig, "jobs.report": None, "jobs.eval_draft": None,
                 "jobs.eval_self_draft": None}
    commands = documented_commands()
    assert {name for _, name, _ in commands} >= {f"specbatch {name}" for name in COMMANDS}
    modules = {name: COMMANDS[name.split()[1]][0] if name.startswith("specbatch ") else name.split()[-1]
               for _, name, _ in commands}
    # Every module's --help in one process (the imports are most of the time): module -> its help text.
    script = ("import contextlib, importlib, io, json, sys\nhelps = {}\nfor module in sys.argv[1:]:\n"
              "    out = io.StringIO()\n    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
              "        importlib.import_module(module).main(['--help'])\n    helps[module] = out.getvalue()\n"
              "print(json.dumps(helps))")
    done = subprocess.run([sys.executable, "-c", script, *sorted(set(modules.values()))], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    helps = json.loads(done.stdout.splitlines()[-1])
    assert all("usage:" in text for text in helps.values()), helps
    wrong = []
    for page, name, options in commands:
        module = modules[name]
        model = overrides.get(module, Config)
        wrong += [f"{page}: {name} --{option}" for option in options
                  if not re.search(rf"(?<![\w-])--{re.escape(option)}(?![\w-])", helps[module])
                  and not (model is not None and accepts(model, option))]
    assert wrong == []


def test_every_page_the_code_and_docs_name_exists() -> None:
    named = {(path.relative_to(REPO), page) for path in product_text_files()
             for page in re.findall(r"\bdocs/[\w-]+\.md\b", path.read_text())}
    assert named and [f"{path}: {page}" for path, page in sorted(named) if not (REPO / page).is_file()] == []


def test_every_repository_path_the_docs_name_exists() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    roots = "|".join([*PACKAGES, "tests", "docs", r"\.ci"])
    named = {(page.name, path) for page in pages
             for path in re.findall(rf"(?<![\w/.])((?:{roots})/[\w/.-]*\w)", page.read_text())}
    assert len(named) > 50
    assert [f"{page}: {path}" for page, path in sorted(named) if not (REPO / path).exists()] == []
