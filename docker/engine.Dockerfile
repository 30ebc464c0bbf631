# syntax=docker/dockerfile:1
# The engine image: `shapeshift serve` in the serving pods and `shapeshift compile` in compile Jobs
# (the operator runs both with command ["shapeshift"]).
#   docker build -f docker/engine.Dockerfile -t shapeshift/engine:0.1.0 .
# torch's Linux x86_64 wheels from PyPI bundle the CUDA runtime libraries (nvidia-* wheels) and
# pull Triton, so a slim Python base is enough; the node provides only the NVIDIA driver
# (through the device plugin). Trainium pools need the Neuron SDK on top of this image.

FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/shapeshift
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY operator ./operator
RUN /opt/shapeshift/bin/pip install .

FROM python:3.12-slim
# Triton compiles kernels at run time and needs a C compiler for its launcher stubs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/shapeshift /opt/shapeshift
ENV PATH=/opt/shapeshift/bin:$PATH \
    PYTHONSAFEPATH=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    # Triton and torch.compile caches go to a writable place (an emptyDir in the pod works too).
    TRITON_CACHE_DIR=/var/cache/shapeshift/triton \
    HOME=/var/cache/shapeshift
RUN mkdir -p /var/cache/shapeshift && chown 10001:10001 /var/cache/shapeshift
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["shapeshift"]
CMD ["serve", "--help"]
