"""Train the shipped EAGLE head `smollm2-135m-eagle` by distillation from SmolLM2-135M (the target).

    OMP_NUM_THREADS=2 python benchmarks/train_eagle.py --threads 2   # writes minfer/drafts/smollm2-135m-eagle (41 min)
    OMP_NUM_THREADS=1 python benchmarks/train_eagle.py --quick --out /tmp/eagle   # a smoke run

Steps, all on the CPU with fixed seeds, nothing downloaded:
  1. the target answers chat prompts made in code (twice each: greedy or sampled, then sampled) and
     continues pydoc text; the pydoc topics of the evaluation text (`minfer.texts.EVAL_TOPICS`) and of
     the speculative benchmark's grounded task are left out, and so are the subjects of the benchmark's
     chat questions;
  2. the head's K tokens: the most frequent ones in that text (as the pruned draft's head);
  3. the target reads the text once; its pre-norm last hidden states (the features) are kept;
  4. the head learns, at every position t, from (feature t, token t+1), to predict feature t+1
     (smooth L1, after the final norm) and the target's next-token distribution over
     the head tokens (KL), with a little noise on its input features (its own guesses are not exact);
  5. the head's first-guess agreement with the target's greedy answers to held-out prompts and to the
     speculative benchmark's chat questions is printed; weights saved in bf16.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minfer import LLM, SamplingParams
from minfer.lab.bench.spec import CHAT_QUESTIONS
from minfer.layers.linear import bf16_autocast
from minfer.lab.distill import distillation_loss, run_training, select_head_tokens
from minfer.speculative.eagle_head import EAGLE_DIR, EagleHead, eagle_from_target, save_eagle
from minfer.texts import EVAL_TOPICS
from train_draft import chat_prompts, pack

BENCH_TOPICS = ("assert", "pass", "del", "return", "break", "continue", "global", "import")  # bench_speculative's
BENCH_SUBJECTS = ("robots", "learning a language", "mountains", "light", "the weather")  # near its chat questions
# More kinds of training prompts (--more-kinds): 103 more subjects and 16 more templates, none near a
# held-out subject or a benchmark question. With them, 4000 prompts x one answer raised the head's
# first-guess agreement on held-out prompts by 3 points, but left the engine's alpha within noise.
EXTRA_SUBJECTS = (
    "bridges", "penguins", "the postal service", "knitting", "coral reefs", "the violin", "origami", "submarines",
    "a school library", "baking cookies", "the Arctic", "clocks", "microscopes", "the water cycle", "tigers",
    "spiders", "skyscrapers", "the Renaissance", "the Vikings", "castles", "pirates", "maps", "compasses", "money",
    "taxes", "elections", "newspapers", "podcasts", "photography", "film making", "theatre", "ballet", "yoga",
    "swimming", "tennis", "public transport", "farming", "rice", "apples", "cheese", "salt", "vitamins",
    "the common cold", "dentists", "hospitals", "teachers", "homework", "exams", "a science fair",
    "the periodic table", "atoms", "DNA", "evolution", "bacteria", "snow", "glaciers", "islands", "caves", "sharks",
    "octopuses", "butterflies", "ants", "horses", "owls", "elephants", "bats", "wolves", "frogs", "calendars",
    "the number zero", "probability", "spreadsheets", "passwords", "email", "cloud computing", "computer viruses",
    "keyboards", "batteries", "wind turbines", "nuclear power", "plastic", "glass", "paper", "cotton", "wool",
    "a road trip", "a picnic", "a lost wallet", "a new neighbour", "a family dinner", "a wedding",
    "a museum visit", "a broken phone", "volunteering", "patience", "honesty", "curiosity", "courage", "habits",
    "procrastination", "stress", "happiness", "gratitude")
EXTRA_TEMPLATES = (
    "List five interesting things about {}.", "Write a letter to a friend about {}.",
    "What would a beginner need to know about {}?", "Compare {} with something similar.",
    "Write a limerick about {}.", "Explain {} in simple words.", "What are the main ideas behind {}?",
    "Write a news headline and a short article about {}.", "How can I learn more about {}?",
    "Give me a step-by-step guide related to {}.", "What might {} look like in a hundred years?",
    "Write a motivational message inspired by {}.", "Describe a day in the life of someone who works with {}.",
    "What are three surprising facts about {}?", "Create a quiz with three questions about {}.",
    "Write a product description for something related to {}.")


@torch.no_grad()
def target_features(target, rows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The target's pre-norm last hidden states [rows, seq, hidden] in bfloat16 (bf16 matmuls)."""
    positions = torch.arange(rows.shape[1])[None]
    out = []
    for i in tqdm(range(0, len(rows), batch_size), desc="target features", disable=len(rows) <= batch_size):
        with bf16_autocast("cpu"):
            out.append(target.hidden_states(rows[i:i + batch_size], positions).to(torch.bfloat16).clone())
    return torch.cat(out)


def head_loss(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, scale: float, noise: float,
              kl_weight: float) -> torch.Tensor:
    """Row t reads (feature t, token t+1) and predicts feature t+1 and the target's distribution there.
    The features are regressed after the final norm: a few channels of the raw features are hundreds of
    times larger than the rest and would decide a raw regression alone."""
    inputs, wanted = features[:, :-1].float(), features[:, 1:].float()
    inputs = inputs + noise * scale * (torch.rand_like(inputs) * 2 - 1)
    positions = torch.arange(inputs.shape[1])[None]
    with bf16_autocast("cpu"):
        predicted = head(inputs, ids[:, 1:], positions)
        logits = head.logits(predicted)
        with torch.no_grad():
            teacher = head.logits(wanted)
    regression = F.smooth_l1_loss(head.norm(predicted.float()), head.norm(wanted))
    return regression + kl_weight * distillation_loss(logits, teacher)


@torch.no_grad()
def answer_agreement(head: EagleHead, target, outputs) -> float:
    """Share of answer tokens where the head's first guess (from the target's features) is the target's
    greedy token over the head tokens: the first drafted token's acceptance when the answers are greedy."""
    hits = total = 0
    for o in outputs:
        prompt, ids = len(o.prompt_token_ids), torch.tensor([list(o.prompt_token_ids) + list(o.outputs[0].token_ids)])
        features = target_features(target, ids, 1)
        positions = torch.arange(ids.shape[1] - 1)[None]
        with bf16_autocast("cpu"):
            guess = head.logits(head(features[:, :-1].float(), ids[:, 1:], positions)).argmax(-1)
            wanted = head.logits(features[:, 1:].float()).argmax(-1)
        hits += (guess == wanted)[0, prompt - 1:].sum().item()  # the positions that predict answer tokens
        total += ids.shape[1] - prompt
    return hits / max(total, 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(EAGLE_DIR))
    parser.add_argument("--head-tokens", type=int, default=8192, help="K: the head covers the K most frequent tokens")
    parser.add_argument("--chat-prompts", type=int, default=1344)
    parser.add_argument("--answers-per-prompt", type=int, default=2,
                        help="answers the target writes to each prompt: the first greedy for two prompts in three, "
                             "every other one sampled at temperature 0.8 with its own seed")
    parser.add_argument("--more-kinds", action="store_true",
                        help="add EXTRA_SUBJECTS and EXTRA_TEMPLATES to the training prompts (5984 prompts in all)")
    parser.add_argument("--answer-tokens", type=int, default=160)
    parser.add_argument("--pydoc-tokens", type=int, default=100000)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--noise", type=float, default=0.1, help="uniform noise on input features, x a typical channel's size")
    parser.add_argument("--kl-weight", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: steady timings on a shared machine)")
    parser.add_argument("--quick", action="store_true", help="a tiny run to check the pipeline")
    args = parser.parse_args(argv)
    if args.quick:
        args.chat_prompts, args.answer_tokens, args.pydoc_tokens, args.steps = 16, 32, 2048, 4
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", seed=args.seed)
    target, tok = llm.model, llm.tokenizer
    target.requires_grad_(False)  # the head trains alone; the shared embedding stays as it is
    extra = (EXTRA_SUBJECTS, EXTRA_TEMPLATES) if args.more_kinds else ((), ())
    train_prompts, held_out = chat_prompts(tok, args.seed, *extra)
    train_prompts = [p for p in train_prompts if not any(s in p for s in BENCH_SUBJECTS)][: args.chat_prompts]
    from pydoc_data.topics import topics

    skip = set(EVAL_TOPICS) | set(BENCH_TOPICS)
    pydoc = [topics[k] for k in sorted(topics) if k not in skip]
    openings = [{"prompt_token_ids": tok(t)["input_ids"][:32]} for t in pydoc[::8]]
    inputs = train_prompts + openings + train_prompts * (args.answers_per_prompt - 1)
    first = len(train_prompts) + len(openings)  # past these, every answer is sampled
    params = [SamplingParams(temperature=0 if i % 3 and i < first else 0.8, seed=args.seed + i,
                             max_tokens=args.answer_tokens) for i in range(len(inputs))]
    writer = LLM("smollm2-135m", dtype="bfloat16", device="cpu", seed=args.seed, max_num_seqs=128)
    outs = writer.generate(inputs, params)
    chats = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    greedy = SamplingParams(temperature=0, max_tokens=64)
    evals = writer.generate(held_out[: 8 if args.quick else 32], greedy)
    bench_evals = writer.generate([writer.chat_prompt([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS], greedy)
    del writer

    text_ids = tok("\n\n".join(pydoc))["input_ids"][: args.pydoc_tokens]
    counts = torch.bincount(torch.tensor(text_ids + [t for c in chats for t in c]), minlength=llm.config.vocab_size)
    head_ids = select_head_tokens(counts, args.head_tokens)

    eos = tok.eos_token_id
    rows = torch.cat([pack([text_ids], args.seq_len, eos), pack(chats, args.seq_len, eos)])
    features = target_features(target, rows, args.batch_size)
    scale = features[:, : 64].float().abs().median().item()  # a typical channel's size (not the outliers')

    head = eagle_from_target(target, head_ids)
    g = torch.Generator().manual_seed(args.seed)

    class Batches:  # re-shuffled every pass
        def __iter__(self):
            order = torch.randperm(len(rows), generator=g)
            for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
                yield order[i: i + args.batch_size]

    trainable = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    head.train()
    bar = tqdm(total=args.steps, desc="training the head")
    losses = run_training(opt, Batches(), args.steps, 20,
                          lambda b: head_loss(head, rows[b], features[b], scale, args.noise, args.kl_weight),
                          on_step=lambda s, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}")), clip=trainable)
    bar.close()
    head.eval()
    agreement = answer_agreement(head, target, evals)
    bench_agreement = answer_agreement(head, target, bench_evals)

    meta = {"target": "smollm2-135m", "seed": args.seed, "steps": args.steps,
            "command": "python benchmarks/train_eagle.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    save_eagle(head, args.out, meta)
    print(f"rows {len(rows)} x {args.seq_len} tokens; loss {losses[0]:.3f} -> {sum(losses[-10:]) / min(10, len(losses)):.3f}")
    print(f"first-guess agreement with the target's greedy answers: held-out prompts {agreement:.3f}, "
          f"bench_speculative's chat questions {bench_agreement:.3f}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s ({time.process_time():.0f} s of CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
