#!/usr/bin/env python3
"""Make the fixture cases that kLLM 0.1.0 itself seals, each with kLLM's own unlocked view.

    kllm_cases.py OUT_DIR PLAIN_BF16 PLAIN_F32

Writes, under OUT_DIR, in the layout of tests/fixtures (see its README.md):

  kllm_v2          PLAIN_BF16 sealed by `kllm seal --transform perm` (lock v2), cut into
                   two shards
  kllm_v1          PLAIN_F32 sealed the same way, then relocked to v1 with kLLM's own v1
                   lock (`kllm.keyed.lock._shift`, what kLLM wrote before v2; it still
                   reads it)
  bad_blob_flip    kllm_v2 with one ciphertext byte of trusted.kllm flipped
  bad_lock_version kllm_v2 with the lock flag "v9"
  bad_unsealed     kllm_v2 without the `kllm` section of config.json
  bad_wrong_key    kllm_v2 with the key of another model

The views come from kLLM alone: `unlock_dir` decodes every shard and drops the lock flag,
`secret_files` decrypts trusted.kllm. Shards are then laid out as the mount shows them:
kLLM's decoded tensors at the sealed file's data offsets, and the sealed header without
`kllm.lock`, padded with spaces to its length.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEAL_SHARDED = HERE.parent / "e2e.d" / "kllm_seal_sharded.py"
HIDDEN = ("trusted.kllm", "kllm.key")


def log(msg: str) -> None:
    print(f"fixtures: {msg}", file=sys.stderr)


def new_key(path: Path):
    from kllm.keyed import keys

    key = keys.generate()
    keys.save_open(key, path)
    return key


def seal(plain: Path, out: Path, keyfile: Path, shard_bytes: int) -> None:
    """kLLM's command line (`kllm seal`), with its shard size lowered."""
    subprocess.run([sys.executable, str(SEAL_SHARDED), str(shard_bytes), "--", str(plain),
                    "-o", str(out), "--key", str(keyfile), "--transform", "perm"],
                   check=True, stdout=subprocess.DEVNULL)


def relock_v1(sealed: Path, key) -> None:
    """Relock a v2 directory with kLLM's own v1 lock, shard by shard."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kllm.keyed import lock

    for rel in lock.shards(sealed):
        entries = lock.file_domains(sealed / rel) or {}
        tensors, domains = {}, {}
        with safe_open(sealed / rel, framework="pt") as f:
            meta = dict(f.metadata() or {"format": "pt"})
            for name in f.keys():
                t = f.get_tensor(name)
                tid = lock.tensor_id(rel, name)
                if name in entries:
                    t = lock.unlock_tensor(t, key, tid, entries[name]).cpu()
                if t.dtype in lock.FORMATS and t.numel():
                    m = lock.domain(t)
                    t, domains[name] = lock._shift(t, key, tid, m, 1), m
                tensors[name] = t
        meta[lock.META_KEY] = json.dumps(domains)
        save_file(tensors, sealed / rel, metadata=meta)
    lock._write_flag(sealed, "v1")


def read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def view_shard(sealed: Path, unlocked: Path) -> bytes:
    """The shard as the mount shows it, from kLLM's unlocked copy of it."""
    import torch
    from safetensors.torch import load_file

    n, header = read_header(sealed)
    meta = header.get("__metadata__")
    if meta is not None:
        meta.pop("kllm.lock", None)
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > n:
        raise ValueError(f"{sealed}: header grew without kllm.lock")
    data = bytearray(sealed.read_bytes()[8 + n:])
    tensors = load_file(unlocked)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        t = tensors[name].contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        if len(raw) != e - b:
            raise ValueError(f"{sealed}:{name}: kLLM gave {len(raw)} bytes, header says {e - b}")
        data[b:e] = raw
    return struct.pack("<Q", n) + text + b" " * (n - len(text)) + bytes(data)


def write_view(sealed: Path, view: Path, key) -> None:
    from kllm.keyed import lock
    from kllm.keyed.provider import secret_files

    with tempfile.TemporaryDirectory() as tmp:
        unlocked = Path(tmp) / "unlocked"
        lock.unlock_dir(sealed, unlocked, key, log=lambda *_: None)
        for p in sorted(unlocked.rglob("*")):
            rel = p.relative_to(unlocked)
            if not p.is_file() or rel.as_posix() in HIDDEN:
                continue
            out = view / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            if lock.is_lockable_file(rel) and lock.file_domains(sealed / rel) is not None:
                out.write_bytes(view_shard(sealed / rel, p))
            else:
                out.write_bytes(p.read_bytes())
    for name, data in secret_files(str(sealed), key).items():
        (view / name).parent.mkdir(parents=True, exist_ok=True)
        (view / name).write_bytes(data)


def finish_case(case: Path, keyfile: Path, key, expect: dict) -> None:
    shutil.copyfile(keyfile, case / "kllm.key")
    (case / "key.hex").write_text(key.secret.hex() + "\n")
    (case / "expect.json").write_text(json.dumps(expect, indent=2) + "\n")


def good_case(out: Path, name: str, plain: Path, shard_bytes: int, v1: bool, work: Path):
    case = out / name
    case.mkdir(parents=True)
    keyfile = work / f"{name}.key"
    key = new_key(keyfile)
    seal(plain, case / "sealed", keyfile, shard_bytes)
    if v1:
        relock_v1(case / "sealed", key)
    write_view(case / "sealed", case / "view", key)
    finish_case(case, keyfile, key, {"ok": True})
    log(f"{name}: sealed by kLLM, view by kLLM's unlock")
    return case, keyfile, key


def bad_case(out: Path, name: str, base: Path, keyfile: Path, key, words, change) -> None:
    case = out / name
    shutil.copytree(base / "sealed", case / "sealed")
    keyfile, key = change(case / "sealed", keyfile, key)
    finish_case(case, keyfile, key, {"ok": False, "error_contains": words})
    log(f"{name}: made from kllm_v2, must be refused")


def edit_config(sealed: Path, fn) -> None:
    cfg = json.loads((sealed / "config.json").read_text())
    fn(cfg)
    (sealed / "config.json").write_text(json.dumps(cfg, indent=2))


def main() -> int:
    out, plain_bf16, plain_f32 = (Path(a) for a in sys.argv[1:4])
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # about half the bf16 model per shard: two shards and an index
        base, keyfile, key = good_case(out, "kllm_v2", plain_bf16, 40_000, False, work)
        good_case(out, "kllm_v1", plain_f32, 1 << 30, True, work)

        def flip(sealed, kf, k):
            blob = bytearray((sealed / "trusted.kllm").read_bytes())
            blob[-20] ^= 0x01  # inside the last chunk's ciphertext
            (sealed / "trusted.kllm").write_bytes(bytes(blob))
            return kf, k

        def version(sealed, kf, k):
            edit_config(sealed, lambda c: c["kllm"].__setitem__("lock", "v9"))
            return kf, k

        def unsealed(sealed, kf, k):
            edit_config(sealed, lambda c: c.pop("kllm"))
            return kf, k

        def wrong_key(sealed, kf, k):
            other = work / "other.key"
            return other, new_key(other)

        bad_case(out, "bad_blob_flip", base, keyfile, key, ["trusted.kllm"], flip)
        bad_case(out, "bad_lock_version", base, keyfile, key, ["v9"], version)
        bad_case(out, "bad_unsealed", base, keyfile, key,
                 [["not sealed", "not a sealed", "no seal", "unsealed", "isn't sealed",
                   "no kllm"]], unsealed)
        bad_case(out, "bad_wrong_key", base, keyfile, key, ["fingerprint"], wrong_key)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
