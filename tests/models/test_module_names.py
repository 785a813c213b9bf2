"""No family's module names outside its description (apt_ds/models/): code asks a description for
a role (`family.layer_module(layer, "attn_output")`, `family.embedding`), so a family whose modules
are named otherwise is one new file, not edits in the units, masks, shrink, exports and loaders.

Checked on the syntax tree of the package, launch/ and benchmarks/: string constants (f-string
parts and `+` concatenations included, regex escapes removed), keyword and attribute names, and
`model.model` (the CausalLM's inner model, whose attribute names are the family's). Docstrings
explain with the familiar names (o_proj, down_proj) and are not code; comments are not in the tree
at all."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from apt_ds.models import FAMILIES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "apt_ds"
DESCRIPTIONS = PACKAGE / "models"
CHECKED = (PACKAGE, ROOT / "launch", ROOT / "benchmarks")
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


def _strings(tree: ast.AST, skip: set[int]):
    """(node, text) of every string in code: constants, and `'a' + 'b'` joined as Python would."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            yield node, node.value
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            parts = [node.left, node.right]
            if all(isinstance(p, ast.Constant) and isinstance(p.value, str) for p in parts):
                yield node, parts[0].value + parts[1].value


def _is_inner_model(node: ast.AST) -> bool:
    """`model.model`, `x.model.model`, `getattr(model, "model")`: transformers' CausalLM.model."""
    if isinstance(node, ast.Attribute) and node.attr == "model":
        inner = node.value
        return (isinstance(inner, ast.Name) and inner.id == "model") or (isinstance(inner, ast.Attribute) and inner.attr == "model")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "model")


def family_names_used(source: str) -> list[str]:
    """Where `source` names a family's module directly: `line: what`."""
    names, tree = _module_names(), ast.parse(source)
    word = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(sorted(map(re.escape, names))) + r")(?![A-Za-z0-9_])")
    dotted = re.compile(r"(^|\.)model\.(layers|norm)(\.|$)|\.layers\.$|^\.layers\.")
    found = []
    for node, text in _strings(tree, _docstrings(tree)):
        text = text.replace("\\", "")  # r"model\.layers\.(\d+)" names model.layers too
        if word.search(text) or dotted.search(text):
            found.append(f"{node.lineno}: string {text!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{node.lineno}: attribute .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg in names:
            found.append(f"{node.lineno}: keyword {node.arg}=")
        elif _is_inner_model(node):
            found.append(f"{node.lineno}: the inner model (model.model)")
    return found


def test_no_family_module_name_outside_the_descriptions():
    found = []
    for path in sorted(p for folder in CHECKED for p in folder.rglob("*.py")):
        if DESCRIPTIONS in path.parents:
            continue
        found += [f"{path.relative_to(ROOT)}:{where}" for where in family_names_used(path.read_text())]
    assert not found, ("ask the family description (apt_ds/models/family.py) for a role instead of naming its modules:\n"
                       + "\n".join(found))


# Code this project had before the descriptions, and the same names however spelled.
CODE_THAT_NAMES_MODULES = [
    "x = layer.self_attn.o_proj\n",
    "inner = model.model\nnorm = model.model.norm\n",
    "name = f'model.layers.{l}.mlp.down_proj.weight'\n",
    "tied = state.pop('lm_head.weight')\n",
    "targets = ('q_proj', 'v_proj')\n",
    "y = model.model.layers[0]\n",
    "inner = model.model\nblocks = inner.layers\n",
    "blocks = getattr(getattr(m, 'model'), 'layers')\n",
    "pattern = r'model\\.layers\\.(\\d+)\\.'\n",
    "name = 'q_' + 'proj'\n",
    "targets = dict(q_proj=1)\n",
    "name = f'{prefix}.layers.{i}'\n",
]


@pytest.mark.parametrize("code", CODE_THAT_NAMES_MODULES)
def test_the_check_finds_what_it_looks_for(code):
    assert family_names_used(code)


def test_the_check_leaves_alone_what_every_model_has():
    assert not family_names_used('def f():\n    """Masks scale o_proj\'s input."""\n    return shape.layers, x.norm()\n')
    assert not family_names_used("total = torch.norm(weight) + module.bias.sum()\n")
