"""Train the shipped EAGLE head `smollm2-135m-eagle` by distillation from SmolLM2-135M (the target).

    OMP_NUM_THREADS=2 python benchmarks/train_eagle.py --threads 2   # writes minfer/drafts/smollm2-135m-eagle (about an hour)
    OMP_NUM_THREADS=1 python benchmarks/train_eagle.py --quick --out /tmp/eagle   # a smoke run

Steps, all on the CPU with fixed seeds, nothing downloaded:
  1. the target answers chat prompts made in code (twice each: greedy or sampled, then sampled) and
     continues pydoc text; the pydoc topics of the evaluation text (`minfer.texts.EVAL_TOPICS`) and of
     the speculative benchmark's grounded task are left out, and so are the subjects of the benchmark's
     chat questions;
  2. the head's K tokens: the most frequent ones in that text (as the pruned draft's head);
  3. the target reads the text once; its pre-norm last hidden states (the features) are kept, after the
     outputs of --feature-layers (EAGLE-3; none by default);
  4. the head learns, at every position t, from (feature t, token t+1), to predict feature t+1
     (smooth L1, after the final norm) and the target's next-token distribution over
     the head tokens (KL), with a little noise on its input features (its own guesses are not exact);
  5. then the training-time test (EAGLE-3): chains of --chain-depth guesses, each reading the head's own
     predicted feature as the engine's later guesses do (`minfer.lab.distill.ChainCache`);
  6. the agreement of its first, second and third chained guess with the target's greedy answers to
     held-out prompts and to the speculative benchmark's chat questions is printed; weights saved in bf16.

--data keeps the text and the features in a file, so that later runs (other settings, other layers) skip
steps 1-3; --init starts from a saved head (with --head-layers, the layers it lacks start as nothing: their
output projections zero, so the grown head guesses as the saved one did until they learn).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from minfer import LLM, SamplingParams
from minfer.lab.bench.spec import CHAT_QUESTIONS
from minfer.layers.linear import bf16_autocast
from minfer.lab.distill import chained_guesses, distillation_loss, run_training, select_head_tokens
from minfer.speculative.eagle_head import EAGLE_DIR, EagleHead, eagle_from_target, load_eagle, save_eagle
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
def target_features(target, rows: torch.Tensor, batch_size: int, layers: tuple[int, ...] = ()) -> torch.Tensor:
    """The target's pre-norm last hidden states [rows, seq, hidden] in bfloat16 (bf16 matmuls), after
    the outputs of `layers` ([rows, seq, (len(layers) + 1) x hidden]; `LlamaModel.hidden_states`)."""
    positions = torch.arange(rows.shape[1])[None]
    out = []
    for i in tqdm(range(0, len(rows), batch_size), desc="target features", disable=len(rows) <= batch_size):
        with bf16_autocast("cpu"):
            out.append(target.hidden_states(rows[i:i + batch_size], positions, keep_layers=layers).to(torch.bfloat16).clone())
    return torch.cat(out)


def head_loss(head: EagleHead, ids: torch.Tensor, features: torch.Tensor, scale: float, noise: float,
              kl_weight: float, depth: int = 1, regression_weight: float = 1.0) -> torch.Tensor:
    """Row t reads (feature t, token t+1) and predicts feature t+1 and the target's distribution there.
    The features are regressed after the final norm: a few channels of the raw features are hundreds of
    times larger than the rest and would decide a raw regression alone. depth > 1 adds the training-time
    test: guess j reads the head's own guess j-1 (ChainCache), its loss weighted 0.8^(j-1)."""
    inputs, wanted = features[:, :-1].float(), features[:, 1:, -head.config.hidden_size:].float()
    inputs = inputs + noise * scale * (torch.rand_like(inputs) * 2 - 1)
    chains = inputs.shape[1]
    with bf16_autocast("cpu"):
        with torch.no_grad():
            teacher = head.logits(wanted)
        loss = 0.0
        for j, guess in enumerate(chained_guesses(head, head.read_features(inputs), ids, depth)):
            predicted = guess[:, :chains - j]  # the chains whose guess j exists
            regression = F.smooth_l1_loss(head.norm(predicted.float()), head.norm(wanted[:, j:]))
            token_loss = distillation_loss(head.logits(predicted), teacher[:, j:])
            loss = loss + 0.8 ** j * (regression_weight * regression + kl_weight * token_loss)
    return loss


@torch.no_grad()
def answer_agreement(head: EagleHead, target, answers, depth: int = 1) -> list[float]:
    """Per guess depth j, the share of answer positions where the head's j-th chained guess (the first
    from the target's features, later ones from the head's own) is the target's greedy token over the
    head tokens, when the guesses before it were right: alpha at each depth when the answers are greedy."""
    hits, total = [0] * depth, [0] * depth
    for prompt_ids, answer_ids in answers:
        prompt, ids = len(prompt_ids), torch.tensor([list(prompt_ids) + list(answer_ids)])
        features = target_features(target, ids, 1, head.feature_layers).float()
        chains = ids.shape[1] - 1
        with bf16_autocast("cpu"):
            wanted = head.logits(features[:, 1:, -head.config.hidden_size:]).argmax(-1)
            guessed = [head.logits(g).argmax(-1) for g in chained_guesses(head, head.read_features(features[:, :-1]), ids, depth)]
        right = torch.ones(chains, dtype=torch.bool)
        for j in range(depth):  # guess j of chain t exists while t + j < chains
            seen = right[:chains - j]  # the chains whose earlier guesses were all right
            right = seen & (guessed[j][0, :chains - j] == wanted[0, j:])
            hits[j] += right[prompt - 1:].sum().item()  # chains that start at an answer position
            total[j] += seen[prompt - 1:].sum().item()
    return [h / max(n, 1) for h, n in zip(hits, total)]


@torch.no_grad()
def grown_head(saved: EagleHead, target, feature_layers: tuple[int, ...], num_layers: int) -> EagleHead:
    """`saved` with more to learn: a new fuse starts as the last layer alone (`eagle_from_target`), new layers
    as nothing (their output projections zero), so the grown head guesses exactly as the saved one did."""
    if num_layers < len(saved.layers):
        raise ValueError(f"--head-layers {num_layers}: the saved head has {len(saved.layers)} layers")
    head = eagle_from_target(target, saved.head_token_ids, feature_layers, num_layers)
    head.load_state_dict(saved.state_dict(), strict=saved.feature_layers == feature_layers and len(saved.layers) == num_layers)
    for layer in head.layers[len(saved.layers):]:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return head


def training_text(args, llm) -> dict:
    """The text the head learns from, the target's features over it, the head tokens, and the greedy
    answers its agreement is measured on (held-out prompts, the benchmark's chat questions)."""
    target, tok = llm.model, llm.tokenizer
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
    answers = lambda outputs: [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outputs]
    evals = answers(writer.generate(held_out[: 8 if args.quick else 32], greedy))
    chat_questions = [writer.chat_prompt([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    bench_evals = answers(writer.generate(chat_questions, greedy))
    del writer

    text_ids = tok("\n\n".join(pydoc))["input_ids"][: args.pydoc_tokens]
    counts = torch.bincount(torch.tensor(text_ids + [t for c in chats for t in c]), minlength=llm.config.vocab_size)
    eos = tok.eos_token_id
    rows = torch.cat([pack([text_ids], args.seq_len, eos), pack(chats, args.seq_len, eos)])
    return {"rows": rows, "features": target_features(target, rows, args.batch_size, tuple(args.feature_layers)),
            "head_ids": select_head_tokens(counts, args.head_tokens), "evals": evals, "bench_evals": bench_evals}


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
    parser.add_argument("--regression-weight", type=float, default=1.0,
                        help="weight of the feature regression (EAGLE-3 trains on the token loss alone: 0)")
    parser.add_argument("--chain-steps", type=int, default=800,
                        help="then this many steps of the training-time test (ChainCache): chains of guesses")
    parser.add_argument("--chain-depth", type=int, default=3, help="guesses per chain in those steps")
    parser.add_argument("--chain-lr", type=float, default=3e-4)
    parser.add_argument("--feature-layers", type=int, nargs="*", default=[],
                        help="EAGLE-3: earlier target layers the head reads besides the last (e.g. 2 15)")
    parser.add_argument("--head-layers", type=int, default=1, help="decoder layers in the head")
    parser.add_argument("--init", help="start from this saved head (a folder written by this script, or the shipped name)")
    parser.add_argument("--data", help="a file that keeps the text and the target's features: written by the "
                                       "first run, read by the next ones with the same text settings (their "
                                       "features recomputed when --feature-layers differ)")
    parser.add_argument("--eval-depth", type=int, default=3, help="chained guesses measured at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: steady timings on a shared machine)")
    parser.add_argument("--quick", action="store_true", help="a tiny run to check the pipeline")
    args = parser.parse_args(argv)
    if args.quick:
        args.chat_prompts, args.answer_tokens, args.pydoc_tokens, args.steps, args.chain_steps = 16, 32, 2048, 4, 2
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", seed=args.seed)
    target = llm.model
    target.requires_grad_(False)  # the head trains alone; the shared embedding stays as it is
    layers = tuple(args.feature_layers)
    if args.data and os.path.exists(args.data):
        data = torch.load(args.data)
        hidden, width = llm.config.hidden_size, data["features"].shape[-1]
        if not layers and width > hidden:  # the last layer's output is always the last block
            data["features"] = data["features"][..., -hidden:]
        elif width != (len(layers) + 1) * hidden:  # the same text, other layers
            data["features"] = target_features(target, data["rows"], args.batch_size, layers)
            torch.save(data, args.data)
    else:
        data = training_text(args, llm)
        if args.data:
            torch.save(data, args.data)
    rows, features, head_ids = data["rows"], data["features"], data["head_ids"]
    scale = features[:, : 64].float().abs().median().item()  # a typical channel's size (not the outliers')

    if args.init:  # the saved head goes on learning, over its own head tokens
        head = grown_head(load_eagle(args.init, target), target, layers, args.head_layers)
    else:
        head = eagle_from_target(target, head_ids, layers, args.head_layers)
    g = torch.Generator().manual_seed(args.seed)

    class Batches:  # re-shuffled every pass
        def __iter__(self):
            order = torch.randperm(len(rows), generator=g)
            for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
                yield order[i: i + args.batch_size]

    trainable = [p for p in head.parameters() if p.requires_grad]
    head.train()
    losses = []
    # first every guess from the target's features, then chains of guesses (the training-time test)
    for steps, depth, lr in ((args.steps, 1, args.lr), (args.chain_steps, args.chain_depth, args.chain_lr)):
        if not steps:
            continue
        opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
        bar = tqdm(total=steps, desc=f"training the head, {depth} guess(es) per chain")
        losses += run_training(opt, Batches(), steps, 20,
                               lambda b: head_loss(head, rows[b], features[b], scale, args.noise, args.kl_weight, depth,
                                                   args.regression_weight),
                               on_step=lambda s, loss: (bar.update(1), bar.set_postfix(loss=f"{loss:.3f}")), clip=trainable)
        bar.close()
    head.eval()
    agreement = answer_agreement(head, target, data["evals"], args.eval_depth)
    bench_agreement = answer_agreement(head, target, data["bench_evals"], args.eval_depth)

    meta = {"target": "smollm2-135m", "seed": args.seed, "steps": args.steps, "chain_steps": args.chain_steps,
            "command": "python benchmarks/train_eagle.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    save_eagle(head, args.out, meta)
    print(f"rows {len(rows)} x {args.seq_len} tokens; loss {losses[0]:.3f} -> {sum(losses[-10:]) / min(10, len(losses)):.3f}"
          if losses else f"rows {len(rows)} x {args.seq_len} tokens; no training steps")
    shown = lambda rates: " ".join(f"{r:.3f}" for r in rates)
    print(f"agreement with the target's greedy answers, guess 1..{args.eval_depth} given the earlier ones right: "
          f"held-out prompts {shown(agreement)}; bench_speculative's chat questions {shown(bench_agreement)}")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s ({time.process_time():.0f} s of CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
