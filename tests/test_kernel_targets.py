"""graft's CPU kernels build for every kind of x86 machine, not only the one running the suite: the rest of
tests/test_kernels.py runs what this machine built, and skips where nothing did."""
import os
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils.cpp_extension import include_paths

import cpu_kernels


def test_every_machine_kinds_kernels_compile_here():
    """The source compiles, as torch's loader compiles it, for each kind of x86 machine's instructions, not
    only this one's: AMX and AVX-512 BF16 (sapphirerapids), AVX-512 BF16 alone (cooperlake), AVX-512
    without BF16 (skylake-avx512), AVX2 (x86-64-v3) and the portable loops (x86-64). Syntax and templates
    only (nothing runs): a path that breaks on a machine kind CI did not draw fails here. (A bfloat16 x
    against int8 W once failed to compile on every AVX-512 BF16 CPU while an AVX2 CI passed.)"""
    if os.uname().machine != "x86_64":
        pytest.skip("x86-64 only")
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    inc = [f"-I{p}" for p in include_paths() + [sysconfig.get_paths()["include"]]]
    flags = [f for f in cpu_kernels.FLAGS if not f.startswith("-march=")]
    runs = {m: subprocess.Popen(["c++", "-std=c++20", "-fsyntax-only", f"-march={m}", *flags, *inc, str(cpu_kernels.SOURCE)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for m in ("sapphirerapids", "cooperlake", "skylake-avx512", "x86-64-v3", "x86-64")}
    errors = {m: r.communicate(timeout=600)[0] for m, r in runs.items()}
    # a compiler too old to know a target ("bad value" in GCC, "unknown target CPU" in clang) says nothing of the source
    known = {m for m, out in errors.items() if "bad value" not in out and "unknown target CPU" not in out}
    failed = {m: [ln for ln in errors[m].splitlines() if "error" in ln][:3] for m in known if runs[m].returncode}
    assert not failed, failed
    if len(known) < len(runs):
        pytest.skip(f"this compiler does not know {sorted(set(runs) - known)}; the others compiled")
