"""No family's module names outside its description (apt_ds/models/): code asks a description for
a role (`family.layer_module(layer, "attn_output")`, `family.embedding`), so a family whose modules
are named otherwise is one new file, not edits in the units, masks, shrink, exports and loaders.

Checked on the syntax tree: string constants (f-string parts included) and attribute names.
Docstrings explain with the familiar names (o_proj, down_proj) and are not code; comments are not
in the tree at all."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from apt_ds.models import FAMILIES

PACKAGE = Path(__file__).resolve().parents[2] / "apt_ds"
DESCRIPTIONS = PACKAGE / "models"
# Path segments every PyTorch model has or that name other things too (`shape.layers`, `torch.norm`,
# `module.weight`): these count only as part of a family's dotted path (`.model.layers`).
GENERIC = {"model", "layers", "norm", "weight", "bias"}


def _family_paths() -> set[str]:
    paths = set()
    for family in FAMILIES.values():
        paths |= {family.embedding, family.final_norm, family.output_embedding, family.layers, family.rotary}
        paths |= {tensor.name for tensor in family.layer_tensors}
    return paths


def _module_names() -> set[str]:
    """Every segment of a family's paths that names a module of that family (q_proj, self_attn, ...)."""
    return {segment for path in _family_paths() for segment in path.split(".")} - GENERIC


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def family_names_used(source: str) -> list[str]:
    """Where `source` names a family's module directly: `line: what`."""
    names, tree = _module_names(), ast.parse(source)
    word = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(sorted(map(re.escape, names))) + r")(?![A-Za-z0-9_])")
    dotted = re.compile(r"(^|\.)model\.(layers|norm)(\.|$)")
    skip, found = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            match = word.search(node.value) or dotted.search(node.value)
            if match:
                found.append(f"{node.lineno}: string {node.value!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr in names:
                found.append(f"{node.lineno}: attribute .{node.attr}")
            elif node.attr in ("layers", "norm") and isinstance(node.value, ast.Attribute) and node.value.attr == "model":
                found.append(f"{node.lineno}: attribute .model.{node.attr}")
    return found


def test_no_family_module_name_outside_the_descriptions():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if DESCRIPTIONS in path.parents:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{where}" for where in family_names_used(path.read_text())]
    assert not found, ("ask the family description (apt_ds/models/family.py) for a role instead of naming its modules:\n"
                       + "\n".join(found))


def test_the_check_finds_what_it_looks_for():
    """The check would fail on the code this project had before the descriptions."""
    assert family_names_used("x = layer.self_attn.o_proj\n")
    assert family_names_used("inner = model.model\nnorm = model.model.norm\n")
    assert family_names_used("name = f'model.layers.{l}.mlp.down_proj.weight'\n")
    assert family_names_used("tied = state.pop('lm_head.weight')\n")
    assert family_names_used("targets = ('q_proj', 'v_proj')\n")
    assert family_names_used("y = model.model.layers[0]\n")
    # ... and not on what every model has, nor on explanations
    assert not family_names_used('def f():\n    """Masks scale o_proj\'s input."""\n    return shape.layers, x.norm()\n')
    assert not family_names_used("total = torch.norm(weight) + module.bias.sum()\n")
