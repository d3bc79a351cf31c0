#!/usr/bin/env python3
"""Write a tiny plain Qwen3 checkpoint (random weights, byte-level BPE vocabulary) for kLLM
to seal.

    make_tiny.py OUT_DIR --dtype bfloat16|float32 --seed N

It is not a useful model: the fixtures test decoding, not generation, so the weights are
seeded noise. Its tokenizer has the shape kLLM's sealer asks for: regular ids 0..255
contiguous, special tokens after them. About 36k parameters.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 2, 1, 16, 64, 2
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
REGULAR = 256
VOCAB = REGULAR + 16  # padded past the specials, as real checkpoints are


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: a printable character for every byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(out: Path) -> None:
    vocab = {t: i for i, t in enumerate(byte_tokens())}
    added = [{"id": REGULAR + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, s in enumerate(SPECIALS)]
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": SPECIALS[0],
        "pad_token": SPECIALS[0], "model_max_length": 512}, indent=2))


def write_weights(out: Path, dtype: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def w(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    def norm():
        return (1 + torch.randn(HIDDEN, generator=g) * 0.01).to(dt)

    t = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN),
         "model.norm.weight": norm()}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, HEADS * HEAD_DIM)
        t[p + "self_attn.q_norm.weight"] = (1 + torch.randn(HEAD_DIM, generator=g) * 0.01).to(dt)
        t[p + "self_attn.k_norm.weight"] = (1 + torch.randn(HEAD_DIM, generator=g) * 0.01).to(dt)
        t[p + "mlp.gate_proj.weight"] = w(FFN, HIDDEN)
        t[p + "mlp.up_proj.weight"] = w(FFN, HIDDEN)
        t[p + "mlp.down_proj.weight"] = w(HIDDEN, FFN)
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), required=True)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=False)
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "torch_dtype": a.dtype, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06, "max_position_embeddings": 512, "rope_theta": 10000.0,
        "bos_token_id": REGULAR, "eos_token_id": REGULAR}, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": REGULAR, "eos_token_id": REGULAR, "do_sample": False}, indent=2))
    (out / "README.md").write_text("tiny test model\n")
    write_tokenizer(out)
    write_weights(out, a.dtype, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
