"""Another checkout's engine in this process: its ``decoding`` package imported under an alias.

``specbatch bench --baseline-tree PATH`` runs the engine of PATH (e.g. a worktree of an earlier commit) beside this
one, on the same loaded models and prompts, turn by turn. The package at ``PATH/decoding`` is imported as
``baseline_decoding`` by a meta-path finder that rewrites, in each of its modules, every import of ``decoding`` or
``decoding.<name>`` (statements, and module names given as whole strings to ``importlib.import_module``) to the
alias, so the two engines share nothing but the libraries below them (torch, transformers) and the on-disk caches
of compiled code, which are keyed by their sources.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from pydantic import BaseModel

PACKAGE = "decoding"
ALIAS = "baseline_decoding"
_MODULE_NAME = re.compile(rf"^{PACKAGE}(\.\w+)*$")


def _aliased(name: str, alias: str) -> str:
    return alias + name[len(PACKAGE):] if name == PACKAGE or name.startswith(PACKAGE + ".") else name


class _RewriteImports(ast.NodeTransformer):
    def __init__(self, alias: str) -> None:
        self.alias = alias

    def visit_Import(self, node: ast.Import) -> ast.AST:
        for name in node.names:
            if name.name == PACKAGE or name.name.startswith(PACKAGE + "."):
                # ``import decoding.x`` binds ``decoding``: bind the alias package under that name instead.
                if name.asname is None:
                    name.asname = PACKAGE if "." not in name.name else None
                    if name.asname is None:
                        raise ImportError(f"cannot alias 'import {name.name}' without 'as' in a baseline tree")
                name.name = _aliased(name.name, self.alias)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if node.level == 0 and node.module is not None:
            node.module = _aliased(node.module, self.alias)
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if isinstance(node.value, str) and _MODULE_NAME.match(node.value):
            return ast.copy_location(ast.Constant(_aliased(node.value, self.alias)), node)
        return node


class _AliasLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, alias: str) -> None:
        super().__init__(fullname, path)
        self.alias = alias

    def source_to_code(self, data: Any, path: Any, *, _optimize: int = -1) -> Any:  # type: ignore[override]
        tree = _RewriteImports(self.alias).visit(ast.parse(data, filename=path))
        return compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True)

    def get_code(self, fullname: str) -> Any:
        # No bytecode cache: the rewritten code must never be mistaken for the tree's own __pycache__.
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path, alias: str) -> None:
        self.root, self.alias = root, alias

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        relative = fullname[len(self.alias):].lstrip(".").replace(".", "/")
        folder = self.root / relative if relative else self.root
        if (folder / "__init__.py").is_file():
            loader = _AliasLoader(fullname, str(folder / "__init__.py"), self.alias)
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py", loader=loader,
                                                          submodule_search_locations=[str(folder)])
        file = self.root / f"{relative}.py"
        if file.is_file():
            return importlib.util.spec_from_file_location(fullname, file,
                                                          loader=_AliasLoader(fullname, str(file), self.alias))
        return None


def load_baseline(tree: str | Path, alias: str = ALIAS) -> ModuleType:
    """The ``decoding`` package of checkout ``tree`` as ``alias``, with its ``engine`` and ``config`` modules
    imported (once per process; a second call with another tree is refused)."""
    root = (Path(tree) / PACKAGE).resolve()
    if not (root / "__init__.py").is_file():
        raise FileNotFoundError(f"{tree} has no {PACKAGE}/ package")
    finder = next((f for f in sys.meta_path if isinstance(f, _AliasFinder) and f.alias == alias), None)
    if finder is None:
        sys.meta_path.insert(0, _AliasFinder(root, alias))
    elif finder.root != root:
        raise ValueError(f"{alias} is already imported from {finder.root.parent}, not {tree}")
    package = importlib.import_module(alias)
    for module in ("config", "engine"):
        importlib.import_module(f"{alias}.{module}")
    return package


def convert_model(value: BaseModel, into: type[BaseModel]) -> BaseModel:
    """A pydantic config of this engine as the baseline's class, keeping only the fields that class has (a field
    the baseline lacks is one it could not honour: its default behaviour runs)."""
    return into.model_validate(_known_fields(value.model_dump(), into))


def _known_fields(data: Any, model: Any) -> Any:
    fields = getattr(model, "model_fields", None)
    if fields is None or not isinstance(data, dict):
        return data
    kept = {}
    for name, value in data.items():
        if name not in fields:
            continue
        annotation = fields[name].annotation
        nested = next((a for a in (annotation, *getattr(annotation, "__args__", ())) if hasattr(a, "model_fields")),
                      None)
        kept[name] = _known_fields(value, nested) if nested is not None else value
    return kept
