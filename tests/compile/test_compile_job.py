"""The compile job and the compile pod's environment, without a cluster.

    builders' CompilePodEnv.to_env() --(kubelet)--> CompilePodEnv.from_environ(): the same values
    flags --request_from_flags--> JobRequest --CompileJob.from_request--> the embedded defaults
    CompileRunSpec + pod env + engine.yaml --worker.job_request--> the request completed, flags winning
    CRD defaults vs command-line defaults: where they differ is written down (job.py), and held here
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shapeshift.engine.compile.cli import build_parser, request_from_flags
from shapeshift.engine.compile.job import CRD_DEFAULTS_THAT_DIFFER, DEFAULT_AGENTS, CompileJob, JobRequest
from shapeshift.engine.compile.worker import Deployment, job_request
from shapeshift.engine.contracts import compile_pod_env as pod_env
from shapeshift.engine.contracts.compile_pod_env import CompilePodEnv, SecretKeySelector
from shapeshift.engine.contracts.traffic_profile import builtin_profile
from shapeshift.operator.api import CompileRunSpec, InferenceDeploymentSpec, InferenceDeploymentStatus


def _run(**fields) -> CompileRunSpec:
    return CompileRunSpec.model_validate({"deploymentRef": {"name": "llama"}, **fields})


def _deployment(status: dict | None = None) -> Deployment:
    spec = InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"},
                                                   "hardware": {"accelerator": "cpu"}})
    return Deployment(spec, InferenceDeploymentStatus.model_validate(status or {}))


# ---- the pod's environment ----------------------------------------------------------------------


def test_the_pod_env_reads_back_what_the_builder_writes():
    env = CompilePodEnv(namespace="prod", compile_run="run-1", inference_deployment="llama", accelerator="cpu",
                        budget_wall_clock_seconds=1800, budget_trials=0, engine_config="/etc/e.yaml",
                        work_dir="/var/lib/shapeshift", artifact_dir="/var/lib/shapeshift-artifacts",
                        engine_env=(("SHAPESHIFT_PDL", "0"), ("NCCL_DEBUG", "")),
                        agent_api_key_secrets={2: SecretKeySelector("llm-key", "api-key")})
    entries = env.to_env()
    assert entries[-1] == {"name": "SHAPESHIFT_AGENT_2_API_KEY",
                           "valueFrom": {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}}
    # what the kubelet makes of it: literal values as they are, the Secret's key resolved
    environ = {e["name"]: e["value"] for e in entries if "value" in e} | {"SHAPESHIFT_AGENT_2_API_KEY": "k"}
    back = CompilePodEnv.from_environ(environ)
    assert back == CompilePodEnv(**{**env.__dict__, "agent_api_key_secrets": {}, "agent_api_keys": {2: "k"}})
    assert CompilePodEnv.from_environ({}) == CompilePodEnv()  # a worker started by hand


def test_a_variable_that_does_not_parse_is_named():
    with pytest.raises(ValueError, match=r"\$SHAPESHIFT_BUDGET_TRIALS='many' is not an integer"):
        CompilePodEnv.from_environ({pod_env.BUDGET_TRIALS: "many"})


def test_every_name_of_the_contract_is_reserved_from_a_specs_engine_env():
    from shapeshift.operator.api import RESERVED_ENV_NAMES, RESERVED_ENV_PREFIX

    assert set(pod_env.NAMES) | {pod_env.POD_NAME} <= set(RESERVED_ENV_NAMES)
    assert pod_env.agent_api_key_name(0).startswith(RESERVED_ENV_PREFIX)


# ---- defaults -----------------------------------------------------------------------------------


def test_no_flags_is_the_embedded_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = CompileJob.from_request(request_from_flags(build_parser().parse_args([]), []))
    assert (job.model, job.profile, job.agents) == ("tiny-llama", builtin_profile("chat"), DEFAULT_AGENTS)
    assert (job.budget.max_trials, job.budget.max_seconds) == (12, None)
    assert job.out == tmp_path / "shapeshift-compile-out" and job.registry == tmp_path / "shapeshift-registry"
    assert (job.min_speedup, job.verification.prompts, job.verification.steps) == (1.0, 4, 16)
    cpu, gpu = job.tiers.on(cpu=True), job.tiers.on(cpu=False)
    assert (cpu.confirm_repeats, cpu.screen_requests, cpu.confirm_requests, cpu.cpu_threads) == (8, 96, 192, 1)
    assert (gpu.confirm_repeats, gpu.screen_requests, gpu.confirm_requests, gpu.cpu_threads) == (3, 64, 256, None)
    assert (job.max_model_len_on(True), job.max_model_len_on(False)) == (512, 8192)
    flags = build_parser().parse_args(["--budget", "15m", "--no-registry"])
    timed = CompileJob.from_request(request_from_flags(flags, []))
    assert (timed.budget.max_trials, timed.budget.max_seconds, timed.registry) == (None, 900.0, None)


def test_where_crd_and_command_line_defaults_differ_is_written_down():
    defaults = _run()
    for path, (crd, _cli) in CRD_DEFAULTS_THAT_DIFFER.items():
        if path == "agents":
            assert tuple(a.kind for a in defaults.agents) == crd
            continue
        section, wire = path.split(".")
        model = getattr(defaults, section)
        [name] = [n for n, f in type(model).model_fields.items() if (f.alias or n) == wire]
        assert getattr(model, name) == crd, path


# ---- a CompileRun completes the command line's request ------------------------------------------


def test_a_compile_run_fills_what_the_flags_leave_open(tmp_path):
    engine_yaml = tmp_path / "engine.yaml"
    engine_yaml.write_text("model: tiny-llama\ndtype: float32\nmax_model_len: 256\nmax_num_seqs: 8\n")
    pod = CompilePodEnv(engine_config=str(engine_yaml), work_dir=str(tmp_path / "work"),
                        artifact_dir=str(tmp_path / "shared"), agent_api_keys={1: "secret"})
    spec = _run(traffic={"builtin": "burst"}, budget={"trials": 4},
                agents=[{"kind": "model-based", "replicas": 2},
                        {"kind": "llm", "llm": {"endpoint": "http://llm/v1", "model": "coder"}}],
                tiers={"fastLayers": 1, "replayRequests": 32, "repeats": 4},
                verification={"greedySteps": 8, "freshPrompts": 2}, baseline={"minSpeedup": 1.05})
    job = CompileJob.from_request(job_request(JobRequest(), spec, "ns/run-1", _deployment(), pod))
    assert (job.model, job.dtype, job.max_model_len, dict(job.engine_base)) == ("tiny-llama", "float32", 256,
                                                                               {"max_num_seqs": 8})
    assert job.profile == builtin_profile("burst") and job.agents == ("bayes", "bayes", "llm")
    assert (job.llm.base_url, job.llm.model) == ("http://llm/v1", "coder")
    assert Path(job.llm.api_key_file).read_text() == "secret" and Path(job.llm.api_key_file).stat().st_mode & 0o077 == 0
    # budget.wallClockSeconds is the CRD's default (3600), not written in this object: trials only
    assert (job.budget.max_trials, job.budget.max_seconds) == (4, None)
    assert (job.tiers.fast_layers, job.tiers.confirm_requests, job.tiers.confirm_repeats) == (1, 32, 4)
    assert (job.verification.steps, job.verification.prompts, job.min_speedup) == (8, 2, 1.05)
    assert job.out == (tmp_path / "work" / "run-1").resolve() and job.artifact_dir == str(tmp_path / "shared")
    assert job.compile_run == "ns/run-1"

    flags = request_from_flags(build_parser().parse_args(
        ["--model", "m", "--profile", "chat", "--budget-trials", "2", "--agents", "sweep", "--confirm-repeats", "9",
         "--verify-steps", "3", "--min-speedup", "1.2", "--out", str(tmp_path / "mine")]), [])
    mine = CompileJob.from_request(job_request(flags, spec, "ns/run-1", _deployment(), pod))
    assert (mine.model, mine.profile, mine.budget.max_trials, mine.agents) == ("m", builtin_profile("chat"), 2,
                                                                                ("sweep",))
    assert (mine.tiers.confirm_repeats, mine.verification.steps, mine.min_speedup) == (9, 3, 1.2)
    assert mine.out == (tmp_path / "mine").resolve() and mine.llm.base_url is None


def test_a_compile_run_without_the_fields_keeps_the_command_lines_defaults(tmp_path):
    observed = builtin_profile("agentic-long-context").to_dict()
    job = CompileJob.from_request(job_request(JobRequest(), _run(), "ns/run-1",
                                              _deployment({"observedTraffic": observed}), CompilePodEnv()))
    assert job.model == "tiny-llama" and job.profile.name == "agentic-long-context"  # the deployment's preset
    assert job.agents == DEFAULT_AGENTS and (job.budget.max_trials, job.budget.max_seconds) == (12, None)
    assert (job.min_speedup, job.verification.steps, job.tiers.fast_layers) == (1.0, 16, None)
    with pytest.raises(ValueError, match="spec.traffic.prometheus"):
        job_request(JobRequest(), _run(traffic={"prometheus": {}}), "ns/run-1", _deployment(), CompilePodEnv())
    with pytest.raises(ValueError, match="no model"):
        job_request(JobRequest(), _run(), "ns/run-1", None, CompilePodEnv())


def test_a_compile_runs_slo_reaches_the_job_and_flags_still_win(tmp_path):
    from shapeshift.engine.replay.slo import DEFAULT_PER_USER_TOKENS_PER_S_P90, DEFAULT_TTFT_P90_S, SLO
    from shapeshift.operator.api import compile_run as api

    # the CRD's descriptions name the engine's defaults
    assert (api.SLO_DEFAULT_TTFT_P90_SECONDS, api.SLO_DEFAULT_PER_USER_TOKENS_PER_SECOND_P90) == (
        DEFAULT_TTFT_P90_S, DEFAULT_PER_USER_TOKENS_PER_S_P90)
    spec = _run(slo={"ttftP90Seconds": 0.25, "perUserTokensPerSecondP90": 0})
    job = CompileJob.from_request(job_request(JobRequest(), spec, "ns/run-1", _deployment(), CompilePodEnv()))
    assert job.slo == SLO(ttft_p90_s=0.25, per_user_tokens_per_s_p90=0.0)
    # one field given: the other keeps the engine's default
    half = CompileJob.from_request(job_request(JobRequest(), _run(slo={"ttftP90Seconds": 2.5}), "ns/run-1",
                                               _deployment(), CompilePodEnv()))
    assert half.slo == SLO(ttft_p90_s=2.5)
    # no spec.slo: the engine's defaults
    plain = CompileJob.from_request(job_request(JobRequest(), _run(), "ns/run-1", _deployment(), CompilePodEnv()))
    assert plain.slo == SLO()
    flags = request_from_flags(build_parser().parse_args(["--slo-ttft-p90", "3", "--out", str(tmp_path / "o")]), [])
    mine = CompileJob.from_request(job_request(flags, spec, "ns/run-1", _deployment(), CompilePodEnv()))
    assert mine.slo == SLO(ttft_p90_s=3.0, per_user_tokens_per_s_p90=0.0)
    with pytest.raises(ValueError, match="slo.ttftP90Seconds"):
        _run(slo={"ttftP90Seconds": 0})


def test_an_empty_agent_list_is_refused_never_read_as_the_defaults():
    """`agents: []` is refused by the model the worker parses the run with (the API server's CEL twin
    refuses it at creation); agents carry no name field: the board names them by kind."""
    with pytest.raises(ValueError, match="spec.agents must name at least one agent"):
        _run(agents=[])
    with pytest.raises(ValueError, match="name"):
        _run(agents=[{"kind": "evolutionary", "name": "evo"}])
    job = CompileJob.from_request(job_request(JobRequest(), _run(agents=[{"kind": "evolutionary", "replicas": 2}]),
                                              "ns/run-1", _deployment(), CompilePodEnv()))
    assert job.agents == ("evolve", "evolve")
