"""posttrain.allocator: after ``keep_freed_memory`` a large block comes from the heap and stays there when freed.

Each check runs in a fresh interpreter: mallopt changes the whole process, and pytest's own is left as it was.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import textwrap

import pytest

from posttrain import runner
from posttrain.config import parse_params
from posttrain.config.sandbox import ENV as SANDBOX_ENV
from tests.test_config import _minimal

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                           reason="mallopt is glibc's")

# hblkhd: bytes in mmapped blocks; arena: bytes of the heap (sbrk), glibc's mallinfo2 (malloc.h)
PROBE = textwrap.dedent("""
    import ctypes, json, sys
    from posttrain import allocator
    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    MB = 1 << 20
    out = {}
    for phase in ("default", "kept"):
        if phase == "kept":
            out["took"] = allocator.keep_freed_memory()
        before = libc.mallinfo2()
        block = bytearray(64 * MB)  # one 64 MB malloc, over glibc's mmap threshold (32 MB at most)
        live = libc.mallinfo2()
        del block
        freed = libc.mallinfo2()
        out[phase] = {"mmapped_mb": (live.hblkhd - before.hblkhd) / MB, "heap_after_free_mb": freed.arena / MB}
    json.dump(out, sys.stdout)
""")


@glibc
def test_a_large_block_is_served_from_the_heap_and_kept_after_free():
    out = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["default"]["mmapped_mb"] >= 64  # glibc's default: its own mmap, unmapped on free
    assert out["took"] is True
    assert out["kept"]["mmapped_mb"] == 0  # now from the heap ...
    assert out["kept"]["heap_after_free_mb"] >= 64  # ... which keeps it after free: no new faults next time


def test_setup_applies_runtime_keep_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(runner.allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    for var in ("TOKENIZERS_PARALLELISM", SANDBOX_ENV):  # setup sets them: restored after the test
        monkeypatch.setenv(var, "")
    raw = _minimal()
    runner.setup(parse_params(raw))
    assert calls == [1]  # on by default
    raw["runtime"] = {**raw.get("runtime", {}), "keep_freed_memory": False}
    runner.setup(parse_params(raw))
    assert calls == [1]  # off: glibc's default left alone
