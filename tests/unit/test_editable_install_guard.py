"""tests/conftest.py refuses to run the suite against another checkout's code (the shared venv's
editable install points at whichever checkout last ran hack/setup.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _collect(tmp_path: Path, extra_pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    env.pop("PYTHONPATH", None)
    if extra_pythonpath:
        env["PYTHONPATH"] = extra_pythonpath
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                           str(Path(__file__))], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_a_venv_serving_another_checkout_fails_the_session(tmp_path: Path) -> None:
    # another checkout's package folders, as an editable install of it would put them first
    other = tmp_path / "other-checkout" / "src" / "shapeshift" / "engine"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    out = _collect(tmp_path, str(tmp_path / "other-checkout" / "src"))
    assert out.returncode == 4, out.stdout + out.stderr  # pytest's usage error: nothing collected or run
    text = out.stdout + out.stderr
    assert str(other.resolve() / "__init__.py") in text and "bash hack/setup.sh" in text, text
    assert "another checkout" in text


def test_this_checkouts_install_passes_the_guard(tmp_path: Path) -> None:
    out = _collect(tmp_path, None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "test_a_venv_serving_another_checkout_fails_the_session" in out.stdout
