#!/usr/bin/env python3
"""Peer attention timings for cellkv's benchmark report (run on one GPU; H200 in mind).

What is measured
  Attention forward only, bf16, H_q = 32 query heads, H_kv = 8 KV heads (GQA group 4), D = 128
  (unless a shape's name ends in _d<D>), scale 1/sqrt(D), no autograd.

  decode  N x L   N sequences, one new query token each, each with L cached tokens; the query
                  sees all L (its own token is the last of them). Metric: effective TB/s =
                  live K+V bytes / time = N * L * H_kv * D * 2 bytes * 2 (K and V) / time, whatever
                  the implementation really reads (a cell pool with a dense mask reads more).
                  Shapes 1x32k, 16x4k, 64x2k, 256x1k.
  prefill N x L   N sequences of L tokens each, causal. Metric: useful TFLOP/s =
                  4 * N * (L * (L + 1) / 2) * H_q * D / time. Shapes 1x8k, 8x1k, 4x4k; and
                  1x8k_d64, 1x8k_d256: 1x8k at head dim 64 / 256 (scale 1/sqrt of that D, the
                  metric with that D), sdpa_cudnn_per_seq and sdpa_flash_per_seq only (a backend
                  that refuses the head dim is skipped with a message on stderr, no JSON line).

Peers (impl names as written to the JSON lines)
  sdpa_cudnn_per_seq, sdpa_flash_per_seq
      F.scaled_dot_product_attention inside sdpa_kernel(CUDNN_ATTENTION / FLASH_ATTENTION), each
      sequence contiguous in a batch: q [N, H_q, Lq, D], k/v [N, H_kv, L, D], enable_gqa=True,
      decode without a mask, prefill with is_causal=True. One call covers the whole batch. If the
      backend refuses enable_gqa, K/V heads are expanded (repeat_interleave, untimed) and the
      name gets '_expanded'.
  sdpa_mask_cell_pool
      The dense-mask cell layout cellkv grew from (an off-graph KV cache feeding SDPA): one pool
      of N*L + 128 spare cells, [1, H_kv, cells, D], shared by all sequences; decode uses interleaved placement (cell c belongs to sequence c % N, position
      c // N), prefill puts sequence i at cells [i*L, (i+1)*L). All queries form one batch of
      T tokens ([1, H_q, T, D]) with an explicit bool mask [1, 1, T, cells] (visible iff same
      sequence and cell position <= query position) built once, untimed; SDPA picks its backend
      (recorded in the 'backend' field). Shapes whose mask would pass 4 GB are skipped.
  flex_block_mask, flex_block_mask_clustered
      torch.compile(flex_attention) over the same pool, with a BlockMask (BLOCK_SIZE 128) made
      once, untimed, from mask_mod = same sequence and pos_of_cell[kv] <= pos_of_query[q];
      enable_gqa=True. Decode: flex_block_mask uses the interleaved placement,
      flex_block_mask_clustered hands out runs of 128 cells (run r belongs to sequence r % N).
      Prefill: only flex_block_mask, with sequence i at cells [i*L, (i+1)*L).

How it is timed
  Plain eager calls, no CUDA graphs. Each measurement rotates among enough distinct input
  buffer sets (q, K, V, pool) that they total at least 3x the L2 cache, so no call finds its
  K/V in L2. Per-call time comes from a pair of torch.cuda.Events around the attention call
  alone; the reported ms is the median. To keep launch overhead (Python, SDPA dispatch,
  torch.compile guards) out of those times, each batch of calls is queued behind a GPU spin
  (torch.cuda._sleep): the CPU enqueues the whole batch while the GPU waits, so the calls then
  run back to back and each event pair brackets GPU work only. If the spin ended before the
  batch was enqueued, the batch is thrown away and the spin lengthened.
  Each output is also checked against a float32 reference (field max_abs_err).

Output: one JSON object per line (stdout, or --out FILE):
  {"work": "decode"|"prefill", "shape": "16x4k", "impl": ..., "ms": median_ms, "metric": value,
   "unit": "TB/s"|"TFLOP/s", plus extra fields: layout (per_seq, interleaved, clustered128,
   contiguous), buffers (sets rotated), iters (timed calls), max_abs_err and max_rel_err (vs. a
   float32 reference; rel = relative to max |reference|), kernel (the longest GPU kernel of one
   call, from torch.profiler), backend (sdpa_mask_cell_pool: SDPA's default choice), and
   queued_ahead (false if launch overhead may have leaked into the times)}
  A peer that fails writes ms = metric = null and an "error" field, and 'n/a' in the table that
  is printed to stderr at the end.

  python3 benchmarks/peers.py [--quick] [--only decode|prefill] [--impls a,b] [--out FILE]
"""

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

H_Q, H_KV, D = 32, 8, 128
GROUP = H_Q // H_KV
DTYPE = torch.bfloat16
SPARE_CELLS = 128  # free cells at the end of every pool (belong to no sequence)
RUN = 128  # clustered placement: cells are handed out in runs of this many
FLEX_BLOCK = 128  # BlockMask BLOCK_SIZE
MAX_MASK_BYTES = 4 << 30

DECODE_SHAPES = [(1, 32768), (16, 4096), (64, 2048), (256, 1024)]
PREFILL_SHAPES = [(1, 8192), (8, 1024), (4, 4096)]
PREFILL_HEAD_DIM_SHAPES = [(1, 8192, 64), (1, 8192, 256)]  # (N, L, D): the per-seq SDPA peers only
QUICK_DECODE_SHAPES = [(16, 4096), (256, 1024)]
QUICK_PREFILL_SHAPES = [(8, 1024)]


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---- shapes --------------------------------------------------------------------------------------


class Case:
    """One shape: N sequences with L tokens of KV each; lq query tokens per sequence; head dim d
    (a d other than D adds '_d<d>' to the shape's name)."""

    def __init__(self, work, n, l, d=D):
        self.work, self.n, self.l, self.d = work, n, l, d
        self.lq = 1 if work == "decode" else l
        self.causal = work == "prefill"
        self.scale = 1.0 / math.sqrt(d)
        self.name = f"{n}x{l // 1024}k" + ("" if d == D else f"_d{d}")

    def metric(self, ms):
        if self.work == "decode":
            live_kv_bytes = self.n * self.l * H_KV * self.d * 2 * 2
            return live_kv_bytes / (ms * 1e-3) / 1e12, "TB/s"
        flops = 4 * self.n * (self.l * (self.l + 1) // 2) * H_Q * self.d
        return flops / (ms * 1e-3) / 1e12, "TFLOP/s"


def make_sets(case, count):
    """`count` independent per-sequence input sets: q [N,H_q,Lq,D], k/v [N,H_kv,L,D]."""
    sets = []
    for _ in range(count):
        sets.append({
            "q": torch.randn(case.n, H_Q, case.lq, case.d, device="cuda", dtype=DTYPE),
            "k": torch.randn(case.n, H_KV, case.l, case.d, device="cuda", dtype=DTYPE),
            "v": torch.randn(case.n, H_KV, case.l, case.d, device="cuda", dtype=DTYPE),
        })
    return sets


def sets_needed(bytes_per_set):
    """Enough buffer sets that they total >= 3x L2 (at least 2)."""
    try:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
    except Exception:
        l2 = 50 << 20
    return max(2, math.ceil(3 * l2 / bytes_per_set))


def set_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def reference(case, s):
    """Float32 attention per sequence (GQA by repeating K/V heads); [N, H_q, Lq, D]."""
    out = torch.empty(case.n, H_Q, case.lq, case.d, device="cuda", dtype=torch.float32)
    for i in range(case.n):
        q = s["q"][i].float()  # [H_q, Lq, D]
        k = s["k"][i].float().repeat_interleave(GROUP, dim=0)  # [H_q, L, D]
        v = s["v"][i].float().repeat_interleave(GROUP, dim=0)
        scores = (q @ k.transpose(-1, -2)) * case.scale  # [H_q, Lq, L]
        if case.causal:
            # query j (position L - Lq + j) sees keys at positions <= its own
            qpos = torch.arange(case.l - case.lq, case.l, device="cuda")[:, None]
            kpos = torch.arange(case.l, device="cuda")[None, :]
            scores.masked_fill_(kpos > qpos, float("-inf"))
        out[i] = torch.softmax(scores, dim=-1) @ v
        del q, k, v, scores
    return out


# ---- the cell pool -------------------------------------------------------------------------------


def placement(case, kind):
    """seq_of_cell, pos_of_cell (int32, length N*L + SPARE_CELLS; spare cells have seq -1)."""
    n, l = case.n, case.l
    c = torch.arange(n * l, device="cuda")
    if kind == "interleaved":  # decode step p gives cell p*N + s to sequence s
        seq, pos = c % n, c // n
    elif kind == "clustered":  # runs of RUN cells; run r belongs to sequence r % N
        assert l % RUN == 0
        run, off = c // RUN, c % RUN
        seq, pos = run % n, (run // n) * RUN + off
    elif kind == "contiguous":  # sequence s owns cells [s*L, (s+1)*L)
        seq, pos = c // l, c % l
    else:
        raise ValueError(kind)
    seq = torch.cat([seq, torch.full((SPARE_CELLS,), -1, device="cuda")])
    pos = torch.cat([pos, torch.zeros(SPARE_CELLS, device="cuda", dtype=pos.dtype)])
    return seq.to(torch.int32), pos.to(torch.int32)


def query_tokens(case):
    """seq_of_query, pos_of_query for the pooled query batch (token t = seq * Lq + j)."""
    t = torch.arange(case.n * case.lq, device="cuda")
    seq = t // case.lq
    pos = (case.l - case.lq) + t % case.lq
    return seq.to(torch.int32), pos.to(torch.int32)


def to_pool(x, seq_of_cell, pos_of_cell):
    """Per-sequence [N, H, L, D] -> pool [1, H, cells, D] in the given placement."""
    cells = seq_of_cell.numel()
    pool = torch.zeros(1, x.shape[1], cells, x.shape[3], device=x.device, dtype=x.dtype)
    live = (seq_of_cell >= 0).nonzero().squeeze(1)
    s = seq_of_cell[live].long()
    p = pos_of_cell[live].long()
    rows = x.permute(0, 2, 1, 3)[s, p]  # [live, H, D]
    pool[0].index_copy_(1, live, rows.transpose(0, 1))
    return pool


def q_to_pool(q):
    """[N, H_q, Lq, D] -> [1, H_q, N*Lq, D] (token t = seq * Lq + j)."""
    n, h, lq, d = q.shape
    return q.permute(1, 0, 2, 3).reshape(1, h, n * lq, d).contiguous()


def pool_out_to_seq(out, case):
    """[1, H_q, N*Lq, D] -> [N, H_q, Lq, D]."""
    return out[0].reshape(H_Q, case.n, case.lq, case.d).permute(1, 0, 2, 3)


def pool_sets(case, sets, kind):
    seq_c, pos_c = placement(case, kind)
    pooled = []
    for s in sets:
        pooled.append({
            "q": q_to_pool(s["q"]),
            "k": to_pool(s["k"], seq_c, pos_c),
            "v": to_pool(s["v"], seq_c, pos_c),
        })
    return pooled, seq_c, pos_c


# ---- timing --------------------------------------------------------------------------------------


def _gpu_sleep(cycles):
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(int(cycles))
    return sleep is not None


def time_calls(calls, quick):
    """Median GPU ms of one call; call i uses calls[i % len(calls)] (rotating buffers).

    Returns (median_ms, timed_calls, queued_ahead); queued_ahead is False when some timed batch
    could not be queued entirely behind the GPU spin (torch.cuda._sleep missing, or a call that
    waits for the GPU itself), so launch gaps may be inside those times.
    """
    n = len(calls)
    warmup = 2 if quick else 5
    for i in range(warmup):
        calls[i % n]()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(3):
        calls[i % n]()
    torch.cuda.synchronize()
    rough_s = (time.perf_counter() - t0) / 3
    budget_s, lo, hi = (0.3, 5, 20) if quick else (2.0, 10, 200)
    iters = int(min(hi, max(lo, budget_s / max(rough_s, 1e-6))))

    times, i, queued_ahead = [], 0, True
    sleep_cycles = 1_000_000  # ~0.5 ms at 2 GHz; grows until the CPU stays ahead
    while len(times) < iters:
        batch = min(16, iters - len(times))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(batch)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(batch)]
        gate = torch.cuda.Event()
        have_sleep = _gpu_sleep(sleep_cycles)
        gate.record()
        for j in range(batch):
            starts[j].record()
            calls[i % n]()
            ends[j].record()
            i += 1
        cpu_ahead = not gate.query()  # GPU still spinning: every call of the batch was queued
        torch.cuda.synchronize()
        if have_sleep and not cpu_ahead and sleep_cycles < 4_000_000_000:
            sleep_cycles *= 4  # the GPU caught up with the CPU: throw the batch away, spin longer
            continue
        queued_ahead = queued_ahead and have_sleep and cpu_ahead
        times.extend(s.elapsed_time(e) for s, e in zip(starts, ends))
    return statistics.median(times), len(times), queued_ahead


def backend_of_sdpa(q, k, v, mask, causal, scale):
    """Name of the backend SDPA's default choice takes for these inputs (private API)."""
    try:
        from torch.nn.attention import SDPBackend

        names = {}
        for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION",
                     "OVERRIDEABLE"):
            if hasattr(SDPBackend, name):
                names[int(getattr(SDPBackend, name))] = name.lower()
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask, dropout_p=0.0,
                                         is_causal=causal, scale=scale, enable_gqa=True)
        return names.get(int(choice), str(choice))
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


def top_kernel(call):
    """Name of the GPU kernel that took the most time in one call (via torch.profiler)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        best, best_t = None, 0.0
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None)
            if t is None:
                t = getattr(e, "cuda_time_total", 0.0)
            if e.key.startswith(("aten::", "cuda", "Memcpy", "Memset", "ProfilerStep")):
                continue
            if t > best_t:
                best, best_t = e.key, t
        return best[:90] if best else None
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__})"


# ---- one measurement -----------------------------------------------------------------------------


def measure(results, case, impl, calls, to_seq, ref, opts, layout, backend=None, context=None):
    """Check, time and record one impl; never raises (failures are recorded as n/a)."""
    rec = {"work": case.work, "shape": case.name, "impl": impl, "ms": None, "metric": None,
           "unit": case.metric(1.0)[1], "layout": layout, "buffers": len(calls)}
    try:
        with context() if context else contextlib.nullcontext():
            out = calls[0]()  # first call: compiles / surfaces unsupported-input errors
            torch.cuda.synchronize()
            err = (to_seq(out).float() - ref).abs().max().item()
            rel = err / max(ref.abs().max().item(), 1e-12)
            del out
            ms, iters, queued_ahead = time_calls(calls, opts.quick)
            kernel = top_kernel(calls[0])
        rec.update(ms=round(ms, 5), metric=round(case.metric(ms)[0], 4), iters=iters,
                   max_abs_err=float(f"{err:.3g}"), max_rel_err=float(f"{rel:.3g}"),
                   kernel=kernel, queued_ahead=queued_ahead)
        if backend:
            rec["backend"] = backend
        if rel > 0.05:
            log(f"  WARNING {impl} {case.name}: max error {err:.3g} = {rel:.1%} of max |reference|")
        if not queued_ahead:
            log(f"  WARNING {impl} {case.name}: calls were not all queued ahead of the GPU; "
                "launch overhead may be in the time")
    except Exception as e:  # noqa: BLE001  (OOM included)
        rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()
    shown = f"{rec['metric']:.3f} {rec['unit']} ({rec['ms']:.4f} ms)" if rec["ms"] else "n/a " + rec.get("error", "")
    log(f"  {case.work:7s} {case.name:6s} {impl:32s} {shown}")
    results.append(rec)
    opts.emit(rec)


def record_failure(results, case, impl, error, opts):
    rec = {"work": case.work, "shape": case.name, "impl": impl, "ms": None, "metric": None,
           "unit": case.metric(1.0)[1], "error": error}
    log(f"  {case.work:7s} {case.name:6s} {impl:32s} n/a {error}")
    results.append(rec)
    opts.emit(rec)


# ---- the peers -----------------------------------------------------------------------------------


def run_sdpa_per_seq(results, case, sets, ref, opts, label, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def context():
        return sdpa_kernel(backend)

    s0 = sets[0]
    gqa = True
    try:
        with context():
            F.scaled_dot_product_attention(s0["q"], s0["k"], s0["v"], is_causal=case.causal,
                                           scale=case.scale, enable_gqa=True)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        log(f"  {label}: enable_gqa refused ({(str(e).strip().splitlines() or [''])[-1][:120]}); "
            "expanding K/V heads outside the timed region")
        gqa = False

    if not gqa and case.d != D:
        # A head dim other than the reference one: a backend that refuses it with expanded heads
        # too is skipped (stderr only, no JSON line) rather than reported as a failure.
        try:
            with context():
                F.scaled_dot_product_attention(
                    s0["q"], s0["k"].repeat_interleave(GROUP, dim=1),
                    s0["v"].repeat_interleave(GROUP, dim=1), is_causal=case.causal,
                    scale=case.scale)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            log(f"  {label} {case.name}: skipped, the backend refuses head dim {case.d} "
                f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:120]})")
            gc.collect()
            torch.cuda.empty_cache()
            return

    impl = label if gqa else label + "_expanded"
    use = sets
    if not gqa:
        try:
            use = [{"q": s["q"], "k": s["k"].repeat_interleave(GROUP, dim=1),
                    "v": s["v"].repeat_interleave(GROUP, dim=1)} for s in sets]
        except Exception:  # noqa: BLE001  (OOM while expanding: measure() records n/a below)
            use = sets
    calls = [lambda s=s: F.scaled_dot_product_attention(
        s["q"], s["k"], s["v"], is_causal=case.causal, scale=case.scale, enable_gqa=gqa) for s in use]
    measure(results, case, impl, calls, lambda out: out, ref, opts, "per_seq", context=context)


def run_sdpa_mask_pool(results, case, sets, ref, opts):
    kind = "interleaved" if case.work == "decode" else "contiguous"
    t = case.n * case.lq
    cells = case.n * case.l + SPARE_CELLS
    if t * cells > MAX_MASK_BYTES:
        log(f"  sdpa_mask_cell_pool {case.name}: mask of {t * cells / 2**30:.1f} GiB, skipped")
        return
    pooled, seq_c, pos_c = pool_sets(case, sets, kind)
    seq_q, pos_q = query_tokens(case)
    mask = ((seq_c[None, :] == seq_q[:, None]) & (pos_c[None, :] <= pos_q[:, None]))
    mask = mask.view(1, 1, t, cells)
    p0 = pooled[0]
    backend = backend_of_sdpa(p0["q"], p0["k"], p0["v"], mask, False, case.scale)
    calls = [lambda s=s: F.scaled_dot_product_attention(
        s["q"], s["k"], s["v"], attn_mask=mask, scale=case.scale, enable_gqa=True) for s in pooled]
    measure(results, case, "sdpa_mask_cell_pool", calls, lambda out: pool_out_to_seq(out, case),
            ref, opts, kind, backend=backend)


_flex_compiled = None


def flex():
    """torch.compile(flex_attention), made once; recompiles per shape (dynamic=False)."""
    global _flex_compiled
    if _flex_compiled is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # Every shape and mask_mod is a new specialization: raise dynamo's per-function cap.
        for knob in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(256, getattr(torch._dynamo.config, knob)))
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled


def run_flex(results, case, sets, ref, opts, impl, kind):
    from torch.nn.attention.flex_attention import create_block_mask

    pooled, seq_c, pos_c = pool_sets(case, sets, kind)
    seq_q, pos_q = query_tokens(case)

    def mask_mod(b, h, q_idx, kv_idx):
        return (seq_c[kv_idx] == seq_q[q_idx]) & (pos_c[kv_idx] <= pos_q[q_idx])

    try:
        block_mask = create_block_mask(mask_mod, None, None, case.n * case.lq, seq_c.numel(),
                                       device="cuda", BLOCK_SIZE=FLEX_BLOCK)
    except Exception as e:  # noqa: BLE001
        record_failure(results, case, impl,
                       f"create_block_mask: {type(e).__name__}: {str(e).strip()[:200]}", opts)
        return
    fn = flex()
    calls = [lambda s=s: fn(s["q"], s["k"], s["v"], block_mask=block_mask, scale=case.scale,
                            enable_gqa=True) for s in pooled]
    layout = kind if kind != "clustered" else f"clustered{RUN}"
    measure(results, case, impl, calls, lambda out: pool_out_to_seq(out, case), ref, opts, layout)


def run_case(results, case, opts):
    log(f"{case.work} {case.name}")
    probe = make_sets(case, 1)
    count = sets_needed(set_bytes(probe[0].values()))
    sets = probe + make_sets(case, count - 1)
    ref = reference(case, sets[0])

    peers = [
        ("sdpa_cudnn_per_seq", lambda: run_sdpa_per_seq(
            results, case, sets, ref, opts, "sdpa_cudnn_per_seq", "CUDNN_ATTENTION")),
        ("sdpa_flash_per_seq", lambda: run_sdpa_per_seq(
            results, case, sets, ref, opts, "sdpa_flash_per_seq", "FLASH_ATTENTION")),
        ("sdpa_mask_cell_pool", lambda: run_sdpa_mask_pool(results, case, sets, ref, opts)),
    ]
    if case.d != D:  # the head-dim shapes: the per-seq SDPA peers only
        peers = peers[:2]
    elif case.work == "decode":
        peers += [
            ("flex_block_mask", lambda: run_flex(
                results, case, sets, ref, opts, "flex_block_mask", "interleaved")),
            ("flex_block_mask_clustered", lambda: run_flex(
                results, case, sets, ref, opts, "flex_block_mask_clustered", "clustered")),
        ]
    else:
        peers += [("flex_block_mask", lambda: run_flex(
            results, case, sets, ref, opts, "flex_block_mask", "contiguous"))]
    for impl, run in peers:
        if opts.impls and impl not in opts.impls:
            continue
        try:
            run()
        except Exception as e:  # noqa: BLE001  (e.g. OOM while building a pool or a mask)
            record_failure(results, case, impl, f"{type(e).__name__}: {str(e).strip()[:200]}", opts)
            gc.collect()
            torch.cuda.empty_cache()


# ---- the table -----------------------------------------------------------------------------------


def print_table(results):
    impls = []
    for r in results:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    rows = []
    for r in results:
        key = (r["work"], r["shape"])
        if key not in rows:
            rows.append(key)
    cell = {(r["work"], r["shape"], r["impl"]): r for r in results}
    width = max(12, max(len(i) for i in impls) if impls else 12)
    log("")
    log(f"{'work':8s} {'shape':7s} " + " ".join(f"{i:>{width}s}" for i in impls))
    for work, shape in rows:
        line = f"{work:8s} {shape:7s} "
        vals = []
        for i in impls:
            r = cell.get((work, shape, i))
            if r is None:
                vals.append(f"{'-':>{width}s}")
            elif r["metric"] is None:
                vals.append(f"{'n/a':>{width}s}")
            else:
                vals.append(f"{r['metric']:>{width - 8}.3f} {r['unit']:<7s}")
        log(line + " ".join(vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: fewer iterations, decode 16x4k/256x1k and prefill 8x1k only")
    ap.add_argument("--only", choices=["decode", "prefill"], help="run one kind of work only")
    ap.add_argument("--out", help="write the JSON lines here instead of stdout")
    ap.add_argument("--impls", type=lambda s: s.split(","), default=None,
                    help="comma-separated peers to run (default: all)")
    opts = ap.parse_args()

    if not torch.cuda.is_available():
        sys.exit("peers.py needs a CUDA GPU")
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    log(f"device: {props.name}, L2 {getattr(props, 'L2_cache_size', 0) / 2**20:.0f} MiB, "
        f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")

    out = open(opts.out, "w") if opts.out else sys.stdout

    def emit(rec):
        out.write(json.dumps(rec) + "\n")
        out.flush()

    opts.emit = emit

    cases = []
    if opts.only in (None, "decode"):
        cases += [Case("decode", n, l) for n, l in (QUICK_DECODE_SHAPES if opts.quick else DECODE_SHAPES)]
    if opts.only in (None, "prefill"):
        cases += [Case("prefill", n, l) for n, l in (QUICK_PREFILL_SHAPES if opts.quick else PREFILL_SHAPES)]
        if not opts.quick:
            cases += [Case("prefill", n, l, d) for n, l, d in PREFILL_HEAD_DIM_SHAPES]

    results = []
    for case in cases:
        try:
            run_case(results, case, opts)
        except Exception as e:  # noqa: BLE001  (e.g. OOM making the inputs)
            log(f"  {case.work} {case.name}: skipped, {type(e).__name__}: {str(e)[:200]}")
        gc.collect()  # the case's buffers went out of scope with run_case
        torch.cuda.empty_cache()
    print_table(results)
    if opts.out:
        out.close()


if __name__ == "__main__":
    main()
