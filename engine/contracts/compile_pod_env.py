"""The compile pod's contract with the operator: its environment in, one annotation out (no torch).

    operator/builders.py build_compile_job: CompilePodEnv(...).to_env() -> the container's env
      --kubelet (literal values, the downward API, Secrets)--> the compile pod's os.environ
      --engine/compile/worker.py: CompilePodEnv.from_environ(os.environ)--> typed settings
    worker publishes a ForwardPass --ARTIFACT_DURABLE_ANNOTATION--> operator's rollout refuses a
      pass whose archive stayed in the pod's emptyDir (no $SHAPESHIFT_ARTIFACT_DIR)

The engine pods get two of these names too (INFERENCE_DEPLOYMENT, ENGINE_CONFIG). Every name
here is one a spec's engine env may not set (operator/api RESERVED_ENV_NAMES, checked by a test).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

NAMESPACE = "SHAPESHIFT_NAMESPACE"
COMPILE_RUN = "SHAPESHIFT_COMPILE_RUN"
INFERENCE_DEPLOYMENT = "SHAPESHIFT_INFERENCE_DEPLOYMENT"
ACCELERATOR = "SHAPESHIFT_ACCELERATOR"  # the pool's accelerator kind: the worker measures on that chip
BUDGET_WALL_CLOCK_SECONDS = "SHAPESHIFT_BUDGET_WALL_CLOCK_SECONDS"
BUDGET_TRIALS = "SHAPESHIFT_BUDGET_TRIALS"
ENGINE_CONFIG = "SHAPESHIFT_ENGINE_CONFIG"  # path of the deployment's engine.yaml (a ConfigMap volume)
WORK_DIR = "SHAPESHIFT_WORK_DIR"  # the pod's own emptyDir
ARTIFACT_DIR = "SHAPESHIFT_ARTIFACT_DIR"  # a shared volume engines also mount; unset: no durable store
ENGINE_ENV_NAMES = "SHAPESHIFT_ENGINE_ENV_NAMES"  # comma-separated names of the deployment's spec.engine.env
AGENT_API_KEY_PREFIX = "SHAPESHIFT_AGENT_"  # SHAPESHIFT_AGENT_<i>_API_KEY: spec.agents[i]'s key, from a Secret
POD_NAME = "POD_NAME"  # the downward API's metadata.name

NAMES = (NAMESPACE, COMPILE_RUN, INFERENCE_DEPLOYMENT, ACCELERATOR, BUDGET_WALL_CLOCK_SECONDS, BUDGET_TRIALS,
         ENGINE_CONFIG, WORK_DIR, ARTIFACT_DIR, ENGINE_ENV_NAMES)
_AGENT_API_KEY = re.compile(rf"^{AGENT_API_KEY_PREFIX}(\d+)_API_KEY$")

# On the ForwardPass the worker publishes: "false" when its archive is in the compile pod's
# work folder (no ARTIFACT_DIR), which vanishes with the pod; the rollout refuses such a pass.
ARTIFACT_DURABLE_ANNOTATION = "shapeshift.dev/artifact-durable"


def agent_api_key_name(index: int) -> str:
    """The variable holding spec.agents[index]'s API key."""
    return f"{AGENT_API_KEY_PREFIX}{index}_API_KEY"


@dataclass(frozen=True)
class SecretKeySelector:
    """Where the kubelet takes a variable's value from: key `key` of Secret `name`."""

    name: str
    key: str


@dataclass(frozen=True)
class CompilePodEnv:
    """The compile container's environment. None: the variable is unset (a worker run by hand).

    The agents' API keys cross as Secrets: the builder names them (`agent_api_key_secrets`), the
    kubelet resolves them, and the worker reads the values (`agent_api_keys`)."""

    namespace: str | None = None
    compile_run: str | None = None
    inference_deployment: str | None = None
    accelerator: str | None = None
    budget_wall_clock_seconds: int | None = None
    budget_trials: int | None = None
    engine_config: str | None = None
    work_dir: str | None = None
    artifact_dir: str | None = None
    # The deployment's spec.engine.env, (name, value) in spec order; None: ENGINE_ENV_NAMES unset.
    engine_env: tuple[tuple[str, str], ...] | None = None
    agent_api_key_secrets: Mapping[int, SecretKeySelector] = field(default_factory=dict)
    agent_api_keys: Mapping[int, str] = field(default_factory=dict)

    def to_env(self) -> list[dict[str, Any]]:
        """Container env entries, in the order the compile Job has always carried them (the
        order is part of the Job's spec hash)."""
        env: list[dict[str, Any]] = [{"name": name, "value": value} for name, value in (
            (NAMESPACE, self.namespace), (COMPILE_RUN, self.compile_run),
            (INFERENCE_DEPLOYMENT, self.inference_deployment), (ACCELERATOR, self.accelerator),
            (BUDGET_WALL_CLOCK_SECONDS, _text(self.budget_wall_clock_seconds)),
            (BUDGET_TRIALS, _text(self.budget_trials)), (ENGINE_CONFIG, self.engine_config),
            (WORK_DIR, self.work_dir)) if value is not None]
        env.append({"name": POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        if self.artifact_dir is not None:
            env.append({"name": ARTIFACT_DIR, "value": self.artifact_dir})
        if self.engine_env is not None:
            # measured under the kernel switches it will serve with; the names let the worker
            # record them in its ForwardPass (rollout refuses it once spec.engine.env changes)
            env.extend({"name": name, "value": value} for name, value in self.engine_env)
            env.append({"name": ENGINE_ENV_NAMES, "value": ",".join(name for name, _ in self.engine_env)})
        for index, ref in sorted(self.agent_api_key_secrets.items()):
            env.append({"name": agent_api_key_name(index),
                        "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "CompilePodEnv":
        """Parse a process environment; ValueError names the variable that does not parse."""
        names = environ.get(ENGINE_ENV_NAMES)
        engine_env = None
        if names is not None:
            listed = dict.fromkeys(n.strip() for n in names.split(","))  # in order, once each
            engine_env = tuple((n, environ.get(n, "")) for n in listed if n)
        keys = {}
        for name, value in environ.items():
            match = _AGENT_API_KEY.match(name)
            if match:
                keys[int(match.group(1))] = value
        return cls(
            namespace=environ.get(NAMESPACE), compile_run=environ.get(COMPILE_RUN),
            inference_deployment=environ.get(INFERENCE_DEPLOYMENT), accelerator=environ.get(ACCELERATOR),
            budget_wall_clock_seconds=_int(environ, BUDGET_WALL_CLOCK_SECONDS),
            budget_trials=_int(environ, BUDGET_TRIALS), engine_config=environ.get(ENGINE_CONFIG),
            work_dir=environ.get(WORK_DIR), artifact_dir=environ.get(ARTIFACT_DIR), engine_env=engine_env,
            agent_api_keys=keys)


def _text(value: int | None) -> str | None:
    return None if value is None else str(value)


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer (the operator sets it from the CompileRun's "
                         "spec.budget; unset it or give a whole number)") from None
