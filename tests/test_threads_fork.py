"""Threads and fork: first calls of every op from many threads at once, capture counts under threads and
across os.fork() / multiprocessing's fork, and bad input arriving from many threads.

A first call is only a first call in a fresh interpreter (the registries load once per process), so
each such case runs its threads in a `python -c` child, all started behind one threading.Barrier, and
the child checks the registries were still unloaded when the barrier opened. Results are checked
against plain torch references computed in float64. Nothing is timed; the one sleep (a plugin whose
import takes a while) only widens the window the threads arrive in, and the checks hold whatever the
interleaving.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from tiers import tiered_at

import gemmtune
from gemmtune.capture import read_shape_list, read_shapes
from gemmtune.concurrency import Once

THREADS = 64

# Every public op that runs on the CPU, with inputs and a float64 torch reference (names: the ops').
CASES = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F

    from gemmtune.quant import shuffle_weight

    F32, F8, I8 = torch.float32, torch.float8_e4m3fn, torch.int8
    gen = torch.Generator().manual_seed(0)


    def r(*shape):
        return torch.randn(*shape, generator=gen)


    def q8(*shape, dtype=I8):  # small integers: exact in int8 and in fp8 e4m3 (times 1/4)
        q = torch.randint(-8, 8, shape, generator=gen)
        return q.to(I8) if dtype == I8 else (q.float() * 0.25).to(dtype)


    def d(t):
        return t.double()


    def lin(x, w, b=None):
        return d(x) @ d(w).T + (0 if b is None else d(b))


    x, w, b, c = r(5, 16), r(6, 16), r(6), r(5, 6)
    wk = r(16, 6)
    ba, bb = r(3, 5, 16), r(3, 16, 7)
    bxq, bwq, bxs, bws = q8(3, 5, 32), q8(3, 7, 32), r(3, 5, 1).abs() + 0.1, r(3, 1, 7).abs() + 0.1
    xq, wq, xs, ws, qb = q8(5, 32), q8(6, 32), r(5, 1).abs() + 0.1, r(1, 6).abs() + 0.1, r(6)
    wqs = shuffle_weight(wq)
    fxq, fwq, fxs, fws = q8(5, 256, dtype=F8), q8(6, 256, dtype=F8), r(5, 2).abs() + 0.1, r(1, 2).abs() + 0.1
    fwqs = shuffle_weight(fwq)
    T, H, I, E, K = 4, 16, 8, 3, 2
    hs, w1, w2 = r(T, H), r(E, 2 * I, H) * 0.3, r(E, H, I) * 0.3
    tw, tid = r(T, K).softmax(-1), torch.tensor([[0, 1], [2, 0], [1, 2], [2, 1]])
    gw = r(E, H, 5)
    dense = r(6, 16) * (r(6, 16) > 0.5)
    csr = dense.to_sparse_csr()
    aq, ak, av = r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8)


    def a8w8():
        return (d(xq) @ d(wq).T) * d(xs) * d(ws)


    def blockscale():
        out = 0
        for g in range(2):
            k = slice(g * 128, (g + 1) * 128)
            out = out + (d(fxq[:, k]) @ d(fwq[:, k]).T) * d(fxs[:, g : g + 1]) * d(fws[0, g])
        return out


    def moe():
        out = torch.zeros(T, H, dtype=torch.float64)
        for t in range(T):
            for j in range(K):
                e, h = tid[t, j], d(hs[t])
                act = F.silu(h @ d(w1[e, :I]).T) * (h @ d(w1[e, I:]).T)
                out[t] += d(tw[t, j]) * (act @ d(w2[e]).T)
        return out


    def grouped():
        return torch.stack([torch.stack([d(hs[t]) @ d(gw[tid[t, j]]) for j in range(K)]) for t in range(T)])


    def attention():
        s = (d(aq) @ d(ak).transpose(-1, -2)) * 8**-0.5
        s = s.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
        return (s.softmax(-1) @ d(av)).transpose(1, 2)


    def cases(gt):
        return {
            "gemm": (lambda: gt.gemm(x, w, b), lambda: lin(x, w, b)),
            "gemm_epilogue": (
                lambda: gt.gemm_epilogue(x, w, b, act="relu", alpha=0.5, beta=2.0, c=c),
                lambda: torch.relu(0.5 * (d(x) @ d(w).T) + 2 * d(c) + d(b)),
            ),
            "gemm_bias": (lambda: gt.gemm_bias(x, w, b), lambda: lin(x, w, b)),
            "gemm_gelu": (lambda: gt.gemm_gelu(x, w, b), lambda: F.gelu(lin(x, w, b))),
            "gemm_relu": (lambda: gt.gemm_relu(x, w, b), lambda: torch.relu(lin(x, w, b))),
            "cutlass_gemm": (
                lambda: gt.cutlass_gemm(x, wk, alpha=2.0, beta=0.5, c=c),
                lambda: 2 * (d(x) @ d(wk)) + 0.5 * d(c),
            ),
            "batched_gemm": (lambda: gt.batched_gemm(ba, bb), lambda: d(ba) @ d(bb)),
            "batched_gemm_a8w8": (
                lambda: gt.batched_gemm_a8w8(bxq, bwq, bxs, bws, dtype=F32),
                lambda: (d(bxq) @ d(bwq).transpose(1, 2)) * d(bxs) * d(bws),
            ),
            "gemm_a8w8": (lambda: gt.gemm_a8w8(xq, wq, xs, ws, qb, dtype=F32), lambda: a8w8() + d(qb)),
            "gemm_a8w8_bpreshuffle": (lambda: gt.gemm_a8w8_bpreshuffle(xq, wqs, xs, ws, dtype=F32), a8w8),
            "int8_gemm": (lambda: gt.int8_gemm(xq, wq, xs, ws, output_dtype=F32), a8w8),
            "gemm_a8w8_blockscale": (lambda: gt.gemm_a8w8_blockscale(fxq, fwq, fxs, fws, dtype=F32), blockscale),
            "gemm_a8w8_blockscale_bpreshuffle": (
                lambda: gt.gemm_a8w8_blockscale_bpreshuffle(fxq, fwqs, fxs, fws, dtype=F32),
                blockscale,
            ),
            "fused_moe": (lambda: gt.fused_moe(hs, w1, w2, tw, tid), moe),
            "grouped_gemm": (lambda: gt.grouped_gemm(hs, gw, tid), grouped),
            "sparse_gemm": (lambda: gt.sparse_gemm(x, csr, "csr", b), lambda: lin(x, dense, b)),
            "softcap_attention": (lambda: gt.softcap_attention(aq, ak, av), attention),
        }
    """
)

# argv: threads, order ("rotated": thread i starts at op i; "same": every thread in one order).
# Prints {"fresh": registries unloaded at the barrier, "calls": {op: right results}, "errors": [...]}.
FIRST_CALLS = CASES + textwrap.dedent(
    """
    import json, sys, threading
    import gemmtune
    from gemmtune import backends, dispatch

    threads, order = int(sys.argv[1]), sys.argv[2]
    ops = cases(gemmtune)
    names = list(ops)
    refs = {n: ref() for n, (_, ref) in ops.items()}
    # (the family registry is filled by `import gemmtune` itself; the backends load at the first call)
    fresh = not backends._builtins.done and not any(dispatch.get_dispatcher()._caches.values())
    barrier = threading.Barrier(threads)
    lock = threading.Lock()
    right = dict.fromkeys(names, 0)
    errors = []

    def work(i):
        mine = names[i % len(names):] + names[: i % len(names)] if order == "rotated" else names
        barrier.wait()
        for n in mine:
            try:
                y = ops[n][0]()
                ok = y.shape == refs[n].shape and torch.allclose(y.double(), refs[n], rtol=1e-4, atol=1e-3)
                with lock:
                    right[n] += ok
                    if not ok:
                        errors.append(f"{n}: wrong result")
            except Exception as exc:
                with lock:
                    errors.append(f"{n}: {type(exc).__name__}: {exc}")

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    print(json.dumps({"fresh": fresh, "calls": right, "errors": errors}))
    """
)


def _child(script: str, *args, env: dict | None = None, timeout: int = 300) -> dict:
    """Run `script` in a fresh interpreter; its last stdout line, parsed as JSON."""
    p = subprocess.run([sys.executable, "-c", script, *map(str, args)], env={**os.environ, **(env or {})},
                       capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _op_names() -> list[str]:
    names = {}
    exec(compile(CASES, "cases", "exec"), names)  # noqa: S102 - the test's own table of calls
    return list(names["cases"](gemmtune))


def test_the_cases_cover_every_public_op_but_the_helpers():
    from gemmtune.ops import registry

    # gemmtune's own ops: a plugin's (another test may have registered the toy family's) is not one.
    ops = {e.name for e in registry.public_ops() if e.custom_op is not None and e.fn.__module__.startswith("gemmtune.")}
    assert set(_op_names()) == ops


@pytest.mark.parametrize("order", tiered_at(["rotated", "same"], {0}))
def test_first_calls_of_every_op_from_64_threads_at_once_are_all_right(order):
    out = _child(FIRST_CALLS, THREADS, order)
    assert out["fresh"], "the registries were loaded before the threads started: no first call was raced"
    assert out["errors"] == []
    assert out["calls"] == dict.fromkeys(_op_names(), THREADS)


def test_first_calls_with_capture_from_the_environment_count_every_call_once(tmp_path):
    path = tmp_path / "shapes.csv"
    out = _child(FIRST_CALLS, THREADS, "rotated", env={"GEMMTUNE_CAPTURE": str(path)})  # flushed at its exit
    assert out["fresh"] and out["errors"] == []
    files = sorted(p for p in tmp_path.iterdir() if p.suffix == ".csv")
    assert path in files and len(files) >= 6  # a16w16 and the other families' files beside it
    counts = [c for f in files for _, c in read_shape_list(str(f))[1]]
    assert counts and set(counts) == {THREADS}  # every key: one call per thread, none lost, none twice


PLUGIN = """
import time
DONE = False
time.sleep(0.3)  # a slow import: the other threads arrive while it runs
DONE = True
"""

PLUGIN_WAIT = textwrap.dedent(
    """
    import json, sys, threading, torch
    import gemmtune

    threads = int(sys.argv[1])
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    barrier = threading.Barrier(threads)
    seen, errors = [], []

    def work():
        barrier.wait()
        try:
            gemmtune.gemm(x, w)
            seen.append(sys.modules["slow_toy_plugin"].DONE)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    print(json.dumps({"seen": seen, "errors": errors}))
    """
)


def test_no_first_call_runs_before_the_plugins_are_imported(tmp_path):
    (tmp_path / "slow_toy_plugin.py").write_text(PLUGIN)
    env = {
        "GEMMTUNE_PLUGINS": "slow_toy_plugin",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    }
    out = _child(PLUGIN_WAIT, 16, env=env)
    assert out["errors"] == [] and out["seen"] == [True] * 16


# ---- capture under threads ------------------------------------------------------------------------
def _count_from_threads(path, threads: int, keys: int, calls: int, flusher: bool) -> dict:
    """`threads` threads, started at once, each make `calls` gemm calls cycling over `keys` shapes (M = 1
    .. keys, each one called); with `flusher`, another thread flushes the capture all the while. {M: count}
    in the file."""
    cap = gemmtune.set_capture(str(path))
    w = torch.ones(3, 4)
    xs = [torch.ones(m, 4) for m in range(1, keys + 1)]
    barrier = threading.Barrier(threads + flusher)
    counting = threading.Event()
    errors = []

    def work(i):
        barrier.wait()
        try:
            for j in range(calls):
                gemmtune.gemm(xs[(i * calls + j) % keys], w)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def flush():
        barrier.wait()
        while not counting.is_set():
            cap.flush()

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    side = threading.Thread(target=flush) if flusher else None
    for t in [*pool, *([side] if side else [])]:
        t.start()
    for t in pool:
        t.join()
    counting.set()
    if side:
        side.join()
    gemmtune.set_capture(None)  # flushes
    assert errors == []
    return {k.M: c for k, c in read_shapes(str(path))}


@pytest.mark.parametrize("flusher", [False, True], ids=["flush at the end", "flushing all along"])
@pytest.mark.parametrize(("keys", "calls"), [(1, 100), (8, 40), (64, 2)], ids=["one key", "8 keys", "64 new keys"])
def test_capture_counts_each_call_once_under_32_threads(tmp_path, keys, calls, flusher):
    threads = 32
    got = _count_from_threads(tmp_path / "shapes.csv", threads, keys, calls, flusher)
    want = {m: 0 for m in range(1, keys + 1)}
    for i in range(threads):
        for j in range(calls):
            want[(i * calls + j) % keys + 1] += 1
    assert sum(got.values()) == threads * calls
    assert got == want


def test_capture_counts_of_ended_threads_are_kept(tmp_path):
    # Threads run one after another: each one's tally is folded in when the next starts counting.
    cap = gemmtune.set_capture(str(tmp_path / "shapes.csv"))
    w, x = torch.ones(3, 4), torch.ones(2, 4)
    for _ in range(5):
        t = threading.Thread(target=lambda: [gemmtune.gemm(x, w) for _ in range(3)])
        t.start()
        t.join()
    assert list(cap.counts.values()) == [15]
    assert len(cap.for_family(gemmtune.families.get("a16w16"))._tallies) <= 1


# ---- capture across fork --------------------------------------------------------------------------
# argv: how the child leaves. The parent makes 7 calls of A before the fork (unflushed), the child 11 of A
# and 4 of B, then the parent 2 of B: the file must say A 18, B 6.
FORK = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, threading, torch
    import gemmtune
    from gemmtune.capture import read_shapes

    torch.set_num_threads(1)
    how, path = sys.argv[1], sys.argv[2]
    cap = gemmtune.set_capture(path)
    w, xa, xb = torch.ones(6, 8), torch.ones(3, 8), torch.ones(5, 8)
    for _ in range(7):
        gemmtune.gemm(xa, w)

    def child():
        for _ in range(11):
            gemmtune.gemm(xa, w)
        for _ in range(4):
            gemmtune.gemm(xb, w)

    if how == "multiprocessing":
        p = multiprocessing.get_context("fork").Process(target=child)
        p.start()
        p.join()
        assert p.exitcode == 0
    elif how == "pool":  # closed and joined inside the with block: the worker exits normally (docs/threads.md)
        with multiprocessing.get_context("fork").Pool(1) as pool:
            pool.apply(child)
            pool.close()
            pool.join()
    else:
        held = threading.Event()
        release = threading.Event()
        if how == "lock held":  # another thread is inside a flush when the fork happens
            one = cap.for_family(gemmtune.families.get("a16w16"))
            def hold():
                with one._flush_lock:
                    held.set()
                    release.wait()
            threading.Thread(target=hold).start()
            held.wait()
        pid = os.fork()
        if pid == 0:
            child()
            if how == "exit":
                sys.exit(0)  # the exit hooks flush
            cap.flush()
            os._exit(0)
        release.set()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    for _ in range(2):
        gemmtune.gemm(xb, w)
    cap.flush()
    print(json.dumps({str(k.M): c for k, c in read_shapes(path)}))
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("how", tiered_at(["exit", "flush", "lock held", "multiprocessing", "pool"], {0, 3}))
def test_capture_across_fork_counts_parent_and_child_calls_once(tmp_path, how):
    out = _child(FORK, how, tmp_path / "shapes.csv", timeout=120)
    assert out == {"3": 7 + 11, "5": 4 + 2}


# ---- bad input from many threads ------------------------------------------------------------------
BAD_ENV = textwrap.dedent(
    """
    import json, sys, threading, torch
    import gemmtune

    threads = int(sys.argv[1])
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    barrier = threading.Barrier(threads)
    got = []

    def work():
        barrier.wait()
        for _ in range(2):
            try:
                gemmtune.gemm(x, w)
                got.append("ran")
            except Exception as exc:
                got.append(f"{type(exc).__name__}: {exc}")

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    print(json.dumps(sorted(set(got))))
    """
)


def test_a_capture_path_that_is_a_tuned_table_refuses_every_thread_alike(tmp_path):
    table = tmp_path / "tuned.csv"
    text = "gfx,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName\n"
    table.write_text(text)
    out = _child(BAD_ENV, 16, env={"GEMMTUNE_CAPTURE": str(table)})
    assert len(out) == 1, out  # one error, the same at every call of every thread: never capture quietly off
    assert out[0].startswith("ShapesFileError: GEMMTUNE_CAPTURE=") and "is a tuned table" in out[0]
    assert table.read_text() == text


def test_a_plugin_that_cannot_be_imported_is_named_to_every_thread(tmp_path):
    out = _child(BAD_ENV, 16, env={"GEMMTUNE_PLUGINS": "gemmtune_no_such_plugin_here"})
    assert len(out) == 1, out
    assert out[0].startswith("EnvVarError: GEMMTUNE_PLUGINS 'gemmtune_no_such_plugin_here': cannot import")


def test_bad_and_good_first_calls_from_32_threads_each_get_their_own_answer():
    x, w = torch.ones(3, 16), torch.ones(5, 16)
    barrier = threading.Barrier(32)
    got: list = [None] * 32

    def work(i):
        barrier.wait()
        try:
            got[i] = gemmtune.gemm(None if i % 2 else x, w)
        except TypeError as exc:
            got[i] = str(exc)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(32)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    for i, res in enumerate(got):
        if i % 2:
            assert "x must be a tensor, got NoneType" in res
        else:
            assert torch.equal(res, torch.full((3, 5), 16.0))


# ---- Once itself ----------------------------------------------------------------------------------
def test_once_runs_once_for_threads_arriving_together_and_each_sees_it_finished():
    once, runs, seen = Once(), [], []
    barrier = threading.Barrier(16)
    state: dict = {}

    def init():
        runs.append(1)
        for i in range(1000):  # long enough for the others to arrive while it runs
            state[i] = i
        state["done"] = True

    def work():
        barrier.wait()
        once.run(init)
        seen.append(state.get("done"))

    pool = [threading.Thread(target=work) for _ in range(16)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert runs == [1] and seen == [True] * 16 and once.done


def test_once_whose_initializer_fails_raises_and_runs_again_at_the_next_ask():
    once, tries = Once(), []

    def init():
        tries.append(1)
        if len(tries) == 1:
            raise ValueError("registry: bad module 'x'")

    with pytest.raises(ValueError, match="bad module 'x'"):
        once.run(init)
    assert not once.done
    once.run(init)
    once.run(init)
    assert tries == [1, 1] and once.done


def test_once_asked_again_from_inside_its_initializer_returns_at_once():
    once, inner = Once(), []

    def init():
        once.run(init)  # a loader that looks its own registry up: sees the partial state, no deadlock
        inner.append(once.done)

    once.run(init)
    assert inner == [False] and once.done


def test_get_or_make_makes_each_key_once_from_many_threads():
    once, cache, made = Once(), {}, []
    barrier = threading.Barrier(16)
    got = []

    def work(i):
        barrier.wait()
        got.append((i % 4, once.get_or_make(cache, i % 4, lambda: made.append(i % 4) or object())))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert sorted(made) == [0, 1, 2, 3]
    assert len(got) == 16 and all(v is cache[k] for k, v in got)
