"""Every DeepSpeed internal apt_ds uses still exists on the installed DeepSpeed.

apt_ds.distributed.deepspeed_private lists them in PRIVATE_NAMES (owner, name, the function
that uses it). Here: the list matches what the module's code touches, no other apt_ds module
touches a DeepSpeed internal, the methods exist on DeepSpeed's classes, and a real one-process
ZeRO-2 and ZeRO-3 engine (tests/distributed/multirank/private_probe.py) carries every
attribute. A failure names the attribute, the installed DeepSpeed version and the function to
update.
"""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from apt_ds.distributed import deepspeed_private as private

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "apt_ds" / "distributed"
PROBE = ROOT / "tests" / "distributed" / "multirank" / "private_probe.py"
LISTED = {entry.name for entry in private.PRIVATE_NAMES}


def _installed_version() -> str:
    from importlib.metadata import version

    return version("deepspeed")


def _failure(entry: private.PrivateName, what: str) -> str:
    return (f"deepspeed {_installed_version()}: {private.OWNERS[entry.owner]} {what} `{entry.name}`; update "
            f"apt_ds.distributed.deepspeed_private.{entry.function} (written against deepspeed {private.READ_FROM})")


def _touched_names(source: str) -> set[str]:
    """Attribute names the code reads or writes: `x.name` and getattr/hasattr/setattr/delattr/
    __dict__ strings, whether private (`_name`) or DeepSpeed partition attributes (`ds_*`), plus
    the engine and optimizer attributes the module lists without either mark."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[A-Za-z_]\w*", node.value):
            names.add(node.value)
    return names


def test_every_internal_the_module_uses_is_listed():
    source = (PACKAGE / "deepspeed_private.py").read_text()
    module = ast.parse(source)
    code_only = ast.unparse([n for n in module.body if not (isinstance(n, ast.Assign) and any(
        getattr(t, "id", "") in ("PRIVATE_NAMES", "OWNERS") for t in n.targets))])
    marked = {n for n in _touched_names(code_only) if re.match(r"_[a-z]|ds_", n) and not n.startswith("__")}
    assert marked <= LISTED, f"deepspeed_private uses internals missing from PRIVATE_NAMES: {sorted(marked - LISTED)}"
    unused = {e.name for e in private.PRIVATE_NAMES} - _touched_names(code_only)
    assert not unused, f"PRIVATE_NAMES lists names deepspeed_private never uses: {sorted(unused)}"
    for entry in private.PRIVATE_NAMES:
        function = getattr(private, entry.function, None)
        assert callable(function), f"PRIVATE_NAMES names {entry.function}, which deepspeed_private lacks"
        assert entry.name in ast.unparse(ast.parse(__import__("inspect").getsource(function))), \
            f"{entry.function} does not touch {entry.name} (PRIVATE_NAMES out of date)"
        assert entry.owner in private.OWNERS


# Listed names too generic to flag elsewhere (torch optimizers have `optimizer`-free APIs, but
# "lr_scheduler" and "monitor" are our own attributes' names as well).
_GENERIC = {"optimizer", "lr_scheduler", "monitor"}


def test_no_other_module_touches_deepspeed_internals():
    """apt_ds.distributed is the only layer that imports deepspeed; in it, only deepspeed_private
    reads a listed internal or any `obj._private` attribute of an object other than self/cls."""
    flagged = LISTED - _GENERIC
    offenders = []
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "deepspeed_private.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            owner = getattr(getattr(node, "value", None), "id", None)
            if isinstance(node, ast.Attribute) and owner not in ("self", "cls", "private") and (
                    node.attr in flagged or (node.attr.startswith("_") and not node.attr.startswith("__"))):
                offenders.append(f"{path.name}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in flagged:
                offenders.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not offenders, "DeepSpeed internals outside deepspeed_private: " + ", ".join(offenders)


def test_methods_exist_on_deepspeed_classes():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    classes = {"zero12_optimizer": DeepSpeedZeroOptimizer, "zero3_optimizer": DeepSpeedZeroOptimizer_Stage3}
    methods = [e for e in private.PRIVATE_NAMES if e.owner in classes and e.name.startswith("_")
               and not e.name.endswith("_linked")]
    assert methods
    for entry in methods:
        assert callable(getattr(classes[entry.owner], entry.name, None)), _failure(entry, "has no method")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("probe") / "found.json"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(PROBE), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("entry", private.PRIVATE_NAMES, ids=lambda e: f"{e.owner}.{e.name}")
def test_real_engine_has_every_private_name(probed, entry):
    assert probed.get(entry.owner, {}).get(entry.name) is True, _failure(entry, "no longer has")
