"""The kernels' on-disk cache (``dynemb.kernels.jit``): stale once any compiled source changes,
and covering every module whose text a kernel can embed."""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import sys
import types
from pathlib import Path

import pytest

import dynemb
from dynemb.kernels import jit

PACKAGE = Path(dynemb.__file__).resolve().parent


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _imports(path: Path) -> set[str]:
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    return _imports_in(path.read_text(), package)


def _imports_in(text: str, package: str) -> set[str]:
    """The dynemb modules (and names in them) ``text`` imports, relative imports resolved
    against ``package``."""
    out = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("dynemb"):
                out.add(base)
                out.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("dynemb"))
    return out


def _file(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:])
    if not rel.parts:
        return PACKAGE / "__init__.py"
    for p in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if p.is_file():
            return p
    return None  # a name imported from a module, not a module


def test_the_sources_cover_every_kernel_module_and_what_it_imports():
    covered = set(jit.source_files())
    uses = re.compile(r"^\s*(from numba\b|import numba\b|from (dynemb\.kernels)?\.?jit import)",
                      re.M)
    kernels = [p for p in PACKAGE.rglob("*.py")
               if p.name != "jit.py" and uses.search(p.read_text())]
    assert len(kernels) >= 8
    for p in kernels:
        text = p.read_text()
        assert not re.search(r"from numba import .*\b(n?jit)\b|numba\.n?jit\b", text), (
            f"{p} compiles with numba's own jit: use dynemb.kernels.jit.njit")
        assert p in covered, f"{p} uses numba but is not in jit.SOURCES"
        for module in _imports(p):
            f = _file(module)
            if f is not None and f.name != "__init__.py":
                assert f in covered, f"{p} imports {module}, which is not in jit.SOURCES"


def test_the_coverage_check_sees_relative_and_package_imports():
    src = "from . import hashing\nfrom ..planner import cost\nfrom dynemb import units\n"
    found = _imports_in(src, "dynemb.kernels")
    assert {"dynemb.kernels.hashing", "dynemb.planner.cost", "dynemb.units"} <= found
    assert _file("dynemb.units") == PACKAGE / "units.py" and _file("dynemb") is not None


def test_a_signature_is_refused():
    with pytest.raises(TypeError, match="no signature"):
        jit.njit("int64(int64)", cache=True)


def test_the_digest_follows_every_source(tmp_path):
    root = tmp_path / "dynemb"
    for p in jit.source_files():
        dst = root / p.relative_to(PACKAGE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dst)
    assert jit.digest(root) == jit.sources_digest()
    for p in (root / "batch.py", root / "kernels" / "hashing.py"):
        before = jit.digest(root)
        p.write_text(p.read_text() + "\n")
        assert jit.digest(root) != before


def test_a_cached_kernel_is_stale_once_the_sources_change(tmp_path, monkeypatch):
    (tmp_path / "jit_probe_mod.py").write_text(
        "from dynemb.kernels.jit import njit\n\n\n"
        "@njit(cache=True)\ndef add_one(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("jit_probe_mod")
    try:
        assert mod.add_one(1) == 2
        assert sum(mod.add_one.stats.cache_misses.values()) == 1  # compiled, then saved
        mod = importlib.reload(mod)
        assert mod.add_one(1) == 2
        assert sum(mod.add_one.stats.cache_hits.values()) == 1  # loaded
        monkeypatch.setattr(jit, "sources_digest", lambda: "another version")
        mod = importlib.reload(mod)
        assert mod.add_one(1) == 2
        assert sum(mod.add_one.stats.cache_hits.values()) == 0  # the saved code is stale
    finally:
        sys.modules.pop("jit_probe_mod", None)


def test_locators_are_found_under_the_names_older_numbas_give_them(monkeypatch):
    """numba before 0.60 names its locators with a leading underscore; without them the kernels
    keep numba's own cache rather than failing to import."""
    class Old:
        def get_source_stamp(self):
            return "own"

    monkeypatch.setattr(jit, "caching", types.SimpleNamespace(_InTreeCacheLocator=Old))
    cls = jit._stamped("InTreeCacheLocator")
    assert issubclass(cls, Old) and cls().get_source_stamp() == ("own", jit.sources_digest())
    assert jit._stamped("UserWideCacheLocator") is None
