"""The one prepared script for a lent GPU machine (issue 37 Part 2, issue 38 item 4).

    python benchmarks/gpu.py --out gpu_results             # on the GPU machine: < 8 minutes
    python benchmarks/gpu.py --device cpu --out /tmp/dry    # dry mode: tiny sizes, seconds

GPU time is short (15 minutes in all, no internet), so the script is one call that leaves
results behind however it ends: every step writes `gpu.json` and `gpu.md` under --out the
moment it finishes (flushed, replaced atomically), runs under its own timeout, and is
skipped when the run's budget (--budget seconds, 450 by default) cannot hold it. Steps, in
order of what matters most:

  install      pip install --no-deps --no-build-isolation -e . (the machine's torch 2.11+cu130
               stays; without internet an isolated build could not fetch setuptools). The
               steps import graphc from this checkout either way
  pytest       pytest -m cuda tests/cuda (the cuda-marked tests)
  gpt_bf16     the GPT of examples/gpt.py at ~124M parameters (GPT-2 small: 12 layers, width
               768, vocabulary 50304) in bf16 autocast: graphc one stage / eager, interleaved;
               tokens/s and MFU against the detected device's dense bf16 peak
  cuda_graphs  the same at a small batch, graphc + config.set_cuda_graphs(True) / eager, and
               the captured run bitwise equal to the uncaptured one over 10 steps
  float64      graphc against eager on the GPU in float64: loss and parameters within 1e-10
  amp          bf16, and fp16 + GradScaler: graphc against eager autocast, the largest loss
               difference over the steps, tokens/s
  stages       two pipeline stages on the one device (interleaved 1F1B, 2 micro-batches)
               against one stage
  simulate     graphc plan's simulator for the detected device (h100, h200, a100 presets)
               on the gpt_bf16 graph: predicted step / measured step (issue 38 item 3)
  compile      torch.compile of the same model (eager / compiled tokens/s), last: its first
               compile is the slowest step

With --device cpu every step runs at tiny sizes (install only asks pip its version; torch.compile with its
"eager" backend; CUDA graphs must be refused with a GraphcError), so the code paths that
need no GPU are known to work before one is lent: tests/test_gpu_script.py runs it.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

# dense bf16 tensor-core peaks (FLOP/s) by device name, from the vendors' data sheets
BF16_PEAKS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12),
              ("L40S", 362e12), ("A10", 125e12))


# -- sizes ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """One run's model and batch sizes, and how many steps each measurement times."""

    layers: int
    width: int
    heads: int
    vocab: int
    block: int
    batch: int          # the throughput measurements' batch
    small_batch: int    # CUDA graphs' batch: where host overhead shows
    small_block: int
    warmup: int
    iters: int


GPU_SIZES = Sizes(layers=12, width=768, heads=12, vocab=50304, block=1024, batch=8,
                  small_batch=2, small_block=128, warmup=3, iters=10)
DRY_SIZES = Sizes(layers=1, width=32, heads=2, vocab=64, block=16, batch=4,
                  small_batch=2, small_block=8, warmup=1, iters=2)


# -- results, written after every step -------------------------------------------------------------
class Results:
    """gpu.json and gpu.md under `out`, rewritten whole (atomically) after every step."""

    def __init__(self, out: str, meta: Dict):
        self.out, self.meta, self.steps = out, meta, []
        os.makedirs(out, exist_ok=True)
        self.write()

    def add(self, row: Dict) -> None:
        self.steps.append(row)
        self.write()

    def write(self) -> None:
        _write_atomic(os.path.join(self.out, "gpu.json"),
                      json.dumps({"meta": self.meta, "steps": self.steps}, indent=1, default=str))
        _write_atomic(os.path.join(self.out, "gpu.md"), self.markdown())

    def markdown(self) -> str:
        head = ", ".join(f"{k} {v}" for k, v in self.meta.items())
        lines = [f"# graphc on {self.meta.get('device')}", "", head, "",
                 "| step | status | seconds | numbers |", "|---|---|---|---|"]
        for row in self.steps:
            numbers = "; ".join(f"{k} {_fmt(v)}" for k, v in row.items()
                                if k not in ("step", "status", "seconds", "error"))
            status = row["status"] + (f": {row['error']}" if row.get("error") else "")
            lines.append(f"| {row['step']} | {status} | {row['seconds']:.1f} | {numbers} |")
        return "\n".join(lines) + "\n"


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "/").replace("\n", " ")


# -- steps under a timeout --------------------------------------------------------------------------
class StepTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """SIGALRM after `seconds`: a step stuck in Python (or between kernels) is cut off."""
    def on_alarm(_sig, _frame):
        raise StepTimeout(f"timed out after {seconds:.0f} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_step(results: Results, name: str, fn: Callable[[], Dict], timeout: float, deadline: float) -> None:
    """Runs one step within min(timeout, what is left of the budget) and records its row."""
    left = deadline - time.monotonic()
    if left < min(timeout, 10.0):
        results.add({"step": name, "status": "skipped", "seconds": 0.0,
                     "error": f"budget: {left:.0f} s left"})
        return
    start = time.monotonic()
    row: Dict = {"step": name}
    try:
        with time_limit(min(timeout, left)):
            row.update(fn())
        row["status"] = row.get("status", "ok")
    except Exception as exc:  # noqa: BLE001 - a failed step is a result; the next one runs
        row.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:400]}")
        traceback.print_exc()
    row["seconds"] = time.monotonic() - start
    print(f"[gpu.py] {name}: {row['status']} in {row['seconds']:.1f} s", flush=True)
    results.add(row)
    _free_device_memory()


def _free_device_memory() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_command(cmd: List[str], timeout: float) -> Dict:
    """A subprocess step: its exit status and the tail of its output. graphc is importable
    from the checkout (PYTHONPATH) whether or not the install step worked."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return {"status": "ok" if done.returncode == 0 else "failed", "rc": done.returncode,
            "tail": " / ".join(tail)}


# -- the model and the two ways of training it ------------------------------------------------------
def make_gpt(sizes: Sizes, device: str, dtype=torch.float32, seed: int = 0):
    import gpt
    torch.manual_seed(seed)
    cfg = gpt.GPTConfig(vocab_size=sizes.vocab, block_size=sizes.block, n_layer=sizes.layers,
                        n_head=sizes.heads, n_embd=sizes.width)
    with torch.device(device):   # initialised where it trains: 124M parameters init in ms on a GPU
        return gpt.GPT(cfg).to(dtype=dtype)


def make_batches(sizes: Sizes, device: str, n: int, batch: int, block: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, sizes.vocab, (batch, block), generator=g).to(device),
             torch.randint(0, sizes.vocab, (batch, block), generator=g).to(device)) for _ in range(n)]


def graph_for(model, device: str, amp=None, scaler: bool = False, stages: int = 1,
              cuda_graphs: bool = False, accumulation: int = 1):
    """A graphc Graph training `model` with AdamW: one stage (its parameters' device), or
    `stages` stages of its blocks on the one device (interleaved 1F1B)."""
    import gpt
    import graphc

    class BenchGraph(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.model = model
            if stages > 1:
                place = graphc.placement(device, ranks=[0])
                t, n = self.model.transformer, len(model.transformer.h)
                t.wte.config.set_stage(0, place)
                t.wpe.config.set_stage(0, place)
                for i in range(n):
                    t.h[i].config.set_stage(i * stages // n, place)
                t.ln_f.config.set_stage(stages - 1, place)
                self.model.lm_head.config.set_stage(stages - 1, place)
                self.config.set_pipeline_schedule("interleaved_1f1b")
            self.config.set_gradient_accumulation_steps(accumulation)
            if amp is not None:
                self.config.enable_amp(True, dtype=amp)
            if scaler:
                self.set_grad_scaler(graphc.amp.GradScaler(init_scale=2.0 ** 16))
            if cuda_graphs:
                self.config.set_cuda_graphs(True)
            self.add_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0))

        def build(self, idx, targets):
            loss = gpt.lm_loss(self.model(idx), targets)
            loss.backward()
            return loss

    return BenchGraph()


class EagerStep:
    """The same step in eager PyTorch: autocast for `amp`, torch's GradScaler for fp16."""

    def __init__(self, model, device: str, amp=None, scaler: bool = False, compiled=None):
        import gpt
        self.model, self.device, self.amp = model, device, amp
        self.forward = compiled if compiled is not None else model
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
        self.scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16) if scaler else None
        self.loss_fn = gpt.lm_loss

    def __call__(self, x, y) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        region = torch.autocast(self.device, dtype=self.amp) if self.amp else contextlib.nullcontext()
        with region:
            loss = self.loss_fn(self.forward(x), y)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        return loss.detach()


def graph_step(graph) -> Callable:
    return lambda x, y: graph(x, y).to_local()


def timed(steps: Dict[str, Callable], batches, warmup: int, sync) -> Dict[str, List[float]]:
    """Each step function on every batch, interleaved (the same load for all), after warmup."""
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for i, (x, y) in enumerate(batches):
        for name, fn in steps.items():
            sync()
            t0 = time.perf_counter()
            fn(x, y)
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def flops_per_token(sizes: Sizes, block: int) -> float:
    """Training FLOPs per token: 6 per parameter-token plus attention's 12 * layers * block *
    width (PaLM's appendix B), parameters counted without position embeddings."""
    n = 12 * sizes.layers * sizes.width ** 2 + sizes.vocab * sizes.width
    return 6 * n + 12 * sizes.layers * block * sizes.width


def bf16_peak(device: str) -> Optional[float]:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAKS if key in name), None)


def device_preset(device: str) -> str:
    """graphc's simulator preset for the detected GPU (h100 in the dry mode)."""
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    return next((preset for key, preset in (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))
                 if key in name), "h100")


def throughput(times: Dict[str, List[float]], tokens: int, sizes: Sizes, block: int, device: str) -> Dict:
    row: Dict = {}
    peak = bf16_peak(device)
    for name, ts in times.items():
        med = statistics.median(ts)
        row[f"{name}_ms"] = med * 1e3
        row[f"{name}_tokens_s"] = tokens / med
        if peak is not None:
            row[f"{name}_mfu"] = tokens * flops_per_token(sizes, block) / med / peak
    return row


# -- the measurements --------------------------------------------------------------------------------
class Bench:
    def __init__(self, device: str, sizes: Sizes):
        self.device, self.sizes = device, sizes
        self.measured: Dict[str, float] = {}   # gpt_bf16's row, for the simulator's comparison

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def pair(self, amp=None, scaler=False, **graph_kw):
        """A graphc step and an eager step on two equal copies of the model."""
        model = make_gpt(self.sizes, self.device)
        ref = copy.deepcopy(model)
        return (graph_step(graph_for(model, self.device, amp, scaler, **graph_kw)),
                EagerStep(ref, self.device, amp, scaler))

    def gpt_bf16(self) -> Dict:
        s = self.sizes
        graph, eager = self.pair(amp=torch.bfloat16)
        batches = make_batches(s, self.device, s.warmup + s.iters, s.batch, s.block)
        times = timed({"graphc": graph, "eager": eager}, batches, s.warmup, self.sync)
        row = throughput(times, s.batch * s.block, s, s.block, self.device)
        row["graphc_over_eager"] = row["graphc_ms"] / row["eager_ms"]
        row["params_M"] = sum(p.numel() for p in eager.model.parameters()) / 1e6
        self.measured = row
        return row

    def simulate(self) -> Dict:
        """The simulator's step for this device's preset against gpt_bf16's measured step."""
        from graphc.tools.costs import device_costs
        from graphc.tools.simulate import simulate
        s = self.sizes
        graph = graph_for(make_gpt(s, self.device), self.device, torch.bfloat16)
        graph.compile(*make_batches(s, self.device, 1, s.batch, s.block)[0])
        preset = device_preset(self.device)
        predicted = simulate(graph.compiled.plans, device_costs(graph.compiled, preset)).step_time * 1e3
        row = {"preset": preset, "predicted_ms": predicted}
        if "graphc_ms" in self.measured:   # meaningless in the dry mode: a GPU preset against a CPU
            row["predicted_over_measured"] = predicted / self.measured["graphc_ms"]
        return row

    def cuda_graphs(self) -> Dict:
        s = self.sizes
        if self.device != "cuda":
            return self._cuda_graphs_refused()
        graph, eager = self.pair(amp=torch.bfloat16)
        captured, _ = self.pair(amp=torch.bfloat16, cuda_graphs=True)
        batches = make_batches(s, self.device, s.warmup + s.iters, s.small_batch, s.small_block)
        times = timed({"graphc": graph, "graphs": captured, "eager": eager}, batches, s.warmup, self.sync)
        row = throughput(times, s.small_batch * s.small_block, s, s.small_block, self.device)
        row["graphs_over_eager"] = row["graphs_ms"] / row["eager_ms"]
        row["bitwise_equal_10_steps"] = self._graphs_bitwise()
        return row

    def _graphs_bitwise(self) -> bool:
        """10 steps with and without capture from equal models: equal losses and parameters."""
        s = self.sizes
        plain_model, captured_model = make_gpt(s, self.device), make_gpt(s, self.device)
        plain = graph_step(graph_for(plain_model, self.device, torch.bfloat16))
        captured = graph_step(graph_for(captured_model, self.device, torch.bfloat16, cuda_graphs=True))
        same = True
        for x, y in make_batches(s, self.device, 10, s.small_batch, s.small_block, seed=2):
            same &= torch.equal(plain(x, y), captured(x, y))
        params = zip(plain_model.parameters(), captured_model.parameters())
        return bool(same and all(torch.equal(a, b) for a, b in params))

    def _cuda_graphs_refused(self) -> Dict:
        """On the CPU, set_cuda_graphs must be refused with a GraphcError (never run silently)."""
        import graphc
        s = self.sizes
        graph = graph_for(make_gpt(s, self.device), self.device, cuda_graphs=True)
        x, y = make_batches(s, self.device, 1, s.small_batch, s.small_block)[0]
        try:
            graph(x, y)
        except graphc.GraphcError as exc:
            return {"status": "refused", "message": " ".join(str(exc).splitlines()[:2])[:300]}
        raise AssertionError("config.set_cuda_graphs(True) ran on CPU placements without a GraphcError")

    def float64(self) -> Dict:
        s = self.sizes
        model = make_gpt(s, self.device, torch.float64)
        ref = copy.deepcopy(model)
        graph, eager = graph_step(graph_for(model, self.device, accumulation=2)), EagerStep(ref, self.device)
        batches = make_batches(s, self.device, 3, s.small_batch * 2, s.small_block)
        dloss = max(float((graph(x, y) - eager(x, y)).abs()) for x, y in batches)
        dparam = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
        ok = dloss <= 1e-10 and dparam <= 1e-10
        return {"status": "ok" if ok else "differs", "loss_diff": dloss, "param_diff": dparam}

    def amp(self) -> Dict:
        s = self.sizes
        row: Dict = {}
        for name, dtype, scaler in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, True)):
            graph, eager = self.pair(amp=dtype, scaler=scaler)
            batches = make_batches(s, self.device, s.warmup + s.iters, s.batch, s.block)
            losses = {"graphc": [], "eager": []}
            steps = {k: _recording(fn, losses[k]) for k, fn in (("graphc", graph), ("eager", eager))}
            times = timed(steps, batches, s.warmup, self.sync)
            row[f"{name}_loss_diff"] = max(abs(a - b) for a, b in zip(losses["graphc"], losses["eager"]))
            got = throughput(times, s.batch * s.block, s, s.block, self.device)
            row[f"{name}_graphc_over_eager"] = got["graphc_ms"] / got["eager_ms"]
            row[f"{name}_graphc_tokens_s"] = got["graphc_tokens_s"]
        return row

    def stages(self) -> Dict:
        s = self.sizes
        one = graph_step(graph_for(make_gpt(s, self.device), self.device, torch.bfloat16, accumulation=2))
        two = graph_step(graph_for(make_gpt(s, self.device), self.device, torch.bfloat16, stages=2,
                                   accumulation=2))
        batches = make_batches(s, self.device, s.warmup + s.iters, s.batch, s.block)
        losses = {"one": [], "two": []}
        times = timed({"one": _recording(one, losses["one"]), "two": _recording(two, losses["two"])},
                      batches, s.warmup, self.sync)
        row = throughput(times, s.batch * s.block, s, s.block, self.device)
        row["two_over_one"] = row["two_ms"] / row["one_ms"]
        row["loss_diff"] = max(abs(a - b) for a, b in zip(losses["one"], losses["two"]))
        return row

    def compile(self) -> Dict:
        s = self.sizes
        backend = "inductor" if self.device == "cuda" else "eager"  # dry mode: the path, not Inductor
        model = make_gpt(s, self.device)
        ref = copy.deepcopy(model)
        compiled = EagerStep(model, self.device, torch.bfloat16, compiled=torch.compile(model, backend=backend))
        eager = EagerStep(ref, self.device, torch.bfloat16)
        graph = graph_step(graph_for(make_gpt(s, self.device), self.device, torch.bfloat16))
        batches = make_batches(s, self.device, s.warmup + s.iters, s.batch, s.block)
        t0 = time.monotonic()
        compiled(*batches[0])   # its compile, outside the timed steps
        self.sync()
        first = time.monotonic() - t0
        times = timed({"compiled": compiled, "graphc": graph, "eager": eager}, batches, s.warmup, self.sync)
        row = throughput(times, s.batch * s.block, s, s.block, self.device)
        row.update(backend=backend, compile_s=first, graphc_over_compiled=row["graphc_ms"] / row["compiled_ms"],
                   compiled_over_eager=row["compiled_ms"] / row["eager_ms"])
        return row


def _recording(fn: Callable, into: List[float]) -> Callable:
    def step(x, y):
        loss = fn(x, y)
        into.append(float(loss))
        return loss
    return step


# -- the run -------------------------------------------------------------------------------------------
def describe(device: str) -> Dict:
    meta = {"device": "cpu (dry mode)", "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device == "cuda":
        meta["device"] = torch.cuda.get_device_name()
        meta["bf16_peak_tflops"] = (bf16_peak(device) or 0.0) / 1e12
    return meta


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default="gpu_results")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    parser.add_argument("--steps", default="", help="comma-separated step names (default: all)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: no CUDA device; use --device cpu for the dry mode")
    deadline = time.monotonic() + args.budget
    dry = args.device == "cpu"
    if dry:   # tiny sizes: threads only contend (and the CI machine runs other tests beside)
        torch.set_num_threads(1)
    results = Results(args.out, describe(args.device))
    bench = Bench(args.device, DRY_SIZES if dry else GPU_SIZES)
    # dry mode leaves the environment alone: pip only says which it is
    # no internet there: no build isolation (it would fetch setuptools); the machine's own is used
    install_cmd = [sys.executable, "-m", "pip"] + (["--version"] if dry else
                                                   ["install", "--no-deps", "--no-build-isolation", "-e", "."])
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/cuda", "-p", "no:cacheprovider"]
    plan = [  # (name, function, timeout in seconds)
        ("install", lambda: run_command(install_cmd, 120), 130),
        ("pytest", lambda: run_command(pytest_cmd, 150), 160),
        ("gpt_bf16", bench.gpt_bf16, 90),
        ("cuda_graphs", bench.cuda_graphs, 90),
        ("float64", bench.float64, 45),
        ("amp", bench.amp, 75),
        ("stages", bench.stages, 60),
        ("simulate", bench.simulate, 45),
        ("compile", bench.compile, 150),
    ]
    wanted = set(filter(None, args.steps.split(",")))
    for name, fn, timeout in plan:
        if not wanted or name in wanted:
            run_step(results, name, fn, timeout, deadline)
    failed = [r["step"] for r in results.steps if r["status"] in ("failed",)]
    print(f"[gpu.py] wrote {os.path.join(args.out, 'gpu.json')} and gpu.md; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
