"""The anti-cheat references are captured by the import mechanism, before any candidate code runs.

In a fresh interpreter (so nothing else captured them first), the first bundle ever
imported is one that patches clocks at import time; the patch must still be reported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TIMING_TRICK = Path(__file__).resolve().parents[1] / "fixtures" / "candidates" / "timing_trick"

SCRIPT = f"""
import sys
from shapeshift.engine.forward_pass.importer import load_bundle
assert "shapeshift.engine.forward_pass.patch_guard" not in sys.modules  # nothing captured yet
load_bundle({str(TIMING_TRICK)!r}, allow_unmanifested=True)
from shapeshift.engine.verify import anticheat  # its references were captured by the load, before the candidate ran
print("PATCHED", ",".join(anticheat.patched_functions()))
"""


def test_patches_made_by_the_first_imported_bundle_are_reported():
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env=env, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.startswith("PATCHED"))
    patched = line.split(" ", 1)[1].split(",")
    assert "time.perf_counter" in patched and "torch.cuda.synchronize" in patched, line
