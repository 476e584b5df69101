# syntax=docker/dockerfile:1
# The humanline recipe pack on a CUDA PyTorch base: DeepSpeed, megatron-core (+ mbridge), lm-eval,
# optionally Transformer Engine, and this package. Build from the repository root:
#   docker build -t humanline:0.1 .
#   docker build --build-arg WITH_TE=1 -t humanline:0.1-te .      # + Transformer Engine (compiles its torch extension)
# Run (the entry point is docker/entrypoint.sh):
#   docker run --gpus all --ipc=host -v "$PWD/runs:/workspace/humanline/runs" humanline:0.1 train recipes/X.yaml
#   docker run --gpus all humanline:0.1 plan recipes/X.yaml
#   docker run --gpus all humanline:0.1 eval data_quality --help
# podman/buildah: add `--format docker` (their OCI default drops SHELL). The base ships torch 2.8.0; the suite and CI's
# build of this file (.ci/container.sh, on a CPU base) use torch 2.13.0: docs/howto/clusters.md.
# On SLURM (from the login node): python launchers/slurm.py recipes/X.yaml --container nvcr.io#acme/humanline:0.1
#   (pyxis/enroot: REGISTRY#IMAGE:TAG or a .sqsh file; Apptainer: a .sif file)
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ARG WITH_TE=0
ARG TE_VERSION=2.20.2
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HL_HOME=/workspace/humanline
WORKDIR /workspace/humanline

# Dependencies first (a cached layer): exactly requirements/cluster.txt (tests/test_container.py checks it),
# constrained to the base image's CUDA torch so that nothing replaces it; then, optionally, Transformer Engine.
COPY requirements/cluster.txt requirements/cluster.txt
RUN python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > /tmp/torch-constraint.txt \
    && python -m pip install --no-cache-dir -c /tmp/torch-constraint.txt -r requirements/cluster.txt \
    && if [ "${WITH_TE}" = "1" ]; then \
         python -m pip install --no-cache-dir --no-build-isolation -c /tmp/torch-constraint.txt \
           "transformer_engine[pytorch]==${TE_VERSION}"; \
       fi

# The package itself (its dependencies are all installed above).
COPY . .
RUN python -m pip install --no-cache-dir --no-deps -e . \
    && chmod 0755 docker/entrypoint.sh \
    && python launchers/run.py recipes/tiny/humanline_dpo.yaml --print-config > /dev/null

ENTRYPOINT ["/workspace/humanline/docker/entrypoint.sh"]
CMD ["help"]
