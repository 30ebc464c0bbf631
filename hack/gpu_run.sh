#!/usr/bin/env bash
# One whole GPU measurement session on a CUDA machine that already has torch,
# triton and transformers (no network): make the `shapeshift` namespace
# importable without installing, run the CUDA tests, then the benchmarks.
#   hack/gpu_run.sh [tests] [kernels] [tune] [layer-tail] [agreement] [decode] [curve] [profile] [reload] [pdl] [compile] [regimes] [serving] [parallel-tests] [parallel]
#   (default: tests kernels decode reload; the parallel ones need 2 or more GPUs)
# Results land in bench/results/; logs and a tarball of the results go to
# $OUT when it is set. Every step runs even when an earlier one fails; the exit
# status is non-zero when any did, and the last line names them.
set -uo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$REPO_ROOT/bench/out}"
mkdir -p "$OUT" "$REPO_ROOT/bench/results"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
# Machines without git metadata get the commit from the caller:
#   SHAPESHIFT_GIT_COMMIT=$(git rev-parse HEAD) bash hack/gpu_run.sh ...
export SHAPESHIFT_GIT_COMMIT="${SHAPESHIFT_GIT_COMMIT:-$(git -C "$REPO_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Namespace package over the repository's code folders (pyproject maps them the same way).
NS=/tmp/shapeshift-ns
mkdir -p "$NS/shapeshift"
for d in engine kernels operator; do ln -sfn "$REPO_ROOT/$d" "$NS/shapeshift/$d"; done
# Packages the GPU machine lacks (pydantic for traffic profiles and the compile loop; fastapi,
# starlette, uvicorn and their pure-Python dependencies for the serving benchmark's server)
# travel as wheels in .whl/ (ignored by git), fetched beforehand on a networked machine:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types \
#     typing-inspection typing_extensions fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 \
#     opentelemetry-api==1.45.2 h11 anyio sniffio idna
SITE=/tmp/shapeshift-site
if compgen -G "$REPO_ROOT/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$REPO_ROOT"/.whl/*.whl
fi
export PYTHONPATH="$NS:$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv

steps=("$@"); [[ ${#steps[@]} -eq 0 ]] && steps=(tests kernels decode reload)
cd "$REPO_ROOT"
failed=()
for step in "${steps[@]}"; do
  echo "=== $step $(date +%T)"
  case "$step" in
    tests)    timeout "${TESTS_TIMEOUT_S:-420}" python3 -m pytest -q -x --timeout 120 -p no:cacheprovider \
                ${TESTS:-tests/kernels tests/engine/test_cuda_engine.py tests/engine/test_triton_recipe.py tests/engine/test_fast_recipe.py \
                tests/engine/test_multi_step_decode.py} 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    kernels)  timeout "${KERNELS_TIMEOUT_S:-270}" python3 hack/bench_kernels.py ${KERNELS_ARGS:---budget-s 240} 2>&1 | tee "$OUT/kernels.log" ;;
    tune)     # Sweep the GEMV search space on this GPU (time-boxed); the best configs are printed and saved.
              timeout "${TUNE_TIMEOUT_S:-200}" python3 hack/bench_kernels.py --tune --ops "${TUNE_OPS:-gemv}" \
                --budget-s "${TUNE_BUDGET_S:-180}" 2>&1 | tee "$OUT/tune.log" | tail -80 ;;
    layer-tail) timeout "${LAYER_TAIL_TIMEOUT_S:-200}" python3 hack/bench_layer_tail.py ${LAYER_TAIL_ARGS:-} 2>&1 | tee "$OUT/layer-tail.log" ;;
    agreement) timeout "${AGREEMENT_TIMEOUT_S:-300}" python3 hack/bench_agreement.py ${AGREEMENT_ARGS:-} 2>&1 | tee "$OUT/agreement.log" ;;
    decode)   timeout "${DECODE_TIMEOUT_S:-300}" python3 hack/bench_decode.py ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" ;;
    curve)    timeout "${CURVE_TIMEOUT_S:-300}" python3 hack/bench_decode.py --curve ${CURVE_ARGS:-} 2>&1 | tee "$OUT/curve.log" ;;
    profile)  timeout "${PROFILE_TIMEOUT_S:-240}" python3 hack/bench_decode.py --profile ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" ;;
    reload)   timeout 270 python3 hack/bench_reload.py --model llama-3.2-1b-shape --repeats 2 2>&1 | tee "$OUT/reload.log" | tail -40 ;;
    parallel-tests) timeout 300 python3 -m pytest -q --timeout 280 -p no:cacheprovider tests/parallel/test_parallel_cuda.py \
                2>&1 | tee "$OUT/parallel-tests.log" | tail -25 ;;
    parallel) timeout "${PARALLEL_TIMEOUT_S:-500}" python3 hack/bench_parallel.py ${PARALLEL_ARGS:-} 2>&1 | tee "$OUT/parallel.log" ;;
    pdl)      # Programmatic dependent launch (SHAPESHIFT_PDL) off, every family on, and on with the GEMVs' L2 weight
              # prefetch ahead of the wait (SHAPESHIFT_GEMV_PREFETCH columns), in one session; then the
              # CUDA engine and decode-path kernel tests with both on.
              a="--recipes ${PDL_RECIPES:-triton,fast,fast+fuse_gate_up_activation=false} --batch-sizes 1,32"
              a="$a --baselines none --repeats 3 --time-budget 60"
              SHAPESHIFT_PDL=0 timeout 120 python3 hack/bench_decode.py $a --skip-check 2>&1 | tee "$OUT/pdl-off.log" | tail -9
              SHAPESHIFT_PDL=1 timeout 150 python3 hack/bench_decode.py $a 2>&1 | tee "$OUT/pdl-on.log" | tail -10
              for columns in ${PDL_PREFETCH:-512 2048}; do
                SHAPESHIFT_PDL=1 SHAPESHIFT_GEMV_PREFETCH=$columns timeout 120 python3 hack/bench_decode.py $a --skip-check \
                  2>&1 | tee "$OUT/pdl-prefetch-$columns.log" | tail -9
              done
              SHAPESHIFT_PDL=1 SHAPESHIFT_GEMV_PREFETCH=${PDL_PREFETCH_TESTED:-512} timeout 240 python3 -m pytest -q -x \
                --timeout 120 -p no:cacheprovider \
                tests/engine/test_cuda_engine.py tests/engine/test_multi_step_decode.py tests/kernels/test_gemv.py \
                tests/kernels/test_gemv_decode_paths.py tests/kernels/test_decode_attention.py \
                tests/kernels/test_rmsnorm_activation.py tests/kernels/test_rotary.py tests/kernels/test_sampling_kernels.py \
                2>&1 | tee "$OUT/pdl-tests.log" | tail -8 ;;
    compile)  # A time-boxed search on the 1B shape; a stop resumes from the board next time.
              timeout "${COMPILE_TIMEOUT_S:-330}" python3 -c 'import sys; from shapeshift.engine.compile.cli import main; sys.exit(main())' \
                --model llama-3.2-1b-shape --profile chat --agents "${COMPILE_AGENTS:-sweep,evolve}" ${COMPILE_ARGS:-} \
                --budget-seconds "${COMPILE_BUDGET_S:-300}" --out "$REPO_ROOT/bench/results/${COMPILE_OUT:-compile-h200-chat}" \
                2>&1 | tee "$OUT/compile.log" | tail -60 ;;
    serving)  timeout "${SERVING_TIMEOUT_S:-300}" python3 hack/bench_serving.py ${SERVING_ARGS:-} 2>&1 | tee "$OUT/serving.log" | tail -30 ;;
    regimes)  # The regime matrix (hack/bench_regimes.py). The compile runs' reports and champions stay in
              # .regimes-work (tarred to $OUT as regimes-work.tgz), so that a later call given that folder
              # (carry) re-measures or completes the matrix with REGIMES_ARGS="--reuse ...".
              timeout "${REGIMES_TIMEOUT_S:-560}" python3 hack/bench_regimes.py --model "${REGIMES_MODEL:-llama-3.2-1b-shape}" \
                --work "$REPO_ROOT/.regimes-work" ${REGIMES_ARGS:-} 2>&1 | tee "$OUT/regimes.log" | tail -40
              rc=$?
              tar czf "$OUT/regimes-work.tgz" -C "$REPO_ROOT" --exclude='.regimes-work/*/work' .regimes-work
              (( rc == 0 )) ;;
    *)        echo "unknown step $step (tests kernels tune layer-tail decode curve profile reload pdl compile regimes serving parallel-tests parallel)" >&2; false ;;
  esac
  # pipefail: the status of the step's command, not of tee or tail.
  (( $? == 0 )) || failed+=("$step")
done
tar czf "$OUT/results.tgz" -C "$REPO_ROOT/bench" results
if (( ${#failed[@]} )); then
  echo "=== failed steps: ${failed[*]}"
  exit 1
fi
