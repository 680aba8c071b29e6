#!/usr/bin/env python3
"""PyTorch peer of cellkv's serving benchmark (cellkv-bench-serve), and the report that puts both in
one table.

The peer
  The example decoder of cellkv (examples/llama: 8 layers, dim 1024, H_q 16, H_kv 4, D 64, ffn
  2816, vocab 16,384, bf16, RMSNorm, RoPE on interleaved pairs, SwiGLU), with the same weights:
  generated on the GPU by the same integer recipe as llama::generate (splitmix64 streams, then the
  same float32 operations, then bf16 round-to-nearest-even), and, with --check-weights FILE, compared
  bit for bit with the file cellkv-bench-serve --weights-out writes. gpt-fast style: fused Q/K/V
  weights, a static per-sequence KV cache [B, H_kv, max_len, D] per layer updated in place, the
  decode step (forward + greedy argmax) under torch.compile(mode="reduce-overhead", fullgraph=True)
  so it replays as a CUDA graph; GQA without copying K/V (the group's query heads ride as query rows
  of their KV head); attention over the whole static cache with a causal mask, as gpt-fast does.
  Batch B = sessions: B sequences of the same 128-token prompt length, prefilled (eager, untimed),
  then decode steps timed exactly as cellkv times its own: after warm-up, tokens/s = B * steps /
  wall time of `steps` back-to-back decode calls, the next token fed back on the device. No
  continuous batching: every sequence is at the same position.

  python3 benchmarks/serve_peer.py [--sessions 1,16,64,256] [--out FILE] [--check-weights FILE]
                                   [--ready FILE --go FILE] [--tune]
  --ready/--go: compile and warm every batch size, write the ready file, wait for the go file, then
  time (so that a build or cellkv's benchmark can share the machine while the peer compiles).

The report
  python3 benchmarks/serve_peer.py --report results-serve.jsonl
  reads cellkv's and the peer's JSON lines ({"work": "serve", "shape": "N sessions", "impl":
  cellkv_cell_clustered | cellkv_sequence | cellkv_cell_fp8 | torch_compile_static, "metric":
  tokens/s, ...}) and prints one markdown table: tokens/s, the ratio to the peer, tokens per step,
  cellkv's step breakdown and its fraction of the physical floor, then the targets met or missed;
  the fp8 KV cache's tokens/s against the bf16 cell layout's (cellkv-bench-serve --kv fp8), when
  the file holds both; then the parallel-sampling rows (work "serve_parallel_sampling": sharing on
  and off).
"""

import argparse
import json
import math
import os
import sys
import time

CONFIG = dict(vocab=16384, dim=1024, layers=8, heads_q=16, heads_kv=4, head_dim=64, ffn=2816,
              rope_theta=10000.0, norm_eps=1e-5, seed=1, prompt=128, max_len=384, warmup=3, timed=64)
PEER = "torch_compile_static"
CELLKV = ("cellkv_cell_clustered", "cellkv_sequence", "cellkv_cell_fp8")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- weights, as llama::generate

def generate_weights(cfg, device):
    """The weights of llama::generate (examples/llama/config.hpp), bf16, on `device`, in its order:
    a dict of name -> tensor with the [in, out] matrices of the C++ side."""
    import torch

    def signed(u):
        u &= (1 << 64) - 1
        return u - (1 << 64) if u >= 1 << 63 else u

    def srl(x, n):  # logical right shift of int64 tensors holding uint64 bits
        return (x >> n) & ((1 << (64 - n)) - 1)

    def splitmix64(x):
        x = x + signed(0x9E3779B97F4A7C15)
        x = (x ^ srl(x, 30)) * signed(0xBF58476D1CE4E5B9)
        x = (x ^ srl(x, 27)) * signed(0x94D049BB133111EB)
        return x ^ srl(x, 31)

    seed = cfg["seed"]

    def uniform(n, limit, stream_id):
        base = signed((seed * 0x100000001B3) ^ (stream_id << 40))
        i = torch.arange(n, device=device, dtype=torch.int64)
        r = splitmix64(base ^ i)
        u = (srl(r, 40).to(torch.float32) / 8388608.0) - 1.0  # exact: < 2^24 / 2^23 - 1
        lim = torch.tensor(limit, dtype=torch.float32, device=device)
        return u * lim

    def f32(x):
        return torch.tensor(x, dtype=torch.float32).item()

    def matrix(rows, cols, stream_id):  # limit sqrt(3 / in), in float32 as the C++ side
        limit = torch.sqrt(torch.tensor(3.0, dtype=torch.float32) / torch.tensor(float(rows), dtype=torch.float32)).item()
        return uniform(rows * cols, limit, stream_id).view(rows, cols)

    def norm_gain(n, stream_id):
        return uniform(n, f32(0.1), stream_id) + 1.0

    c = cfg
    q_w, kv_w = c["heads_q"] * c["head_dim"], c["heads_kv"] * c["head_dim"]
    w = {"embed": uniform(c["vocab"] * c["dim"], 1.0, 1).view(c["vocab"], c["dim"])}
    for l in range(c["layers"]):
        i = 100 + 16 * l
        w[f"{l}.attn_norm"] = norm_gain(c["dim"], i)
        w[f"{l}.wq"] = matrix(c["dim"], q_w, i + 1)
        w[f"{l}.wk"] = matrix(c["dim"], kv_w, i + 2)
        w[f"{l}.wv"] = matrix(c["dim"], kv_w, i + 3)
        w[f"{l}.wo"] = matrix(q_w, c["dim"], i + 4)
        w[f"{l}.ffn_norm"] = norm_gain(c["dim"], i + 5)
        w[f"{l}.w1"] = matrix(c["dim"], c["ffn"], i + 6)
        w[f"{l}.w3"] = matrix(c["dim"], c["ffn"], i + 7)
        w[f"{l}.w2"] = matrix(c["ffn"], c["dim"], i + 8)
    w["final_norm"] = norm_gain(c["dim"], 2)
    w["lm_head"] = matrix(c["dim"], c["vocab"], 3) * 4.0
    return {k: v.to(torch.bfloat16) for k, v in w.items()}


def weight_order(cfg):
    names = ["embed"]
    for l in range(cfg["layers"]):
        names += [f"{l}.{n}" for n in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2")]
    return names + ["final_norm", "lm_head"]


def check_weights(path, weights, cfg):
    """Compares the generated weights with cellkv's file (bf16, weight_order): 'identical', or why not."""
    import torch
    if not os.path.exists(path):
        return "not checked (no file)"
    total = sum(weights[n].numel() for n in weight_order(cfg))
    if os.path.getsize(path) != 2 * total:
        return f"file size {os.path.getsize(path)} != {2 * total}"
    disk = torch.from_file(path, shared=False, size=total, dtype=torch.bfloat16)
    at = 0
    for n in weight_order(cfg):
        t = weights[n].reshape(-1).cpu()
        if not torch.equal(disk[at:at + t.numel()].view(torch.int16), t.view(torch.int16)):
            return f"differ in {n}"
        at += t.numel()
    return "identical"


# ---------------------------------------------------------------- the model

def build_model_class():
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def frozen(t):
        return nn.Parameter(t, requires_grad=False)

    class Layer(nn.Module):
        def __init__(self, w, l, batch, c, max_len, device):
            super().__init__()
            self.attn_norm, self.ffn_norm = frozen(w[f"{l}.attn_norm"]), frozen(w[f"{l}.ffn_norm"])
            self.wqkv, self.wo = frozen(w[f"{l}.wqkv_t"]), frozen(w[f"{l}.wo_t"])
            self.w1, self.w3, self.w2 = frozen(w[f"{l}.w1_t"]), frozen(w[f"{l}.w3_t"]), frozen(w[f"{l}.w2_t"])
            shape = (batch, c["heads_kv"], max_len, c["head_dim"])
            self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.bfloat16, device=device), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.bfloat16, device=device), persistent=False)

    class Transformer(nn.Module):
        """The decoder for batch `batch` with its static KV cache (buffers); weights (frozen
        parameters) share storage between instances."""

        def __init__(self, cfg, w, batch, max_len, device):
            super().__init__()
            c = cfg
            self.c = c
            self.q_w, self.kv_w = c["heads_q"] * c["head_dim"], c["heads_kv"] * c["head_dim"]
            self.group = c["heads_q"] // c["heads_kv"]
            self.embed = frozen(w["embed"])
            self.layers = nn.ModuleList(Layer(w, l, batch, c, max_len, device) for l in range(c["layers"]))
            self.final_norm = frozen(w["final_norm"])
            self.lm_head = frozen(w["lm_head_t"])
            self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=device)),
                                 persistent=False)
            half = c["head_dim"] // 2
            inv = c["rope_theta"] ** (-2.0 * torch.arange(half, dtype=torch.float32, device=device) / c["head_dim"])
            angles = torch.arange(max_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
            self.register_buffer("rope", torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1),
                                 persistent=False)  # [max_len, D/2, 2]

        def norm(self, x, gain):
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.c["norm_eps"]) * gain.float()).to(x.dtype)

        def rotate(self, x, pos):  # x [B, T, H, D], pairs (2i, 2i + 1)
            xs = x.float().reshape(*x.shape[:-1], -1, 2)
            r = self.rope[pos].view(1, xs.size(1), 1, xs.size(3), 2)
            out = torch.stack([xs[..., 0] * r[..., 0] - xs[..., 1] * r[..., 1],
                               xs[..., 0] * r[..., 1] + xs[..., 1] * r[..., 0]], dim=-1)
            return out.flatten(3).to(x.dtype)

        def forward(self, tokens, pos):  # tokens [B, T], pos [T]; logits of the last position
            c = self.c
            B, T = tokens.shape
            H, Hkv, D = c["heads_q"], c["heads_kv"], c["head_dim"]
            x = F.embedding(tokens, self.embed)
            mask = self.causal[pos]  # [T, max_len]
            for lw in self.layers:
                h = self.norm(x, lw.attn_norm)
                q, k, v = F.linear(h, lw.wqkv).split([self.q_w, self.kv_w, self.kv_w], dim=-1)
                q = self.rotate(q.reshape(B, T, H, D), pos)
                k = self.rotate(k.reshape(B, T, Hkv, D), pos)
                v = v.reshape(B, T, Hkv, D)
                lw.k_cache[:, :, pos] = k.transpose(1, 2)
                lw.v_cache[:, :, pos] = v.transpose(1, 2)
                if T == 1:  # decode: the group's query heads as query rows of their KV head, no K/V copy
                    qg = q.reshape(B, Hkv, self.group, D)
                    y = F.scaled_dot_product_attention(qg, lw.k_cache, lw.v_cache, attn_mask=mask[None, None])
                    y = y.reshape(B, 1, self.q_w)
                else:
                    kk = lw.k_cache.repeat_interleave(self.group, dim=1)
                    vv = lw.v_cache.repeat_interleave(self.group, dim=1)
                    y = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask[None, None])
                    y = y.transpose(1, 2).reshape(B, T, self.q_w)
                x = x + F.linear(y, lw.wo)
                h = self.norm(x, lw.ffn_norm)
                x = x + F.linear(F.silu(F.linear(h, lw.w1)) * F.linear(h, lw.w3), lw.w2)
            x = x[:, -1:]
            return F.linear(self.norm(x, self.final_norm), self.lm_head).float()

    return Transformer


def linear_weights(cfg, w):
    """The [out, in] layout nn.functional.linear reads, Q/K/V fused, made once for every instance."""
    import torch
    out = dict(w)
    for l in range(cfg["layers"]):
        out[f"{l}.wqkv_t"] = torch.cat([w[f"{l}.wq"], w[f"{l}.wk"], w[f"{l}.wv"]], dim=1).t().contiguous()
        for n in ("wo", "w1", "w3", "w2"):
            out[f"{l}.{n}_t"] = w[f"{l}.{n}"].t().contiguous()
    out["lm_head_t"] = w["lm_head"].t().contiguous()
    return out


def decode_one(model, tokens, pos):
    import torch
    logits = model(tokens, pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


# ---------------------------------------------------------------- the peer's run

class Runner:
    def __init__(self, cfg, weights, batch, device, compiled):
        import torch
        Transformer = build_model_class()
        self.torch = torch
        self.batch = batch
        self.model = Transformer(cfg, weights, batch, cfg["max_len"], device)
        self.step = compiled
        prompt = torch.tensor([[(s * 131 + t * 7) % cfg["vocab"] for t in range(cfg["prompt"])] for s in range(batch)],
                              dtype=torch.int64, device=device)
        with torch.no_grad():  # prefill, eager, untimed
            logits = self.model(prompt, torch.arange(cfg["prompt"], device=device))
            self.tokens = torch.argmax(logits[:, -1], dim=-1, keepdim=True)
        self.pos = torch.tensor([cfg["prompt"]], dtype=torch.int64, device=device)

    def run(self, steps):
        torch = self.torch
        with torch.no_grad():
            for _ in range(steps):
                torch.compiler.cudagraph_mark_step_begin()
                out = self.step(self.model, self.tokens, self.pos)
                self.tokens = out.clone()
                self.pos += 1

    def time(self, steps):
        torch = self.torch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.run(steps)
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def run_peer(args):
    import torch
    import torch._inductor.config as inductor_config
    inductor_config.triton.unique_kernel_names = True
    inductor_config.fx_graph_cache = True
    if args.tune:
        inductor_config.coordinate_descent_tuning = True
    device = "cuda"
    cfg = dict(CONFIG)
    sessions = [int(s) for s in args.sessions.split(",")]
    t_start = time.perf_counter()
    generated = generate_weights(cfg, device)
    weights = linear_weights(cfg, generated)
    log(f"serve_peer: torch {torch.__version__}, {torch.cuda.get_device_name()}; weights generated "
        f"({time.perf_counter() - t_start:.1f} s)")
    compiled = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
    runners = {}
    for b in sessions:
        t0 = time.perf_counter()
        runners[b] = Runner(cfg, weights, b, device, compiled)
        runners[b].run(cfg["warmup"])  # compiles, records the CUDA graph
        torch.cuda.synchronize()
        log(f"serve_peer: batch {b}: prefilled, compiled and warmed in {time.perf_counter() - t0:.1f} s")
    if args.ready:
        open(args.ready, "w").close()
    if args.go:
        t0 = time.perf_counter()
        while not os.path.exists(args.go) and time.perf_counter() - t0 < args.wait:
            time.sleep(0.2)
        log(f"serve_peer: go after {time.perf_counter() - t0:.1f} s")
    out = open(args.out, "w") if args.out else sys.stdout
    for b in sessions:
        r = runners[b]
        r.run(cfg["warmup"])
        secs = r.time(cfg["timed"])
        tps = b * cfg["timed"] / secs
        rec = {"work": "serve", "shape": f"{b} sessions", "impl": PEER, "metric": round(tps, 1), "unit": "tokens/s",
               "tokens_per_step": b, "ms_per_step": round(1e3 * secs / cfg["timed"], 4), "max_len": cfg["max_len"],
               "torch": torch.__version__}
        print(json.dumps(rec), file=out, flush=True)
        log(f"  {b:4d} sessions  {PEER}  {tps:10.0f} tokens/s  {1e3 * secs / cfg['timed']:.3f} ms/step")
    if args.check_weights:
        log(f"serve_peer: weights against {args.check_weights}: {check_weights(args.check_weights, generated, cfg)}")


# ---------------------------------------------------------------- the report

def report(path):
    rows = {}
    sampling = []
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("work") == "serve_parallel_sampling":
            sampling.append(rec)
        if rec.get("work") != "serve":
            continue
        n = int(rec["shape"].split()[0])
        rows.setdefault(n, {})[rec["impl"]] = rec
    out = []
    out.append("| sessions | impl | tokens/s | vs peer | tokens/step | ms/step | host plan / enqueue / wait ms "
               "| GPU upload / forward / sampling / copy / idle ms | floor ms | of floor |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for n in sorted(rows):
        peer = rows[n].get(PEER)
        for impl in CELLKV + (PEER,):
            r = rows[n].get(impl)
            if r is None:
                continue
            ratio = ""
            if impl != PEER and peer and peer.get("metric"):
                ratio = f"{r['metric'] / peer['metric']:.2f}x"
                verdicts.append((f"{n} sessions {impl} >= 1.0x peer", r["metric"] >= peer["metric"]))
            host = gpu = floor = frac = ""
            if impl != PEER:
                host = f"{r['host_plan_ms']:.3f} / {r['host_enqueue_ms']:.3f} / {r['host_wait_ms']:.3f}"
                gpu = (f"{r['gpu_upload_ms']:.3f} / {r['gpu_forward_ms']:.3f} / {r['gpu_sampling_ms']:.3f} / "
                       f"{r['gpu_copy_ms']:.3f} / {r['gpu_idle_ms']:.3f}")
                floor = f"{r['floor_ms']:.3f}"
                frac = f"{100 * r['fraction_of_floor']:.0f}% ({100 * r.get('fraction_of_roofline', 0):.0f}% of roofline)"
                if n == 256:
                    verdicts.append((f"256 sessions {impl} >= 40% of floor", r["fraction_of_floor"] >= 0.4))
                verdicts.append((f"{n} sessions {impl} tokens/step == {n}", abs(r["tokens_per_step"] - n) < 1e-9))
            out.append(f"| {n} | {impl} | {r['metric']:.0f} | {ratio} | {r.get('tokens_per_step', n):.0f} | "
                       f"{r['ms_per_step']:.3f} | {host} | {gpu} | {floor} | {frac} |")
    out.append("")
    out.append("floor: bytes / 4.2 TB/s + FLOPs / 780 TFLOP/s for one decode step: bytes = bf16 weights read once "
               "+ every live K/V row read once (mean context of the timed steps; fp8 rows: codes and scales); FLOPs = 2 x parameters x sessions "
               "+ attention (the JSON lines also give the roofline, max of the two, and the fraction of it). GPU "
               "phases from a second timed pass with events between phases (the sampler then runs outside the "
               "graph); host times from the plain pass.")
    for what, ok in verdicts:
        out.append(f"- {'PASS' if ok else 'MISS'}: {what}")
    out += fp8_report(rows)
    out += sampling_report(sampling)
    print("\n".join(out))


def fp8_report(rows):
    """The fp8 KV cache's tokens/s over the bf16 cell layout's, per session count holding both."""
    lines = []
    for n in sorted(rows):
        fp8, bf16 = rows[n].get("cellkv_cell_fp8"), rows[n].get("cellkv_cell_clustered")
        if not fp8 or not bf16 or not bf16.get("metric"):
            continue
        kv = ""
        if fp8.get("kv_bytes_per_cell") and bf16.get("kv_bytes_per_cell"):
            kv = f", K/V bytes per cell {fp8['kv_bytes_per_cell']} vs {bf16['kv_bytes_per_cell']}"
        lines.append(f"- fp8 KV cache, {n} sessions: {fp8['metric'] / bf16['metric']:.2f}x the bf16 cell layout's "
                     f"tokens/s{kv}")
    return [""] + lines if lines else []


def sampling_report(recs):
    """The parallel-sampling rows (cellkv-bench-serve --parallel-sampling): each sharing setting's
    whole-job and decode-phase tokens/s, and sharing on over sharing off."""
    if not recs:
        return []
    out = ["", "Parallel sampling (add_samples; metric = generated tokens / wall time of the whole job, prompts "
           "fed on the way; decode = the steps in which every sample generates):", "",
           "| shape | impl | share_prefixes | tokens/s (job) | decode tokens/s | decode ms/step | job s | "
           "same tokens as sharing |", "|---|---|---|---|---|---|---|---|"]
    by = {}
    for r in recs:
        by.setdefault(r["shape"], {})[r["share_prefixes"]] = r
        out.append(f"| {r['shape']} | {r['impl']} | {r['share_prefixes']} | {r['metric']:.0f} | "
                   f"{r['decode_tokens_per_s']:.0f} | {r['decode_ms_per_step']:.3f} | {r['seconds']:.3f} | "
                   f"{100 * r['same_tokens_as_sharing']:.0f}% |")
    for shape, pair in by.items():
        if True in pair and False in pair:
            on, off = pair[True], pair[False]
            out.append(f"- {shape}: sharing on / off = {on['metric'] / off['metric']:.2f}x (job), "
                       f"{on['decode_tokens_per_s'] / off['decode_tokens_per_s']:.2f}x (decode)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1,16,64,256")
    ap.add_argument("--out", help="JSON lines to this file (default stdout)")
    ap.add_argument("--check-weights", help="cellkv's weight file (cellkv-bench-serve --weights-out)")
    ap.add_argument("--ready", help="write this file once every batch size is compiled and warm")
    ap.add_argument("--go", help="wait for this file before timing")
    ap.add_argument("--wait", type=float, default=300.0, help="seconds to wait for --go at most")
    ap.add_argument("--tune", action="store_true", help="inductor coordinate-descent tuning (slower compile)")
    ap.add_argument("--report", help="print the table of these JSON lines (cellkv's and the peer's) and exit")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return 0
    run_peer(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
