"""The one writer of each engine child of an InferenceDeployment.

    engine_child_writers(parent, spec, rollout, active)      ConfigMap, Service, then the Deployment
    ensure_engine_deployment(parent, spec, rollout, active)  the engine Deployment, whose pod template
        carries the forward pass the rollout wants (Restart: rollout_tick.template_annotations)

Two reactions write the engine Deployment: the InferenceDeployment reconcile and resync
(handlers/deployment.py), and, under the Restart strategy, the rollout timer
(handlers/rollout.py) when its state moves. Both go through ensure_engine_deployment, so the
pod template is always built from the same inputs and the two never undo each other.
CompileRun children (RBAC, Job) have one writer already: handlers/compile_run.py.
"""

from __future__ import annotations

from typing import Any

from shapeshift.operator import builders
from shapeshift.operator.api import InferenceDeploymentSpec
from shapeshift.operator.kube import Kube
from shapeshift.operator.rollout import ForwardPassIdentity, RolloutState
from shapeshift.operator.rollout_tick import template_annotations

Written = tuple[str, dict[str, Any], dict[str, Any]]  # (created | updated | unchanged, desired, as stored)


def ensure_engine_deployment(kube: Kube, parent: builders.Parent, spec: InferenceDeploymentSpec,
                             rollout: RolloutState, active: ForwardPassIdentity | None) -> Written:
    """Make the engine Deployment match the spec and the rollout (raises ApiException)."""
    desired = builders.build_engine_deployment(parent, spec, template_annotations(spec, rollout, active))
    action, stored = kube.ensure(desired)
    return action, desired, stored


def engine_child_writers(kube: Kube, parent: builders.Parent, spec: InferenceDeploymentSpec,
                         rollout: RolloutState, active: ForwardPassIdentity | None):
    """One call per child, in creation order (ConfigMap, Service, Deployment); each returns
    Written and raises ApiException, so the caller decides how to retry."""

    def ensure(desired: dict[str, Any]) -> Written:
        action, stored = kube.ensure(desired)
        return action, desired, stored

    return [
        lambda: ensure(builders.build_engine_configmap(parent, spec)),
        lambda: ensure(builders.build_engine_service(parent, spec)),
        lambda: ensure_engine_deployment(kube, parent, spec, rollout, active),
    ]
