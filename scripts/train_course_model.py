"""Train the course model: a tiny Llama with GQA that writes simple English stories.

Usage::

    python scripts/train_course_model.py                 # writes minipaged/data/course_model/
    python scripts/train_course_model.py --out /tmp/cm --steps 50   # a quick smoke run

Three stages, all seeded (``--seed``), all on CPU:

1. **Corpus.** A small grammar writes children's stories: a character with a name and a
   pronoun, a place, an object, something that goes wrong, a friend who helps, an ending.
   Pronouns agree with names and articles with nouns, so continuations read as English.
2. **Tokenizer.** A byte-level BPE (``tokenizers``) with a small vocabulary and three special
   tokens ``<|bos|>``, ``<|eos|>``, ``<|pad|>``. Encoding prepends ``<|bos|>`` (as Llama's
   tokenizer does), so ``tokenizer("Once upon a time")`` looks like the start of a story.
3. **Model.** ``transformers.LlamaForCausalLM`` (RMSNorm, RoPE, SwiGLU, grouped-query
   attention: 8 query heads share 2 KV heads), tied embeddings, trained with AdamW on packed
   sequences of stories, with a tqdm progress bar.

Output (``save_pretrained``): config.json, generation_config.json, model.safetensors (fp32),
tokenizer.json, tokenizer_config.json (+ special_tokens_map.json). It loads offline with
``AutoModelForCausalLM.from_pretrained(path)`` / ``AutoTokenizer.from_pretrained(path)``.

Invariants: the checkpoint is at most 20 MB; the default run (700 steps of 16 x 128 tokens,
one torch thread so that the result does not depend on the core count) takes about 7
minutes on one free CPU core; ``--threads 0`` uses every core. Failure mode: if the budget is cut too far (``--steps``), greedy
continuations loop or drift into word salad; the script prints samples at the end so a
human can see it.

vLLM has no counterpart (it serves checkpoints, it does not train them); the model is the
one ``minipaged.model.llama`` runs and the one ``LLM()`` loads when no model is given.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "minipaged" / "data" / "course_model"

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

# ---------------------------------------------------------------------------------------
# 1. The story grammar
# ---------------------------------------------------------------------------------------

GIRLS = ["Lily", "Mia", "Sara", "Emma", "Anna", "Lucy", "Zoe", "Amy", "Ella", "Rosa"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Hugo"]
ANIMALS = [  # (kind, name, pronoun)
    ("cat", "Mittens", "she"),
    ("dog", "Rex", "he"),
    ("rabbit", "Hops", "he"),
    ("bird", "Pip", "she"),
    ("fox", "Rusty", "he"),
    ("bear", "Bruno", "he"),
    ("duck", "Daisy", "she"),
    ("mouse", "Squeak", "she"),
    ("frog", "Fred", "he"),
]
PLACES = [  # (where they live, where things happen)
    ("a small house near the forest", "the forest"),
    ("a little town by the sea", "the beach"),
    ("a big farm with many animals", "the barn"),
    ("a tall house on a hill", "the garden"),
    ("a quiet village in the mountains", "the meadow"),
    ("a busy city with many lights", "the park"),
    ("a cozy cottage by a river", "the river"),
]
OBJECTS = [  # (adjective, noun)
    ("red", "ball"),
    ("shiny", "key"),
    ("blue", "kite"),
    ("little", "boat"),
    ("old", "book"),
    ("yellow", "hat"),
    ("soft", "blanket"),
    ("green", "box"),
    ("big", "drum"),
    ("pretty", "shell"),
    ("golden", "ring"),
    ("purple", "flower"),
]
TRAITS = ["kind", "brave", "curious", "happy", "shy", "clever", "funny", "gentle"]
LIKES = [
    "to play outside",
    "to read books",
    "to sing songs",
    "to draw pictures",
    "to climb trees",
    "to look at the stars",
    "to help her mom",
    "to run fast",
    "to bake cookies",
    "to dance in the rain",
]
PROBLEMS = [  # what goes wrong with the object; {o} = the object noun
    "the wind blew the {o} away",
    "the {o} fell into a deep hole",
    "the {o} got stuck in a tree",
    "a big dog took the {o}",
    "the {o} rolled into the water",
    "the {o} was lost in the tall grass",
]
FIXES = [  # how the friend helps get the object back
    "used a long stick to reach the {o}",
    "climbed up and got the {o}",
    "ran very fast and found the {o}",
    "looked everywhere until they saw the {o}",
    "asked a tall man for help, and he gave them the {o}",
]
FEELINGS = ["sad", "scared", "worried", "upset"]
ENDINGS = [
    "They played together until the sun went down.",
    "From that day on, they were best friends.",
    "{N} learned that it is good to share with friends.",
    "{N} smiled and gave {F} a big hug.",
    "That night, {N} went to bed happy.",
]
OPENINGS = ["Once upon a time", "One day", "Long ago", "One sunny morning", "Once"]


def _person(rng: random.Random) -> tuple[str, str, str, str]:
    """(name, subject pronoun, object pronoun, possessive) for a girl or a boy."""
    if rng.random() < 0.5:
        return rng.choice(GIRLS), "she", "her", "her"
    return rng.choice(BOYS), "he", "him", "his"


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def make_story(rng: random.Random) -> str:
    """One story: setup, object, problem, friend helps, ending. Agreement is by construction."""
    name, he, him, his = _person(rng)
    if rng.random() < 0.35:
        kind, fname, fhe = rng.choice(ANIMALS)
        friend = f"{his} friend {fname} the {kind}"
    else:
        fname, fhe, _, _ = _person(rng)
        while fname == name:
            fname, fhe, _, _ = _person(rng)
        friend = f"{his} friend {fname}"
    home, spot = rng.choice(PLACES)
    adj, obj = rng.choice(OBJECTS)
    trait = rng.choice(TRAITS)
    like = rng.choice(LIKES).replace("her mom", f"{his} mom")
    opening = rng.choice(OPENINGS)
    art = "an" if trait[0] in "aeiou" else "a"
    kid = "girl" if he == "she" else "boy"

    s = []
    if opening in ("Once upon a time", "Long ago", "Once"):
        s.append(f"{opening}, there was {art} {trait} little {kid} named {name}.")
        s.append(f"{_cap(he)} lived in {home}.")
    else:
        s.append(f"{opening}, {art} {trait} little {kid} named {name} was at {spot}.")
    s.append(f"{name} loved {like}.")
    find = rng.choice(["found", "saw", "had"])
    a_obj = ("an " if adj[0] in "aeiou" else "a ") + f"{adj} {obj}"
    s.append(f"One day, {name} {find} {a_obj} in {spot}.")
    s.append(
        rng.choice(
            [
                f"{_cap(he)} was very happy.",
                f'"What a nice {obj}!" {he} said.',
                f"{_cap(he)} wanted to keep it forever.",
            ]
        )
    )
    s.append(f"But then, {rng.choice(PROBLEMS).format(o=obj)}.")
    s.append(f"{name} was {rng.choice(FEELINGS)}.")
    if rng.random() < 0.6:
        s.append(f'"Oh no! My {obj}!" {he} cried.')
    s.append(f"Then {friend} came to help.")
    s.append(f'"Do not worry, {name}. I will help you," {fhe} said.')
    s.append(f"{_cap(fhe)} {rng.choice(FIXES).format(o=obj)}.")
    s.append(f"{name} was so happy to have the {adj} {obj} back.")
    s.append(f'"Thank you, {fname}!" {he} said.')
    s.append(rng.choice(ENDINGS).format(N=name, F=fname))
    s.append("The end.")
    return " ".join(s)


def make_corpus(num_stories: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [make_story(rng) for _ in range(num_stories)]


# ---------------------------------------------------------------------------------------
# 2. The tokenizer
# ---------------------------------------------------------------------------------------


def train_tokenizer(stories: list[str], vocab_size: int):
    """A byte-level BPE wrapped as a transformers PreTrainedTokenizerFast (prepends <|bos|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


# ---------------------------------------------------------------------------------------
# 3. The model and its training loop
# ---------------------------------------------------------------------------------------


def make_config(tokenizer, args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,  # GQA: heads // kv_heads query heads per KV head
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def pack(stories, tokenizer, seq_len: int):
    """Concatenate <|bos|> story <|eos|> ... and cut into rows of seq_len tokens."""
    import torch

    ids: list[int] = []
    for enc in tokenizer(stories)["input_ids"]:  # each starts with <|bos|>
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)  # [N, S]


def train(model, data, args):
    import torch
    from tqdm.auto import tqdm

    g = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step):  # linear warmup, cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        p = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))

    model.train()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    ema = None
    for step in bar:
        rows = torch.randint(0, data.shape[0], (args.batch,), generator=g)
        batch = data[rows]  # [B, S]
        for pg in opt.param_groups:
            pg["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return ema


def samples(model, tokenizer, prompts, max_new_tokens=48):
    import torch

    out = []
    for p in prompts:
        enc = tokenizer(p, return_tensors="pt")
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        out.append(tokenizer.decode(gen[0], skip_special_tokens=True))
    return out


PROMPTS = ["Once upon a time", "One day, Tom found", "The dog", "Lily was sad because"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stories", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: bitwise reproducible; 0: torch default)"
    )
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()

    stories = make_corpus(args.stories, args.seed)
    tokenizer = train_tokenizer(stories, args.vocab)
    data = pack(stories, tokenizer, args.seq_len)
    print(f"corpus: {len(stories)} stories, {data.numel()} tokens, vocab {len(tokenizer)}")
    print(f"example: {stories[0]}")

    config = make_config(tokenizer, args)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters ({n_params * 4 / 2**20:.1f} MiB fp32)")

    t1 = time.perf_counter()
    loss = train(model, data, args)
    t2 = time.perf_counter()
    print(f"final loss (ema) {loss:.3f}; training {t2 - t1:.0f}s, total {t2 - t0:.0f}s")

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    # NOTE: name the class transformers 4.x knows too (5.x writes "TokenizersBackend").
    tc_path = args.out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("backend", None)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta.update(final_loss=round(loss, 4), num_parameters=n_params)
    meta["out"] = "minipaged/data/course_model" if args.out == DEFAULT_OUT else meta["out"]
    (args.out / "training_args.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved to {args.out} ({size / 2**20:.1f} MiB)")

    for text in samples(model, tokenizer, PROMPTS):
        print(f"  {text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
