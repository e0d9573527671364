#!/usr/bin/env python
"""The L2 -> shared-memory feed of Hopper (sm_90a) for tree_verify's key tiles: issue 45, "measure the limit first".

What: one key tile of tree_verify = 64 keys x 576 bf16 columns = 73,728 bytes, loaded as the seesaw loads it
(templates/tree_verify_seesaw.cu.j2): 9 TMA boxes of 64 keys x 64 columns, 128-byte swizzle, one mbarrier per box,
the tensor map encoded as the kernels' (ddtree_gen.launch.callplan.tensor_map_words). A CTA = a producer warp (lane 0
issues the boxes into a ring of RING slab buffers of 8 KB: 18 = the seesaw's two tile buffers) and 4 consumer warps
(wait for each box, optionally read it READS times with ld.shared, release it). Configurations (one table row each):
  * L2-resident source (64 tiles, 4.7 MB): one CTA on one SM alone; 1 CTA per SM with rings of 1, 2, 3 tiles;
    2 and 4 CTAs per SM; the seesaw's ring with 3 reads of every box (shared-memory port contention, as wgmma's
    reads of K, Q and V add ~3 tile-reads per key tile); a consumer paced like the math (each box held for its share
    of a 64-row tile's 2,176 clocks at the full tensor rate, or at 660/989 of it: is the math ever starved?);
  * 9 CTAs reading the same tiles in the same order (the row tiles of an H=8 Nq=65 request), from L2 and from HBM;
  * 2- and 4-CTA clusters reading the same tiles: each CTA its own copy, or each tile ONCE per cluster by TMA
    multicast (cp.async.bulk.tensor...multicast::cluster; box j issued by CTA j mod N to every CTA's mbarrier);
  * HBM source (--hbm-gb, default 1.5 GB): every tile read once per launch, 1 CTA per SM, and 2-CTA multicast.
Tested without a GPU by tests/test_probe_l2_feed_cpu.py (the source compiles for sm_90a; the host side over a stand-in).
Per row: CTAs, SMs, bytes delivered into shared memory per second (chip and per SM) and per SM clock (the clock read
in the kernel: clock64 against globaltimer), bytes read from L2 (multicast: delivered / N), and the dense bf16 rate
that feed allows: each delivered tile is one (64-row tile, 64-key tile) pair of work, 2*64*64*(576+512) FLOP
(S = 64x576 . 576x64, P.V = 64x64 . 64x512). Last, the comparison with the compute peak (--peak-tflops: FlashMLA's
measured 660; --datasheet-tflops: 989, H100 / H200 SXM dense bf16). Every row's data is checked first: a short
launch whose consumers sum every 32-bit word they receive, against the tiles' sums taken by CuPy (docs/perf-feed.md).
When: issue 45's first direction, and after a change to how tree_verify feeds its key tiles.
Run: PYTHONPATH=. python3 scripts/probe_l2_feed.py --out DIR [--ncu] [--hbm-gb 1.5] [--reps 7]
  --ncu also profiles today's kernel (tree_verify_wgmma, B=1, H=8, L=65536, Nq=65: kimi-k2.6-tp8) with Nsight
  Compute (the metrics this ncu knows of FEED_METRICS); --ncu-target is that launch alone (what ncu runs).
Writes DIR/probe_l2_feed.txt (the table) and DIR/probe_l2_feed.json (the rows); with --ncu, DIR/ncu_tree_verify.txt.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass

SLAB_BYTES = 64 * 128            # one TMA box: 64 keys x 64 bf16 columns
SLABS = 9                        # 576 / 64
TILE_BYTES = SLABS * SLAB_BYTES  # 73,728
TILE_FLOP = 2 * 64 * 64 * (576 + 512)   # one 64-row tile x one 64-key tile: S and P.V
FLOP_PER_CLK_SM = 4096           # dense bf16 per SM per clock (4 tensor cores x 512 FMA)
THREADS = 160                    # producer warp + 4 consumer warps
L2_TILES = 64                    # the L2-resident source: 4.7 MB
MAX_SMEM = 227 * 1024            # opt-in shared memory per block on sm_90
HOLD_PEAK = round(TILE_FLOP / FLOP_PER_CLK_SM / SLABS)   # 242 clocks of math per box at the tensor pipe's full rate
HOLD_660 = round(HOLD_PEAK * 989 / 660)                   # 363: at FlashMLA's 660 of the datasheet's 989 TFLOP/s

SOURCE = r"""
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#define SLAB_BYTES 8192
#define SLABS 9
struct __align__(64) TmaMap { uint64_t words[16]; };
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory"); }
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(bytes) : "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory"); }
// the barrier at the same offset in CTA `cta` of the cluster (a consumer releases a multicast stage everywhere)
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"   /* .release.cluster: a MEMBAR.GPU each */
                 :: "r"(bar), "r"(cta) : "memory"); }
__device__ __forceinline__ uint64_t gtimer() {
    uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ bool mbar_try(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// a watchdog: a phase that has not completed in 2 s (a launch takes milliseconds) is a deadlock of the probe; trap
// (the launch fails with an illegal instruction) rather than hang the device call
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    if (mbar_try(bar, parity)) return;
    const uint64_t t0 = gtimer();
    while (!mbar_try(bar, parity))
        if (gtimer() - t0 > 2000000000ull) asm volatile("trap;");
}
__device__ __forceinline__ void tma_load(uint32_t dst, const TmaMap* map, int c0, int c1, uint32_t bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, { %2, %3 }], [%4];\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory"); }
// the box into the same offset of every CTA in `mask`, completing on each one's barrier at offset `bar`
__device__ __forceinline__ void tma_load_mcast(uint32_t dst, const TmaMap* map, int c0, int c1, uint32_t bar,
                                               unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, { %2, %3 }], [%4], %5;\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask) : "memory"); }
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ uint32_t smid() { uint32_t r; asm volatile("mov.u32 %0, %%smid;" : "=r"(r)); return r; }

// CTA b streams `tiles` key tiles, tile i = (group * gstride + i) mod n_src with group = b / gsize, box by box
// through a ring of `ring` slab buffers. rec[b]: smid, clock and globaltimer at start and end, cluster rank;
// sums[b]: the sum of the 32-bit words its consumers read (`reads` passes over every box).
template <int CLUSTER, int MCAST>
__device__ __forceinline__ void feed(const TmaMap* map, int tiles, int n_src, int gsize, long long gstride, int ring,
                                     int reads, int hold, uint64_t* rec, uint32_t* sums) {
    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t buf0 = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t full0 = buf0 + ring * SLAB_BYTES, empty0 = full0 + 8 * ring;
    const int tid = threadIdx.x;
    const uint32_t rank = CLUSTER > 1 ? cluster_rank() : 0;
    if (tid == 0) {
        for (int s = 0; s < ring; ++s) { mbar_init(full0 + 8 * s, 1); mbar_init(empty0 + 8 * s, MCAST ? CLUSTER : 1); }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (CLUSTER > 1) cluster_sync();      // every CTA's barriers exist before any multicast or remote arrival
    const long long first = (long long)(blockIdx.x / gsize) * gstride;
    const int total = tiles * SLABS;
    uint64_t* const r = rec + 6 * blockIdx.x;
    if (tid == 0) {                       // the producer
        r[0] = smid(); r[1] = clock64(); r[3] = gtimer(); r[5] = rank;
        // box g = slab sl of tile t into stage s, its k-th use; counters, not divisions (one thread issues every box)
        int s = 0, k = 0, sl = 0, t = (int)(first % n_src);
        for (int g = 0; g < total; ++g) {
            if (k > 0) mbar_wait(empty0 + 8 * s, (uint32_t)(k - 1) & 1u);   // every reader released its last use
            mbar_expect_tx(full0 + 8 * s, SLAB_BYTES);
            if (!MCAST) tma_load(buf0 + s * SLAB_BYTES, map, sl * 64, t * 64, full0 + 8 * s);
            else if (sl % CLUSTER == (int)rank)
                tma_load_mcast(buf0 + s * SLAB_BYTES, map, sl * 64, t * 64, full0 + 8 * s,
                               (unsigned short)((1u << CLUSTER) - 1));
            if (++s == ring) { s = 0; ++k; }
            if (++sl == SLABS) { sl = 0; if (++t == n_src) t = 0; }
        }
    } else if (tid >= 32) {               // the consumers
        const int ct = tid - 32;
        uint32_t acc = 0;
        long long busy_until = clock64();
        int s = 0, k = 0;
        for (int g = 0; g < total; ++g) {
            mbar_wait(full0 + 8 * s, (uint32_t)k & 1u);
            if (hold > 0 && ct == 0) {     // the math on this box: `hold` clocks, after the box and the previous math
                const long long now = clock64();
                busy_until = (now > busy_until ? now : busy_until) + hold;
                while (clock64() < busy_until) { }
            }
            for (int p = 0; p < reads; ++p) {
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    uint32_t a, b, c, d;
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                                 : "r"(buf0 + s * SLAB_BYTES + j * 2048 + ct * 16) : "memory");
                    acc += a + b + c + d;
                }
            }
            asm volatile("bar.sync 1, 128;\n" ::: "memory");   // the whole box read before it is released
            if (ct == 0) {
                if (MCAST) { for (int c = 0; c < CLUSTER; ++c) mbar_arrive_cluster(empty0 + 8 * s, c); }
                else mbar_arrive(empty0 + 8 * s);
            }
            if (++s == ring) { s = 0; ++k; }
        }
        if (ct == 0) { r[2] = clock64(); r[4] = gtimer(); }
        atomicAdd(sums + blockIdx.x, acc);
    }
    if (CLUSTER > 1) cluster_sync();      // no CTA leaves while another may still arrive on its barriers
}
#define ENTRY(NAME, DIMS, C, M) extern "C" __global__ void DIMS __launch_bounds__(160, 1) NAME(           \
    const __grid_constant__ TmaMap map, int tiles, int n_src, int gsize, long long gstride, int ring, int reads, \
    int hold, uint64_t* rec, uint32_t* sums) {                                                                  \
    feed<C, M>(&map, tiles, n_src, gsize, gstride, ring, reads, hold, rec, sums); }
ENTRY(feed_c1, , 1, 0)
ENTRY(feed_c2_own, __cluster_dims__(2, 1, 1), 2, 0)
ENTRY(feed_c2_mcast, __cluster_dims__(2, 1, 1), 2, 1)
ENTRY(feed_c4_own, __cluster_dims__(4, 1, 1), 4, 0)
ENTRY(feed_c4_mcast, __cluster_dims__(4, 1, 1), 4, 1)
extern "C" __global__ void fill_words(uint32_t* p, uint64_t n, uint32_t seed) {   // a hash of the word index
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
        x ^= x >> 29; x *= 0xBF58476D1CE4E5B9ull; x ^= x >> 32;
        p[i] = (uint32_t)x;
    }
}
"""
ENTRIES = {(1, False): "feed_c1", (2, False): "feed_c2_own", (2, True): "feed_c2_mcast", (4, False): "feed_c4_own",
           (4, True): "feed_c4_mcast"}


@dataclass(frozen=True)
class Config:
    name: str
    source: str            # "l2" or "hbm"
    cluster: int = 1
    mcast: bool = False
    per_sm: int = 1        # CTAs per SM (0: one CTA on one SM, alone)
    ring: int = 18         # 8 KB slab buffers per CTA
    reads: int = 0         # ld.shared passes over every box
    hold: int = 0          # clocks of "math" per box: the consumer holds each box that long (0: releases at once)
    share: int = 0         # CTAs reading the same tiles without a cluster (0: the cluster's CTAs)

    def gsize(self) -> int:
        return self.share or self.cluster

    def smem(self) -> int:
        return self.ring * (SLAB_BYTES + 16)


CONFIGS = [   # the cluster rows last: a deadlock there (the watchdog's trap) ends the run, the rows above are kept
    Config("1 SM alone, ring 2 tiles", "l2", per_sm=0),
    Config("1 CTA/SM, ring 1 tile", "l2", ring=9),
    Config("1 CTA/SM, ring 2 tiles (seesaw)", "l2"),
    Config("1 CTA/SM, ring 3 tiles", "l2", ring=27),
    Config("2 CTA/SM, ring 1 tile each", "l2", per_sm=2, ring=9),
    Config("4 CTA/SM, ring 2/3 tile each", "l2", per_sm=4, ring=6),
    Config("1 CTA/SM, ring 2, 3 ld.shared reads", "l2", reads=3),
    Config("ring 2, math at full rate (242 clk/box)", "l2", hold=HOLD_PEAK),
    Config("ring 1, math at full rate (242 clk/box)", "l2", ring=9, hold=HOLD_PEAK),
    Config("ring 2, math at 660/989 (363 clk/box)", "l2", hold=HOLD_660),
    Config("HBM, 1 CTA/SM, ring 2 tiles", "hbm"),
    Config("HBM, 1 CTA/SM, ring 3 tiles", "hbm", ring=27),
    Config("9 CTAs share each tile (H=8 row tiles)", "l2", share=9),
    Config("HBM, 9 CTAs share each tile (64k keys)", "hbm", share=9),
    Config("cluster 2, own copies", "l2", cluster=2),
    Config("cluster 4, own copies", "l2", cluster=4),
    Config("cluster 2, multicast", "l2", cluster=2, mcast=True),
    Config("cluster 4, multicast", "l2", cluster=4, mcast=True),
    Config("HBM, cluster 2, multicast", "hbm", cluster=2, mcast=True),
]
assert all(c.smem() <= MAX_SMEM and (c.cluster == 1 or not (c.reads or c.share)) for c in CONFIGS)


def needed_rates(peak_tflops: float, sms: int, clock_ghz: float) -> dict:
    """What the compute needs from the feed at `peak_tflops` (one 73,728-byte tile per 64-row tile per key tile)."""
    tiles_per_s = peak_tflops * 1e12 / TILE_FLOP
    return dict(tiles_per_s=tiles_per_s, chip_tb_s=tiles_per_s * TILE_BYTES / 1e12,
                b_per_clk_sm=tiles_per_s * TILE_BYTES / (sms * clock_ghz * 1e9))


def summarize(cfg: Config, rec, tiles: int, event_ms: float) -> dict:
    """A row of the table from one timed launch's per-CTA records [ctas, 6] (smid, clk0, clk1, ns0, ns1, rank)."""
    ctas = len(rec)
    sm_ids = {int(x[0]) for x in rec}
    window_ns = max(int(x[4]) for x in rec) - min(int(x[3]) for x in rec)
    if window_ns <= 0:
        raise RuntimeError(f"{cfg.name}: globaltimer window {window_ns} ns; the records are not a finished launch")
    ghz = statistics.median((int(x[2]) - int(x[1])) / max(1, int(x[4]) - int(x[3])) for x in rec)
    delivered = ctas * tiles * TILE_BYTES
    # the consumer's math as a share of its time (1.0: the feed never starved it)
    busy = (statistics.median(tiles * SLABS * cfg.hold / max(1, int(x[2]) - int(x[1])) for x in rec)
            if cfg.hold else None)
    chip = delivered / (window_ns * 1e-9)
    per_sm = chip / len(sm_ids)
    return dict(config=cfg.name, ctas=ctas, sms=len(sm_ids), cluster=cfg.cluster, mcast=cfg.mcast,
                co_resident=max(int(x[3]) for x in rec) < min(int(x[4]) for x in rec),
                ctas_per_sm_max=max(sum(1 for x in rec if int(x[0]) == s) for s in sm_ids),
                window_us=window_ns / 1e3, event_us=event_ms * 1e3, clock_ghz=ghz,
                chip_tb_s=chip / 1e12, sm_gb_s=per_sm / 1e9, b_per_clk_sm=per_sm / (ghz * 1e9),
                l2_read_tb_s=chip / (cfg.cluster if cfg.mcast else 1) / 1e12,
                tflops_allowed=chip / TILE_BYTES * TILE_FLOP / 1e12, math_busy=busy)


def table(rows: list, peak: float, datasheet: float, sms: int, clock_ghz: float, device: str) -> str:
    head = (f"{'configuration':<40} {'CTAs':>5} {'SMs':>4} {'us':>8} {'GHz':>5} {'TB/s':>6} {'GB/s/SM':>8} "
            f"{'B/clk/SM':>8} {'L2 TB/s':>7} {'TFLOP/s':>8}  note")
    out = [f"L2 -> shared memory feed, {device}: {sms} SMs; key tile = {TILE_BYTES} B (9 boxes of 64x64 bf16, "
           f"128-byte swizzle); one tile per 64-row tile = {TILE_FLOP:,} FLOP", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['config']:<40} {'':>5} {'':>4} {'':>8} {'':>5} {'':>6} {'':>8} {'':>8} {'':>7} {'':>8}  "
                       f"{r['error']}")
            continue
        note = [] if r["co_resident"] else ["NOT one wave"]
        if r["sms"] == 1:
            note.append("one SM: read B/clk/SM")
        if r.get("math_busy") is not None:
            note.append(f"math busy {100 * r['math_busy']:.0f} % of the time")
        if r.get("check") is False:
            note.append("DATA CHECK FAILED")
        out.append(f"{r['config']:<40} {r['ctas']:>5} {r['sms']:>4} {r['window_us']:>8.1f} {r['clock_ghz']:>5.2f} "
                   f"{r['chip_tb_s']:>6.2f} {r['sm_gb_s']:>8.1f} {r['b_per_clk_sm']:>8.1f} {r['l2_read_tb_s']:>7.2f} "
                   f"{r['tflops_allowed']:>8.0f}  {', '.join(note)}")
    out.append("TFLOP/s = the dense bf16 rate the feed allows (each delivered tile: one 64-row x 64-key tile of work); "
               "L2 TB/s = bytes read from L2 (multicast: delivered / cluster size)")
    for label, p in (("measured peak", peak), ("datasheet", datasheet)):
        n = needed_rates(p, sms, clock_ghz)
        out.append(f"compute at {p:.0f} TFLOP/s ({label}) needs {n['tiles_per_s'] / 1e6:.1f} M tiles/s = "
                   f"{n['chip_tb_s']:.2f} TB/s = {n['b_per_clk_sm']:.1f} B/clk/SM at {clock_ghz:.2f} GHz")
    out.append(f"at the tensor pipe's full rate ({FLOP_PER_CLK_SM} FLOP/clk/SM) a 64-row tile needs "
               f"{TILE_BYTES * FLOP_PER_CLK_SM / TILE_FLOP:.1f} B/clk/SM of key tiles, at any clock")
    ok = [r for r in rows if "error" not in r and r["co_resident"] and r.get("check") is not False]
    for key in ("1 CTA/SM, ring 2 tiles (seesaw)", "HBM, 9 CTAs share each tile (64k keys)", "cluster 2, multicast",
                "cluster 4, multicast", "HBM, 1 CTA/SM, ring 2 tiles"):
        r = next((x for x in ok if x["config"] == key), None)
        if r is not None:
            lower = "the feed" if r["tflops_allowed"] < peak else "the compute"
            out.append(f"{key}: feed allows {r['tflops_allowed']:.0f} TFLOP/s vs {peak:.0f} measured peak "
                       f"({datasheet:.0f} datasheet): lower is {lower}"
                       + ("" if r["tflops_allowed"] >= datasheet else " (below the datasheet peak)")
                       + (f"; x9 = {9 * r['tflops_allowed']:.0f} where the 9 row tiles of H=8 Nq=65 share each tile "
                          "through L2" if key == "HBM, 1 CTA/SM, ring 2 tiles" else ""))
    return "\n".join(out)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="folder for probe_l2_feed.txt / .json (and ncu_tree_verify.txt)")
    ap.add_argument("--reps", type=int, default=7, help="timed launches per row, the median kept (default 7)")
    ap.add_argument("--tiles", type=int, default=1500, help="key tiles per SM per L2 launch (default 1500)")
    ap.add_argument("--hbm-gb", type=float, default=1.5, help="HBM source size in GB, > L2 (default 1.5; 0: skip)")
    ap.add_argument("--peak-tflops", type=float, default=660.0, help="measured dense peak (default 660)")
    ap.add_argument("--datasheet-tflops", type=float, default=989.0, help="datasheet dense bf16 (default 989)")
    ap.add_argument("--only", action="append", help="run only configurations whose name contains this (repeatable)")
    ap.add_argument("--ncu", action="store_true", help="also profile tree_verify (B=1 H=8 L=65536 Nq=65) with ncu")
    ap.add_argument("--ncu-target", action="store_true", help="only launch that call (what --ncu profiles)")
    ap.add_argument("--compile-only", action="store_true", help="compile the probe for sm_90a (no GPU) and exit")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.tiles < 4:
        ap.error(f"--reps must be >= 1 and --tiles >= 4 (got {a.reps}, {a.tiles})")
    if a.hbm_gb < 0 or 0 < a.hbm_gb < 0.2 or a.hbm_gb > 16:
        ap.error(f"--hbm-gb: 0 (skip) or 0.2..16 GB, larger than L2 (got {a.hbm_gb})")
    if a.peak_tflops <= 0 or a.datasheet_tflops <= 0:
        ap.error("--peak-tflops and --datasheet-tflops must be positive")
    if not (a.out or a.ncu_target or a.compile_only):
        ap.error("--out DIR is required")
    if a.only:
        names = [c.name for c in CONFIGS]
        for o in a.only:
            if not any(o in n for n in names):
                ap.error(f"--only {o!r} matches no configuration; they are: {'; '.join(names)}")
    return a


def compile_probe():
    """The probe's cubin for sm_90a (NVRTC through CuPy, as the project's kernels; no GPU needed)."""
    from ddtree_gen.build import compile as cc
    return cc.compile_source(SOURCE, "probe_l2_feed.cu", [*ENTRIES.values(), "fill_words"],
                             options=cc.options("sm_90a"))


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


class Probe:
    """The loaded probe on the current device: launches, occupancy, data checks."""

    def __init__(self, built):
        import cupy
        self.cp = cupy
        drv = cupy.cuda.driver
        self.module = cupy.cuda.function.Module()
        self.module.load(built.cubin)
        self.fn = {}
        for key, name in ENTRIES.items():
            f = self.module.get_function(name)
            drv.funcSetAttribute(f.ptr, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                 max(c.smem() for c in CONFIGS))
            self.fn[key] = f
        self.fill = self.module.get_function("fill_words")
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.sms = int(cupy.cuda.Device().attributes["MultiProcessorCount"])

    def blocks_per_sm(self, fn, smem: int) -> int:
        n = ctypes.c_int()
        _check(self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), ctypes.c_void_p(fn.ptr),
                                                                      THREADS, ctypes.c_size_t(smem)),
               "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return n.value

    @staticmethod
    def _launch_config(grid: int, smem: int, stream, attrs, nattrs: int):
        class LaunchConfig(ctypes.Structure):   # CUlaunchConfig
            _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                        ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint),
                        ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint)]
        return LaunchConfig(grid, 1, 1, THREADS, 1, 1, smem, stream, attrs, nattrs)

    def max_clusters(self, fn, grid: int, smem: int) -> int | None:
        """Clusters of `fn` (its size compiled in) co-resident on the chip; None if the driver cannot tell."""
        n = ctypes.c_int()
        c = self._launch_config(grid, smem, None, None, 0)
        rc = self.lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(fn.ptr), ctypes.byref(c))
        return n.value if rc == 0 and n.value > 0 else None

    def source(self, tiles: int):
        cp = self.cp
        words = tiles * TILE_BYTES // 4
        buf = cp.empty(words, dtype=cp.uint32)
        self.fill((min(65535, -(-words // 256)),), (256,), (buf, cp.uint64(words), cp.uint32(tiles)))
        sums = buf.reshape(tiles, TILE_BYTES // 4).sum(axis=1, dtype=cp.uint64) & cp.uint64(0xFFFFFFFF)
        cp.cuda.Device().synchronize()
        return buf, [int(x) for x in cp.asnumpy(sums)]

    def launch(self, cfg: Config, grid: int, words, n_src: int, tiles: int, gstride: int, reads: int, hold: int,
               rec, sums, stream) -> None:
        from ddtree_gen.launch.callplan import TensorMap, tensor_map_words
        words16 = tensor_map_words(words.data.ptr, TensorMap(0, n_src * 64, 576, 64, 64, 2, 128))
        gsize = cfg.gsize()
        vals = [(ctypes.c_uint64 * 16)(*words16), ctypes.c_int(tiles), ctypes.c_int(n_src), ctypes.c_int(gsize),
                ctypes.c_longlong(gstride), ctypes.c_int(cfg.ring), ctypes.c_int(reads), ctypes.c_int(hold),
                ctypes.c_uint64(rec.data.ptr), ctypes.c_uint64(sums.data.ptr)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        fn = self.fn[(cfg.cluster, cfg.mcast)].ptr
        try:
            self.cp.cuda.driver.launchKernel(fn, grid, 1, 1, THREADS, 1, 1, cfg.smem(), stream.ptr,
                                             ctypes.addressof(params), 0)
        except self.cp.cuda.driver.CUDADriverError:
            if cfg.cluster == 1:
                raise
            # a driver that wants the cluster size at launch: cuLaunchKernelEx, CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            class Attr(ctypes.Structure):
                _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                            ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]
            attr = Attr(4, 0, cfg.cluster, 1, 1)
            conf = self._launch_config(grid, cfg.smem(), stream.ptr, ctypes.addressof(attr), 1)
            _check(self.lib.cuLaunchKernelEx(ctypes.byref(conf), ctypes.c_void_p(fn), params, None),
                   f"cuLaunchKernelEx ({cfg.name})")

    def run(self, cfg: Config, src, reps: int, tiles_per_sm: int) -> dict:
        cp = self.cp
        words, tile_sums = src
        n_src = len(tile_sums)
        fn = self.fn[(cfg.cluster, cfg.mcast)]
        fit = self.blocks_per_sm(fn, cfg.smem()) if cfg.cluster == 1 else 1   # clusters: max_clusters below
        if fit < max(1, cfg.per_sm):
            return dict(config=cfg.name, error=f"only {fit} CTA(s) of {cfg.smem()} B fit an SM")
        grid = 1 if cfg.per_sm == 0 else cfg.per_sm * self.sms // cfg.gsize() * cfg.gsize()
        if cfg.cluster > 1:
            mc = self.max_clusters(fn, grid, cfg.smem())
            if mc is not None:
                grid = min(grid, mc * cfg.cluster)
        groups = grid // cfg.gsize()
        if cfg.source == "hbm":   # every tile once per launch: each group its own range
            tiles = n_src // groups
            gstride = tiles
            if tiles < 4:
                return dict(config=cfg.name, error=f"HBM source too small: {n_src} tiles for {groups} CTA groups")
        else:
            tiles = max(4, tiles_per_sm // max(1, cfg.per_sm))
            gstride = 7
        stream = cp.cuda.Stream()   # every CuPy operation below on it (allocations, fills, copies): no race
        with stream:
            rec = cp.zeros((grid, 6), dtype=cp.uint64)
            sums = cp.zeros(grid, dtype=cp.uint32)
            # the data check: a short launch, 1 read of every box; CTA b's expected sum from CuPy's per-tile sums
            check_tiles = min(tiles, 3 * cfg.ring // SLABS + 5)
            self.launch(cfg, grid, words, n_src, check_tiles, gstride, 1, 0, rec, sums, stream)
            stream.synchronize()
            got = cp.asnumpy(sums).tolist()
            want = [sum(int(tile_sums[((b // cfg.gsize()) * gstride + i) % n_src]) for i in range(check_tiles))
                    % (1 << 32) for b in range(grid)]
            start, end = cp.cuda.Event(), cp.cuda.Event()
            results = []
            for rep in range(reps + 1):   # the first launch warms up
                sums.fill(0)
                start.record(stream)
                self.launch(cfg, grid, words, n_src, tiles, gstride, cfg.reads, cfg.hold, rec, sums, stream)
                end.record(stream)
                end.synchronize()
                if rep:
                    ms = cp.cuda.get_elapsed_time(start, end)
                    results.append(summarize(cfg, cp.asnumpy(rec).tolist(), tiles, ms))
        check = got == want
        row = sorted(results, key=lambda r: r["chip_tb_s"])[len(results) // 2]   # the median launch
        row.update(check=check, tiles_per_cta=tiles, smem=cfg.smem(), ring=cfg.ring, reads=cfg.reads,
                   source=cfg.source, spread_tb_s=[round(r["chip_tb_s"], 3) for r in results])
        return row


FEED_METRICS = [   # asked for if this ncu knows them (ncu --query-metrics --chip gh100)
    "gpu__time_duration.sum", "sm__cycles_elapsed.avg.per_second", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_srcunit_tex.sum", "lts__t_sectors_srcunit_tex_op_read.sum", "lts__t_bytes.sum.per_second",
    "lts__t_sector_hit_rate.pct", "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__m_xbar2l1tex_read_bytes.sum", "l1tex__m_xbar2l1tex_read_bytes.sum.per_second",
    "dram__bytes_read.sum", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_executed_pipe_tensor_op_gmma.sum", "smsp__inst_executed_pipe_tensor.sum",
    "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
    "smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct", "smsp__warp_issue_stalled_wait_per_warp_active.pct",
    "smsp__warp_issue_stalled_math_pipe_throttle_per_warp_active.pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
]


def find_ncu() -> str | None:
    import glob
    for c in [shutil.which("ncu"), *sorted(glob.glob("/usr/local/cuda*/bin/ncu")),
              *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))]:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def known_metrics(ncu: str, wanted: list) -> list:
    """The metrics of `wanted` whose base name this ncu lists for GH100 (all of them if it cannot list)."""
    try:
        listed = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True,
                                timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return wanted
    base = {line.split()[0] for line in listed.splitlines() if line.strip() and "__" in line.split()[0]}
    if not base:
        return wanted
    return [m for m in wanted if m.split(".")[0] in base]


def ncu_command(ncu: str, metrics: list) -> list:
    return [ncu, "--target-processes", "all", "--clock-control", "none", "-k", "regex:^ddtree_tree_verify_wgmma$",
            "--launch-skip", "2", "--launch-count", "1", "--section", "SpeedOfLight", "--section", "WarpStateStats",
            "--metrics", ",".join(metrics),
            sys.executable, os.path.abspath(__file__), "--ncu-target"]


def verify_set():
    """kimi-k2.6-tp8's tree_verify_wgmma and split-KV combine, sm_90a (compiled into the cache if needed; no GPU)."""
    import ddtree_gen
    from ddtree_gen.ops.tree_verify.split import COMBINE
    return ddtree_gen.load("kimi-k2.6-tp8", kernels=["tree_verify_wgmma", COMBINE], arch="sm_90a")


def ncu_target() -> None:
    """One B=1, H=8, L=65536, Nq=65 call of tree_verify (the default route: tree_verify_wgmma, its seesaw build, and
    the split-KV combine where it splits), three times."""
    import numpy as np
    from ddtree_gen.inputs import verify_inputs
    ks = verify_set()
    x = verify_inputs(ks.spec, 1, np.full(1, 65536), 65)
    for _ in range(3):
        ks.tree_verify(**x)
    import cupy
    cupy.cuda.Device().synchronize()
    row_tiles, key_tiles = -(-65 * 8 // 64), -(-(65536 + 65) // 64)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    print(f"ncu target: tree_verify B=1 H=8 L=65536 Nq=65, 3 calls; {row_tiles} row tiles x {key_tiles} key tiles = "
          f"{row_tiles * key_tiles} (row tile, key tile) pairs, {row_tiles * key_tiles / sms:.1f} per SM: the "
          f"kernel's duration / that = its time per tile per SM (2,176 clocks at the full tensor rate)", flush=True)


def main(argv=None) -> int:
    a = parse(argv)
    if a.ncu_target:
        ncu_target()
        return 0
    built = compile_probe()
    regs = {k: v.registers for k, v in built.reports.items()}
    if a.compile_only:
        print(f"compiled for sm_90a: {len(built.cubin)} bytes of cubin; registers {regs}")
        return 0
    import cupy
    try:
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        print(f"probe_l2_feed: no usable CUDA device ({e}); --compile-only checks the source without one",
              file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if (props["major"], props["minor"]) != (9, 0):
        print(f"probe_l2_feed: needs compute capability 9.0 (sm_90a: H100 / H200); device {dev.id} is {name}",
              file=sys.stderr)
        return 2
    cupy.zeros(1, dtype=cupy.uint8)   # the device's context exists before the module is loaded into it
    dev.synchronize()
    probe = Probe(built)
    l2_mb = props["l2CacheSize"] / 2**20
    print(f"{name}: {probe.sms} SMs, L2 {l2_mb:.0f} MB; probe registers {regs}", flush=True)
    chosen = [c for c in CONFIGS if not a.only or any(o in c.name for o in a.only)]
    if a.hbm_gb == 0:
        chosen = [c for c in chosen if c.source != "hbm"]
    rows, sources = [], {}
    for cfg in chosen:
        try:
            if cfg.source not in sources:
                tiles = L2_TILES if cfg.source == "l2" else int(a.hbm_gb * 1e9) // TILE_BYTES
                if cfg.source == "hbm" and tiles * TILE_BYTES < 4 * props["l2CacheSize"]:
                    raise ValueError(f"--hbm-gb {a.hbm_gb}: not 4x larger than the {l2_mb:.0f} MB L2")
                sources[cfg.source] = probe.source(tiles)
            row = probe.run(cfg, sources[cfg.source], a.reps, a.tiles)
        except Exception as e:   # one row's failure (a launch error) is reported; a sticky error ends the run below
            row = dict(config=cfg.name, error=f"{type(e).__name__}: {e}"[:200])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "error" in row:
            try:
                dev.synchronize()
            except Exception:   # a sticky error (the watchdog's trap): no later launch can run in this process
                print("the CUDA context is broken after that error; stopping", file=sys.stderr)
                break
    ok = [r for r in rows if "error" not in r]
    clock = statistics.median(r["clock_ghz"] for r in ok) if ok else 1.83
    text = table(rows, a.peak_tflops, a.datasheet_tflops, probe.sms, clock, name)
    ncu = find_ncu()
    metrics = known_metrics(ncu, FEED_METRICS) if ncu else FEED_METRICS
    cmd = ncu_command(ncu or "ncu", metrics)
    text += "\n\nprofile today's kernel: PYTHONPATH=. " + " ".join(cmd)
    with open(os.path.join(a.out, "probe_l2_feed.json"), "w") as f:
        json.dump(dict(device=name, sms=probe.sms, l2_mb=l2_mb, registers=regs, rows=rows), f, indent=1)
    with open(os.path.join(a.out, "probe_l2_feed.txt"), "w") as f:
        f.write(text + "\n")
    if a.ncu:
        if ncu is None:
            text += "\nncu: not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)"
        else:
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
            report = ""
            try:   # compiled here, so that ncu's time limit is the profile's alone
                verify_set()
            except Exception as e:
                report += f"loading the kernel set before ncu failed: {type(e).__name__}: {e}\n"
            for attempt in (cmd, [x for i, x in enumerate(cmd) if "--metrics" not in cmd[max(0, i - 1):i + 1]]):
                try:   # the second attempt: the sections alone, if this ncu refused a metric
                    p = subprocess.run(attempt, capture_output=True, text=True, timeout=120, env=env)
                    report += " ".join(attempt) + "\n" + p.stdout + p.stderr + f"\n(ncu exit status {p.returncode})\n"
                except subprocess.TimeoutExpired:
                    report += "ncu: timed out after 120 s\n"
                    break
                if p.returncode == 0 or "metric" not in (p.stdout + p.stderr).lower():
                    break
            with open(os.path.join(a.out, "ncu_tree_verify.txt"), "w") as f:
                f.write(report)
            text += "\n\n" + report[-6000:]
    print(text)
    return 0 if all("error" not in r and r.get("check") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
