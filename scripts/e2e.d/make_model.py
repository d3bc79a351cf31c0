#!/usr/bin/env python3
"""Make a tiny Qwen3 checkpoint from scratch, with no hub access.

    make_model.py OUT_DIR [--dtype float32|bfloat16] [--steps N]

- A byte-level BPE tokenizer (the pre-tokenizer and decoder of Qwen2/Qwen3) trained on the
  built-in text below, with the special tokens <|endoftext|>, <|im_start|>, <|im_end|>
  added after the regular vocabulary, as in Qwen's tokenizers. Written as tokenizer.json
  plus vocab.json and merges.txt, and a tokenizer_config.json naming Qwen2Tokenizer.
- A Qwen3ForCausalLM (hidden size 256, 4 heads of 64, 2 KV heads, 4 layers) with untied
  embeddings, trained for a few steps on the same text so that greedy generation
  continues a prompt with a memorized sentence: a wrong byte in the weights shows up as
  different text. Its vocabulary is then padded to 32768 rows (unused, as in real
  checkpoints), which makes the float32 shard about 75 MiB: several 16 MiB blocks.

Everything is seeded: the same versions make the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

TEXT = """\
The quick brown fox jumps over the lazy dog while the farmer sleeps under the old oak tree.
A sealed model keeps its tensor names, shapes and data types, so the stock engine serves it.
The mount shows the unlocked view: every tensor decoded, the tokenizer and the config restored.
Rust is a systems programming language that runs fast and prevents memory errors.
Seven silver swans swam slowly south across the silent lake at sunrise.
Every morning the baker opens the shop at six and sells fresh bread to the whole village.
The library on the hill holds ten thousand books, a globe, and a cat named Pascal.
Tensor parallel engines load the same shards from four processes at once.
When the rain stops, the children run outside to look for snails and rainbows.
The lighthouse keeper counts the ships that pass the rocks each night and writes them down.
Greedy decoding picks the most likely token at every step, so the same model gives the same text.
Mountains of the north are covered with snow from October until the end of April.
"""

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2/Qwen3's pre-tokenizer pattern.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer(out: Path, vocab_size: int = 640):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(TEXT.splitlines(keepends=True) * 4, trainer=trainer)
    # Specials after the regular vocabulary (Qwen's layout): ids regular, regular+1, ...
    tok.add_special_tokens(SPECIALS)
    tok.save(str(out / "tokenizer.json"))

    doc = json.loads((out / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    merges = doc["model"]["merges"]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")
    ids = {t["content"]: t["id"] for t in doc["added_tokens"]}
    added = {
        str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True}
        for s in SPECIALS
    }
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    return tok, len(vocab), ids


def pad_vocab(model, cfg, size: int, tok):
    """The trained model with `size` vocabulary rows. The new embedding rows are random
    and never looked up; the new LM head rows are zero. Greedy text must not change."""
    import copy

    import torch
    from transformers import Qwen3ForCausalLM

    big_cfg = copy.deepcopy(cfg)
    big_cfg.vocab_size = size
    big = Qwen3ForCausalLM(big_cfg).float().eval()
    state = model.state_dict()
    n = cfg.vocab_size
    emb = big.model.embed_tokens.weight.detach().clone()
    emb[:n] = state["model.embed_tokens.weight"]
    head = torch.zeros_like(big.lm_head.weight)
    head[:n] = state["lm_head.weight"]
    state["model.embed_tokens.weight"], state["lm_head.weight"] = emb, head
    big.load_state_dict(state)
    for prompt in ("The quick brown", "Seven silver", "The library on", "Every morning the"):
        x = torch.tensor([tok.encode(prompt).ids])
        with torch.no_grad():
            a = model.generate(x, max_new_tokens=24, do_sample=False)
            b = big.generate(x, max_new_tokens=24, do_sample=False)
        if not torch.equal(a, b):
            raise SystemExit(f"padding the vocabulary changed the greedy text of {prompt!r}")
    return big


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--steps", type=int, default=80, help="training steps (0: random weights)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=32768,
                    help="rows of the embedding and LM head after training; the rows past "
                    "the tokenizer's are unused, as in real checkpoints, and make the shards "
                    "big enough for several 16 MiB blocks (0: leave as trained)")
    ap.add_argument("--from", dest="src", default=None,
                    help="reuse the weights and tokenizer of an existing checkpoint, only "
                    "changing the dtype")
    args = ap.parse_args()

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dtype = getattr(torch, args.dtype)

    if args.src:
        import shutil

        src = Path(args.src)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy2(f, out / f.name)
        model = Qwen3ForCausalLM.from_pretrained(src, dtype=torch.float32)
        model.to(dtype).save_pretrained(out, safe_serialization=True)
        print(f"wrote {out} ({args.dtype}, from {src})")
        return 0

    tok, regular, ids = make_tokenizer(out)
    cfg = Qwen3Config(
        vocab_size=regular + len(SPECIALS) + 13,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        initializer_range=0.05,
    )
    model = Qwen3ForCausalLM(cfg).float()

    if args.steps:
        stream = []
        for line in TEXT.splitlines():
            stream += tok.encode(line + "\n").ids
        data = torch.tensor(stream)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        window, batch = 48, 8
        t0 = time.time()
        model.train()
        for step in range(args.steps):
            starts = torch.randint(0, len(data) - window - 1, (batch,))
            x = torch.stack([data[s:s + window] for s in starts])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % 20 == 0 or step == args.steps - 1:
                print(f"  step {step:4d} loss {loss.item():.3f} ({time.time() - t0:.0f} s)",
                      file=sys.stderr)
        model.eval()

    if args.vocab_size:
        model = pad_vocab(model, cfg, args.vocab_size, tok)

    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = ids["<|endoftext|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    print(f"wrote {out} ({args.dtype}, vocab {model.config.vocab_size}, {regular} regular "
          "tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
