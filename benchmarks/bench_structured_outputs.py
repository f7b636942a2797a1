"""What a structured output costs: TPOT with a JSON-schema mask against without, at batch 8, in one run.

    python benchmarks/bench_structured_outputs.py [--rounds 3] [--tokens 64] [--update-docs]

Both runs decode the same 8 chat prompts for the same number of tokens: the unconstrained ones with
ignore_eos, the constrained ones under a schema that cannot end sooner (an array of at least 64
short strings), so every step of theirs fills and applies a mask. Rounds alternate; each side keeps
its best mean TPOT. Also: how long compiling a schema takes, the first time (with reading the
vocabulary) and for new schemas after it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.lab.bench.common import machine_info, write_docs_section  # noqa: E402
from minfer.engine.structured_output import StructuredOutputs  # noqa: E402
from minfer.sampling_params import StructuredOutputsParams  # noqa: E402

DOCS_PAGE = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench_structured:start -->", "<!-- bench_structured:end -->"
TOPICS = ["cities", "rivers", "colours", "animals", "tools", "fruits", "metals", "planets"]
SCHEMAS = [{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name"]},
           {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
           {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}}}]


def mean_tpot(llm: LLM, params: SamplingParams) -> float:
    prompts = [llm.chat_prompt([{"role": "user", "content": f"List {t} as JSON."}]) for t in TOPICS]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs), "a run ended early"
    return statistics.mean(o.metrics.tpot for o in outputs)


def compile_times(llm: LLM) -> tuple[float, float]:
    """Seconds for the first schema (with the vocabulary read) and the mean for new schemas after it."""
    shapes = StructuredOutputs(llm.tokenizer, llm.model.config.vocab_size, llm.engine.eos_token_ids)
    start = time.perf_counter()
    shapes.matchers(StructuredOutputsParams(json=SCHEMAS[0]), 1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for schema in SCHEMAS[1:]:
        shapes.matchers(StructuredOutputsParams(json=schema), 1)
    return first, (time.perf_counter() - start) / (len(SCHEMAS) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--update-docs", action="store_true", help=f"rewrite the section in {DOCS_PAGE.name}")
    args = parser.parse_args()
    llm = LLM("smollm2-135m", dtype="float32", device="cpu")
    long_array = {"type": "array", "minItems": args.tokens, "items": {"type": "string", "maxLength": 12}}
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    shaped = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens,
                            structured_outputs=StructuredOutputsParams(json=long_array))
    mean_tpot(llm, free)  # warm-up
    rounds = [(mean_tpot(llm, free), mean_tpot(llm, shaped)) for _ in range(args.rounds)]
    best_free, best_shaped = min(r[0] for r in rounds), min(r[1] for r in rounds)
    first, later = compile_times(llm)
    info = machine_info()
    markdown = "\n".join([
        f"Command: `python benchmarks/bench_structured_outputs.py --rounds {args.rounds} --tokens {args.tokens}`. "
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}; SmolLM2-135M in float32, 8 chat "
        f"requests decoding {args.tokens} tokens each at once; best of {args.rounds} alternating rounds.",
        "",
        "| | mean TPOT (ms) |",
        "|---|---|",
        f"| unconstrained | {1000 * best_free:.1f} |",
        f"| JSON schema (an array of ≥ {args.tokens} strings) | {1000 * best_shaped:.1f} |",
        "",
        f"TPOT with the mask / without: **{best_shaped / best_free:.3f}** (every round: "
        + ", ".join(f"{s / f:.3f}" for f, s in rounds) + "). Compiling a schema: "
        f"{1000 * first:.0f} ms the first time (reading the vocabulary included), {1000 * later:.1f} ms for each "
        "new schema after it; a schema seen before comes from the cache.",
    ])
    print(markdown)
    if args.update_docs:
        write_docs_section(markdown, DOCS_PAGE, START, END, "## Structured outputs: what the mask costs")


if __name__ == "__main__":
    main()
