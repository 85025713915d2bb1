"""rayspec.memory.malloc: freed buffers stay in the process (no page faults to touch them again)."""

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, resource, torch
    from rayspec.memory.malloc import keep_freed_memory
    tuned = keep_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # growing buffers, as a decode step's logits grow with the batch: glibc's default maps
    # each one fresh from the kernel (it is above the last freed size) and unmaps it on free
    before = faults()
    for mb in range(1, 17):
        torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
    print(json.dumps({"tuned": tuned, "faults": faults() - before}))
""")


def probe(env_extra):
    import os
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                         env={**os.environ, **env_extra})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_buffers_are_reused_without_page_faults():
    pages = sum(range(1, 17)) * (1 << 20) // 4096  # what touching every buffer fresh costs
    off = probe({"RAYSPEC_MALLOC_TUNING": "0"})
    on = probe({})
    assert off["tuned"] is False and on["tuned"] is True
    assert off["faults"] > 0.8 * pages  # the control: glibc's default faults them all in again
    assert on["faults"] < 0.5 * pages  # kept: mostly only the heap's growth faults (measured 38%)
