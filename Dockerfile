# The mlscale image that `mlscale k8s train|serve` manifests run (docs/scale-out.md).
# CPU (default):  docker build -t registry.example.com/mlscale:0.1.0 .
# NVIDIA GPUs:    docker build --build-arg TORCH_CHANNEL=cu128 -t registry.example.com/mlscale:0.1.0-cuda .
# TORCH_CHANNEL is a PyTorch wheel index (cpu, cu126, cu128, ...): CUDA wheels carry their CUDA
# libraries, so a GPU node needs only its driver and the NVIDIA device plugin.
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_CHANNEL=cpu
ARG EXTRAS=export,parquet,features,postgres
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from its own index: the largest layer, rebuilt only when the version or channel changes
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_CHANNEL}"

WORKDIR /opt/mlscale
COPY pyproject.toml README.md ./
COPY mlscale ./mlscale
# the package in this folder: its dependencies' ranges are pyproject.toml's
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[${EXTRAS}]" && mlscale --version

# not root: the serving Deployment sets runAsNonRoot
RUN useradd --create-home --uid 10001 mlscale
USER 10001
WORKDIR /home/mlscale
# HTTP and gRPC of `mlscale serve`; torchrun's c10d rendezvous
EXPOSE 8000 8001 29500
CMD ["mlscale", "--help"]
