# The conversations image: conversation storage over gRPC (50060 gRPC, 9160 metrics).
#   docker build -f deploy/docker/conversations.Dockerfile -t llmserve/conversations:0.1.0 .     (from the repo root)
# `make images` builds it from a local Debian base instead (--build-arg PYTHON_IMAGE=...).
# Runs as uid 10001 on a read-only root filesystem (the Helm chart mounts /tmp and the config).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# /opt/venv: only what the service imports, at the versions constraints.txt pins; /src/out: the
# gRPC stubs made from protos/ as `make protos` makes them (grpcio-tools stays in this stage).
FROM ${PYTHON_IMAGE} AS venv
ARG PIP_INDEX_URL
ARG PIP_FIND_LINKS
# PEM certificates pip trusts besides the system's: a TLS-inspecting proxy's CA, say (make images
# passes the build machine's local ones). They stay in this stage.
ARG EXTRA_CA_CERTS
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/src/ca.pem
WORKDIR /src
RUN printf '%s\n' "$EXTRA_CA_CERTS" | cat /etc/ssl/certs/ca-certificates.crt - > ca.pem
COPY constraints.txt ./
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install -c constraints.txt grpcio grpcio-health-checking protobuf prometheus-client \
        pyyaml asyncpg aiosqlite \
    && /opt/venv/bin/pip uninstall -q -y pip setuptools
RUN python3 -m venv /opt/protoc && /opt/protoc/bin/pip install -c constraints.txt grpcio-tools
COPY protos protos
RUN mkdir -p out && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=out \
        --grpc_python_out=out --pyi_out=out protos/llmserve/v1/*.proto && touch out/llmserve/v1/__init__.py

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/app:/app/libs PATH=/opt/venv/bin:$PATH
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin llmserve
COPY --from=venv /opt/venv /opt/venv
WORKDIR /app
COPY --from=venv /src/out/llmserve/v1 libs/llmserve/v1
COPY libs/llmserve libs/llmserve
COPY services/__init__.py services/
COPY services/conversations services/conversations
USER 10001:10001
EXPOSE 50060 9160
ARG VERSION=0.1.0
ARG SOURCE=""
ARG REVISION=""
LABEL org.opencontainers.image.title="llmserve-conversations" \
      org.opencontainers.image.description="llmserve conversations: stored conversations, resumable" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.revision="${REVISION}"
ENTRYPOINT ["python", "-m", "services.conversations"]
CMD ["--config", "/etc/llmserve/conversations.yaml"]
