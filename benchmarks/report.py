#!/usr/bin/env python3
"""Merge cellkv's benchmark JSON lines with the peers' (benchmarks/peers.py) into one report.

Input: JSON lines, one measurement each:
  {"work": "decode"|"prefill"|"mixed"|"overhead"|..., "shape": "16x4k", "impl": name,
   "ms": median_ms, "metric": value, "unit": "TB/s"|"TFLOP/s"|"us"|"ms"|"x"}
Lines whose impl starts with 'cellkv_' are cellkv's (whichever file they come from); all others
are peers. A line with metric null (a peer that failed) shows as n/a. If the same
(work, shape, impl) appears twice, the later line wins. Extra fields are ignored.

Output:
  * ONE markdown table (stdout, and --markdown FILE): a row per (work, shape); columns: the unit,
    each cellkv impl's metric (followed by its own unit where that differs from the row's, e.g.
    the mixed step's ratio 'x' in a row of 'ms'), the best peer's metric and name, and cellkv best / best peer
    (for TB/s and TFLOP/s the ratio of the metrics; for time units such as us, where lower is
    better, the inverse, so > 1 always means cellkv is ahead).
  * a PNG bar chart (--png FILE; needs matplotlib, Agg backend): decode TB/s and prefill TFLOP/s
    per shape, cellkv impls and peers side by side, with the measured ceilings (device copy
    4.23 TB/s, bf16 GEMM 783 TFLOP/s) as dashed lines.

  python3 benchmarks/report.py --cellkv CELLKV.jsonl --peers PEERS.jsonl \\
      --markdown OUT.md --png OUT.png
  python3 benchmarks/report.py --selftest    # fabricated lines -> /tmp/cellkv_report_selftest/
"""

import argparse
import json
import os
import sys

HIGHER_IS_BETTER = {"TB/s", "TFLOP/s", "GB/s", "tok/s"}
WORK_ORDER = ["decode", "prefill"]  # then anything else, 'overhead' last
SHAPE_ORDER = ["1x32k", "16x4k", "64x2k", "256x1k", "1x8k", "8x1k", "4x4k", "1x8k_d64", "1x8k_d256"]
COPY_CEILING_TBS = 4.23
GEMM_CEILING_TFLOPS = 783.0


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def load(path):
    recs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log(f"{path}:{lineno}: not JSON, skipped")
                continue
            if not isinstance(rec, dict) or not all(k in rec for k in ("work", "shape", "impl")):
                log(f"{path}:{lineno}: no work/shape/impl, skipped")
                continue
            recs.append(rec)
    return recs


def is_cellkv(impl):
    return impl.startswith("cellkv_")


def better(unit):
    """max for throughput units, min for time-like units."""
    return max if unit in HIGHER_IS_BETTER else min


def merge(records):
    """-> rows [(work, shape)], table {(work, shape): {impl: rec}}, cellkv impls, peer impls."""
    table, cellkv_impls, peer_impls, first_seen = {}, [], [], {}
    for i, rec in enumerate(records):
        key = (rec["work"], rec["shape"])
        first_seen.setdefault(key, i)
        table.setdefault(key, {})[rec["impl"]] = rec
        names = cellkv_impls if is_cellkv(rec["impl"]) else peer_impls
        if rec["impl"] not in names:
            names.append(rec["impl"])

    def row_key(key):
        work, shape = key
        w = WORK_ORDER.index(work) if work in WORK_ORDER else (
            len(WORK_ORDER) + 1 if work == "overhead" else len(WORK_ORDER))
        s = SHAPE_ORDER.index(shape) if shape in SHAPE_ORDER else len(SHAPE_ORDER)
        return (w, s, first_seen[key])

    return sorted(table, key=row_key), table, cellkv_impls, peer_impls


def metric_of(rec):
    if rec is None:
        return None
    m = rec.get("metric")
    return float(m) if isinstance(m, (int, float)) else None


def fmt(v):
    if v is None:
        return "n/a"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def row_summary(impls):
    """For one row's {impl: rec}: unit, best cellkv (name, value), best peer (name, value)."""
    units = [r.get("unit") for r in impls.values() if r.get("unit")]
    unit = units[0] if units else ""
    pick = better(unit)
    ck = [(metric_of(r), i) for i, r in impls.items()
          if is_cellkv(i) and metric_of(r) is not None and r.get("unit", unit) == unit]
    peers = [(metric_of(r), i) for i, r in impls.items()
             if not is_cellkv(i) and metric_of(r) is not None]
    best_ck = pick(ck) if ck else None
    best_peer = pick(peers) if peers else None
    return unit, best_ck, best_peer


def markdown(rows, table, cellkv_impls):
    head = ["work", "shape", "unit"] + cellkv_impls + ["best peer", "best peer impl",
                                                       "cellkv best / best peer"]
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join(["---", "---", "---"] + ["---:"] * len(cellkv_impls)
                               + ["---:", "---", "---:"]) + " |"]
    for key in rows:
        impls = table[key]
        unit, best_ck, best_peer = row_summary(impls)
        cells = [key[0], key[1], unit]
        for name in cellkv_impls:
            rec = impls.get(name)
            if rec is None:
                cells.append("")
            elif rec.get("unit") and rec.get("unit") != unit and metric_of(rec) is not None:
                cells.append(f"{fmt(metric_of(rec))} {rec['unit']}")
            else:
                cells.append(fmt(metric_of(rec)))
        if best_peer:
            cells += [fmt(best_peer[0]), best_peer[1]]
        else:
            failed = [i for i in impls if not is_cellkv(i)]
            cells += ["n/a" if failed else "", ""]
        ratio = ""
        if best_ck and best_peer and best_ck[0] > 0 and best_peer[0] > 0:
            r = best_ck[0] / best_peer[0] if unit in HIGHER_IS_BETTER else best_peer[0] / best_ck[0]
            ratio = f"{r:.2f}x"
        cells.append(ratio)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bar_chart(path, rows, table, cellkv_impls, peer_impls, copy_ceiling, gemm_ceiling):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not installed: no PNG written ({path}); the markdown table is complete")
        return False

    ck_colors = ["#08306b", "#2171b5", "#6baed6", "#4292c6", "#9ecae1"]
    peer_colors = ["#e6550d", "#fd8d3c", "#a63603", "#756bb1", "#636363", "#bdbdbd", "#31a354"]
    panels = [("decode", "TB/s", "decode: effective K+V TB/s (higher is better)",
               copy_ceiling, f"device copy {copy_ceiling:g} TB/s"),
              ("prefill", "TFLOP/s", "causal prefill: useful TFLOP/s (higher is better)",
               gemm_ceiling, f"bf16 GEMM {gemm_ceiling:g} TFLOP/s")]
    fig, axes = plt.subplots(2, 1, figsize=(12, 9))
    for ax, (work, unit, title, ceiling, ceiling_label) in zip(axes, panels):
        shapes = [s for w, s in rows if w == work]
        present = [i for i in cellkv_impls + peer_impls
                   if any(i in table[(work, s)] for s in shapes)]
        ax.set_title(title)
        ax.set_ylabel(unit)
        if not shapes or not present:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        width = 0.8 / len(present)
        top = ceiling
        ck_i = peer_i = 0
        for j, impl in enumerate(present):
            if is_cellkv(impl):
                color, hatch = ck_colors[ck_i % len(ck_colors)], None
                ck_i += 1
            else:
                color, hatch = peer_colors[peer_i % len(peer_colors)], "//"
                peer_i += 1
            xs, ys, na = [], [], []
            for k, shape in enumerate(shapes):
                x = k - 0.4 + width * (j + 0.5)
                rec = table[(work, shape)].get(impl)
                if rec is None:
                    continue
                v = metric_of(rec)
                if v is None:
                    na.append(x)
                else:
                    xs.append(x)
                    ys.append(v)
                    top = max(top, v)
            # n/a entries get a zero-height bar (so the legend keeps the style) and a label
            ax.bar(xs + na, ys + [0.0] * len(na), width, label=impl, color=color, hatch=hatch,
                   edgecolor="white")
            for x, y in zip(xs, ys):
                ax.text(x, y, " " + fmt(y), rotation=90, ha="center", va="bottom", fontsize=6)
            for x in na:
                ax.text(x, 0, " n/a", rotation=90, ha="center", va="bottom", fontsize=6)
        ax.axhline(ceiling, ls="--", color="black", lw=1, label=ceiling_label)
        ax.set_ylim(0, top * 1.18)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_xlabel("N sequences x L tokens")
        ax.legend(fontsize=8, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(cellkv_path, peers_path, md_path, png_path,
           copy_ceiling=COPY_CEILING_TBS, gemm_ceiling=GEMM_CEILING_TFLOPS):
    records = load(cellkv_path) + load(peers_path)
    if not records:
        sys.exit("no measurements in the input files")
    rows, table, cellkv_impls, peer_impls = merge(records)
    md = markdown(rows, table, cellkv_impls)
    print(md, end="")
    if md_path:
        with open(md_path, "w") as f:
            f.write(md)
    wrote_png = False
    if png_path:
        wrote_png = bar_chart(png_path, rows, table, cellkv_impls, peer_impls,
                              copy_ceiling, gemm_ceiling)
    return md, wrote_png


# ---- self test on fabricated data ---------------------------------------------------------------


def selftest():
    out = "/tmp/cellkv_report_selftest"
    os.makedirs(out, exist_ok=True)
    decode = ["1x32k", "16x4k", "64x2k", "256x1k"]
    prefill = ["1x8k", "8x1k", "4x4k"]
    ck, peers = [], []
    for k, shape in enumerate(decode):
        for name, tbs in (("cellkv_cell_clustered", 3.6), ("cellkv_cell_lowest_free", 3.1),
                          ("cellkv_sequence", 3.8)):
            ck.append({"work": "decode", "shape": shape, "impl": name, "ms": 0.05,
                       "metric": tbs - 0.1 * k, "unit": "TB/s"})
        for name, tbs in (("sdpa_cudnn_per_seq", 3.3), ("sdpa_flash_per_seq", 3.0),
                          ("sdpa_mask_cell_pool", 0.02), ("flex_block_mask", 0.9),
                          ("flex_block_mask_clustered", 1.4)):
            peers.append({"work": "decode", "shape": shape, "impl": name, "ms": 0.05,
                          "metric": tbs * (1 - 0.05 * k), "unit": "TB/s"})
    for k, shape in enumerate(prefill):
        for name, tf in (("cellkv_cell_clustered", 520.0), ("cellkv_cell_lowest_free", 505.0),
                         ("cellkv_sequence", 540.0)):
            ck.append({"work": "prefill", "shape": shape, "impl": name, "ms": 1.0,
                       "metric": tf + 10 * k, "unit": "TFLOP/s"})
        for name, tf in (("sdpa_cudnn_per_seq", 560.0), ("sdpa_flash_per_seq", 450.0),
                         ("flex_block_mask", 380.0)):
            peers.append({"work": "prefill", "shape": shape, "impl": name, "ms": 1.0,
                          "metric": tf + 5 * k, "unit": "TFLOP/s"})
        peers.append({"work": "prefill", "shape": shape, "impl": "sdpa_mask_cell_pool",
                      "ms": None, "metric": None, "unit": "TFLOP/s", "error": "OutOfMemoryError"})
    for shape, tf in (("1x8k_d64", 300.0), ("1x8k_d256", 250.0)):
        ck.append({"work": "prefill", "shape": shape, "impl": "cellkv_cell_clustered", "ms": 1.0,
                   "metric": tf, "unit": "TFLOP/s"})
        peers.append({"work": "prefill", "shape": shape, "impl": "sdpa_cudnn_per_seq", "ms": 1.0,
                      "metric": 2 * tf, "unit": "TFLOP/s"})
    for name, ms in (("cellkv_mixed", 1.2), ("cellkv_decode_part", 0.2), ("cellkv_prefill_part", 0.8)):
        ck.append({"work": "mixed", "shape": "128x2k+2x1k", "impl": name, "ms": ms, "metric": ms,
                   "unit": "ms"})
    ck.append({"work": "mixed", "shape": "128x2k+2x1k", "impl": "cellkv_mixed_over_parts",
               "ms": 1.2, "metric": 1.2, "unit": "x"})
    ck.append({"work": "overhead", "shape": "256tok_256kcells", "impl": "cellkv_step_overhead",
               "metric": 12.5, "unit": "us"})
    ck_path, peers_path = f"{out}/cellkv.jsonl", f"{out}/peers.jsonl"
    with open(ck_path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ck))
    with open(peers_path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in peers) + "not json\n")
    md, wrote_png = report(ck_path, peers_path, f"{out}/report.md", f"{out}/report.png")

    lines = md.strip().splitlines()
    assert len(lines) == 2 + len(decode) + len(prefill) + 2 + 1 + 1, len(lines)
    assert "cellkv_step_overhead" in lines[0] and "best peer impl" in lines[0]
    first = lines[2].split("|")
    assert "decode" in first[1] and "1x32k" in first[2], first
    assert "sdpa_cudnn_per_seq" in lines[2] and "1.15x" in lines[2], lines[2]  # 3.8 / 3.3
    assert "sdpa_cudnn_per_seq" in lines[6] and "0.96x" in lines[6], lines[6]  # 540 / 560
    assert "1x8k_d64" in lines[9] and "0.50x" in lines[9], lines[9]  # 300 / 600
    assert "1x8k_d256" in lines[10] and "0.50x" in lines[10], lines[10]
    mixed = lines[-2].split("|")
    assert mixed[1].strip() == "mixed" and mixed[3].strip() == "ms", mixed
    assert "| 1.20 x |" in lines[-2] and "| 0.8 |" in lines[-2], lines[-2]
    assert lines[-1].split("|")[1].strip() == "overhead" and "12.5" in lines[-1], lines[-1]
    log(f"selftest ok: {out}/report.md" + (f", {out}/report.png" if wrote_png else " (no PNG)"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cellkv", help="cellkv's JSON lines")
    ap.add_argument("--peers", help="peers.py's JSON lines")
    ap.add_argument("--markdown", help="also write the markdown table to this file")
    ap.add_argument("--png", help="write the bar chart to this PNG (needs matplotlib)")
    ap.add_argument("--copy-ceiling", type=float, default=COPY_CEILING_TBS,
                    help="decode ceiling line, TB/s (default %(default)s, measured device copy)")
    ap.add_argument("--gemm-ceiling", type=float, default=GEMM_CEILING_TFLOPS,
                    help="prefill ceiling line, TFLOP/s (default %(default)s, measured bf16 GEMM)")
    ap.add_argument("--selftest", action="store_true",
                    help="fabricate a few lines and render both outputs under /tmp")
    args = ap.parse_args()
    if args.selftest:
        selftest()
        return
    if not args.cellkv or not args.peers:
        ap.error("--cellkv and --peers are required (or --selftest)")
    report(args.cellkv, args.peers, args.markdown, args.png, args.copy_ceiling, args.gemm_ceiling)


if __name__ == "__main__":
    main()
