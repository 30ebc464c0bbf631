"""Pydantic models of Shapeshift's custom resources (group shapeshift.dev, v1alpha1): the
typed contract between the user, the operator and the compile pod.

    group.py                 GROUP, VERSION, Kind (what each custom resource is called)
    common.py                wire base classes, conditions, hardware and env field types, parsing
    hardware.py              the closed set of accelerator kinds
    inference_deployment.py  InferenceDeployment: spec, defaults, validation, status
    compile_run.py           CompileRun: spec, defaults, validation, status
    forward_pass.py          ForwardPass: spec, validation, status
        --operator/crdgen.py--> crds/*.yaml

Torch-free (stdlib, pydantic and shapeshift.engine.contracts only), so the engine imports
it too. Everything public is re-exported here: `from shapeshift.operator.api import X`.
"""

from __future__ import annotations

from shapeshift.operator.api.common import (DTYPES, ENV_LIST_SCHEMA, MAX_ENV_VARS, OPERATOR_ENV_NAMES,
                                            RESERVED_ENV_NAMES, RESERVED_ENV_PREFIX, RESERVED_ENV_PREFIXES,
                                            EnvSecretKeyRef, EnvValueFrom, BuiltinTrafficProfile, Condition, Dtype, EnvVar,
                                            HardwareSpec, StatusModel, Toleration, WireModel, cel, get_condition,
                                            now_utc, parse_spec, parse_status, parse_time, set_condition, short_error)
from shapeshift.operator.api.compile_run import (COMPILE_RUN, TERMINAL_PHASES, AgentSpec, BaselineSpec, CompileBudget,
                                                 CompileEconomics,
                                                 CompileRunPhase, CompileRunSpec, CompileRunStatus, CompileSLO, CompileTrigger,
                                                 DeploymentRef, LeaderboardEntry, LLMAgentSpec, PrometheusWindow,
                                                 SecretKeyRef, TierSpec, TrafficSource, TrialCounts, VerificationSpec)
from shapeshift.operator.api.forward_pass import (COMPILE_RUN_UID_ANNOTATION, FORWARD_PASS, Artifact, ForwardPassEngine, ForwardPassHardware,
                                                  ForwardPassMetrics, ForwardPassPhase, ForwardPassRefusal,
                                                  ForwardPassSpec, ForwardPassStatus, GateResult, ModelSignature,
                                                  ReasoningNote, VerificationReport)
from shapeshift.operator.api.group import API_VERSION, GROUP, VERSION, Kind
from shapeshift.operator.api.hardware import (ACCELERATORS, Accelerator, AcceleratorKind, accelerator,
                                              accelerator_of_device)
from shapeshift.operator.api.inference_deployment import (ARTIFACT_MOUNT, DEFAULT_ENGINE_IMAGE, INFERENCE_DEPLOYMENT,
                                                          KV_BLOCK_SIZES, AdminTokenSecret, ArtifactPVC, ArtifactStore,
                                                          CompilationPolicy, CompileRunTemplate, CurrentRegime,
                                                          DriftStatus, REGIMES_KEPT, RegimeChampion,
                                                          RegimeChampionPin, RegimePolicy, RegimeStatus,
                                                          DriftThresholds, EngineSettings, ForwardPassRef,
                                                          InferenceDeploymentSpec, InferenceDeploymentStatus,
                                                          ModelSource, PodForwardPass, PVCModelSource, RolloutSpec,
                                                          RolloutStatus, VERIFIED_FORWARD_PASSES_KEPT,
                                                          VerifiedForwardPass)

KINDS: tuple[Kind, ...] = (INFERENCE_DEPLOYMENT, COMPILE_RUN, FORWARD_PASS)

__all__ = [
    # group
    "GROUP", "VERSION", "API_VERSION", "Kind", "KINDS", "INFERENCE_DEPLOYMENT", "COMPILE_RUN", "FORWARD_PASS",
    # common
    "WireModel", "StatusModel", "cel", "Condition", "set_condition", "get_condition", "Toleration", "HardwareSpec",
    "BuiltinTrafficProfile", "Dtype", "DTYPES", "EnvVar", "EnvValueFrom", "EnvSecretKeyRef",
    "OPERATOR_ENV_NAMES", "RESERVED_ENV_NAMES", "RESERVED_ENV_PREFIX", "RESERVED_ENV_PREFIXES", "MAX_ENV_VARS",
    "ENV_LIST_SCHEMA", "parse_spec", "parse_status", "parse_time", "now_utc", "short_error",
    # hardware
    "AcceleratorKind", "Accelerator", "ACCELERATORS", "accelerator", "accelerator_of_device",
    # InferenceDeployment
    "DEFAULT_ENGINE_IMAGE", "KV_BLOCK_SIZES", "ARTIFACT_MOUNT", "PVCModelSource", "ModelSource", "AdminTokenSecret",
    "EngineSettings", "DriftThresholds", "CompileRunTemplate", "CompilationPolicy", "RolloutSpec", "ArtifactPVC",
    "ArtifactStore", "InferenceDeploymentSpec", "ForwardPassRef", "DriftStatus", "PodForwardPass", "RolloutStatus",
    "VerifiedForwardPass", "VERIFIED_FORWARD_PASSES_KEPT", "InferenceDeploymentStatus", "RegimeChampionPin",
    "RegimePolicy", "RegimeChampion", "RegimeStatus", "CurrentRegime", "REGIMES_KEPT",
    # CompileRun
    "SecretKeyRef", "LLMAgentSpec", "AgentSpec", "TierSpec", "VerificationSpec", "BaselineSpec", "CompileBudget",
    "DeploymentRef", "PrometheusWindow", "TrafficSource", "CompileTrigger", "CompileSLO", "CompileRunSpec", "LeaderboardEntry",
    "TrialCounts", "CompileRunPhase", "TERMINAL_PHASES", "CompileRunStatus", "CompileEconomics",
    # ForwardPass
    "ModelSignature", "ForwardPassHardware", "Artifact", "ForwardPassMetrics", "GateResult", "VerificationReport",
    "ReasoningNote", "ForwardPassEngine", "ForwardPassSpec", "ForwardPassRefusal", "ForwardPassPhase",
    "ForwardPassStatus", "COMPILE_RUN_UID_ANNOTATION",
]
