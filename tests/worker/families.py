"""Tiny random checkpoints of every model family, built with transformers' own classes, and the
checks the family tests share: transformers' greedy tokens as the reference, our engine under
batching, chunked prefill, prefix caching and preemption, and a real worker over gRPC.

A checkpoint: AutoConfig.for_model(model_type, ...) -> AutoModelForCausalLM.from_config, weights
N(0, 0.2), every norm weight and bias moved off its identity (so a norm applied wrongly shows),
save_pretrained (5.x keys) beside SmolLM2's tokenizer files; `to_4x_layout` rewrites its
config.json the way transformers 4.x writes it. Random models have near-flat logits here and
there: where ours and the reference differ at a step whose top two reference logits are within
TIE of each other, the rest of the sequence is not compared (a tie, not a bug).
"""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from llmserve.v1 import worker_pb2 as pb
from llmserve.v1 import worker_pb2_grpc
from services.worker.attention.torch_paged import TorchPagedAttention
from services.worker.model.loader import LoadedModel, load_model
from tests.procs import worker
from tests.worker.test_engine import greedy, make_engine, run

COMMON = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 10          # sliding window of the families that have one: shorter than most prompts
NEW_TOKENS = 12
TIE = 1e-3


def prompts(vocab_size: int = COMMON["vocab_size"]) -> dict[str, list[int]]:
    """Token prompts of 5 to 41 tokens; `shared` repeats two blocks of `long` (a prefix-cache hit)."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, vocab_size) for _ in range(n)]  # noqa: E731
    long = ids(41)
    return {"short": ids(5), "mid": ids(23), "long": long, "shared": long[:32] + ids(7)}


@dataclass
class Reference:
    tokens: list[int]
    margins: list[float]        # top-1 minus top-2 logit at each step


def save_checkpoint(folder: Path, tokenizer, model_type: str, **config) -> torch.nn.Module:
    """-> transformers' model (float32, eval), saved in `folder` with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = AutoConfig.for_model(model_type, **{**COMMON, **config})
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    return model


def to_4x_layout(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint whose config.json has transformers 4.x's keys: rope_theta and
    rope_scaling (Gemma 3: rope_local_base_freq; Phi-3: partial_rotary_factor at the top level),
    Qwen3-MoE's num_experts, no layer_types where 4.x derived them."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    hf = json.loads((src / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    if "full_attention" in rope:        # Gemma 3
        sliding = rope.pop("sliding_attention")
        hf["rope_local_base_freq"] = sliding["rope_theta"]
        rope = rope["full_attention"]
        hf["sliding_window_pattern"] = hf.pop("_sliding_window_pattern", 6)
    hf["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        hf["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        rope["type"] = rope.pop("rope_type")        # the oldest spelling
        hf["rope_scaling"] = rope
    if hf["model_type"] == "qwen3_moe":
        hf["num_experts"] = hf.pop("num_local_experts")
    hf["transformers_version"] = "4.57.1"
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def build_family(case: str, cases: dict, tmp_path_factory, tokenizer) -> tuple[str, Path, dict[str, Reference]]:
    """cases[case] = (model_type, config): -> (case, its checkpoint folder, transformers' greedy
    reference for each prompt)."""
    model_type, config = cases[case]
    folder = tmp_path_factory.mktemp(case)
    model = save_checkpoint(folder, tokenizer, model_type, **config)
    return case, folder, {rid: reference_greedy(model, ids) for rid, ids in prompts().items()}


def check_4x_layout(folder: Path, references: dict[str, Reference], tmp_path: Path) -> None:
    """The checkpoint with a 4.x-layout config.json is the same model, giving the reference's tokens."""
    five, four = load(folder), load(to_4x_layout(folder, tmp_path / "4x"))
    assert "rope_parameters" not in (tmp_path / "4x" / "config.json").read_text()
    assert {**vars(four.config), "name": ""} == {**vars(five.config), "name": ""}
    ours, _ = engine_outputs(four, prompts())
    for rid, ref in references.items():
        assert_matches(ours[rid], ref, f"4.x layout {rid}")


def reference_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> Reference:
    """transformers' greedy decoding, one token at a time over its own KV cache."""
    tokens, margins, past, x = [], [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=x, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1].float()
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            x = torch.tensor([[tokens[-1]]])
    return Reference(tokens, margins)


def assert_matches(ours: list[int], ref: Reference, what: str) -> None:
    """Equal to the reference's tokens up to a near-tie of its top two logits (and past it: not compared)."""
    for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=True)):
        if a != b:
            assert ref.margins[i] < TIE, f"{what}: token {i} is {a}, transformers' {b} " \
                                         f"(margin {ref.margins[i]:.4f}); ours {ours}, theirs {ref.tokens}"
            return


def load(folder: Path) -> LoadedModel:
    return load_model(str(folder), torch.float32, torch.device("cpu"), TorchPagedAttention())


ENGINE_SETTINGS = {
    "batched": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(num_blocks=7),
}


def engine_outputs(loaded: LoadedModel, requests: dict[str, list[int]], **settings) -> tuple[dict, object]:
    """Greedy tokens of every prompt, all in one engine: each twice (the second time from the prefix cache)."""
    engine = make_engine(loaded, **settings)
    batch = {rid: (ids, greedy(NEW_TOKENS, ignore_eos=True)) for rid, ids in requests.items()}
    first = run(engine, batch)
    again = run(engine, {f"{rid}-again": request for rid, request in batch.items()})
    return {**{k: r.tokens for k, r in first.items()}, **{k: r.tokens for k, r in again.items()}}, \
        (engine, {k: r.cached for k, r in again.items()})


def check_engine(loaded: LoadedModel, references: dict[str, Reference]) -> None:
    """Every engine setting gives the reference's tokens, and all settings agree to the token."""
    requests = prompts()
    baseline = None
    for setting, kwargs in ENGINE_SETTINGS.items():
        outputs, (engine, cached) = engine_outputs(loaded, requests, **kwargs)
        for rid, ref in references.items():
            assert_matches(outputs[rid], ref, f"{setting} {rid}")
            assert outputs[f"{rid}-again"] == outputs[rid], f"{setting} {rid}: a prefix-cache hit changed it"
        if kwargs.get("enable_prefix_caching", True):
            assert cached["long-again"] >= 32, cached
        if setting == "preemption":
            assert engine.scheduler.num_preemptions > 0
        assert engine.pool.num_free_blocks == engine.pool.num_usable_blocks
        baseline = baseline or outputs
        assert outputs == baseline, setting


def check_worker(tmp_path: Path, folder: Path, references: dict[str, Reference]) -> None:
    """A real worker process serving the folder over gRPC gives the reference's tokens."""
    requests = prompts()
    with worker(tmp_path, model__source=str(folder), model__name="tiny", engine__num_blocks="64") as w, \
            grpc.insecure_channel(w.address) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        for rid, ref in references.items():
            request = pb.GenerateRequest(model="tiny", token_ids=pb.TokenIdsPrompt(ids=requests[rid]),
                                         sampling=pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                    ignore_eos=True))
            tokens = [t for r in stub.Generate(request, timeout=120) for t in r.token_ids]
            assert_matches(tokens, ref, f"worker {rid}")
