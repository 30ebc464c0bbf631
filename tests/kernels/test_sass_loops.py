"""hack/sass_loops.py: the loops of the decode kernels' sm_90 SASS, compiled without a GPU."""

from __future__ import annotations

import pathlib

import pytest

from harness.scripts import load_hack_script

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/               @!P0 LDG.E.EF.128 R4, desc[UR4][R2.64] ;
        /*0020*/                   FFMA R5, R4, R6, R5 ;
        /*0030*/                   BSSY B0, `(.L_x_1) ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
.L_x_1:
        /*0050*/                   MUFU.EX2 R7, R5 ;
        /*0060*/               @P1 BRA `(.L_x_0) ;
        /*0070*/               @P2 BRA `(.L_x_2) ;
        /*0080*/                   LDG.E R9, desc[UR4][R2.64] ;
.L_x_2:
        /*0090*/                   EXIT ;
.L_x_3:
        /*00a0*/                   BRA `(.L_x_3);
"""


def test_loops_are_backward_branches_with_what_they_hold():
    """A backward branch and its target make a loop (its loads' places in it, FMAs, barriers,
    reconvergence regions, exp2); forward branches and a kernel's closing self-branch do not."""
    sass = load_hack_script("sass_loops")
    instructions, labels = sass.parse_sass(SASS)
    assert len(instructions) == 11 and labels == {".L_x_0": 1, ".L_x_1": 5, ".L_x_2": 9, ".L_x_3": 10}
    assert sass.opcode("@!P0 LDG.E.EF.128 R4, desc[UR4][R2.64]") == "LDG.E.EF.128"
    assert sass.loops(instructions, labels) == [{"start": 1, "length": 6, "loads": [0], "ffma": 1, "bar": 1,
                                                 "bssy": 1, "exp2": 1}]


def test_the_layer_tail_compiles_with_its_gate_up_loop(tmp_path):
    """On the real compile: the one-launch layer tail has a loop with the gated epilogue's exp2
    and its round's four weight-tile loads (two of gate, two of up), as the report prints."""
    sass = load_hack_script("sass_loops")
    triton = pytest.importorskip("triton")
    bin_dir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (bin_dir / "ptxas").exists() or not (bin_dir / "nvdisasm").exists():
        pytest.skip("Triton's bundled ptxas / nvdisasm not found")
    out = tmp_path / "report.json"
    assert sass.main(["--only", "decode_layer_tail, one launch", "--json", str(out)]) == 0
    import json

    report = json.loads(out.read_text())
    assert report["triton"] == triton.__version__  # the version that compiled, read from the compile's rows
    (variant,) = report["variants"]
    assert variant["kernel"] == "_decode_layer_tail_kernel" and variant["instructions"] > 500
    gate_up = [loop for loop in variant["loops"] if loop["exp2"] >= 2 and len(loop["loads"]) == 4]
    assert len(gate_up) == 1, variant["loops"]
    assert gate_up[0]["ffma"] > 0 and gate_up[0]["bar"] > 0
