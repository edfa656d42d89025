# syntax=docker/dockerfile:1
# The gem-platform operator: `gem-operator` (kopf) with the API types; no torch.
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/gem-platform/operator:0.1.0 .
#
# The base is pinned to an exact tag; pin it by digest as well in your registry mirror
# (`python:3.12.8-slim-bookworm@sha256:...`) for fully reproducible builds.
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gem
ENV PATH=/opt/gem/bin:$PATH
WORKDIR /src
# .dockerignore lets only the package sources through (pyproject.toml, README.md, gem/, operator/, sdk/).
COPY . .
# The project's own install: dependency ranges come from pyproject.toml (no lock file yet).
# hadolint ignore=DL3013
RUN pip install ".[operator]" \
 && gem-operator --help >/dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gem-operator" \
      org.opencontainers.image.description="Reconciles GEMTraining and LoopFMDistill into Kubeflow PyTorchJobs" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 gem \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin gem
COPY --from=build /opt/gem /opt/gem
# The chart mounts a writable emptyDir at /tmp; the root filesystem is read-only.
ENV PATH=/opt/gem/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 8080: kopf liveness (/healthz); 8081: readiness (/readyz); 9090: Prometheus metrics (/metrics).
# The same ports and paths as the chart's defaults, so `docker run` serves what the chart probes.
EXPOSE 8080 8081 9090
ENTRYPOINT ["gem-operator"]
CMD ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", "--readiness=http://0.0.0.0:8081/readyz"]
