# syntax=docker/dockerfile:1
# The operator image: `shapeshift operator` (kopf) without the engine's heavy dependencies.
#   docker build -f docker/operator.Dockerfile -t shapeshift/operator:0.1.0 .
# The operator imports shapeshift.operator and, from the engine, only the pure-Python
# traffic-profile module; it never imports torch. So the distribution is installed with
# --no-deps and only the operator's own dependencies are added (keep this list in step with
# pyproject.toml; tests/helm/test_dockerfiles.py checks that every one of them is declared there).

FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/shapeshift
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY operator ./operator
RUN /opt/shapeshift/bin/pip install --no-deps . \
 && /opt/shapeshift/bin/pip install \
      "pydantic>=2.7" "pyyaml>=6" "numpy>=1.26" \
      "kopf>=1.37" "kubernetes>=30" "prometheus-api-client>=0.5"

FROM python:3.12-slim
COPY --from=build /opt/shapeshift /opt/shapeshift
ENV PATH=/opt/shapeshift/bin:$PATH \
    PYTHONSAFEPATH=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The chart runs it as this user with a read-only root filesystem and /tmp as an emptyDir.
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["shapeshift"]
CMD ["operator", "--all-namespaces", "--standalone"]
