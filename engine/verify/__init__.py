"""Verification gates for candidate forward passes (see gates.py for the list and data flow).

Importing this package captures the anti-cheat references (clocks, math functions) first,
so import it before any candidate code runs.
"""

from shapeshift.engine.verify.anticheat import HARDWARE, HardwareSpec, decode_step_lower_bound_s, detect_hardware  # noqa: F401  (first)
from shapeshift.engine.verify.gates import (GATE_NAMES, GateReport, GateSettings, VerificationReport, check_speed_of_light,  # noqa: F401
                    verify_candidate)
