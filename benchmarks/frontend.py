"""The front end's cost: compile time of the GPT example (and of a Hugging Face Llama when
transformers is installed) and the guard check graphc runs on every call (NOTE: Guards).

    python benchmarks/frontend.py [--repeats 3] [--layers 4 32]

One process, float32, one thread. Compile time is graph.compile(x, y) (trace, passes, plan,
runtime set-up), the median of --repeats fresh graphs; the guard check is
compiled.guards.failing() timed over 2000 calls (what every call of the graph runs before
its step), beside the median step time it adds to. Works on graphc before guards too (then
no guard figures are printed), to compare the two front ends on one machine.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt  # noqa: E402
import graphc  # noqa: E402


def _gpt(layers):
    ids, vocab = gpt.load_corpus()
    opts = argparse.Namespace(block=32, layers=layers, heads=4, embd=64, seed=0, batch=16, lr=3e-3)

    def make(accumulation):
        model = gpt.make_model(vocab, opts)
        return gpt.GPTGraph(model, torch.optim.AdamW(model.parameters(), lr=opts.lr),
                            gpt.Layout(), accumulation)
    return make, next(gpt.batches(ids, opts.batch, opts.block, 1))


def _llama(layers):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

    class LlamaGraph(graphc.Graph):
        def __init__(self, model, opt, accumulation):
            super().__init__()
            self.model = model
            self.config.set_gradient_accumulation_steps(accumulation)
            self.add_optimizer(opt)

        def build(self, idx, targets):
            logits = self.model(input_ids=idx).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            return loss

    def make(accumulation):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        return LlamaGraph(model, torch.optim.AdamW(model.parameters(), lr=1e-3), accumulation)
    g = torch.Generator().manual_seed(0)
    return make, (torch.randint(0, 128, (8, 32), generator=g), torch.randint(0, 128, (8, 32), generator=g))


def measure(name, make, batch, repeats):
    for accumulation in (1, 2):
        compiles = []
        for _ in range(repeats):
            graph = make(accumulation)
            t0 = time.perf_counter()
            graph.compile(*batch)
            compiles.append(time.perf_counter() - t0)
        steps = []
        for _ in range(5):
            t0 = time.perf_counter()
            graph(*batch)
            steps.append(time.perf_counter() - t0)
        line = (f"{name:9s} accumulation {accumulation}: compile {statistics.median(compiles) * 1e3:7.0f} ms, "
                f"step {statistics.median(steps) * 1e3:6.1f} ms")
        guards = getattr(graph.compiled, "guards", None)
        if guards is not None:
            checks = []
            for _ in range(2000):
                t0 = time.perf_counter()
                guards.failing()
                checks.append(time.perf_counter() - t0)
            line += f", {len(guards)} guards checked in {statistics.median(checks) * 1e6:6.1f} us per call"
        print(line, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 32],
                        help="model depths to measure (the guard check grows with the modules)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    for layers in args.layers:
        measure(f"gpt-{layers}", *_gpt(layers), args.repeats)
        llama = _llama(layers)
        if llama is None:
            print("llama: skipped (pip install transformers to include it)")
        else:
            measure(f"llama-{layers}", *llama, args.repeats)


if __name__ == "__main__":
    main()
