"""The README's generated sections, written from results/coalesced_metrics.json only.

`update(doc)` rewrites two regions of phase4_coalesced/README.md: the measurement and ncu evidence
(between `<!-- results:begin -->` and `<!-- results:end -->`, through utils.readme) and the
success checklist (between `<!-- checklist:begin -->` and `<!-- checklist:end -->`). run.py calls
it after a GPU run and, without a GPU, from the committed results. Every measured number in the
text is read from the results document here; the only numbers typed in this file are the
prediction's (PREDICTION, copied from the README's "Prediction" section, written before the run)
and the issue's targets (run.TARGETS).
"""

from __future__ import annotations

from pathlib import Path

from utils import gpu_checks
from utils.readme import CHECKLIST_BEGIN, CHECKLIST_END, env_line, fmt, replace_between, update_readme
from utils.results import select

IMPL = "phase4_coalesced"
PHASE3 = "phase3_tiled_t16"
HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
OPS = ("matmul_qk", "softmax", "matmul_av")

# The prediction of the README (H100 figures from shared/GPU-NOTES.md), as (low, high) ranges.
PREDICTION_GPU = {"name": "H100", "dram_TBps": 3.0, "fp32_TFLOPs": 65.3}
PREDICTION = {
    "matmul_qk_ms": (1.7, 2.3), "softmax_ms": (1.5, 1.7), "matmul_av_ms": (1.7, 2.3),
    "attention_ms": (5.0, 6.5), "vs_torch_naive": (1.0, 1.3), "phase3_ms": (12.0, 20.0),
    "vs_phase3": (2.0, 3.0), "cublas_fraction": (0.60, 0.80), "sectors_per_request": (16.0, 16.0),
    "causal_over_full": (0.55, 0.65), "softmax_bw_share": (0.85, 0.95),
}
CONFLICTS_NEAR_ZERO = 0.01   # bank conflicts "near zero": they cost under 1% of a kernel's time


# ------------------------------------------------------------------------------------------------
# Reading the results


def label_ncu(records: list[dict]) -> list[tuple[str, dict]]:
    """(op, record) for one impl's kernels in launch order: softmax kernels by name, torch's
    elementwise kernel as `scale`, the others (GEMMs, tiled matmuls) as matmul_qk then matmul_av."""
    out, matmuls = [], iter(("matmul_qk", "matmul_av"))
    for r in records:
        name = r["kernel"].lower()
        if "softmax" in name:
            op = "softmax"
        elif "elementwise" in name:
            op = "scale"
        else:
            op = next(matmuls, "other")
        out.append((op, r))
    return out


def ncu_by_op(doc: dict, impl: str) -> dict[str, dict]:
    return {op: r for op, r in label_ncu(doc.get("ncu", {}).get("records", {}).get(impl, []))}


def attention_ms(rows, impl, S, D, causal):
    found = select(rows, impl=impl, op="attention", Sq=S, D=D, causal=causal)
    return found[0]["ms"] if found else None


def kernel_ms(rows, impl, op, D):
    found = select(rows, impl=impl, op=op, D=D)
    return found[0]["ms"] if found else None


def conflict_share(r: dict, sms: int) -> float | None:
    """Upper estimate of the time bank conflicts cost: each extra wavefront holds an SM's shared
    memory for one clock, so conflicts / (SMs * clock * kernel time)."""
    if not (r.get("time_ns") and r.get("clock_hz")):
        return None
    extra = (r.get("smem_ld_conflicts") or 0) + (r.get("smem_st_conflicts") or 0)
    return extra / (sms * r["clock_hz"] * r["time_ns"] * 1e-9)


def dram_share(r: dict, ceilings: dict) -> float | None:
    if r.get("dram_GBps") is None or not ceilings.get("dram_TBps"):
        return None
    return r["dram_GBps"] / (ceilings["dram_TBps"] * 1e3)


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%" if x >= 0.01 else f"{100 * x:.2f}%"


# ------------------------------------------------------------------------------------------------
# The measurement section


def headline_table(doc: dict, h: dict) -> list[str]:
    rows = select(doc["rows"], op="attention", B=h["B"], H=h["H"], Sq=h["S"], D=h["D"], causal=False)
    base = {r["impl"]: r["ms"] for r in rows}
    lines = [f"### Attention forward at the headline shape (B={h['B']}, H={h['H']}, S={h['S']}, "
             f"D={h['D']}, non-causal, float32)", "",
             "| impl | ms | TFLOP/s | × torch_naive | × phase3_tiled_t16 | extra MB |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["ms"]):
        ratios = [fmt(base[p] / r["ms"]) if p in base else "–" for p in ("torch_naive", PHASE3)]
        name = f"**{r['impl']}**" if r["impl"] == IMPL else r["impl"]
        lines.append(f"| {name} | {fmt(r['ms'])} | {fmt(r['tflops'])} | {ratios[0]} | {ratios[1]} | "
                     f"{fmt(r.get('extra_mb'))} |")
    lines += ["", "× columns: that peer's time over this row's time (above 1: faster than the peer). "
              "Extra MB: the peak memory of one call beyond its inputs (the output included).", ""]
    return lines


def kernel_account(doc: dict) -> list[str]:
    """Each op's ncu time for phase 3, phase 4 and torch_naive at the headline shape."""
    impls = [i for i in (PHASE3, IMPL, "torch_naive") if doc.get("ncu", {}).get("records", {}).get(i)]
    if not impls:
        return []
    by = {i: ncu_by_op(doc, i) for i in impls}
    lines = ["**Where the time goes** (ncu kernel times at the headline shape; torch_naive's `scale` is "
             "its separate `* scale` pass over S):", "",
             "| op (ncu, one call) | " + " | ".join(f"{i} ms" for i in impls) + " |",
             "|---|" + "---|" * len(impls)]
    for op in ("matmul_qk", "scale", "softmax", "matmul_av"):
        cells = [fmt(by[i][op]["time_ns"] * 1e-6) if op in by[i] else "—" for i in impls]
        if any(c != "—" for c in cells):
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
    totals = [fmt(sum(r["time_ns"] for r in by[i].values()) * 1e-6) for i in impls]
    lines.append("| **total** | " + " | ".join(f"**{t}**" for t in totals) + " |")
    return lines + [""]


def diagnose(op: str, mine: dict, peer: dict, peer_name: str, doc: dict) -> str:
    """A sentence on why `mine` is slower than `peer` (same op), from their ncu numbers."""
    ceilings, sms = doc["ceilings"], doc["env"]["sms"]
    t_m, t_p = mine["time_ns"] * 1e-6, peer["time_ns"] * 1e-6
    d_m, d_p = dram_share(mine, ceilings), dram_share(peer, ceilings)
    c_m = conflict_share(mine, sms)
    text = (f"`{op}` takes {fmt(t_m)} ms against {fmt(t_p)} ms for {peer_name} "
            f"({fmt(t_m - t_p)} ms more). ")
    text += (f"Both move about the same DRAM bytes ({fmt(mine['dram_bytes'] * 1e-6)} against "
             f"{fmt(peer['dram_bytes'] * 1e-6)} MB)" if abs(mine["dram_bytes"] / peer["dram_bytes"] - 1) < 0.05
             else f"It moves {fmt(mine['dram_bytes'] * 1e-6)} MB of DRAM traffic against "
                  f"{fmt(peer['dram_bytes'] * 1e-6)} MB")
    text += f", at {pct(d_m)} of the measured copy bandwidth against {pct(d_p)}"
    if d_m is not None and d_m >= 0.6:
        return text + ": it is bound by DRAM, and only fewer bytes (fusion) would make it faster."
    text += "; so DRAM does not limit it. "
    if c_m is not None and c_m >= 0.1:
        return text + (f"Shared-memory bank conflicts hold the shared memory for up to {pct(c_m)} of "
                       f"its time: the layout, not the arithmetic, is what to fix.")
    text += (f"Bank conflicts cost at most {pct(c_m)} of its time. Its SM throughput (the busiest "
             f"unit's share of its peak) is {fmt(mine.get('sm_pct'))}% against {fmt(peer.get('sm_pct'))}%, "
             f"at an achieved occupancy of {fmt(mine.get('occupancy_pct'))}% against "
             f"{fmt(peer.get('occupancy_pct'))}% ({fmt(mine.get('registers'))} against "
             f"{fmt(peer.get('registers'))} registers per thread)")
    if (mine.get("sm_pct") or 0) < (peer.get("sm_pct") or 0):
        text += (": with the same work and less of the SM busy, its warps spend more of their time "
                 "waiting (on shared-memory and global latency, at barriers) than the peer's do. "
                 "ncu's warp-state statistics, not recorded in this run, would name the stall.")
    else:
        text += ": the SM is as busy as the peer's, so it issues more instructions per FLOP."
    return text


def targets_section(doc: dict, targets: dict, run_targets: dict) -> list[str]:
    rows, h = doc["rows"], targets.get("shape", {})
    lines = [f"### Targets (issue 3), at S={h.get('S')}, D={h.get('D')}, non-causal, same run", "",
             "| target | required | measured | status |", "|---|---|---|---|"]
    labels = {"vs_phase3": f"attention speed over {PHASE3}",
              "vs_torch_naive": "attention speed over torch_naive (cuBLAS SGEMM + torch softmax, TF32 off)"}
    for key, label in labels.items():
        t = targets.get(key)
        if t is None:
            lines.append(f"| {label} | ≥ {fmt(run_targets[key])}× | not measured | **not checked** |")
            continue
        lines.append(f"| {label} | ≥ {fmt(t['target'])}× | {t['speedup']:.2f}× | "
                     f"**{'met' if t['met'] else 'NOT met'}** ({t['speedup'] / t['target']:.2f}× the requirement) |")
    fractions = [f for f in doc.get("matmul_vs_cublas", []) if f["D"] == h.get("D")]
    for f in fractions:
        lines.append(f"| `{f['op']}` TFLOP/s as a fraction of cuBLAS SGEMM (D={f['D']}) | reported | "
                     f"{fmt(f['phase4_tflops'])} / {fmt(f['cublas_tflops'])} TFLOP/s = {pct(f['fraction'])} | "
                     f"reported (no threshold in the issue) |")
    lines.append("")
    others = [f for f in doc.get("matmul_vs_cublas", []) if f["D"] != h.get("D")]
    for D in sorted({f["D"] for f in others}):
        lines += [f"The same fractions at D={D}: " + ", ".join(
            f"`{f['op']}` {fmt(f['phase4_tflops'])} / {fmt(f['cublas_tflops'])} TFLOP/s = {pct(f['fraction'])}"
            for f in others if f["D"] == D) + f" (each kernel alone, S={others[0]['S']}, CUDA-event medians).", ""]

    # Where a target is missed: how far, and which kernel loses the time (ncu).
    peers = {"vs_phase3": PHASE3, "vs_torch_naive": "torch_naive"}
    mine = ncu_by_op(doc, IMPL)
    for key, peer in peers.items():
        t = targets.get(key)
        if t is None or t["met"]:
            continue
        ms = attention_ms(rows, IMPL, h["S"], h["D"], False)
        need = ms * t["speedup"] / t["target"]
        lines.append(f"**Gap ({key}):** phase 4 runs at {t['speedup']:.2f}× {peer}'s speed, "
                     f"{t['target'] / t['speedup']:.2f}× short of the {fmt(t['target'])}× target: it would "
                     f"need {fmt(need)} ms instead of {fmt(ms)} ms ({fmt(ms - need)} ms less).")
        theirs = ncu_by_op(doc, peer)
        losses = sorted(((mine[op]["time_ns"] - theirs[op]["time_ns"], op) for op in mine if op in theirs),
                        reverse=True)
        if losses and losses[0][0] > 0:
            op = losses[0][1]
            lines.append(f"The op that loses most in the ncu profile: {diagnose(op, mine[op], theirs[op], peer, doc)}")
        elif losses:
            lines.append("In the ncu profile every phase 4 kernel is faster than its counterpart, by "
                         + ", ".join(f"`{op}` {fmt(theirs[op]['time_ns'] / mine[op]['time_ns'])}×"
                                     for _, op in sorted(losses, reverse=True))
                         + f"; the smallest gain ({losses[0][1]}) is the one to work on.")
        lines.append("")
    return lines


def cublas_gap(doc: dict) -> list[str]:
    """Why the matmuls stop short of cuBLAS, op by op, from ncu at the headline shape."""
    mine, cublas = ncu_by_op(doc, IMPL), ncu_by_op(doc, "torch_naive")
    lines = []
    for op in ("matmul_qk", "matmul_av"):
        if op in mine and op in cublas and mine[op]["time_ns"] > cublas[op]["time_ns"]:
            lines.append(f"- {diagnose(op, mine[op], cublas[op], 'cuBLAS', doc)}")
    if not lines:
        return []
    fr = {(f["op"], f["D"]): f["fraction"] for f in doc.get("matmul_vs_cublas", [])}
    lines = ["**Where the matmuls stand against cuBLAS** (ncu, one call each at the headline shape):", ""] + lines
    if ("matmul_av", 64) in fr and ("matmul_av", 128) in fr and ("matmul_qk", 64) in fr:
        lines.append(f"- One design difference fits these numbers: `matmul_av` at D=64 uses 8×4 micro-tiles "
                     f"(12 shared-memory reads per 32 FMAs, 1.5× the reads per FMA of the 8×8 tiles, 16 per "
                     f"64, of `matmul_qk` and of `matmul_av` at D=128). It reaches {pct(fr[('matmul_av', 64)])} "
                     f"of cuBLAS, against {pct(fr[('matmul_av', 128)])} at D=128 and "
                     f"{pct(fr[('matmul_qk', 64)])} for `matmul_qk` (each kernel alone, CUDA events).")
    return lines + [""]


def shapes_table(doc: dict, run_targets: dict) -> list[str]:
    rows = doc["rows"]
    ours = sorted(select(rows, impl=IMPL, op="attention"), key=lambda r: (r["D"], r["causal"], r["Sq"]))
    lines = ["### Every measured shape (B=4, H=8)", "",
             "| D | causal | S | phase 4 ms | × phase3_tiled_t16 | × torch_naive | × sdpa_efficient |",
             "|---|---|---|---|---|---|---|"]
    worst = {}
    for r in ours:
        cells = []
        for peer in (PHASE3, "torch_naive", "sdpa_efficient"):
            other = attention_ms(rows, peer, r["Sq"], r["D"], r["causal"])
            ratio = other / r["ms"] if other else None
            if ratio is not None and (peer not in worst or ratio < worst[peer][0]):
                worst[peer] = (ratio, r)
            cells.append(fmt(ratio))
        lines.append(f"| {r['D']} | {r['causal']} | {r['Sq']} | {fmt(r['ms'])} | " + " | ".join(cells) + " |")
    lines.append("")
    for peer in (PHASE3, "torch_naive"):
        if peer in worst:
            ratio, r = worst[peer]
            n = sum(1 for x in ours if attention_ms(rows, peer, x["Sq"], x["D"], x["causal"]))
            below = sum(1 for x in ours if (m := attention_ms(rows, peer, x["Sq"], x["D"], x["causal"]))
                        and m / x["ms"] < 1)
            key = "vs_phase3" if peer == PHASE3 else "vs_torch_naive"
            reach = sum(1 for x in ours if (m := attention_ms(rows, peer, x["Sq"], x["D"], x["causal"]))
                        and m / x["ms"] >= run_targets[key])
            lines.append(f"- Against {peer}: at least the target's {fmt(run_targets[key])}× at {reach} of the "
                         f"{n} shapes both ran; slower than {peer} at {below}; lowest ratio {ratio:.2f}× "
                         f"(S={r['Sq']}, D={r['D']}, causal={r['causal']}).")
    lines += ["", "In the causal rows phase 4 skips the QKᵀ tiles above the diagonal and stops AV's reduction "
              "at it, while torch_naive computes the full products and adds a masking pass: hence its larger "
              "ratios there.", ""]
    return lines


def verdict(value, lo, hi, lower_is_better: bool) -> str:
    if value is None:
        return "not measured"
    if lo <= value <= hi:
        return "inside"
    better = (value < lo) == lower_is_better
    return "better than predicted" if better else "worse than predicted"


def prediction_table(doc: dict, h: dict) -> list[str]:
    rows, P = doc["rows"], PREDICTION
    D, S = h["D"], h["S"]
    full = attention_ms(rows, IMPL, S, D, False)
    causal = attention_ms(rows, IMPL, S, D, True)
    p3 = attention_ms(rows, PHASE3, S, D, False)
    tn = attention_ms(rows, "torch_naive", S, D, False)
    fr = {f["op"]: f["fraction"] for f in doc.get("matmul_vs_cublas", []) if f["D"] == D}
    mine, before = ncu_by_op(doc, IMPL), {}
    dram = dram3 = None

    def rng(key, unit="", scale=1.0):
        lo, hi = P[key]
        return f"{fmt(lo * scale)}{unit}" if lo == hi else f"{fmt(lo * scale)}–{fmt(hi * scale)}{unit}"

    items = [  # (quantity, prediction key, measured, unit, scale, lower is better)
        (f"`matmul_qk` alone, ms (S={S}, D={D})", "matmul_qk_ms", kernel_ms(rows, IMPL, "matmul_qk", D), "", 1, True),
        ("`softmax` alone, ms (H100 figure: scaled below)", "softmax_ms", kernel_ms(rows, IMPL, "softmax", D), "", 1, True),
        ("`matmul_av` alone, ms", "matmul_av_ms", kernel_ms(rows, IMPL, "matmul_av", D), "", 1, True),
        ("attention, ms", "attention_ms", full, "", 1, True),
        ("speed over torch_naive", "vs_torch_naive", tn / full if tn and full else None, "×", 1, False),
        (f"{PHASE3} attention, ms", "phase3_ms", p3, "", 1, True),
        ("speed over phase 3", "vs_phase3", p3 / full if p3 and full else None, "×", 1, False),
        ("`matmul_qk` / cuBLAS", "cublas_fraction", fr.get("matmul_qk"), "%", 100, False),
        ("`matmul_av` / cuBLAS", "cublas_fraction", fr.get("matmul_av"), "%", 100, False),
        ("causal time / non-causal time", "causal_over_full", causal / full if causal and full else None, "", 1, True),
    ]
    lines = ["### Prediction against measurement", "",
             f"The prediction was written for an {PREDICTION_GPU['name']} ({fmt(PREDICTION_GPU['dram_TBps'])} TB/s, "
             f"{fmt(PREDICTION_GPU['fp32_TFLOPs'])} TFLOP/s FFMA); this run's GPU measured "
             f"{fmt(doc['ceilings']['dram_TBps'])} TB/s copy bandwidth, {fmt(doc['ceilings']['fp32_TFLOPs'])} "
             f"TFLOP/s FFMA and {fmt(doc['ceilings'].get('sgemm_TFLOPs'))} TFLOP/s cuBLAS SGEMM, so its "
             f"memory-bound times (the softmax) should come out near "
             f"{fmt(PREDICTION_GPU['dram_TBps'] / doc['ceilings']['dram_TBps'])}× the predicted ones. "
             "The ratios (× peers, fractions of cuBLAS) carry over between the two GPUs better than the times.", "",
             "| quantity | predicted | measured | verdict |", "|---|---|---|---|"]
    for label, key, value, unit, scale, lower in items:
        shown = "–" if value is None else f"{fmt(value * scale)}{unit}"
        lines.append(f"| {label} | {rng(key, unit, scale)} | {shown} | "
                     f"{verdict(value, *P[key], lower_is_better=lower)} |")
    if mine:
        spr = [r.get("sectors_per_request") for r in mine.values() if r.get("sectors_per_request") is not None]
        lo, hi = P["sectors_per_request"]
        if spr:
            ok = all(lo <= x <= hi for x in spr)
            lines.append(f"| global load sectors per request, phase 4 kernels | {fmt(lo)} | "
                         f"{', '.join(fmt(x) for x in spr)} | {'inside' if ok else 'differs'} |")
        if "softmax" in mine:
            share = dram_share(mine["softmax"], doc["ceilings"])
            lines.append(f"| `softmax` DRAM rate / copy bandwidth (ncu) | {rng('softmax_bw_share', '%', 100)} | "
                         f"{pct(share)} | {verdict(share, *P['softmax_bw_share'], lower_is_better=False)} |")
        shares = [conflict_share(r, doc["env"]["sms"]) for r in mine.values()]
        shares = [s for s in shares if s is not None]
        if shares:
            lines.append(f"| bank conflicts, phase 4 kernels (share of time, upper estimate) | near zero | "
                         f"at most {pct(max(shares))} | "
                         f"{'inside' if max(shares) < CONFLICTS_NEAR_ZERO else 'worse than predicted'} |")
        B, H = h["B"], h["H"]
        unfused = 4 * B * H * S * S * 4 + 4 * B * H * S * D * 4   # 4 S×S passes + q, k, v, o
        dram = sum(r["dram_bytes"] for r in mine.values())
        lines.append(f"| phase 4 DRAM traffic, GB | near {fmt(unfused * 1e-9)} (4 S×S passes + inputs and output) | "
                     f"{fmt(dram * 1e-9)} | {'inside' if abs(dram / unfused - 1) < 0.05 else 'differs'} |")
        before = ncu_by_op(doc, PHASE3)
        if before:
            spr3 = [r.get("sectors_per_request") for r in before.values() if r.get("sectors_per_request") is not None]
            lines.append(f"| global load sectors per request, phase 3 kernels | 4 or more | "
                         f"{', '.join(fmt(x) for x in spr3)} | {'inside' if min(spr3) >= 4 else 'differs'} |")
            dram3 = sum(r["dram_bytes"] for r in before.values())
            same = abs(dram3 / dram - 1) < 0.02
            lines.append(f"| phase 3 DRAM traffic, GB | more than phase 4 (S and P separate) | {fmt(dram3 * 1e-9)} | "
                         f"{'wrong: the same traffic' if same else 'inside' if dram3 > dram else 'wrong: less'} |")
    lines.append("")
    sm = kernel_ms(rows, IMPL, "softmax", D)
    if sm is not None and doc["ceilings"].get("dram_TBps"):
        k = PREDICTION_GPU["dram_TBps"] / doc["ceilings"]["dram_TBps"]
        lo, hi = P["softmax_ms"]
        lines += [f"Scaled by the bandwidth ratio, the softmax prediction becomes {fmt(lo * k)}–{fmt(hi * k)} ms "
                  f"on this GPU, against {fmt(sm)} ms measured: "
                  f"{verdict(sm, lo * k, hi * k, lower_is_better=True)}.", ""]
    if dram and dram3 and abs(dram3 / dram - 1) < 0.02:
        lines += ["Phase 3's separate P buffer does not add DRAM traffic: its softmax reads S and writes P, "
                  "phase 4's reads S and writes it back in place; both are one read and one write of S×S. "
                  "The in-place softmax saves memory (the extra MB column), not bandwidth.", ""]
    return lines


def ncu_section(doc: dict) -> list[str]:
    ncu = doc.get("ncu", {})
    if "error" in ncu or not ncu.get("records"):
        return ["### ncu evidence", "", f"ncu did not run: {ncu.get('error', 'no records')}", ""]
    s, ceilings, sms = ncu["shape"], doc["ceilings"], doc["env"]["sms"]
    lines = ["### ncu evidence: before (phase 3) and after (phase 4), kernel by kernel", "",
             f"One call each at B={s['B']}, H={s['H']}, S={s['S']}, D={s['D']}, non-causal "
             "(`ncu --clock-control none`); torch_naive's kernels for reference. The full table, with "
             "DRAM reads and writes apart: [results/memory_analysis.txt](results/memory_analysis.txt).", "",
             "| impl | op | ms | sectors/req | DRAM MB | % of copy BW | L2 MB | L1 MB | smem ld confl. | "
             "smem st confl. | confl. time ≤ | occupancy % | regs | FP32 TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for impl in (PHASE3, IMPL, "torch_naive"):
        for op, r in label_ncu(ncu["records"].get(impl, [])):
            lines.append(
                f"| {impl} | {op} | {fmt(r['time_ns'] * 1e-6)} | {fmt(r.get('sectors_per_request'))} | "
                f"{fmt(r['dram_bytes'] * 1e-6)} | {pct(dram_share(r, ceilings))} | {fmt(r['l2_bytes'] * 1e-6)} | "
                f"{fmt(r['l1_bytes'] * 1e-6)} | {fmt(r.get('smem_ld_conflicts'))} | {fmt(r.get('smem_st_conflicts'))} | "
                f"{pct(conflict_share(r, sms))} | {fmt(r.get('occupancy_pct'))} | {fmt(r.get('registers'))} | "
                f"{fmt(r.get('fp32_GFLOPs', 0) * 1e-3)} |")
    lines += ["", "sectors/req: global-load sectors per request (4 for a coalesced float load, 16 for a coalesced "
              "float4 load); confl. time ≤: the bank conflicts' extra wavefronts at one per SM clock, as a share "
              "of the kernel's time (an upper estimate of what they cost); % of copy BW: the kernel's DRAM rate over the "
              "copy bandwidth measured for the ceilings (one kernel's rate under ncu can pass 100%).", ""]
    before, after, torch_ = ncu_by_op(doc, PHASE3), ncu_by_op(doc, IMPL), ncu_by_op(doc, "torch_naive")
    if before and after:
        lines += ["What the numbers say:", ""]
        for op in ("matmul_qk", "matmul_av"):
            b, a = before.get(op), after.get(op)
            if not (b and a):
                continue
            lines.append(
                f"- `{op}`: {fmt(b['time_ns'] * 1e-6)} → {fmt(a['time_ns'] * 1e-6)} ms "
                f"({b['time_ns'] / a['time_ns']:.1f}× faster). L1 traffic {fmt(b['l1_bytes'] * 1e-9)} → "
                f"{fmt(a['l1_bytes'] * 1e-9)} GB (÷{b['l1_bytes'] / a['l1_bytes']:.1f}) and L2 traffic "
                f"{fmt(b['l2_bytes'] * 1e-9)} → {fmt(a['l2_bytes'] * 1e-9)} GB (÷{b['l2_bytes'] / a['l2_bytes']:.1f}): "
                f"the larger block tiles (128×128; 128×64 for AV at D ≤ 64) fetch each operand element fewer times. Global loads "
                f"{fmt(b.get('sectors_per_request'))} → {fmt(a.get('sectors_per_request'))} sectors per request "
                f"(float4, every sector used whole). Bank conflicts (loads + stores) "
                f"{fmt(b['smem_ld_conflicts'] + b['smem_st_conflicts'])} → "
                f"{fmt(a['smem_ld_conflicts'] + a['smem_st_conflicts'])}, at most "
                f"{pct(conflict_share(a, sms))} of the new kernel's time. Achieved occupancy "
                f"{fmt(b['occupancy_pct'])}% → {fmt(a['occupancy_pct'])}% ({fmt(b['registers'])} → "
                f"{fmt(a['registers'])} registers per thread for the register tile), and FP32 throughput "
                f"{fmt(b['fp32_GFLOPs'] * 1e-3)} → {fmt(a['fp32_GFLOPs'] * 1e-3)} TFLOP/s: fewer warps, each "
                f"doing more independent FMAs per value loaded, hide the latency better than many warps "
                f"that wait on shared memory.")
        b, a = before.get("softmax"), after.get("softmax")
        if b and a:
            lines.append(
                f"- `softmax`: {fmt(b['time_ns'] * 1e-6)} → {fmt(a['time_ns'] * 1e-6)} ms; same DRAM traffic "
                f"({fmt(b['dram_bytes'] * 1e-9)} → {fmt(a['dram_bytes'] * 1e-9)} GB: one read and one write "
                f"of S×S), moved at {pct(dram_share(b, ceilings))} → {pct(dram_share(a, ceilings))} of the "
                f"measured copy bandwidth; L1 traffic {fmt(b['l1_bytes'] * 1e-9)} → {fmt(a['l1_bytes'] * 1e-9)} GB "
                f"(the row is read once into registers instead of twice).")
        if all(o in torch_ for o in ("scale", "softmax", "matmul_qk", "matmul_av")) and len(after) == 3:
            sc = torch_["scale"]
            soft = (torch_["softmax"]["time_ns"] - after["softmax"]["time_ns"]) * 1e-6
            lost = sum(after[o]["time_ns"] - torch_[o]["time_ns"] for o in ("matmul_qk", "matmul_av")) * 1e-6
            gained = sc["time_ns"] * 1e-6 + soft
            lines.append(
                f"- Against torch_naive: its separate `* scale` kernel costs {fmt(sc['time_ns'] * 1e-6)} ms and "
                f"{fmt(sc['dram_bytes'] * 1e-9)} GB of DRAM traffic, which phase 4 folds into QKᵀ's epilogue, and "
                f"phase 4's softmax is {fmt(soft)} ms {'faster' if soft >= 0 else 'slower'} than torch's. Together "
                f"that is {fmt(gained)} ms, against the {fmt(lost)} ms its two matmuls lose to cuBLAS: "
                + (f"a net {fmt(gained - lost)} ms in phase 4's favour." if gained >= lost
                   else f"a net {fmt(lost - gained)} ms in torch_naive's favour."))
        lines.append("")
    return lines


def measurement_lines(doc: dict, headline: dict, run_targets: dict, targets: dict) -> list[str]:
    c = doc["ceilings"]
    lines = [env_line(doc), "",
             f"Ceilings measured on the same GPU: copy bandwidth {fmt(c.get('dram_TBps'))} TB/s, FP32 FFMA "
             f"{fmt(c.get('fp32_TFLOPs'))} TFLOP/s, cuBLAS SGEMM {fmt(c.get('sgemm_TFLOPs'))} TFLOP/s.", ""]
    lines += headline_table(doc, headline)
    lines += targets_section(doc, targets, run_targets)
    lines += kernel_account(doc)
    lines += cublas_gap(doc)
    lines += shapes_table(doc, run_targets)
    lines += prediction_table(doc, headline)
    lines += ncu_section(doc)
    lines += ["Plots: [attention TFLOP/s against S](results/coalesced_speed.png), "
              "[each kernel alone](results/kernel_times.png), [Roofline](results/coalesced_roofline.png); "
              "the ncu tables: [memory_analysis.txt](results/memory_analysis.txt)."]
    return lines


# ------------------------------------------------------------------------------------------------
# The success checklist


def checklist_lines(doc: dict, targets: dict) -> list[str]:
    env = doc["env"]
    on_h100 = "H100" in env["gpu"]
    t3, tn = targets.get("vs_phase3"), targets.get("vs_torch_naive")
    ncu_ok = bool(doc.get("ncu", {}).get("records", {}).get(IMPL)) and bool(doc["ncu"]["records"].get(PHASE3))
    fractions = doc.get("matmul_vs_cublas", [])

    def box(done: bool) -> str:
        return "[x]" if done else "[ ]"

    def met(t) -> str:
        return "not measured" if t is None else f"{'met' if t['met'] else 'NOT met'}, {t['speedup']:.2f}×"

    return [
        *gpu_checks.checklist_lines("phase4_coalesced/README.md"),
        f"- {box(bool(t3 and t3['met']))} At S = 4096, D = 64: attention at least 1.3× the speed of "
        f"phase3_tiled_t16 ({met(t3)}).",
        f"- {box(bool(tn and tn['met']))} At S = 4096, D = 64: attention at least 0.8× torch_naive ({met(tn)}).",
        f"- {box(bool(fractions))} matmul_qk and matmul_av TFLOP/s reported as a fraction of cuBLAS SGEMM in the "
        f"same run ({len(fractions)} fractions in `matmul_vs_cublas`).",
        f"- {box(ncu_ok)} `results/memory_analysis.txt`: ncu before/after kernel by kernel.",
        f"- {box(on_h100 and not doc.get('quick'))} `results/coalesced_metrics.json` and the PNGs from one "
        f"H100 run, committed: they come from one full run on {env['gpu']} ({env['date'][:10]}, commit "
        f"{env['commit']}){'' if on_h100 else ', not an H100'}.",
    ]


def update(doc: dict, headline: dict, run_targets: dict, targets_fn) -> None:
    """Rewrite the README's generated sections from a full run's results document."""
    targets = doc.get("targets") or targets_fn(doc["rows"])
    update_readme(README, measurement_lines(doc, headline, run_targets, targets),
                  source="results/coalesced_metrics.json")
    replace_between(README, CHECKLIST_BEGIN, CHECKLIST_END,
                    ["_Generated by run.py from results/coalesced_metrics.json; do not edit by hand._", "",
                     *checklist_lines(doc, targets)])
