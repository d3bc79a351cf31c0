#!/usr/bin/env python3
"""The driver of scripts/bench-gpu: how long a sealed checkpoint's weights take to reach the
device by each route, and whether they arrive equal to the plain ones.

    bench_gpu.py run --work DIR [--gib 8] [--shard-gib 2] [--device cuda|cpu] [--out FILE]

Setup (cached in DIR/model-<size>, reused while the size and this file are unchanged):
  1. a Qwen3-shaped BF16 checkpoint with random weights (`make`);
  2. sealed by kLLM 0.1.0 with `--transform perm` and shards of --shard-gib, first without
     the lock: that directory is the *plain* checkpoint, the bytes every route must deliver;
  3. a copy of it locked with lock v2 by kLLM's own `lock_dir`, which is what `kllm seal`
     does after sealing: the *sealed* checkpoint.

Routes: plain files; kllm-mount --mode passthrough; kllm-mount --mode fuse; kLLM's lock hook
(the environment `kllm serve` gives an engine: `safetensors.safe_open` wrapped, each locked
tensor unlocked on the device as it is read); kLLM's unlock-to-disk copy (`lock.cached`,
what `kllm unlock` writes) then a plain load. Loads: `safe_open` + `get_tensor` of every
tensor onto the device; transformers `from_pretrained(device_map=device)`; 4 processes, each
`get_slice(name)[rows]` of its quarter of every tensor's rows onto the device (cuda:rank
modulo the device count). Before every cell the page cache is dropped and a mount is made
afresh. Every tensor (or slice) that reaches the device is hashed (SHA-256 of its bytes)
after the clock stops and compared with the plain checkpoint read by `safe_open`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
MOUNT_BIN = TARGET / "release" / "kllm-mount"
GiB = 1 << 30
MODEL_VERSION = 1  # bump when make() or prepare() changes what they write
WORLD = 4  # processes slicing rows, as a 4-way tensor-parallel engine does

ROUTES = ["plain", "mount-passthrough", "mount-fuse", "kllm-hook", "kllm-unlock-to-disk"]
# Not run unless named: the sealed files read as they are, without the key. Its cells must
# come out different, which shows the equality check can fail.
CONTROL = "sealed-as-is"
LOADS = ["safe_open", "from_pretrained", "slices-x4"]

# Real Qwen3 layouts (hidden, intermediate, heads, kv heads), smallest first. The checkpoint
# takes the widest one whose untied embeddings leave room for at least 16 layers, and as many
# layers as the size asks for; below the smallest, the vocabulary shrinks instead.
LAYOUTS = [
    ("Qwen3-0.6B", 1024, 3072, 16, 8),
    ("Qwen3-1.7B", 2048, 6144, 16, 8),
    ("Qwen3-4B", 2560, 9728, 32, 8),
    ("Qwen3-8B", 4096, 12288, 32, 8),
    ("Qwen3-14B", 5120, 17408, 40, 8),
]
HEAD_DIM = 128
VOCAB = 151936
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ the checkpoint


def layer_params(hidden, inter, heads, kv):
    attn = hidden * heads * HEAD_DIM * 2 + hidden * kv * HEAD_DIM * 2
    return attn + 3 * hidden * inter + 2 * hidden + 2 * HEAD_DIM


def shape_for(total_bytes: int) -> dict:
    target = total_bytes // 2  # BF16
    chosen = None
    for name, hidden, inter, heads, kv in LAYOUTS:
        per = layer_params(hidden, inter, heads, kv)
        if 2 * VOCAB * hidden + 16 * per <= target or chosen is None:
            chosen = (name, hidden, inter, heads, kv, VOCAB)
    name, hidden, inter, heads, kv, vocab = chosen
    per = layer_params(hidden, inter, heads, kv)
    if 2 * vocab * hidden + 4 * per > target:  # smaller than the smallest layout
        vocab = max(1024, (target // 4) // (2 * hidden) // 128 * 128)
    layers = max(1, -(-(target - 2 * vocab * hidden - hidden) // per))
    return {
        "like": name, "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": HEAD_DIM,
        "num_hidden_layers": int(layers), "vocab_size": int(vocab),
    }


def tensor_shapes(s: dict):
    h, f, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (s["vocab_size"], h)
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "self_attn.q_norm.weight", (d,)
        yield p + "self_attn.k_norm.weight", (d,)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (f, h)
        yield p + "mlp.up_proj.weight", (f, h)
        yield p + "mlp.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (s["vocab_size"], h)


def make(out: Path, total_bytes: int, shard_bytes: int, seed: int = 0) -> dict:
    """A Qwen3ForCausalLM checkpoint with random BF16 weights (norm gains near 1, the rest
    ~N(0, 0.02)) and a tokenizer.json whose vocabulary fills the embedding, as the sealer
    needs one to permute."""
    import torch
    from safetensors.torch import save_file

    s = shape_for(total_bytes)
    out.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shard, size, files, weight_map = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, out / name, metadata={"format": "pt"})
            files.append(name)
            weight_map.update({n: name for n in shard})
            shard, size = {}, 0

    for name, shape in tensor_shapes(s):
        if len(shape) == 1:
            t = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen).mul_(0.02)
        shard[name] = t.to(torch.bfloat16)
        size += shard[name].numel() * 2
        if size >= shard_bytes:
            flush()
    flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum((out / f).stat().st_size for f in files)},
         "weight_map": weight_map}, indent=2))
    regular = s["vocab_size"] - 8  # Qwen's special tokens sit after the regular vocabulary
    cfg = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_attention_heads": s["num_attention_heads"],
        "num_key_value_heads": s["num_key_value_heads"], "head_dim": s["head_dim"],
        "vocab_size": s["vocab_size"], "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": regular, "eos_token_id": regular, "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": regular + i, "content": c, "single_word": False,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "special": True} for i, c in enumerate(SPECIAL)],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {f"t{i}": i for i in range(regular)}, "merges": []},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return s


def prepare(work: Path, gib: float, shard_gib: float) -> dict:
    """The plain and the sealed checkpoint and the key, made once per size."""
    from kllm.keyed import keys, lock
    from kllm.keyed.schemes import seal as kllm_seal
    from kllm.trust import load_provider

    total, shard = int(gib * GiB), int(shard_gib * GiB)
    base = work / f"model-v{MODEL_VERSION}-{total}-{shard}"
    done = base / "ready.json"
    if done.is_file():
        log(f"checkpoint cached in {base}")
        return json.loads(done.read_text())
    for old in work.glob("model-*"):  # one size at a time: they are large
        shutil.rmtree(old)
    base.mkdir(parents=True)
    t = time.monotonic()
    shape = make(base / "orig", total, shard)
    log(f"made {base / 'orig'} ({shape['like']} widths, {shape['num_hidden_layers']} layers, "
        f"vocab {shape['vocab_size']}) in {time.monotonic() - t:.1f} s")
    key = keys.generate()
    keys.save_open(key, base / "model.key")
    # kLLM cuts shards at 4 GiB; the same sealer with its limit set to --shard-gib.
    kllm_seal._SHARD_BYTES = shard
    t = time.monotonic()
    load_provider().seal(base / "orig", base / "plain", key, transform="perm", lock=False)
    log(f"sealed (perm, not locked) into {base / 'plain'} in {time.monotonic() - t:.1f} s")
    shutil.copytree(base / "plain", base / "sealed")
    t = time.monotonic()
    lock.lock_dir(base / "sealed", key, log=lambda *_: None)
    log(f"locked (v2) {base / 'sealed'} in {time.monotonic() - t:.1f} s")
    shutil.rmtree(base / "orig")
    info = {
        "base": str(base), "plain": str(base / "plain"), "sealed": str(base / "sealed"),
        "key": str(base / "model.key"), "shape": shape,
        "bytes": sum(p.stat().st_size for p in (base / "plain").glob("*.safetensors")),
        "shards": len(list((base / "plain").glob("*.safetensors"))),
    }
    done.write_text(json.dumps(info, indent=2))
    return info


# ------------------------------------------------------------------ loads (child processes)


def sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def digest(tensors: dict) -> dict:
    """SHA-256 of each tensor's bytes, copied back to the CPU (after the clock stops)."""
    import torch

    def one(item):
        name, t = item
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        return name, hashlib.sha256(raw).hexdigest()

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(pool.map(one, tensors.items()))


def shard_files(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


def rows_of(n: int, rank: int) -> slice:
    per = -(-n // WORLD)
    return slice(min(n, rank * per), min(n, (rank + 1) * per))


def has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def wait_for_go():
    """Imports and start-up are done: say so, and start the clock when the parent says."""
    print("ready", flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        raise SystemExit(f"expected 'go', got {line!r}")


def load(args) -> None:
    import torch  # imported before the clock starts

    model, device = Path(args.model), args.device
    if args.kind == "from_pretrained":
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM
    from safetensors import safe_open

    if device.startswith("cuda:"):  # as each worker of a tensor-parallel engine does
        torch.cuda.set_device(device)
    wait_for_go()
    t0 = time.monotonic()
    got = {}
    if args.kind == "safe_open":
        for path in shard_files(model):
            with safe_open(str(path), framework="pt", device=device) as f:
                for name in f.keys():
                    got[name] = f.get_tensor(name)
    elif args.kind == "from_pretrained":
        if has_accelerate():
            m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16,
                                                     device_map=device)
        else:  # transformers needs accelerate for device_map: load, then move
            m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16)
            m.to(device)
        got = dict(m.state_dict())
    elif args.kind == "slice":
        for path in shard_files(model):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    part = f.get_slice(name)
                    rows = rows_of(part.get_shape()[0], args.rank)
                    got[name] = part[rows].to(device, non_blocking=True)
    sync(device)
    t1 = time.monotonic()
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    result = {"start": t0, "end": t1, "seconds": t1 - t0, "bytes": nbytes,
              "devices": sorted({str(t.device) for t in got.values()})}
    result["sha256"] = digest(got)
    if args.reference_slices:  # the plain safe_open run also hashes every rank's rows
        result["slices"] = {
            str(r): digest({n: t[rows_of(t.shape[0], r)] for n, t in got.items()})
            for r in range(WORLD)}
    Path(args.result).write_text(json.dumps(result))


def unlock(args) -> None:
    """kLLM's unlock-to-disk copy, as `kllm unlock` makes it (into KLLM_UNLOCKED_DIR)."""
    from kllm.keyed import keys, lock

    key = keys.load(Path(args.key), "")
    wait_for_go()
    t0 = time.monotonic()
    out = lock.cached(args.model, key, log=lambda *_: None)
    os.sync()  # the copy is on disk, as a later load from it would find it
    t1 = time.monotonic()
    Path(args.result).write_text(json.dumps({"seconds": t1 - t0, "dir": str(out)}))


# ------------------------------------------------------------------ the parent


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Mount:
    def __init__(self, sealed: str, key: str, mnt: Path, mode: str):
        self.mnt = mnt
        mnt.mkdir(parents=True, exist_ok=True)
        t = time.monotonic()
        subprocess.run([str(MOUNT_BIN), sealed, str(mnt), "--key", key, "--mode", mode],
                       check=True, timeout=300)
        self.seconds = time.monotonic() - t

    def close(self):
        for _ in range(50):
            r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True)
            if r.returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["fusermount3", "-uz", str(self.mnt)])
        # The daemon wipes its memory before exiting; wait so the next cell starts clean.
        for _ in range(100):
            if subprocess.run(["pgrep", "-f", f"kllm-mount .* {self.mnt} "],
                              capture_output=True).returncode != 0:
                break
            time.sleep(0.1)


def children(argv_list, envs, result_paths):
    """Start the processes, let them import, start them together, return their results and
    the wall time from the common start to the last one done."""
    procs = [subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for argv, env in zip(argv_list, envs)]
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"child did not start: {line!r}")
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            if p.wait(timeout=3600) != 0:
                raise RuntimeError(f"child exited {p.returncode}: {' '.join(p.args)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads(Path(r).read_text()) for r in result_paths]
    end = max(r.get("end", t0 + r["seconds"]) for r in results)
    return results, end - t0


def run_load(kind, model, device, env, tmp: Path, reference_slices=False):
    me = [sys.executable, str(Path(__file__).resolve())]
    if kind == "slices-x4":
        import torch

        count = torch.cuda.device_count() if device.startswith("cuda") else 0
        argvs, paths = [], []
        for r in range(WORLD):
            dev = f"cuda:{r % count}" if count else device
            paths.append(str(tmp / f"slice-{r}.json"))
            argvs.append(me + ["load", "slice", model, "--device", dev, "--rank", str(r),
                               "--result", paths[-1]])
        results, wall = children(argvs, [env] * WORLD, paths)
        return {"seconds": wall, "bytes": sum(r["bytes"] for r in results),
                "slices": {str(r): res["sha256"] for r, res in enumerate(results)},
                "devices": sorted({d for r in results for d in r["devices"]})}
    path = str(tmp / "load.json")
    argv = me + ["load", kind, model, "--device", device, "--result", path]
    if reference_slices:
        argv.append("--reference-slices")
    (res,), wall = children([argv], [env], [path])
    res["wall"] = wall
    return res


def compare(got: dict, want: dict) -> str | None:
    """None when equal, else what differs."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    wrong = sorted(n for n in set(got) & set(want) if got[n] != want[n])
    if not (missing or extra or wrong):
        return None
    parts = []
    for label, names in (("missing", missing), ("unexpected", extra), ("different", wrong)):
        if names:
            parts.append(f"{len(names)} {label} ({', '.join(names[:3])})")
    return "; ".join(parts)


def orchestrate(args) -> int:
    import signal

    import torch

    # A stop runs the `finally` blocks: children killed, the current mount unmounted.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.work).resolve()
    info = prepare(work / "state", args.gib, args.shard_gib)
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    routes = args.routes.split(",") if args.routes else ROUTES
    unknown = set(routes) - set(ROUTES) - {CONTROL}
    if unknown:
        raise SystemExit(f"unknown route(s): {', '.join(sorted(unknown))}")
    loads = args.loads.split(",") if args.loads else LOADS
    if set(loads) - set(LOADS):
        raise SystemExit(f"unknown load(s): {', '.join(sorted(set(loads) - set(LOADS)))}")
    base_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                    TRANSFORMERS_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    for var in ("KLLM_LOCK_HOOK", "KLLM_MODEL_KEY", "KLLM_MODEL_DIR"):
        base_env.pop(var, None)

    from kllm.keyed import keys, lock_load

    key = keys.load(Path(info["key"]), "")
    hook_env = dict(base_env, **lock_load.hook_env(info["sealed"], key))

    log(f"device {device}; {info['bytes'] / GiB:.2f} GiB in {info['shards']} shards "
        f"({info['shape']['like']} widths, {info['shape']['num_hidden_layers']} layers)")
    dropped = drop_caches()
    ref = run_load("safe_open", info["plain"], device, base_env, run_dir, reference_slices=True)
    want = {"safe_open": ref["sha256"], "from_pretrained": ref["sha256"],
            "slices-x4": ref["slices"]}
    rows, failures = [], 0
    for route in routes:
        for kind in loads:
            dropped = drop_caches() and dropped
            tmp = run_dir / f"{route}-{kind}"
            tmp.mkdir()
            setup, mount, env, model = 0.0, None, base_env, info["plain"]
            try:
                if route.startswith("mount-"):
                    mount = Mount(info["sealed"], info["key"], tmp / "mnt",
                                  route.removeprefix("mount-"))
                    setup, model = mount.seconds, str(mount.mnt)
                elif route == CONTROL:
                    model = info["sealed"]
                elif route == "kllm-hook":
                    env, model = hook_env, info["sealed"]
                elif route == "kllm-unlock-to-disk":
                    res_path = str(tmp / "unlock.json")
                    uenv = dict(base_env, KLLM_UNLOCKED_DIR=str(tmp / "unlocked"))
                    (u,), _ = children([[sys.executable, str(Path(__file__).resolve()),
                                         "unlock", info["sealed"], "--key", info["key"],
                                         "--result", res_path]], [uenv], [res_path])
                    setup, model = u["seconds"], u["dir"]
                    drop_caches()
                res = run_load(kind, model, device, env, tmp)
            finally:
                if mount:
                    mount.close()
                shutil.rmtree(tmp / "unlocked", ignore_errors=True)
            if kind == "slices-x4":
                diffs = [compare(res["slices"].get(r, {}), want[kind][r]) for r in want[kind]]
                diff = "; ".join(f"rank {r}: {d}" for r, d in zip(want[kind], diffs) if d) or None
            else:
                diff = compare(res["sha256"], want[kind])
            failures += bool(diff)
            load_s = res["seconds"]
            total = setup + load_s
            row = {"route": route, "load": kind, "setup_s": setup, "load_s": load_s,
                   "total_s": total, "gb_s": info["bytes"] / total / 1e9,
                   "equal": diff is None, "diff": diff, "devices": res.get("devices")}
            rows.append(row)
            log(f"{route:22} {kind:16} setup {setup:7.2f} s  load {load_s:7.2f} s  "
                f"{row['gb_s']:6.2f} GB/s  {'equal' if diff is None else 'DIFFERENT: ' + diff}")
    report = render(info, device, rows, dropped, args)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    out.with_suffix(".json").write_text(json.dumps({"info": info, "device": device,
                                                    "rows": rows}, indent=2))
    log(f"report written to {out}")
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    if failures:
        log(f"{failures} cell(s) delivered tensors different from the plain checkpoint")
        return 1
    return 0


def render(info, device, rows, dropped, args) -> str:
    import platform

    import torch

    dev = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() \
        or platform.machine()
    s = info["shape"]
    lines = [
        f"Device: {device} ({dev}), {os.cpu_count()} CPUs. Checkpoint: "
        f"{info['bytes'] / GiB:.2f} GiB BF16 in {info['shards']} shards, "
        f"{s['like']} widths (hidden {s['hidden_size']}, intermediate "
        f"{s['intermediate_size']}, {s['num_attention_heads']}/{s['num_key_value_heads']} "
        f"heads), {s['num_hidden_layers']} layers, vocabulary {s['vocab_size']}; sealed "
        f"`--transform perm`, lock v2. Page cache "
        f"{'dropped before every cell' if dropped else 'NOT dropped (not root)'}.",
        "",
        "| route | load | setup s | load s | total s | GB/s | equal to plain |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['route']} | {r['load']} | {r['setup_s']:.2f} | {r['load_s']:.2f} "
                     f"| {r['total_s']:.2f} | {r['gb_s']:.2f} | "
                     f"{'yes' if r['equal'] else 'NO: ' + r['diff']} |")
    fp = ("`from_pretrained(device_map=device)`" if has_accelerate() else
          "`from_pretrained()` then `.to(device)` (no accelerate in this venv)")
    lines += ["", "setup: mounting (mount routes) or kLLM's unlock-to-disk copy, synced to "
              "disk (then the page cache is dropped again). load: from the first open to "
              f"the last tensor on the device; from_pretrained is {fp}; slices-x4 is the "
              "wall time of 4 processes started together. GB/s: checkpoint bytes / total. "
              "equal: SHA-256 of every tensor (slice) on the device against the plain "
              "checkpoint read by safe_open."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="prepare the checkpoints and time every route")
    r.add_argument("--work", required=True, help="state and scratch directory")
    r.add_argument("--gib", type=float, default=8.0, help="checkpoint size (GiB)")
    r.add_argument("--shard-gib", type=float, default=2.0, help="shard size (GiB)")
    r.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    r.add_argument("--routes", default=None,
                   help=f"comma-separated subset of {ROUTES}, or {CONTROL!r} (the sealed files "
                   "without the key: a control that must come out different)")
    r.add_argument("--loads", default=None, help=f"comma-separated subset of {LOADS}")
    r.add_argument("--out", default=str(TARGET / "bench-gpu" / "results.md"))
    r.add_argument("--keep", action="store_true", help="keep the run's scratch files")
    m = sub.add_parser("make", help="only write the random Qwen3-shaped checkpoint")
    m.add_argument("out")
    m.add_argument("--gib", type=float, default=8.0)
    m.add_argument("--shard-gib", type=float, default=2.0)
    ld = sub.add_parser("load", help="(internal) one load, in a process of its own")
    ld.add_argument("kind", choices=["safe_open", "from_pretrained", "slice"])
    ld.add_argument("model")
    ld.add_argument("--device", required=True)
    ld.add_argument("--rank", type=int, default=0)
    ld.add_argument("--result", required=True)
    ld.add_argument("--reference-slices", action="store_true")
    u = sub.add_parser("unlock", help="(internal) kLLM's unlock-to-disk copy")
    u.add_argument("model")
    u.add_argument("--key", required=True)
    u.add_argument("--result", required=True)
    args = p.parse_args(argv)
    if args.cmd == "run":
        return orchestrate(args)
    if args.cmd == "make":
        s = make(Path(args.out), int(args.gib * GiB), int(args.shard_gib * GiB))
        print(json.dumps(s, indent=2))
        return 0
    if args.cmd == "load":
        load(args)
        return 0
    unlock(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
