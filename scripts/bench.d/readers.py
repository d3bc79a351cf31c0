"""The read patterns scripts/bench times: each opens a file, reads it the way a reader
of that kind does, and returns (bytes, seconds) with the open included."""

import json
import mmap
import os
import threading
import time

from host import MiB, READ

def read_seq(path, start=0, length=None):
    """Sequential READ-byte preads into one buffer; returns (bytes, seconds). The time
    includes the open: in passthrough mode kllm-mount decodes the shard there."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_fd(fd, start, length, name=path)[0], time.perf_counter() - t0
    finally:
        os.close(fd)


def read_fd(fd, start=0, length=None, name=None):
    """Sequential READ-byte preads of open descriptor `fd` into one buffer, from `start` to
    the file's end or `length` bytes on; returns (bytes, seconds)."""
    t0 = time.perf_counter()
    size = os.fstat(fd).st_size
    end = size if length is None else min(size, start + length)
    buf = bytearray(READ)
    mv = memoryview(buf)
    off = start
    while off < end:
        n = os.preadv(fd, [mv[: min(READ, end - off)]], off)
        if n <= 0:
            raise IOError(f"{name or f'descriptor {fd}'}: short read at {off}")
        off += n
    return off - start, time.perf_counter() - t0


def touch_fd(fd):
    """Map open descriptor `fd` and touch one byte of every 4 KiB page, in order (as a
    safetensors mmap load does); returns (bytes, seconds)."""
    t0 = time.perf_counter()
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    mv = memoryview(m)
    touched = bytes(mv[::4096])  # one byte per page, copied in C
    mv.release()
    m.close()
    dt = time.perf_counter() - t0
    assert len(touched) == (size + 4095) // 4096
    return size, dt


def read_mmap(path):
    """`touch_fd` of `path`; returns (bytes, seconds), the open included."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        return touch_fd(fd)[0], time.perf_counter() - t0
    finally:
        os.close(fd)


def read_conc(path, readers=4, length=None):
    """`readers` threads, each with its own descriptor, each reading a contiguous share
    sequentially; returns (bytes, wall seconds)."""
    size = os.path.getsize(path)
    end = size if length is None else min(size, length)
    share = -(-end // readers)
    share = -(-share // 4096) * 4096
    results = [None] * readers
    errors = []

    def work(k):
        try:
            a = k * share
            results[k] = read_seq(path, a, max(0, min(end, a + share) - a))[0]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(readers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(results), dt


def scatter(path, start, length, readers=4):
    """4 KiB reads, one per MiB of [start, start + length), in a shuffled order, by
    `readers` threads; returns the number of reads."""
    import random
    offs = [start + k * MiB + 64 * 1024 for k in range(length // MiB)]
    random.Random(1).shuffle(offs)
    errors = []

    def work(part):
        fd = os.open(path, os.O_RDONLY)
        try:
            for o in part:
                os.pread(fd, 4096, o)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            os.close(fd)

    threads = [threading.Thread(target=work, args=(offs[k::readers],)) for k in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return len(offs)


def safetensors_tensors(fd):
    """(offset, bytes, rows) of every tensor of an open safetensors file, in file order;
    rows is the first dimension (1 for a scalar)."""
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    raw = b""
    while len(raw) < n:
        chunk = os.pread(fd, n - len(raw), 8 + len(raw))
        if not chunk:
            raise IOError("short safetensors header")
        raw += chunk
    out = []
    for name, t in json.loads(raw).items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        rows = t["shape"][0] if t["shape"] else 1
        out.append((8 + n + b, e - b, rows))
    return sorted(out)


def load_rows(path, rank, world):
    """What one rank of a tensor-parallel loader reads: open the file, parse its header,
    and pread rows [rank/world, (rank+1)/world) of every tensor into a buffer; returns
    (bytes, seconds)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = bytearray(READ)
        mv = memoryview(buf)
        total = 0
        for off, length, rows in safetensors_tensors(fd):
            if rows == 0 or length == 0:
                continue
            row_bytes = length // rows
            a = off + rows * rank // world * row_bytes
            end = off + rows * (rank + 1) // world * row_bytes
            while a < end:
                n = os.preadv(fd, [mv[: min(READ, end - a)]], a)
                if n <= 0:
                    raise IOError(f"{path}: short read at {a}")
                a += n
                total += n
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


def _tp_rank(path, rank, world, barrier, results):
    barrier.wait()
    try:
        results.put((rank, load_rows(path, rank, world), None))
    except Exception as e:  # noqa: BLE001
        results.put((rank, None, repr(e)))


def tensor_parallel_load(path, world):
    """`world` processes started together, each loading its share of the rows of every
    tensor; returns (bytes of all ranks, wall seconds from the common start)."""
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(world + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(path, k, world, barrier, results))
             for k in range(world)]
    for p in procs:
        p.start()
    barrier.wait()
    t0 = time.perf_counter()
    got = [results.get(timeout=600) for _ in procs]
    dt = time.perf_counter() - t0
    for p in procs:
        p.join()
    errors = [e for _, _, e in got if e]
    if errors:
        raise IOError(f"tensor-parallel load of {path}: {errors[0]}")
    return sum(r[0] for _, r, _ in got), dt


# ---------------------------------------------------------------- a loader's view
# What a safetensors loader does with one shard: read the header, then every tensor. The
# time includes the open and the header, as a loader's does.


def load_tensors_pread(path):
    """Header, then one pread of each tensor into a buffer of its size (safetensors'
    non-mmap path, vLLM's eager load)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        for off, length, _ in safetensors_tensors(fd):
            buf = bytearray(length)
            mv = memoryview(buf)
            got = 0
            while got < length:
                n = os.preadv(fd, [mv[got:]], off + got)
                if n <= 0:
                    raise IOError(f"{path}: short read at {off + got}")
                got += n
            total += got
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


def load_tensors_mmap(path):
    """Header, then each tensor copied out of one shared mapping of the file
    (safetensors' safe_open + get_tensor: page faults, then a copy)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        tensors = safetensors_tensors(fd)
        m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        mv = memoryview(m)
        total = 0
        try:
            for off, length, _ in tensors:
                total += len(bytes(mv[off:off + length]))
        finally:
            mv.release()
            m.close()
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


DIRECT_ALIGN = 4096
DIRECT_CHUNK = 16 * MiB  # fastsafetensors' and InstantTensor's requests are of this order


def load_tensors_direct(path):
    """Header, then every tensor by O_DIRECT preads of aligned 16 MiB chunks into one
    page-aligned buffer, bypassing the page cache (fastsafetensors without GPUDirect).
    Raises OSError (EINVAL) where the file system refuses O_DIRECT."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        buf = mmap.mmap(-1, DIRECT_CHUNK)  # anonymous mappings are page-aligned
        mv = memoryview(buf)
        head = bytearray()
        total = 0
        try:
            # the header through the same descriptor: one aligned read of its first page(s)
            n = os.preadv(fd, [mv[:DIRECT_ALIGN]], 0)
            hlen = int.from_bytes(bytes(mv[:8]), "little")
            need = -(-(8 + hlen) // DIRECT_ALIGN) * DIRECT_ALIGN
            off = n
            head += mv[:n]
            while off < min(need, size):
                n = os.preadv(fd, [mv[:min(DIRECT_CHUNK, need - off)]], off)
                if n <= 0:
                    raise IOError(f"{path}: short O_DIRECT read at {off}")
                head += mv[:n]
                off += n
            spans = []
            for t in json.loads(bytes(head[8:8 + hlen])).values():
                if "data_offsets" in t:
                    b, e = t["data_offsets"]
                    spans.append((8 + hlen + b, 8 + hlen + e))
            for a, e in sorted(spans):
                pos = a - a % DIRECT_ALIGN
                while pos < e:
                    want = min(DIRECT_CHUNK, -(-(e - pos) // DIRECT_ALIGN) * DIRECT_ALIGN)
                    n = os.preadv(fd, [mv[:want]], pos)
                    if n <= 0:
                        raise IOError(f"{path}: short O_DIRECT read at {pos}")
                    pos += n
                total += e - a
        finally:
            mv.release()
            buf.close()
        return total, time.perf_counter() - t0
    finally:
        os.close(fd)


def read_seq_first(path):
    """Open, read the first 4 KiB, then the rest sequentially in 1 MiB preads: returns
    (bytes, seconds in all, seconds to the first 4 KiB), the open included in both."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        first = os.pread(fd, 4096, 0)
        t_first = time.perf_counter() - t0
        if len(first) != min(4096, os.fstat(fd).st_size):
            raise IOError(f"{path}: short first read")
        size = os.fstat(fd).st_size
        buf = bytearray(READ)
        mv = memoryview(buf)
        off = total = len(first)
        while off < size:
            n = os.preadv(fd, [mv[: min(READ, size - off)]], off)
            if n <= 0:
                raise IOError(f"{path}: short read at {off}")
            off += n
            total += n
        return total, time.perf_counter() - t0, t_first
    finally:
        os.close(fd)
