"""make bench-spec: speculative decoding (n-gram prompt lookup or a draft model) against plain
decoding, in one run.

Two workloads on SmolLM2 on this CPU, greedy, batch 1 then a batch of 4:
- copying: the answer mostly copies its input (edit or repeat a given text);
- open-ended: the answer is new text.
Prints tokens/s with and without speculation, the ratio, the acceptance rate, and whether both
made the same tokens (with float32 weights they must; with int8 weights a verification row's
tiny rounding difference can flip a near-tie: see docs/perf/spec.md).
Targets: >= 1.8x on copying; >= 0.95x on open-ended.

Usage: python -m bench.spec [--k 4] [--max-tokens 160] [--method ngram|draft_model]
                            [--draft-model smollm2|random:tiny|path] [--quantization none|int8] [--threads N]

--draft-model: SmolLM2 itself (the default; its weights are shared with the target) shows the
mechanism's cost at near-total acceptance, random:tiny at almost none. Plain rows run on an
engine without a draft model, which would otherwise run in every step.
"""

from __future__ import annotations

import argparse
import time

import torch

from services.worker.config import EngineConfig, ModelSourceConfig
from services.worker.engine.build import build_engine
from services.worker.engine.sampling_params import SamplingParams

PASSAGE = (
    "The lighthouse stood at the end of the harbour wall. Every evening the keeper climbed the ninety "
    "steps, trimmed the wick, polished the lens and lit the lamp. Ships far out at sea saw the beam sweep "
    "across the water every ten seconds, and knew where the rocks were. In the morning he put the lamp "
    "out, wrote the weather in his log, and walked back down to the village for bread."
)
COPYING = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this text in the past perfect tense, changing nothing else:\n\n{PASSAGE}",
    f"Copy this paragraph, replacing 'keeper' with 'warden':\n\n{PASSAGE}",
    f"Correct any mistakes in this text and return it in full:\n\n{PASSAGE.replace('the', 'teh', 3)}",
]
OPEN_ENDED = [
    "Write a short story about a dragon who learns to bake.",
    "Explain why the sky is blue to a ten-year-old.",
    "Describe your ideal weekend in a few sentences.",
    "What are the benefits of learning a second language?",
]


def run(engine, tokenizer, prompts: list[str], max_tokens: int, k: int) -> tuple[float, list[int], int, int]:
    """Tokens/s, the tokens made (all requests'), drafts proposed and accepted for the prompts run together."""
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                        num_speculative_tokens=k))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    proposed = accepted = 0
    t0 = time.perf_counter()
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                proposed += out.spec_proposed
                accepted += out.spec_accepted
    made = [t for request in tokens.values() for t in request]
    return len(made) / (time.perf_counter() - t0), made, proposed, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    parser.add_argument("--draft-model", default="smollm2", help="the draft's model source (draft_model only)")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none",
                        help="the target's weights (int8: the CPU serving option)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = ModelSourceConfig(quantization=args.quantization)
    built = build_engine(model, EngineConfig(num_blocks=512))
    plain_engine, tokenizer = built.engine, built.loaded.tokenizer
    draft = built.loaded if args.draft_model == "smollm2" else None
    spec_engine = build_engine(model, EngineConfig(num_blocks=512, speculative_method=args.method,
                                                                 draft_model=args.draft_model),
                               loaded=built.loaded, draft=draft).engine
    run(plain_engine, tokenizer, OPEN_ENDED[:1], 8, 0)    # warm-up
    run(spec_engine, tokenizer, OPEN_ENDED[:1], 8, args.k)
    method = "n-gram" if args.method == "ngram" else f"draft model {args.draft_model}"
    print(f"# bench-spec  {time.strftime('%Y-%m-%d %H:%M')}  {method} k={args.k}, greedy, SmolLM2 on the CPU, "
          f"{'int8 weights' if args.quantization == 'int8' else 'float32 weights'}, {torch.get_num_threads()} thread(s)")
    print("| workload | batch | plain tok/s | spec tok/s | ratio | acceptance | same tokens | target |")
    print("|---|---|---|---|---|---|---|---|")
    for name, prompts, target in (("copying", COPYING, 1.8), ("open-ended", OPEN_ENDED, 0.95)):
        for batch in (1, 4):
            chosen = prompts[:batch]
            plain, plain_tokens, _, _ = run(plain_engine, tokenizer, chosen, args.max_tokens, 0)
            spec, spec_tokens, proposed, accepted = run(spec_engine, tokenizer, chosen, args.max_tokens, args.k)
            rate = accepted / proposed if proposed else 0.0
            print(f"| {name} | {batch} | {plain:.1f} | {spec:.1f} | {spec / plain:.2f}x | {rate * 100:.0f}% "
                  f"| {'yes' if plain_tokens == spec_tokens else 'no'} | >= {target}x |", flush=True)


if __name__ == "__main__":
    main()
