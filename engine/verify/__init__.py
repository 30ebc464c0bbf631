"""Verification gates for candidate forward passes (gates.py: the list, the data flow and the run;
outputs.py, sampling_gate.py, kv_isolation.py, concurrency.py, anti_cheat_gates.py: the gates;
context.py, report.py: their common types).

Importing this package captures the anti-cheat references (clocks, math functions) first,
so import it before any candidate code runs.
"""

from shapeshift.engine.verify.anticheat import HARDWARE, HardwareSpec, decode_step_lower_bound_s, detect_hardware  # noqa: F401  (first)
from shapeshift.engine.verify.anti_cheat_gates import check_speed_of_light  # noqa: F401
from shapeshift.engine.verify.context import GateSettings  # noqa: F401
from shapeshift.engine.verify.gates import verify_candidate  # noqa: F401
from shapeshift.engine.verify.report import GATE_NAMES, GateReport, GateSuiteReport  # noqa: F401
