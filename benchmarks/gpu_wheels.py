"""Wheels for a GPU machine that has no network: what apt-ds needs there beyond what its image holds.

    python benchmarks/gpu_wheels.py --have image_packages.txt --out .whl

The machine's image already has PyTorch and much of the stack; this collects the rest as wheels
for its Python (default 3.12, x86-64 manylinux), at the versions installed here, where the tests
pass. `--have` lists what the image holds, one name per line or comma-separated (a `pip freeze`
also works: `name==version` lines; copy the names only, without a heading). A package the image holds at a version outside apt-ds's
range is carried anyway when named with `--carry` (default: transformers, whose pin asks for a
newer release than the images seen so far). Packages published only as source (deepspeed, pure
Python with its ops built on first use) are built into a wheel here. Then, on that machine:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Needs the network here (PyPI) and the packages installed here (`pip install -e ".[dev]"`).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

from packaging.requirements import Requirement

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
DEFAULT_CARRY = ("transformers",)
CARRY_LIMIT_MB = 64  # what one device call carries in all


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip().lower())


def read_have(path: Path) -> set[str]:
    """Names from a list (one per line, or comma-separated, or `pip freeze` lines)."""
    names = set()
    for part in re.split(r"[,\n]", path.read_text()):
        part = part.strip().split("==")[0].split(" ")[0]
        if part and not part.startswith("#"):
            names.add(normalise(part))
    return names


def closure(root: str, python: str = "3.12") -> dict[str, str]:
    """Every distribution `root` needs when installed without extras on that Python, with its version here."""
    environment = {"extra": "", "python_version": python, "python_full_version": f"{python}.0"}
    found, todo = {}, [normalise(root)]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        try:
            found[name] = version(name)
            needs = requires(name) or []
        except PackageNotFoundError:
            raise SystemExit(f"error: {name} (needed by {root}) is not installed here: pip install -e \".[dev]\" first")
        for text in needs:
            need = Requirement(text)
            if need.marker is None or need.marker.evaluate(environment):
                todo.append(normalise(need.name))
    return found


def to_carry(root: str, have: set[str], carry: tuple[str, ...], python: str = "3.12") -> dict[str, str]:
    needed = closure(root, python)
    forced = {normalise(name) for name in carry}
    return {n: v for n, v in sorted(needed.items()) if n != normalise(root) and (n not in have or n in forced)}


def fetch(packages: dict[str, str], out: Path, python: str) -> list[str]:
    """Download binary wheels; build the ones with no binary on PyPI. Returns the names built here."""
    built = []
    platform_flags = [flag for p in PLATFORMS for flag in ("--platform", p)]
    for name, ver in packages.items():
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    python, "--implementation", "cp", *platform_flags, "-d", str(out), f"{name}=={ver}"]
        fetched = subprocess.run(download, capture_output=True, text=True)
        if fetched.returncode == 0:
            continue
        # no wheel for that Python and platform: only a pure-Python source distribution can be built here
        build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), f"{name}=={ver}"]
        result = subprocess.run(build, capture_output=True, text=True)
        wheels = sorted(out.glob(f"{name.replace('-', '_')}-{ver}-*.whl"))
        if result.returncode != 0 or not wheels or not wheels[0].name.endswith("-py3-none-any.whl"):
            said = " ".join(f"{_last_line(fetched.stderr)}; {_last_line(result.stderr)}".split())
            raise SystemExit(f"error: no wheel of {name}=={ver} for Python {python} on x86-64 Linux, and none could be "
                             f"built here that runs there (pip: {said})")
        built.append(name)
    return built


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][-200:] if lines else "no message"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--have", type=Path, required=True, help="the packages the GPU machine's image holds")
    parser.add_argument("--carry", nargs="*", default=list(DEFAULT_CARRY),
                        help="carry these even if the image holds them (its version is outside apt-ds's range)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--out", type=Path, default=Path(".whl"), help="where the wheels go (replaced; default .whl)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be carried, fetch nothing")
    args = parser.parse_args(argv)
    try:
        return _collect(parser, args)
    except (OSError, UnicodeDecodeError) as err:  # unreadable list, read-only parent, ...: one line
        raise SystemExit(f"error: {err}") from None


def _collect(parser, args) -> int:
    if not args.have.is_file():
        parser.error(f"--have {args.have}: no such file")
    out = args.out.absolute()
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(
            not p.name.endswith(".whl") or not p.is_file() for p in out.iterdir()))):
        parser.error(f"--out {args.out} is a link or holds other things than wheels; it is replaced: give a new directory")
    if not out.parent.is_dir():
        parser.error(f"--out {args.out}: {out.parent} is not a directory")
    if out == Path.cwd() or out in Path.cwd().parents:
        parser.error(f"--out {args.out} is the current directory or holds it: give a new directory")
    packages = to_carry("apt-ds", read_have(args.have), tuple(args.carry), args.python)
    print(" ".join(f"{n}=={v}" for n, v in packages.items()))
    if args.dry_run:
        return 0
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))  # ours alone
    try:
        built = fetch(packages, tmp, args.python)
        size_mb = sum(p.stat().st_size for p in tmp.iterdir()) / 2**20
        shutil.rmtree(out, ignore_errors=True)  # checked above: nothing but wheels
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{len(packages)} wheels in {args.out} ({size_mb:.1f} MB; built here: {', '.join(built) or 'none'})")
    if size_mb > CARRY_LIMIT_MB:
        print(f"warning: {size_mb:.0f} MB is over what one device call carries ({CARRY_LIMIT_MB} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
