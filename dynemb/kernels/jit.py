"""``njit``: numba's, with an on-disk cache that is stale once any compiled source changes.

numba keys a cached function on its own file only, but a compiled kernel embeds the kernels it
calls from other files (``grouped_numba`` runs ``rows_numba.init_rows``, every index kernel
inlines ``hashing``) and the constants it reads (``batch.EMPTY_KEY``). Edit a callee, or pull a
version that changes one, and the caller's cache still holds the old callee: two paths of one
table then compute different rows, silently. Every kernel of the package is compiled through
this ``njit``, whose cache is valid only for the sources it was built from: those of
:data:`SOURCES` (``tests/kernels/test_jit.py`` checks that they cover every module with a
kernel and every module of the package those import). (numba's NUMBA_CACHE_LOCATOR_CLASSES
replaces these locators, and with them the digest.)
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numba
from numba.core import caching

_PACKAGE = Path(__file__).resolve().parents[1]
SOURCES = (
    "batch.py", "errors.py", "kernels/*.py", "planner/profile.py", "planner/search.py")
"""The package's files (globs, relative to it) whose text compiled kernels may embed."""


def source_files(root: Path = _PACKAGE) -> list[Path]:
    """The files of :data:`SOURCES` under the package directory ``root``."""
    return sorted({p for pattern in SOURCES for p in root.glob(pattern)})


def digest(root: Path) -> str:
    """SHA-256 over the names and texts of ``source_files(root)``."""
    h = hashlib.sha256()
    for p in source_files(root):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """:func:`digest` of this package (read once per process)."""
    return digest(_PACKAGE)


class _Stamped:
    """A locator whose stamp adds the digest of every compiled source to its file's."""

    def get_source_stamp(self):
        return super().get_source_stamp(), sources_digest()


def _stamped(name: str):
    """numba's locator class ``name`` (``_name`` before numba 0.60) with :class:`_Stamped`'s
    stamp, or None where this numba has no such class."""
    base = getattr(caching, name, None) or getattr(caching, "_" + name, None)
    return None if base is None else type("Stamped" + name, (_Stamped, base), {})


_LOCATORS = [_stamped(n) for n in
             ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")]
_Cache = None
if all(_LOCATORS) and hasattr(caching, "CompileResultCacheImpl"):
    class _Impl(caching.CompileResultCacheImpl):
        _locator_classes = _LOCATORS

    class _Cache(caching.FunctionCache):
        _impl_class = _Impl


def njit(*args, **options):
    """``numba.njit`` (same arguments); with ``cache=True`` the cache described above."""
    if args and callable(args[0]):  # used bare: @njit
        return njit(**options)(args[0])
    if not options.get("cache"):
        return numba.njit(*args, **options)
    if args:  # numba would compile a signature at once, before the cache is set
        raise TypeError("dynemb.kernels.jit.njit(cache=True) takes no signature: kernels "
                        "compile for the types they are called with")
    options["cache"] = False

    def wrap(fn):
        dispatcher = numba.njit(*args, **options)(fn)
        if not hasattr(dispatcher, "py_func"):  # NUMBA_DISABLE_JIT: the function itself
            return dispatcher
        try:  # what cache=True would have set; numba's own where this numba lacks our classes
            dispatcher._cache = (_Cache or caching.FunctionCache)(dispatcher.py_func)
        except RuntimeError:  # no locator of ours fits (a zipped package): numba's own, whose
            dispatcher.enable_caching()  # stamp is the whole archive's
        return dispatcher

    return wrap
