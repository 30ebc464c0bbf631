"""kopf handlers: thin reactions, each calling one plain function and applying what it returns.

    lifecycle     startup (kopf's bookkeeping in annotations), login (ServiceAccount or $KUBECONFIG)
    deployment    InferenceDeployment create/update/resume and resync timer -> engine ConfigMap,
                  Service, Deployment -> status from the Deployment's and pods' real state
    compile_run   CompileRun create/resume and resync timer -> RBAC + Job -> phase, conditions
    drift         drift timer: Prometheus -> observed traffic -> status (+ a CompileRun),
                  deciding through operator/drift_check.py
    rollout       rollout timer: desired ForwardPass -> canary pods -> analysis in Prometheus ->
                  all pods (or back), deciding through operator/rollout_tick.py
    children      the one writer of each engine child (the Deployment has two callers)

Edge handlers react; timers observe. Every write is get-or-create-then-update keyed by a
content hash (kube.Kube.ensure) and every status write merges only when something changed
(kube.Kube.write_status), so a resync or an operator restart changes nothing that is already
right. Children carry controller owner references: deleting a parent is left to the garbage
collector (no finalizers).

Retries go through kopf's error types: TemporaryError for what time can fix, PermanentError
for specs the models reject. A timer that raises anything else (an unreachable API server: the
client's connection errors are no ApiException) runs again after its own interval (backoff), not
after kopf's default of 60 s. Timer intervals come from operator/settings.py, read once when
this package is imported; `kopf run -m shapeshift.operator.handlers` and `shapeshift
operator` register every handler by importing it.
"""

# Importing registers; kopf runs a resource's handlers in registration order, kept as it was.
from shapeshift.operator.handlers import lifecycle  # noqa: F401
from shapeshift.operator.handlers import deployment  # noqa: F401
from shapeshift.operator.handlers import compile_run  # noqa: F401
from shapeshift.operator.handlers import drift  # noqa: F401
from shapeshift.operator.handlers import rollout  # noqa: F401

__all__ = ["compile_run", "deployment", "drift", "lifecycle", "rollout"]
