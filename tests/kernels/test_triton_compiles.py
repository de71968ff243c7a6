"""Every Triton kernel compiles for a real GPU (an H100's sm_90), checked without one.

Triton's interpreter, which runs the kernels in CI, accepts code the compiler refuses (a
module-level constant that is not ``tl.constexpr``, a variable whose type differs between the
branches of an ``if``). Triton compiles for a named target on any host (its frontend, MLIR
passes and bundled ptxas), so each kernel is compiled here, in a process without
``TRITON_INTERPRET``, in every specialisation a launch can ask for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dynemb.kernels import triton_index

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from dynemb.kernels import triton_index as ti, triton_lookup as tlk, triton_rows as tr

    TARGET = GPUTarget("cuda", 90, 32)
    failed = []

    def compile_(fn, types, consts, ones=()):
        """``fn`` with pointer and scalar ``types`` (default: *_ptr int64, else int32),
        ``consts`` as constexprs, and the int arguments ``ones`` equal to 1 (which Triton's
        launcher specialises as constants)."""
        consts = {**consts, **{k: 1 for k in ones}}
        sig = {a: "constexpr" if a in consts else types.get(
            a, "*i64" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=TARGET)
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{fn.__name__} {consts}: {str(e).strip().splitlines()[-1][:300]}")

    u8, i32, i1, f32 = "*u8", "*i32", "*i1", "*fp32"
    for journal in (False, True):
        compile_(ti._probe_kernel, {"digest_ptr": u8, "idig_ptr": u8},
                 {"W": 128, "JOURNAL": journal, "BLOCK": 16})
    ins = {"digest_ptr": u8, "idig_ptr": u8, "pins_ptr": i32, "ins_ptr": i1, "evflag_ptr": i1,
           "fail_ptr": i1}
    for n in range(4):
        for ones in itertools.combinations(("policy", "tkind", "num_buckets"), n):
            compile_(ti._insert_kernel, ins, {"W": 8, "MAX": ti.MAX_SCORE}, ones)
    for tkind in range(4):
        for step in ("i32", "i64"):
            compile_(tlk._touch_kernel, {"last_ptr": "*i8" if tkind == 3 else "*i64",
                                         "pins_ptr": i32, "step": step},
                     {"TKIND": tkind, "BLOCK": 128})
    compile_(tlk._release_kernel, {"pins_ptr": i32}, {"BLOCK": 128})
    floats = {k: f32 for k in ("rows_ptr", "extra_ptr", "w_ptr", "out_ptr", "gout_ptr",
                               "grads_ptr", "wgrad_ptr", "hbm_ptr", "ddr_ptr", "buf_ptr")}
    for mean, weighted in itertools.product((False, True), repeat=2):
        flags = {"MEAN": mean, "WEIGHTED": weighted, "BLOCK": 16}
        compile_(tr._pool_kernel, floats, flags)
        compile_(tr._pool_backward_kernel, floats, flags)
        compile_(tr._weight_grad_kernel, floats, {"MEAN": mean, "BLOCK": 16})
    for rule in range(4):
        compile_(tr._update_kernel, {**floats, **{k: "fp32" for k in "abcde"}},
                 {"RULE": rule, "BLOCK": 128})
    for mode in range(3):
        compile_(tr._rows_kernel, floats, {"MODE": mode, "BLOCK": 128})
        compile_(tr._rows_kernel, {**floats, "split": "i64"}, {"MODE": mode, "BLOCK": 16},
                 ("start",))
    print("\\n".join(failed) or "all compiled")
    raise SystemExit(1 if failed else 0)
''')


@pytest.mark.skipif(triton_index.triton is None, reason="triton is not installed")
def test_every_kernel_compiles_for_an_h100(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cached result must not hide a failure
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
