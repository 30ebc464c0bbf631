#!/usr/bin/env python3
"""The loops of the decode-path kernels' sm_90 SASS, compiled here without a GPU.

Compiles the batch-1 decode kernels at their H200 defaults (tests/kernels/sm90_compile_decode_paths.py,
Triton's bundled ptxas), disassembles each variant with Triton's bundled nvdisasm and prints,
for every loop (a backward branch and its target), its length in instructions, where in the
loop the global loads (LDG) are issued, and how many FMAs, CTA barriers (BAR), reconvergence
regions (BSSY) and exp2 (MUFU.EX2) it holds. It is a way to compare how two variants of a
kernel compile, loop by loop, before spending GPU time on them: e.g. the layer tail with and
without the next layer's attention (docs/decode-performance.md, ninth set).

The compile is only as faithful as the Triton that runs it: pass --triton DIR (a directory
holding another Triton package, e.g. from `pip install --no-deps --target DIR triton==X`) to
compile with the version the GPU machine runs.

    python3 hack/sass_loops.py [--only "decode_layer_tail"] [--triton DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPILE_SCRIPT = REPO_ROOT / "tests" / "kernels" / "sm90_compile_decode_paths.py"
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


def parse_sass(text: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm -c output -> (instructions without their addresses, label -> instruction index)."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = _INSTRUCTION.search(line)
        if found:
            instructions.append(re.sub(r"\s+", " ", found.group(2)))
    return instructions, labels


def opcode(instruction: str) -> str:
    """The opcode with its modifiers ('@P0 LDG.E.128 R4, [R2]' -> 'LDG.E.128')."""
    words = instruction.split(" ")
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def loops(instructions: list[str], labels: dict[str, int]) -> list[dict]:
    """Every backward branch's loop, in program order: its span and what it holds."""
    found = []
    for end, instruction in enumerate(instructions):
        branch = _BRANCH.search(instruction)
        if not branch or labels.get(branch.group(1), end + 1) >= end:
            continue  # forward, or the branch to itself that pads a kernel's end
        start = labels[branch.group(1)]
        ops = [opcode(i) for i in instructions[start:end + 1]]
        counts = collections.Counter(op.split(".")[0] for op in ops)
        found.append({"start": start, "length": end - start + 1,
                      "loads": [k for k, op in enumerate(ops) if op.startswith("LDG")],
                      "ffma": counts["FFMA"], "bar": counts["BAR"], "bssy": counts["BSSY"],
                      "exp2": sum(op.startswith("MUFU.EX2") for op in ops)})
    return found


def nvdisasm() -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not tool.exists():
        raise FileNotFoundError(f"no nvdisasm in Triton's bundle ({tool})")
    return str(tool)


def compile_variants(only: str, triton_dir: str | None, cubin_dir: str) -> list[dict]:
    """Run the sm_90 compile check for the labels starting with `only`; its rows, with cubins."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [p for p in (triton_dir, str(COMPILE_SCRIPT.parent), env.get("PYTHONPATH")) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), SM90_COMPILE_ONLY=only, SM90_CUBIN_DIR=cubin_dir,
               PYTHONSAFEPATH="1")
    result = subprocess.run([sys.executable, str(COMPILE_SCRIPT)], capture_output=True, text=True, env=env,
                            cwd=COMPILE_SCRIPT.parent, timeout=900)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not rows:
        raise RuntimeError(f"the sm_90 compile failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="decode_layer_tail",
                        help="compile the variants whose label starts with this (see sm90_compile_decode_paths.py)")
    parser.add_argument("--triton", default=None, help="a directory holding the Triton package to compile with")
    parser.add_argument("--json", default=None, help="also write the report as JSON here")
    args = parser.parse_args(argv)
    tool = nvdisasm()
    with tempfile.TemporaryDirectory() as cubins:
        rows = compile_variants(args.only, args.triton, cubins)
        report = {"triton": rows[0]["triton"], "only": args.only, "variants": []}  # the Triton that compiled them
        print(f"Triton {report['triton']}, sm_90, variants starting with {args.only!r}")
        for row in rows:
            text = subprocess.run([tool, "-c", row["cubin"]], capture_output=True, text=True, timeout=120).stdout
            instructions, labels = parse_sass(text)
            found = loops(instructions, labels)
            report["variants"].append({"label": row["label"], "kernel": row["kernel"], "registers": row["registers"],
                                       "shared_bytes": row["shared_bytes"], "instructions": len(instructions),
                                       "loops": found})
            print(f"\n{row['label']} ({row['kernel']}): {len(instructions)} instructions, {row['registers']} registers, "
                  f"{row['shared_bytes']} B shared")
            for loop in found:
                print(f"  loop at {loop['start']:5d}: {loop['length']:4d} instr, loads at {loop['loads']}, "
                      f"FFMA {loop['ffma']}, BAR {loop['bar']}, BSSY {loop['bssy']}, EX2 {loop['exp2']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
