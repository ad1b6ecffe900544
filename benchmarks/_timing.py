"""Timing helpers shared by the benchmarks: CUDA-graph replay timing with an L2 flush (cold) or a
spin (warm) before each replay, the streaming-read and matmul ceilings of the same run, and GPU
clock/power samples. The method is described in benchmarks/README.md."""
import statistics
import subprocess
import time

import torch

FLUSH_BYTES = 512 * 1024 * 1024  # read before each cold replay: evicts the 60 MB L2
SPIN_CYCLES = 40000  # ~20 us at ~2 GHz


class GraphTimer:
    """Median replay time of a CUDA graph: cold = each replay preceded by a FLUSH_BYTES read (L2
    evicted), warm = each preceded by a ~20 us spin kernel (no memory traffic)."""

    def __init__(self):
        self.buf = torch.ones(FLUSH_BYTES // 2, dtype=torch.bfloat16, device="cuda")
        self.sink = torch.empty((), dtype=torch.float32, device="cuda")

    def flush(self):
        torch.sum(self.buf, 0, dtype=torch.float32, out=self.sink)

    def estimate_ms(self, fn):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush()
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)

    def time(self, graph, rep_ms, min_reps=20, max_reps=600):
        return self.time_interleaved([graph], rep_ms, min_reps, max_reps)[0]

    def time_interleaved(self, graphs, rep_ms, min_reps=20, max_reps=600, rounds=4):
        """time() of several graphs (the kernels of one config), their replays interleaved: each
        graph's replays are cut into `rounds` rounds, and in every round each graph runs its share in
        turn, starting from a different graph each round. Clock and power drift over the config (the
        GPU warms up as it goes) then weighs on every kernel alike, instead of favouring the first."""
        reps = []
        for g in graphs:
            for _ in range(3):
                g.replay()
            est = self.estimate_ms(g.replay)
            flush_ms = self.estimate_ms(self.flush)
            n = int(max(min_reps, min(max_reps, rep_ms / (est + flush_ms + 0.01))))
            reps.append(-(-n // rounds))  # per round
        k = len(graphs)
        res = [dict(reps=r * rounds) for r in reps]
        for mode in ("cold", "warm"):
            events = [[] for _ in graphs]
            for rnd in range(rounds):
                for j in range(k):
                    i = (rnd + j) % k
                    for _ in range(reps[i]):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        if mode == "cold":
                            self.flush()
                        else:
                            torch.cuda._sleep(SPIN_CYCLES)
                        s.record()
                        graphs[i].replay()
                        e.record()
                        events[i].append((s, e))
                torch.cuda.synchronize()  # bounds the events in flight
            for i in range(k):
                ts = sorted(s.elapsed_time(e) * 1e3 for s, e in events[i])
                res[i][f"{mode}_us"] = statistics.median(ts)
                res[i][f"{mode}_p10_us"] = ts[len(ts) // 10]
                res[i][f"{mode}_p90_us"] = ts[(9 * len(ts)) // 10]
        return res


def capture(fn):
    """CUDA graph of fn() (warmed up on a side stream); returns (graph, outputs of the captured call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = fn()
    torch.cuda.synchronize()
    return g, outs


def event_ms(fn, warmup, iters):
    """Median ms of fn() over iters calls (CUDA events), after warmup calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ts)


def _make_stream_read():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(src, dst, chunk, TILE: tl.constexpr):
        # each program sums one contiguous chunk of `chunk` elements (a multiple of TILE)
        row = tl.program_id(0).to(tl.int64) * chunk
        acc = tl.zeros([TILE], dtype=tl.float32)
        for off in tl.range(0, chunk, TILE, num_stages=3):
            acc += tl.load(src + row + off + tl.arange(0, TILE)).to(tl.float32)
        tl.store(dst + tl.program_id(0), tl.sum(acc, axis=0))
    return stream_read


def measure_ceilings(matmul=True):
    """HBM streaming read (Triton kernel if importable, else torch.sum) and, with matmul, a bf16 8192^3
    matmul, measured now on this GPU."""
    res = {}
    n = 1 << 31                                     # 4 GiB of bf16
    x = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    ms = event_ms(lambda: torch.sum(x, 0, dtype=torch.float32, out=sink), 5, 20)
    res["read_torch_sum_TBps"] = 2 * n / ms / 1e9
    try:
        kern = _make_stream_read()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        best = 0.0
        for progs in (sms * 8, sms * 16, sms * 32):
            for tile in (2048, 4096):
                chunk = n // progs // tile * tile
                dst = torch.empty(progs, dtype=torch.float32, device="cuda")
                ms = event_ms(lambda: kern[(progs,)](x, dst, chunk, TILE=tile, num_warps=8), 3, 15)
                best = max(best, 2 * progs * chunk / ms / 1e9)
        res["read_triton_TBps"] = best
    except Exception as e:
        res["read_triton_error"] = repr(e)[:300]
    res["read_TBps"] = max(res.get("read_triton_TBps", 0.0), res["read_torch_sum_TBps"])
    del x
    torch.cuda.empty_cache()
    if not matmul:
        return res
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    bm = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t_end = time.time() + 0.5                       # ~0.5 s warm-up (clocks / power settle)
    while time.time() < t_end:
        torch.matmul(a, bm, out=c)
        torch.cuda.synchronize()
    ms = event_ms(lambda: torch.matmul(a, bm, out=c), 2, 50)
    res["mm8192_bf16_TFLOPs"] = 2 * 8192 ** 3 / ms / 1e9
    res["nvml_after_mm"] = nvml_sample()
    del a, bm, c
    torch.cuda.empty_cache()
    return res


_NVML = []


def nvml_sample():
    try:
        import pynvml
        if not _NVML:
            pynvml.nvmlInit()
            _NVML.append(pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device()))
        h = _NVML[0]
        return dict(sm_MHz=pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                    power_W=round(pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0, 1))
    except Exception:
        return {}


def smi():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,"
                               "power.draw,power.limit,temperature.gpu", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:
        return repr(e)
