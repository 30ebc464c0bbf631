"""Fixtures for operator tests on the real control plane (tests/conftest.py starts it).

  (crds     session, from tests/conftest.py: crds/*.yaml applied and served by discovery.)
  operator  per test: the operator running in this process (kopf.testing.KopfRunner,
            --standalone) watching the test's namespace; kopf's exceptions fail the test.
  kube      per test: shapeshift.operator.kube.Kube on the test cluster (dict-based reads).

Timers resync every SHAPESHIFT_RESYNC_SECONDS; the tests set 2 s (before the handlers
module is imported) so that observations land quickly.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("SHAPESHIFT_RESYNC_SECONDS", "2")


@pytest.fixture
def kube(crds):
    from shapeshift.operator.kube import Kube

    return Kube(crds.api_client)


@pytest.fixture
def run_operator(crds, namespace, monkeypatch):
    """A context manager factory: `with run_operator() as runner:` runs the operator in-process."""
    import contextlib

    from kopf.testing import KopfRunner

    monkeypatch.setenv("KUBECONFIG", str(crds.kubeconfig))
    import shapeshift.operator.handlers  # noqa: F401  (registers the handlers once per process)

    @contextlib.contextmanager
    def start():
        args = ["run", "--standalone", "--namespace", namespace, "-m", "shapeshift.operator.handlers"]
        with KopfRunner(args, timeout=60) as runner:
            yield runner
        assert runner.exception is None, runner.output[-4000:]
        assert runner.exit_code == 0, runner.output[-4000:]

    return start


@pytest.fixture
def operator(run_operator):
    with run_operator() as runner:
        yield runner
