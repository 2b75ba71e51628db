"""The sparse family (families/sparse.py), sparse_gemm / prune_2_4 (ops/sparse.py), backends/sparse.py.

CPU: CSR / COO / BSR weights (with empty rows and fully dense blocks) against an fp32 reference in
fp32 / fp16 / bf16, every solution the backend offers; layout / pattern mismatches and bad shapes raise
clear errors; prune_2_4 keeps 2 of every 4 and reports its error; tables of the family load. GPU
(marked gpu): the same on CUDA, 2:4 through cuSPARSELt where it runs, CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from gemmtune.families.sparse import SparseKey, density_bucket


def _rel_err(y, ref) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _weight(n, k, block=(4, 8), seed=0):
    """A dense [n, k] weight with an empty block row, a fully dense block and random blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    r, c = block
    keep = (torch.rand(n // r, k // c, generator=g) < 0.4).repeat_interleave(r, 0).repeat_interleave(c, 1)
    keep[:r] = False  # empty rows
    keep[r : 2 * r, :c] = True  # one fully dense block
    return w * keep


def _as(pattern, w, block=(4, 8)):
    return {"csr": w.to_sparse_csr, "coo": lambda: w.to_sparse(), "bsr": lambda: w.to_sparse_bsr(block),
            "block": lambda: w.to_sparse_bsr(block)}[pattern]()  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["csr", "coo", "bsr", "block"])
def test_sparse_gemm_matches_reference(pattern, dtype):
    from gemmtune import sparse_gemm

    w = _weight(40, 48).to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 48, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    ws = _as(pattern, w)
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for bias in (None, b):
        y = sparse_gemm(x, ws, pattern, bias)
        ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        assert y.shape == (3, 7, 40) and y.dtype == dtype
        assert _rel_err(y, ref) < tol
        assert (y[..., :4] == (0 if bias is None else bias[:4])).all()  # the empty rows of W
    y1 = sparse_gemm(x[0, 0], ws, pattern)  # a 1-D input
    assert y1.shape == (40,)


@pytest.mark.parametrize("pattern", ["csr", "coo", "bsr"])
def test_every_solution_of_the_backend(pattern):
    from gemmtune.backends import get as get_backend
    from gemmtune.families import get

    fam, be, cpu = get("sparse"), get_backend("torch", "sparse"), torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        for density in (0.05, 0.5, 1.0):
            key = SparseKey(37, 48, 64, pattern, density, "8x16" if pattern == "bsr" else "", True, dtype)
            inputs = fam.make_inputs(key, cpu, 1, 0)[0]
            ref = fam.reference(key, inputs)
            sols = be.candidates(key, cpu)
            names = [s.kernel_name for s in sols]
            assert "dense" in names and be.default_solution(key, cpu) in sols
            # The CPU's MKL path has no 16-bit CSR / BSR product and no non-square BSR blocks; COO has both.
            assert ("sparse" in names) == (pattern == "coo" or (pattern == "csr" and dtype == torch.float32))
            for sol in sols:
                run = be.make_runner(sol, key, cpu)
                for what, variant, shape in [("main", inputs, (37, 48)), *fam.check_variants(key, inputs)]:
                    y = run(*variant)
                    assert tuple(y.shape) == shape, (sol.kernel_name, what)
                    err = _rel_err(y, fam.reference(key, variant))
                    assert err < (1e-5 if dtype == torch.float32 else 1e-2), (sol.kernel_name, what, err)
            assert tuple(ref.shape) == (37, 48)


def test_key_density_bucket_and_block():
    from gemmtune.ops.sparse import key_of

    w = _weight(40, 48)
    x = torch.randn(5, 48)
    k = key_of(x, w.to_sparse_bsr((4, 8)), None, "bsr")
    assert k.block == "4x8" and k.pattern == "bsr" and k.M == 5
    nnz = (w != 0).sum().item() / w.numel()
    assert k.density == density_bucket(nnz) and k.density >= nnz
    assert key_of(x, w.to_sparse_csr(), None, "csr").density == density_bucket(nnz)
    assert density_bucket(0.27) == 0.3 and density_bucket(0.001) == 0.01 and density_bucket(1.0) == 1.0


def test_dense_twin_made_once_and_dropped_with_the_weight():
    from gemmtune.backends.sparse.pytorch import _twins, dense_twin

    ws = _weight(16, 16, (4, 4)).to_sparse_csr()
    d1 = dense_twin(ws)
    assert dense_twin(ws) is d1 and torch.equal(d1, ws.to_dense())
    key = id(ws)
    del ws
    assert key not in _twins


@pytest.mark.parametrize(
    ("pattern", "weight", "match"),
    [
        ("csr", "dense", r"sparsity_pattern 'csr' needs a torch.sparse_csr weight \(weight.to_sparse_csr\(\)\)"),
        ("csr", "coo", r"needs a torch.sparse_csr weight .*torch.sparse_coo"),
        ("coo", "csr", "needs a torch.sparse_coo weight"),
        ("block", "csr", r"needs a torch.sparse_bsr weight \(weight.to_sparse_bsr"),
        ("2:4", "dense", r"'2:4' needs a SparseSemiStructuredTensor \(gemmtune.prune_2_4"),
        ("2:4", "csr", "needs a SparseSemiStructuredTensor"),
        ("diagonal", "csr", "sparsity_pattern must be one of .* got 'diagonal'"),
    ],
)
def test_layout_mismatch_errors(pattern, weight, match):
    from gemmtune import sparse_gemm

    w = _weight(40, 48)
    ws = w if weight == "dense" else _as(weight, w)
    with pytest.raises(ValueError, match=match):
        sparse_gemm(torch.randn(5, 48), ws, pattern)


def test_shape_dtype_bias_errors():
    from gemmtune import sparse_gemm

    ws = _weight(40, 48).to_sparse_csr()
    with pytest.raises(ValueError, match=r"input\[..., K=47\] does not match weight \[N, K=48\]"):
        sparse_gemm(torch.randn(5, 47), ws, "csr")
    with pytest.raises(ValueError, match="dtypes must match"):
        sparse_gemm(torch.randn(5, 48).double(), ws, "csr")
    with pytest.raises(ValueError, match="bias must be a 1-D tensor of length N=40"):
        sparse_gemm(torch.randn(5, 48), ws, "csr", torch.zeros(41))
    with pytest.raises(ValueError, match="hybrid sparse"):
        sparse_gemm(torch.randn(5, 48), torch.randn(40, 48).to_sparse(1), "coo")


def test_prune_2_4_keeps_the_two_largest_of_four():
    from gemmtune import prune_2_4

    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    pruned, err = prune_2_4(w, compress=False)
    groups = pruned.reshape(32, 16, 4)
    assert ((groups != 0).sum(-1) == 2).all()
    kept = w.reshape(32, 16, 4).abs().topk(2, -1).values.sum(-1)
    assert torch.allclose(groups.abs().sum(-1), kept)
    expect = ((w - pruned).norm() / w.norm()).item()
    assert err == pytest.approx(expect) and 0.2 < err < 0.6
    with pytest.raises(ValueError, match="K=30 is not a multiple of 4"):
        prune_2_4(torch.randn(8, 30), compress=False)
    with pytest.raises(ValueError, match="dense 2-D"):
        prune_2_4(w.to_sparse(), compress=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
            prune_2_4(w)


def test_table_loads_and_routes_to_the_dense_twin(tmp_path):
    import gemmtune
    from gemmtune.configs.table import ConfigTable
    from gemmtune.device import identity
    from gemmtune.errors import ConfigError
    from gemmtune.families import detect, get

    fam = get("sparse")
    ident = identity("cpu")
    w = _weight(40, 48)
    ws = w.to_sparse_bsr((4, 8))
    x = torch.randn(16, 48)
    key = gemmtune.ops.sparse.key_of(x, ws, None, "bsr")
    cols = list(fam.tuned_columns)
    row = dict(gfx=ident.gfx, cu_num=ident.cu_num, M=16, N=40, K=48, bias="False", dtype="torch.float32",
               libtype="torch", solidx=0, splitK=0, us=1, kernelName="dense", err_ratio=0, tflops=0, bw=0,
               pattern="bsr", density=str(key.density * 0.9), block="4x8")  # fmt: skip
    p = tmp_path / "sparse_tuned.csv"
    p.write_text(",".join(cols) + "\n" + ",".join(str(row[c]) for c in cols) + "\n")
    assert detect(cols, str(p)).name == "sparse"
    gemmtune.set_config(str(p))  # the row's density rounds up to the key's bucket
    res = gemmtune.resolve(key, "cpu", family="sparse")
    assert res.solution.kernel_name == "dense" and res.row is not None
    assert _rel_err(gemmtune.sparse_gemm(x, ws, "block"), x.double() @ w.double().t()) < 1e-6
    bad = dict(row, block="")
    p.write_text(",".join(cols) + "\n" + ",".join(str(bad[c]) for c in cols) + "\n")
    with pytest.raises(ConfigError, match="'block'"):
        ConfigTable.load(str(p), "sparse")


# ---- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["csr", "coo", "bsr", "2:4"])
def test_gpu_every_solution_matches_fp32(gpu, pattern):
    from gemmtune.backends import get as get_backend
    from gemmtune.families import get
    from gemmtune.ops.sparse import semi_structured_reason

    if pattern == "2:4" and semi_structured_reason(gpu, torch.bfloat16, (1024, 1024)):
        pytest.skip(semi_structured_reason(gpu, torch.bfloat16, (1024, 1024)))
    fam, be = get("sparse"), get_backend("torch", "sparse")
    key = SparseKey(300, 1024, 1024, pattern, 0.5 if pattern == "2:4" else 0.1, "32x32" if pattern == "bsr" else "",
                    True, torch.bfloat16)  # fmt: skip
    inputs = fam.make_inputs(key, gpu, 1, 0)[0]
    ref = fam.reference(key, inputs)
    x, w, b = inputs
    floor = _rel_err(torch.nn.functional.linear(x, w.to_dense(), b), ref)
    for sol in be.candidates(key, gpu):
        y = be.make_runner(sol, key, gpu)(*inputs)
        assert not torch.isnan(y).any(), sol.kernel_name
        assert _rel_err(y, ref) <= 2 * floor + 2e-3, (sol.kernel_name, _rel_err(y, ref), floor)


@pytest.mark.gpu
def test_gpu_prune_2_4_and_sparse_gemm(gpu):
    from gemmtune import prune_2_4, sparse_gemm
    from gemmtune.ops.sparse import semi_structured_reason

    if semi_structured_reason(gpu, torch.bfloat16, (512, 512)):
        pytest.skip(semi_structured_reason(gpu, torch.bfloat16, (512, 512)))
    w = torch.randn(512, 512, device=gpu, dtype=torch.bfloat16) / 23
    ws, err = prune_2_4(w)
    dense, err2 = prune_2_4(w, compress=False)
    assert err == err2 and 0.2 < err < 0.6
    x = torch.randn(100, 512, device=gpu, dtype=torch.bfloat16)
    ref = x.double() @ dense.double().t()
    assert _rel_err(sparse_gemm(x, ws, "2:4"), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("pattern", ["csr", "bsr", "2:4"])
def test_gpu_graph_replay(gpu, pattern):
    from gemmtune.backends import get as get_backend
    from gemmtune.families import get
    from gemmtune.ops.sparse import semi_structured_reason

    if pattern == "2:4" and semi_structured_reason(gpu, torch.bfloat16, (1024, 1024)):
        pytest.skip("no 2:4 here")
    fam, be = get("sparse"), get_backend("torch", "sparse")
    key = SparseKey(256, 1024, 1024, pattern, 0.5, "32x32" if pattern == "bsr" else "", False, torch.bfloat16)
    inputs = fam.make_inputs(key, gpu, 1, 0)[0]
    for sol in be.candidates(key, gpu):
        run = be.make_runner(sol, key, gpu)
        eager = run(*inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # every sparse solution is captured in serving: a failure is a failure
            out = run(*inputs)
        out.fill_(float("nan"))  # the replay must write every element again
        graph.replay()
        torch.cuda.synchronize()
        # cuSPARSE may sum in another order on each run: equal up to the dtype's rounding, not bitwise.
        assert _rel_err(out, eager.double()) < 1e-2, sol.kernel_name
