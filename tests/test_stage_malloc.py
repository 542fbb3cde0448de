"""A stage kernel's glibc serves tensors of a training step's sizes from its heap and keeps them there when freed
(`cpu.glibc_tunables`), instead of mapping them afresh and handing them back to the system each step."""
import ctypes
import json
import os
import subprocess
import sys

import pytest

from slm_bench.core.config import KEEP_FREED_MEMORY, PROFILES, engine_environment, engine_settings

# A 30 MiB tensor (the sft stage's logits are 25 MiB) allocated and freed; prints how much of it glibc served by mmap and
# how much of it the heap kept after the free.
ALLOCATE_AND_FREE = """
import ctypes, json, torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
MIB = 2 ** 20
before = libc.mallinfo2()
block = torch.ones(30 * MIB // 4)
during = libc.mallinfo2()
del block
after = libc.mallinfo2()
print(json.dumps({"mmapped_mib": round((during.hblkhd - before.hblkhd) / MIB), "heap_kept_mib": round((after.arena - before.arena) / MIB)}))
"""


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_mallinfo2(), reason="glibc 2.33 or later (mallinfo2) reports where malloc put a block")


def _allocate_and_free(sets: list[str]) -> dict:
    stage_env = engine_environment(engine_settings(PROFILES["tiny"], sets))
    proc = subprocess.run([sys.executable, "-c", ALLOCATE_AND_FREE], env={**os.environ, **stage_env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_stage_kernel_keeps_freed_blocks_in_its_heap():
    """With the default setting the block comes from glibc's heap and stays there when freed, for the next step's tensors."""
    assert engine_environment(engine_settings(PROFILES["tiny"]))["GLIBC_TUNABLES"] == KEEP_FREED_MEMORY
    assert _allocate_and_free([]) == {"mmapped_mib": 0, "heap_kept_mib": 30}


def test_with_glibc_defaults_the_block_is_mapped_and_returned():
    """`--set cpu.glibc_tunables=` (glibc's defaults): the block is mmapped and handed back to the system when freed, so the
    next one of its size page-faults all its pages afresh. This is what the setting removes."""
    assert _allocate_and_free(["cpu.glibc_tunables="]) == {"mmapped_mib": 30, "heap_kept_mib": 0}
