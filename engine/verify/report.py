"""What the verification gates report: one GateReport per gate, one GateSuiteReport per candidate.

Data flow: each gate's evidence (engine/verify/outputs.py, kv_isolation.py, anti_cheat_gates.py)
-> GateReport(name, passed, evidence) -> GateSuiteReport(passed = every gate passed), written
by engine/verify/gates.py and read by the compile loop (engine/compile/promotion.py),
hack/probe_agreement_gate.py and the tests. GATE_NAMES are stable: reports and tests refer to them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


GATE_NAMES = (
    "smoke", "outputs.finite", "outputs.agreement", "outputs.sampling", "kv.prefix_hit_equals_miss",
    "kv.batched_equals_alone", "kv.canary_isolation", "kv.swap_compatibility", "coverage.shapes",
    "coverage.long_context", "coverage.mixed_steps", "coverage.concurrent_calls", "coverage.padded_batches",
    "coverage.block_pool",
    "anti_cheat.fresh_inputs",
    "anti_cheat.poisoned_outputs", "anti_cheat.inputs_unchanged", "anti_cheat.speed_of_light",
    "anti_cheat.no_patching",
)


@dataclass
class GateReport:
    name: str
    passed: bool
    evidence: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False

    def __str__(self) -> str:
        state = "SKIP" if self.skipped else ("PASS" if self.passed else "FAIL")
        return f"{state} {self.name}: {self.evidence}"


@dataclass
class GateSuiteReport:
    candidate: str
    digest: str | None
    seed: int
    gates: list[GateReport]
    tolerance: dict[str, Any] = field(default_factory=dict)  # the bounds used and where they came from
    isolation: dict[str, Any] = field(default_factory=dict)  # the candidate's process: start, calls

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failed(self) -> list[str]:
        return [g.name for g in self.gates if not g.passed]

    def gate(self, name: str) -> GateReport:
        return next(g for g in self.gates if g.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "digest": self.digest, "seed": self.seed, "passed": self.passed,
                "failed": self.failed, "tolerance": self.tolerance, "isolation": self.isolation,
                "gates": [asdict(g) for g in self.gates]}
