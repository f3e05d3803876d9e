# syntax=docker/dockerfile:1
# The router image: gRPC Generation front for the worker pools (50050 gRPC, 9150 metrics).
#   docker build -f deploy/docker/router.Dockerfile -t llmserve/router:0.1.0 .     (from the repo root)
# Runs as uid 10001 on a read-only root filesystem (the Helm chart mounts /tmp and the config).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# gRPC stubs from protos/, as `make protos` makes them.
FROM ${PYTHON_IMAGE} AS stubs
WORKDIR /src
COPY constraints.txt ./
RUN pip install --no-cache-dir -c constraints.txt grpcio-tools
COPY protos protos
RUN mkdir -p out && python -m grpc_tools.protoc -Iprotos --python_out=out --grpc_python_out=out \
        --pyi_out=out protos/llmserve/v1/*.proto && touch out/llmserve/v1/__init__.py

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app:/app/libs
WORKDIR /app
COPY constraints.txt ./
# Only what this service imports, at the versions constraints.txt pins (no torch here).
RUN pip install --no-cache-dir -c constraints.txt grpcio grpcio-health-checking grpcio-reflection protobuf prometheus-client opentelemetry-api opentelemetry-sdk pyyaml uvloop
COPY libs/llmserve libs/llmserve
COPY --from=stubs /src/out/llmserve/v1 libs/llmserve/v1
COPY services/__init__.py services/
COPY services/router services/router
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin llmserve
USER 10001:10001
EXPOSE 50050 9150
ENTRYPOINT ["python", "-m", "services.router"]
CMD ["--config", "/etc/llmserve/router.yaml"]
