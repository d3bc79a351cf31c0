#!/usr/bin/env python3
"""End-to-end checks of a kllm-mount mount against kLLM 0.1.0 itself.

Every check prints one line, `PASS <case>/<check>: ...` or `FAIL <case>/<check>: ...`,
and appends it to $E2E_RESULTS when that is set; the exit status is non-zero if any
check failed. The subcommands, in the order scripts/e2e runs them:

  reference SEALED REF           kLLM's own unlocked view of SEALED, written to REF:
                                 `kllm.keyed.lock.unlock_dir`, plus the secret files of
                                 trusted.kllm, minus trusted.kllm and kllm.key
  unlock SEALED OUT              `unlock_dir` alone (a sealed-but-unlocked directory,
                                 the input of `kllm-seal lock --lock v1`)
  v1-readback V1 V2REF           a directory locked with v1 by the project's sealer:
                                 kLLM's unlock_dir reads it back exactly, and its codes
                                 are the ones kLLM's own v1 lock writes
  generate-ref ORIG REF          kLLM's unlocked view generates the original's text
                                 (a check of the setup, not of the mount)
  view MNT SEALED REF            the mount's files: names, hidden files, config,
                                 secret files, headers, read-only
  loaders MNT SEALED REF         the engines' loading patterns, tensor by tensor
  transformers MNT ORIG          AutoTokenizer + AutoModelForCausalLM from the mount:
                                 greedy text equal to the original's
  mlx MNT ORIG                   mlx-lm from the mount: greedy text equal to the
                                 original's (mlx-lm on the original)
  sglang MNT REF                 SGLang's loader on the mount: safetensors_weights_iterator
                                 (default, disable_mmap, prefetch, both), get_config and
                                 get_tokenizer give what they give on kLLM's unlocked view

The key comes from --key FILE (KLLM_PASSPHRASE for a passphrase file) or --key-hex.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import random
import shutil
import struct
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PROMPTS = ("The quick brown", "Seven silver", "The library on", "Every morning the")
MAX_NEW_TOKENS = 24
HIDDEN = ("trusted.kllm", "kllm.key")
BLOCK = 16 << 20  # vLLM's prefetch block

FAILED = 0
CASE = "e2e"


def report(ok: bool, check: str, detail: str = "") -> bool:
    global FAILED
    line = f"{'PASS' if ok else 'FAIL'} {CASE}/{check}" + (f": {detail}" if detail else "")
    print(line, flush=True)
    if os.environ.get("E2E_RESULTS"):
        with open(os.environ["E2E_RESULTS"], "a") as f:
            f.write(line + "\n")
    if not ok:
        FAILED += 1
    return ok


def guarded(check: str):
    """Run a check; an exception is a FAIL with its message (and a traceback on stderr)."""
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.time()
            try:
                ok, detail = fn(*a, **kw)
            except Exception as exc:  # noqa: BLE001 - every error is a failed check
                traceback.print_exc()
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            return report(ok, check, f"{detail} ({time.time() - t0:.1f} s)")
        return run
    return wrap


# ---------------------------------------------------------------------------- key & files

def load_key(args):
    from kllm.keyed import keys

    if args.key_hex:
        return keys.ModelKey(bytes.fromhex(args.key_hex))
    return keys.load(Path(args.key), os.environ.get("KLLM_PASSPHRASE", ""))


def rel_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def shards(root: Path) -> list[str]:
    return [r for r in rel_files(root) if r.endswith(".safetensors")]


def read_header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def tensor_bytes(t) -> bytes:
    """The raw little-endian bytes of a tensor, whatever its dtype."""
    import torch

    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.view(-1).view(torch.uint8).numpy().tobytes()


def ref_tensors(ref: Path, rel: str) -> dict:
    from safetensors.torch import load_file

    return load_file(ref / rel)


def expected_data(sealed: Path, ref: Path, rel: str) -> tuple[int, bytes, list]:
    """The bytes the mount must show after the header of shard `rel`: the sealed file's
    data section with every tensor replaced by kLLM's unlocked one at the same offsets.
    Returns (data start, bytes, [(begin, end, name)] sorted)."""
    n, header = read_header(sealed / rel)
    data = bytearray((sealed / rel).read_bytes()[8 + n:])
    tensors = ref_tensors(ref, rel)
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = tensor_bytes(tensors[name])
        if len(raw) != e - b:
            raise ValueError(f"{rel}:{name}: reference has {len(raw)} bytes, header {e - b}")
        data[b:e] = raw
        spans.append((b, e, name))
    return 8 + n, bytes(data), sorted(spans)


def where(spans, start: int, off: int) -> str:
    """Name the tensor that holds file offset `off`."""
    d = off - start
    if d < 0:
        return "header"
    for b, e, name in spans:
        if b <= d < e:
            return f"tensor {name} (+{d - b} into it)"
    return "outside every tensor"


def first_diff(a: bytes, b: bytes) -> int | None:
    if a == b:
        return None
    n = min(len(a), len(b))
    step = 1 << 16
    for i in range(0, n, step):
        if a[i:i + step] != b[i:i + step]:
            for j in range(i, min(i + step, n)):
                if a[j] != b[j]:
                    return j
    return n


# ---------------------------------------------------------------------------- reference

def cmd_unlock(args) -> int:
    from kllm.keyed import lock

    key = load_key(args)
    lock.unlock_dir(Path(args.sealed), Path(args.out), key, log=lambda *_: None)
    return 0


def cmd_reference(args) -> int:
    from kllm.keyed import lock
    from kllm.keyed.provider import secret_files

    key = load_key(args)
    sealed, ref = Path(args.sealed), Path(args.ref)
    lock.unlock_dir(sealed, ref, key, log=lambda *_: None)
    for name, data in secret_files(str(sealed), key).items():
        (ref / name).parent.mkdir(parents=True, exist_ok=True)
        (ref / name).write_bytes(data)
    for name in HIDDEN:
        (ref / name).unlink(missing_ok=True)
    print(f"kLLM's unlocked view of {sealed}: {ref} ({len(rel_files(ref))} files)")
    return 0


def kllm_lock_v1(t, key, tid):
    """kLLM's own v1 lock of one tensor (its `_shift`, as kLLM before v2 wrote it)."""
    from kllm.keyed import lock

    m = lock.domain(t)
    return lock._shift(t, key, tid, m, 1), m


def cmd_lock_v1_python(args) -> int:
    """Lock a sealed-but-unlocked directory with v1 using kLLM's internals. Only for
    debugging when the project's sealer is not built (KLLM_E2E_V1_WITH=python)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kllm.keyed import lock

    key, d = load_key(args), Path(args.dir)
    for rel in lock.shards(d):
        out, doms = {}, {}
        with safe_open(d / rel, framework="pt") as f:
            meta = dict(f.metadata() or {"format": "pt"})
            for name in f.keys():
                t = f.get_tensor(name)
                if t.dtype in lock.FORMATS and t.numel():
                    t, doms[name] = kllm_lock_v1(t, key, lock.tensor_id(rel, name))
                out[name] = t
        meta[lock.META_KEY] = json.dumps(doms)
        save_file(out, d / rel, metadata=meta)
    lock._write_flag(d, "v1")
    return 0


def cmd_v1_readback(args) -> int:
    global CASE
    CASE = args.case
    from safetensors import safe_open

    from kllm.keyed import lock

    key = load_key(args)
    v1, v2ref = Path(args.v1), Path(args.v2ref)

    @guarded("v1-flag")
    def flag():
        cfg = json.loads((v1 / "config.json").read_text())
        got = (cfg.get("kllm") or {}).get("lock")
        bad = [r for r in lock.shards(v1)
               if any(not isinstance(v, int) for v in (lock.file_domains(v1 / r) or {}).values())
               or lock.file_domains(v1 / r) is None]
        return got == "v1" and not bad, f"lock flag {got!r}, shards without v1 entries: {bad}"

    @guarded("v1-matches-kllm-lock")
    def codes():
        """The sealer's codes and domains are the ones kLLM's own v1 lock writes."""
        mism, n = [], 0
        for rel in lock.shards(v1):
            plain = ref_tensors(v2ref, rel.as_posix())
            doms = lock.file_domains(v1 / rel) or {}
            with safe_open(v1 / rel, framework="pt") as f:
                for name in f.keys():
                    t = plain[name]
                    if t.dtype not in lock.FORMATS or not t.numel():
                        if name in doms:
                            mism.append(f"{rel}:{name} locked but kLLM v1 would not")
                        continue
                    want, m = kllm_lock_v1(t, key, lock.tensor_id(rel, name))
                    n += 1
                    if doms.get(name) != m:
                        mism.append(f"{rel}:{name} domain {doms.get(name)} != {m}")
                    elif tensor_bytes(f.get_tensor(name)) != tensor_bytes(want):
                        mism.append(f"{rel}:{name} codes differ")
        return not mism, f"{n} tensors" + (f"; {mism[:5]}" if mism else " identical")

    @guarded("v1-unlock_dir-exact")
    def readback():
        out = Path(args.tmp)
        shutil.rmtree(out, ignore_errors=True)
        lock.unlock_dir(v1, out, key, log=lambda *_: None)
        mism, n = [], 0
        for rel in shards(v2ref):
            a, b = ref_tensors(out, rel), ref_tensors(v2ref, rel)
            if a.keys() != b.keys():
                mism.append(f"{rel}: names differ")
            for name in b:
                n += 1
                if name in a and (a[name].dtype != b[name].dtype
                                  or tensor_bytes(a[name]) != tensor_bytes(b[name])):
                    mism.append(f"{rel}:{name}")
        cfg_a = json.loads((out / "config.json").read_text())
        cfg_b = json.loads((v2ref / "config.json").read_text())
        if cfg_a != cfg_b:
            mism.append("config.json differs")
        shutil.rmtree(out, ignore_errors=True)
        return not mism, f"{n} tensors" + (f"; differ: {mism[:5]}" if mism else " bit-exact")

    flag()
    codes()
    readback()
    return 1 if FAILED else 0


# ---------------------------------------------------------------------------- the view

class View:
    """A mounted model and what it must show: the sealed directory and kLLM's unlocked
    view of it (the reference)."""

    def __init__(self, args):
        self.mnt, self.sealed, self.ref = Path(args.mnt), Path(args.sealed), Path(args.ref)


@guarded("listing")
def view_listing(view: View):
    mnt, ref = view.mnt, view.ref
    got, want = rel_files(mnt), rel_files(ref)
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    return got == want, f"{len(got)} files" + (
        f"; extra {extra} missing {missing}" if extra or missing else "")


@guarded("hidden")
def view_hidden(view: View):
    mnt = view.mnt
    bad = []
    for name in HIDDEN:
        if name in os.listdir(mnt):
            bad.append(f"{name} listed")
        try:
            os.stat(mnt / name)
            bad.append(f"{name} stat succeeds")
        except FileNotFoundError:
            pass
    return not bad, ", ".join(bad) or "trusted.kllm and kllm.key absent (ENOENT)"


@guarded("config.json")
def view_config(view: View):
    mnt, sealed = view.mnt, view.sealed
    got = json.loads((mnt / "config.json").read_bytes())
    want = json.loads((sealed / "config.json").read_bytes())
    want["kllm"].pop("lock", None)
    return got == want, ("the sealed config without kllm.lock" if got == want else
                         f"got kllm={got.get('kllm')}")


@guarded("secret-files")
def view_secret_files(view: View):
    mnt, ref = view.mnt, view.ref
    from kllm.keyed import keys  # noqa: F401 - the secret files come from the reference
    bad, names = [], []
    for name in ("tokenizer.json", "vocab.json"):
        if (ref / name).exists():
            names.append(name)
            if (mnt / name).read_bytes() != (ref / name).read_bytes():
                bad.append(name)
    return names and not bad, (f"differ from trusted.kllm: {bad}" if bad else
                               f"{', '.join(names)} equal to trusted.kllm's")


@guarded("other-files")
def view_other_files(view: View):
    mnt, sealed, ref = view.mnt, view.sealed, view.ref
    bad, n = [], 0
    for rel in rel_files(ref):
        if rel.endswith(".safetensors") or rel in ("config.json", "tokenizer.json",
                                                    "vocab.json"):
            continue
        n += 1
        if (mnt / rel).read_bytes() != (sealed / rel).read_bytes():
            bad.append(rel)
    return not bad, f"{n} files byte-equal to the sealed ones" + (f"; differ {bad}" if bad
                                                                 else "")


@guarded("shard-headers")
def view_shard_headers(view: View):
    mnt, sealed, ref = view.mnt, view.sealed, view.ref
    bad = []
    for rel in shards(ref):
        st_m, st_s = os.stat(mnt / rel), os.stat(sealed / rel)
        if st_m.st_size != st_s.st_size:
            bad.append(f"{rel}: size {st_m.st_size} != {st_s.st_size}")
            continue
        nm, hm = read_header(mnt / rel)
        ns, hs = read_header(sealed / rel)
        meta = dict(hs.get("__metadata__") or {})
        meta.pop("kllm.lock", None)
        want = {k: v for k, v in hs.items() if k != "__metadata__"}
        if meta:
            want["__metadata__"] = meta
        got = dict(hm)
        if not got.get("__metadata__"):
            got.pop("__metadata__", None)
        if nm != ns:
            bad.append(f"{rel}: header length {nm} != {ns}")
        if got != want:
            diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
            bad.append(f"{rel}: header differs at {diff[:5]}")
        raw = (mnt / rel).open("rb").read(8 + nm)[8:]
        if "kllm.lock" in raw.decode("utf-8", "replace"):
            bad.append(f"{rel}: kllm.lock still in the header")
    return not bad, "; ".join(bad) or f"{len(shards(ref))} shards: same size, offsets, " \
                                      "header without kllm.lock"


@guarded("read-only")
def view_read_only(view: View):
    mnt = view.mnt
    bad = []
    for rel, mode in (("config.json", "r+b"), ("new-file", "wb")):
        try:
            with open(mnt / rel, mode) as f:
                f.write(b"x")
            bad.append(f"open({rel}, {mode}) succeeded")
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                bad.append(f"{rel}: {e}")
    return not bad, "; ".join(bad) or "writes refused"


VIEW_CHECKS = (view_listing, view_hidden, view_config, view_secret_files, view_other_files, view_shard_headers, view_read_only)


def cmd_view(args) -> int:
    global CASE
    CASE = args.case
    view = View(args)
    for check in VIEW_CHECKS:
        check(view)
    return 1 if FAILED else 0


# ---------------------------------------------------------------------------- loaders

def compare_tensors(got: dict, ref: dict, what: str) -> list[str]:
    bad = []
    if set(got) != set(ref):
        bad.append(f"{what}: names differ {sorted(set(got) ^ set(ref))[:5]}")
    for name, t in ref.items():
        g = got.get(name)
        if g is None:
            continue
        if g.dtype != t.dtype or tuple(g.shape) != tuple(t.shape):
            bad.append(f"{what}:{name} dtype/shape {g.dtype}{tuple(g.shape)}")
        elif tensor_bytes(g) != tensor_bytes(t):
            ga, ta = tensor_bytes(g), tensor_bytes(t)
            bad.append(f"{what}:{name} differs from byte {first_diff(ga, ta)} of the tensor")
    return bad


def _mmap_load(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {n: f.get_tensor(n).clone() for n in f.keys()}


def _tp_worker(path_list, rank, world, barrier, out_q):
    """One tensor-parallel rank: safe_open every shard (mmap) and take its slice of each
    2-D tensor's first dimension with get_slice, as vLLM's and SGLang's loaders do."""
    try:
        from safetensors import safe_open

        barrier.wait(timeout=120)
        digests = {}
        for path in path_list:
            with safe_open(path, framework="pt") as f:
                for n in f.keys():
                    s = f.get_slice(n)
                    shape = s.get_shape()
                    if len(shape) == 2 and shape[0] % world == 0:
                        k = shape[0] // world
                        t = s[rank * k:(rank + 1) * k]
                    else:
                        t = f.get_tensor(n)
                    digests[f"{Path(path).name}:{n}"] = hashlib.sha256(tensor_bytes(t)).hexdigest()
        out_q.put((rank, digests, None))
    except Exception as exc:  # noqa: BLE001
        out_q.put((rank, None, f"{type(exc).__name__}: {exc}"))


class Loading:
    """A mounted model, kLLM's unlocked view of it (the reference) and, for each shard,
    the tensors and data bytes the engines must read from the mount."""

    def __init__(self, args):
        import torch  # noqa: F401

        self.mnt, self.sealed, self.ref = Path(args.mnt), Path(args.sealed), Path(args.ref)
        self.rels = shards(self.ref)
        self.refs = {rel: ref_tensors(self.ref, rel) for rel in self.rels}
        self.expected = {rel: expected_data(self.sealed, self.ref, rel) for rel in self.rels}
        self.total = sum((self.mnt / r).stat().st_size for r in self.rels)

    def drop_caches(self):
        """Evict the mount's pages from the kernel's cache where we may (root), so each
        loader reads through the FUSE file system and not from an earlier loader's pages."""
        for rel in self.rels:
            try:
                fd = os.open(self.mnt / rel, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass


@guarded("safe_open-mmap")
def loader_safe_open_mmap(c: Loading):
    """vLLM's default (lazy) and SGLang's loader: safe_open over mmap, page faults."""
    mnt, rels, refs = c.mnt, c.rels, c.refs
    c.drop_caches()
    bad = []
    for rel in rels:
        bad += compare_tensors(_mmap_load(str(mnt / rel)), refs[rel], rel)
    return not bad, "; ".join(bad[:5]) or f"{sum(map(len, refs.values()))} tensors " \
                                          f"equal to unlock_dir's"


@guarded("whole-file-read")
def loader_whole_file_read(c: Loading):
    """vLLM eager: safetensors.torch.load(open(f, 'rb').read())."""
    from safetensors.torch import load as st_load

    mnt, rels, refs, expected, total = c.mnt, c.rels, c.refs, c.expected, c.total
    c.drop_caches()
    bad = []
    for rel in rels:
        with open(mnt / rel, "rb") as f:
            raw = f.read()
        start, data, spans = expected[rel]
        off = first_diff(raw[start:], data)
        if len(raw) != start + len(data):
            bad.append(f"{rel}: read {len(raw)} bytes, want {start + len(data)}")
        elif off is not None:
            bad.append(f"{rel}: first wrong byte at file offset {start + off}, in "
                       f"{where(spans, start, start + off)}")
        bad += compare_tensors(st_load(raw), refs[rel], rel)
    return not bad, "; ".join(bad[:5]) or f"{len(rels)} shards, {total} bytes exact"


@guarded("prefetch-8x16MiB")
def loader_prefetch(c: Loading):
    """vLLM's prefetch strategy: a pool of 8 threads, one shard each, reads every shard
    start to end in 16 MiB reads (to fill the page cache) while the loader maps the
    same files with safe_open. Every block read must hold the expected bytes."""
    mnt, rels, refs, expected = c.mnt, c.rels, c.refs, c.expected
    c.drop_caches()
    bad, lock = [], threading.Lock()
    blocks = [0]

    def whole(rel):
        start, data, spans = expected[rel]
        with open(mnt / rel, "rb") as f:
            head = None
            off = 0
            while True:
                chunk = f.read(BLOCK)
                if not chunk:
                    break
                if head is None:
                    n = struct.unpack("<Q", chunk[:8])[0]
                    head = chunk[:8 + n]
                want = (head + data)[off:off + len(chunk)]
                d = first_diff(chunk, want)
                with lock:
                    blocks[0] += 1
                    if d is not None:
                        bad.append(f"{rel}: 16 MiB read at {off}: first wrong byte at "
                                   f"file offset {off + d}, in {where(spans, start, off + d)}")
                off += len(chunk)
            if off != start + len(data):
                with lock:
                    bad.append(f"{rel}: read {off} bytes to EOF, want {start + len(data)}")

    with ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(whole, rel) for rel in rels]
        loaded = {rel: _mmap_load(str(mnt / rel)) for rel in rels}  # meanwhile
        for f in futs:
            f.result()
    for rel in rels:
        bad += compare_tensors(loaded[rel], refs[rel], rel)
    return not bad, "; ".join(bad[:5]) or f"{blocks[0]} reads of 16 MiB exact, " \
                                          "tensors equal"


@guarded("pread-blocks-8threads")
def loader_pread_blocks_8threads(c: Loading):
    """Harder than any engine: 8 threads pread 16 MiB blocks at once from anywhere in
    every shard, so one file is read at several places at the same time."""
    mnt, rels, expected = c.mnt, c.rels, c.expected
    c.drop_caches()
    bad, lock = [], threading.Lock()
    jobs = []
    for rel in rels:
        size = (mnt / rel).stat().st_size
        jobs += [(rel, off, min(BLOCK, size - off)) for off in range(0, size, BLOCK // 2)]
    random.Random(3).shuffle(jobs)
    fds = {rel: os.open(mnt / rel, os.O_RDONLY) for rel in rels}
    heads = {}
    for rel in rels:
        n = struct.unpack("<Q", os.pread(fds[rel], 8, 0))[0]
        heads[rel] = os.pread(fds[rel], 8 + n, 0)

    def block(job):
        rel, off, n = job
        got = b""
        while len(got) < n:
            chunk = os.pread(fds[rel], n - len(got), off + len(got))
            if not chunk:
                break
            got += chunk
        start, data, spans = expected[rel]
        want = (heads[rel] + data)[off:off + n]
        d = first_diff(got, want)
        if d is not None:
            with lock:
                bad.append(f"{rel}: pread({n}, {off}): first wrong byte at file offset "
                           f"{off + d} ({len(got)} bytes read), in "
                           f"{where(spans, start, off + d)}")

    try:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(block, jobs))
    finally:
        for fd in fds.values():
            os.close(fd)
    return not bad, "; ".join(bad[:5]) or f"{len(jobs)} overlapping blocks exact"


@guarded("tensor-parallel-4proc")
def loader_tensor_parallel(c: Loading):
    """Four processes open the same shards at once and each takes its slice."""
    mnt, rels, refs = c.mnt, c.rels, c.refs
    import multiprocessing as mp

    c.drop_caches()
    world = 4
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(world), ctx.Queue()
    paths = [str(mnt / r) for r in rels]
    procs = [ctx.Process(target=_tp_worker, args=(paths, r, world, barrier, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    bad = [f"rank {r}: {err}" for r, _, err in results if err]
    for rank, digests, err in results:
        if err:
            continue
        for rel in rels:
            for n, t in refs[rel].items():
                if t.dim() == 2 and t.shape[0] % world == 0:
                    k = t.shape[0] // world
                    t = t[rank * k:(rank + 1) * k]
                want = hashlib.sha256(tensor_bytes(t)).hexdigest()
                if digests.get(f"{Path(rel).name}:{n}") != want:
                    bad.append(f"rank {rank}: {rel}:{n}")
    return not bad, "; ".join(bad[:5]) or f"{world} ranks, every slice equal"


@guarded("pread-random")
def loader_pread_random(c: Loading):
    """Positioned reads at random offsets and lengths (mlx, llama.cpp style), some
    across tensor boundaries, some past the end."""
    mnt, rels, expected = c.mnt, c.rels, c.expected
    rng = random.Random(7)
    bad, n = [], 0
    for rel in rels:
        start, data, spans = expected[rel]
        fd = os.open(mnt / rel, os.O_RDONLY)
        size = os.fstat(fd).st_size
        for i in range(400):
            if i % 4 == 0 and spans:  # straddle a tensor boundary
                b, e, _ = rng.choice(spans)
                off = start + e - rng.randint(1, 3)
                ln = rng.randint(2, 9)
            else:
                off = rng.randrange(start, size)
                ln = rng.choice((1, 2, 3, 7, 4096, 65537, 1 << 20))
            got = os.pread(fd, ln, off)
            want = data[off - start: off - start + ln]
            n += 1
            d = first_diff(got, want)
            if d is not None:
                bad.append(f"{rel}: pread({ln}, {off}): first wrong byte at offset "
                           f"{off + d} in {where(spans, start, off + d)}")
        if os.pread(fd, 16, size) != b"":
            bad.append(f"{rel}: pread at EOF returned data")
        os.close(fd)
    return not bad, "; ".join(bad[:5]) or f"{n} reads exact"


LOADER_CHECKS = (loader_safe_open_mmap, loader_whole_file_read, loader_prefetch, loader_pread_blocks_8threads, loader_tensor_parallel, loader_pread_random)


def cmd_loaders(args) -> int:
    global CASE
    CASE = args.case
    loading = Loading(args)
    for check in LOADER_CHECKS:
        check(loading)
    return 1 if FAILED else 0


# ---------------------------------------------------------------------------- SGLang

SGLANG_ITERATORS = {"default": {}, "disable_mmap": {"disable_mmap": True},
                    "prefetch": {"prefetch": True},
                    "disable_mmap+prefetch": {"disable_mmap": True, "prefetch": True}}


@guarded("sglang-weights-iterator")
def sglang_weights_iterator(mnt: Path, ref: Path):
    """SGLang's safetensors_weights_iterator, each way it reads: the same tensors from the
    mount as from kLLM's unlocked view."""
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator

    rels = shards(ref)
    bad = []
    for variant, kw in SGLANG_ITERATORS.items():
        got = {n: t.clone() for n, t in safetensors_weights_iterator(
            [str(mnt / r) for r in rels], **kw)}
        want = {n: t.clone() for n, t in safetensors_weights_iterator(
            [str(ref / r) for r in rels], **kw)}
        if not want:
            bad.append(f"{variant}: no tensors in the reference")
        bad += compare_tensors(got, want, variant)
    return not bad, "; ".join(bad[:5]) or f"{', '.join(SGLANG_ITERATORS)}: every tensor equal"


@guarded("sglang-get_config")
def sglang_get_config(mnt: Path, ref: Path):
    from sglang.srt.utils.hf_transformers_utils import get_config

    got = get_config(str(mnt), trust_remote_code=False).to_dict()
    want = get_config(str(ref), trust_remote_code=False).to_dict()
    for c in (got, want):
        c.pop("_name_or_path", None)  # the directory it was read from
    diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    return not diff, (f"differs at {diff[:5]}" if diff else
                      f"{got.get('model_type')}, {len(got)} fields equal")


@guarded("sglang-get_tokenizer")
def sglang_get_tokenizer(mnt: Path, ref: Path):
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    def summary(path):
        tok = get_tokenizer(str(path))
        chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                       tokenize=False, add_generation_prompt=True)
        return {"class": type(tok).__name__, "vocab": tok.get_vocab(),
                "special": tok.special_tokens_map, "chat": chat,
                "ids": [tok.encode(p) for p in PROMPTS]}

    got, want = summary(mnt), summary(ref)
    diff = sorted(k for k in want if got[k] != want[k])
    return not diff, (f"differs in {diff}" if diff else
                      f"{got['class']}, {len(got['vocab'])} tokens, encodings and chat "
                      "template equal")


def cmd_sglang(args) -> int:
    """SGLang's loader (what `sglang --model-path` runs) on the mount against kLLM's
    unlocked view: its weight iterators, get_config and get_tokenizer."""
    global CASE
    CASE = args.case
    mnt, ref = Path(args.mnt), Path(args.ref)
    for check in (sglang_weights_iterator, sglang_get_config, sglang_get_tokenizer):
        check(mnt, ref)
    return 1 if FAILED else 0


# ---------------------------------------------------------------------------- engines

def hf_generate(path: str, dtype: str) -> tuple[list[str], list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    texts, ids = [], []
    for p in PROMPTS:
        x = tok(p, return_tensors="pt")
        with torch.no_grad():
            y = model.generate(**x, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
        texts.append(tok.decode(y[0], skip_special_tokens=True))
        ids.append(x["input_ids"][0].tolist())
    return texts, ids


def compare_texts(got: list[str], want: list[str]) -> tuple[bool, str]:
    bad = [f"{PROMPTS[i]!r}: got {g!r}, want {w!r}" for i, (g, w) in enumerate(zip(got, want))
           if g != w]
    if bad:
        return False, "; ".join(bad)
    return True, f"{len(want)} prompts, e.g. {want[0]!r}"


def cmd_generate_ref(args) -> int:
    global CASE
    CASE = args.case

    @guarded("kllm-reference-generates-original")
    def run():
        want, _ = hf_generate(args.orig, args.dtype)
        got, _ = hf_generate(args.ref, args.dtype)
        return compare_texts(got, want)

    run()
    return 1 if FAILED else 0


def cmd_transformers(args) -> int:
    global CASE
    CASE = args.case

    @guarded("transformers-generate")
    def run():
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(args.mnt)
        lock = (getattr(cfg, "kllm", None) or {}).get("lock")
        want, orig_ids = hf_generate(args.orig, args.dtype)
        got, mnt_ids = hf_generate(args.mnt, args.dtype)
        ok, detail = compare_texts(got, want)
        if lock is not None:
            ok, detail = False, f"config.json from the mount still has lock={lock!r}; " + detail
        if mnt_ids == orig_ids:  # the mount's tokenizer must be the permuted one
            ok, detail = False, "the mount's tokenizer gives the original token ids; " + detail
        return ok, detail + "; token ids permuted as sealed"

    run()
    return 1 if FAILED else 0


def cmd_mlx(args) -> int:
    global CASE
    CASE = args.case

    @guarded("mlx-lm-generate")
    def run():
        from mlx_lm import generate, load

        def texts(path):
            model, tok = load(path)
            out = []
            for p in PROMPTS:
                # mlx-lm returns the continuation alone (its first space trimmed)
                out.append(f"{p} -> " + generate(model, tok, prompt=p, max_tokens=MAX_NEW_TOKENS))
            return out

        want = texts(args.orig)
        got = texts(args.mnt)
        return compare_texts(got, want)

    run()
    return 1 if FAILED else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(name, *pos, key=False):
        p = sub.add_parser(name)
        for a in pos:
            p.add_argument(a)
        p.add_argument("--case", default="e2e")
        p.add_argument("--dtype", default="float32")
        if key:
            g = p.add_mutually_exclusive_group(required=True)
            g.add_argument("--key")
            g.add_argument("--key-hex")
        return p

    add("reference", "sealed", "ref", key=True)
    add("unlock", "sealed", "out", key=True)
    add("lock-v1-python", "dir", key=True)
    add("v1-readback", "v1", "v2ref", "tmp", key=True)
    add("generate-ref", "orig", "ref")
    add("view", "mnt", "sealed", "ref")
    add("loaders", "mnt", "sealed", "ref")
    add("transformers", "mnt", "orig")
    add("mlx", "mnt", "orig")
    add("sglang", "mnt", "ref")
    args = ap.parse_args()
    fn = {
        "reference": cmd_reference, "unlock": cmd_unlock, "lock-v1-python": cmd_lock_v1_python,
        "v1-readback": cmd_v1_readback, "generate-ref": cmd_generate_ref, "view": cmd_view,
        "loaders": cmd_loaders, "transformers": cmd_transformers, "mlx": cmd_mlx,
        "sglang": cmd_sglang,
    }[args.cmd]
    return fn(args)


if __name__ == "__main__":
    sys.exit(main())
