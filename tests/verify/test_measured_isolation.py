"""Measurement in the candidate's own process (engine/verify/measured_engine.py): the compile
worker never runs candidate code; it drives the replay, reads the clock and checks the outputs,
while the candidate's engine runs the serving loop in a process forked from the clean zygote.
A crashed or hung candidate costs only its process; the worker's engine and the incumbent's
process go on. Real engine, real processes, tiny-llama on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from shapeshift.engine.compile.candidate import Candidate
from shapeshift.engine.compile.evaluator import EngineEvaluator, EvaluatorSettings
from shapeshift.engine.contracts.traffic_profile import builtin_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def evaluator(tmp_path_factory):
    ev = EngineEvaluator(builtin_profile("chat"), EvaluatorSettings(
        model="tiny-llama", device="cpu", max_model_len=256, screen_requests=6, confirm_requests=6,
        screen_repeats=1, confirm_repeats=2, cpu_threads=1, reload_timeout_s=10.0,
        work_dir=str(tmp_path_factory.mktemp("work"))))
    yield ev
    ev.close()


def _candidate(ev: EngineEvaluator, source: str, note: str) -> Candidate:
    return Candidate(ev.space().default(), source, "test", note)


def test_the_candidate_runs_only_in_its_own_process(evaluator, tmp_path):
    """A candidate that records where its build and forward ran: another pid than the worker's,
    and the same process for both; its module is never imported here; the measurement is timed
    by that process's CPU clock, read from here."""
    marks = tmp_path / "pids"
    source = (f"import os, threading\nfrom shapeshift.engine.forward_pass.importer import import_stock_module\n"
              f"stock = import_stock_module()\nCACHE_FORMAT_VERSION = stock.CACHE_FORMAT_VERSION\n"
              f"class Marks(stock.StockForwardPass):\n"
              f"    def forward(self, *args):\n"
              f"        if threading.current_thread().name == 'shapeshift-engine-loop':\n"
              f"            with open({str(marks)!r}, 'a') as f:\n"
              f"                f.write(f'forward {{os.getpid()}}\\n')\n"
              f"        return super().forward(*args)\n"
              f"def build(model_config, weights, recipe):\n"
              f"    with open({str(marks)!r}, 'a') as f:\n"
              f"        f.write(f'build {{os.getpid()}}\\n')\n"
              f"    return Marks(model_config, weights, recipe)\n")
    stock = _candidate(evaluator, evaluator.stock_source, "stock")
    modules_before = set(sys.modules)
    cand_m, stock_m = evaluator.compare(_candidate(evaluator, source, "marks"), stock, repeats=2)
    assert cand_m.ok and stock_m.ok, (cand_m.error, stock_m.error)
    assert evaluator.describe()["measurement"] == "in the candidate's own process"
    seen = {tuple(line.split()) for line in marks.read_text().splitlines()}
    pids = {int(pid) for _, pid in seen}
    assert len(pids) == 1 and os.getpid() not in pids, seen
    assert {kind for kind, _ in seen} == {"build", "forward"}
    new_modules = set(sys.modules) - modules_before
    assert not [m for m in new_modules if "compiled" in m or "bundle" in m], sorted(new_modules)
    # the measured tokens were checked against the incumbent's on the same requests
    assert cand_m.details["measured_outputs"]["ok"]


@pytest.mark.parametrize("fixture, what", [("crash_while_served", "CandidateDied"),
                                           ("hang_while_served", "DeadlineExceeded")])
def test_a_candidate_that_dies_or_hangs_costs_only_its_process(evaluator, fixture, what):
    """Crashing or hanging while measured fails that measurement, saying so; the worker's engine is
    the same object (nothing to rebuild), and the incumbent is measured in the same comparison."""
    engine = evaluator._engine("full", {})
    source = (FIXTURES / "isolation" / fixture / "forward.py").read_text()
    stock = _candidate(evaluator, evaluator.stock_source, "stock")
    cand_m, stock_m = evaluator.compare(_candidate(evaluator, source, fixture), stock, repeats=1)
    assert cand_m.error and cand_m.error.startswith(f"failed during replay: {what}"), cand_m.error
    assert stock_m.ok, stock_m.error
    assert evaluator._engine("full", {}) is engine
    print(f"{fixture}: {cand_m.error[:200]}")


def test_a_measuring_process_starts_in_well_under_a_second(evaluator):
    """What a candidate's hot reload becomes: fork from the warm zygote, an engine over the shared
    weights, the stock pass, the candidate's build and smoke check (the first start also waits for
    the zygote itself). Printed for the record; bounded loosely (a shared 2-core machine)."""
    stock = _candidate(evaluator, evaluator.stock_source, "stock")
    fused = Candidate({**evaluator.space().default(), "fuse_qkv": True}, None, "test", "fused")
    evaluator.compare(fused, stock, repeats=1)
    starts = evaluator._processes.starts
    later = sorted(starts[1:])
    print(f"measuring-process starts (s): first {starts[0]:.2f}, then median {later[len(later) // 2]:.2f} "
          f"of {len(later)}")
    assert later and later[len(later) // 2] < 5.0, starts
