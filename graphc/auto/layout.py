"""A parallel layout as a value, and how it turns a Graph's compile spec into that layout.

NOTE: Auto layouts
A `Layout` says how a model trains on `pp * tp * dp` ranks: `pp` pipeline ranks (with
`chunks` stages each: 1, or 2 for the interleaved and V schedules), each stage on a `dp` x
`tp` grid of ranks (rows: data-parallel replicas, columns: tensor-parallel shards), the
schedule, the micro-batches (gradient accumulation), ZeRO's stage, activation
checkpointing, and where the stages cut the model's layer list. `apply_layout(spec, layout)`
returns the CompileSpec that layout gives, as if the user had written the set_stage and
to_global calls, without touching the user's modules:
  * the layer list is the model's longest ModuleList / Sequential of one class (found by
    `layer_list`); a stage gets consecutive layers (`boundaries`: the first layer of each
    stage after the first); the modules with parameters defined before the list (embeddings)
    go to the first stage, those after it (final norm, head) to the last; a tied weight
    stays tied across stages (NOTE: Tied parameters);
  * with tp > 1 each layer's Megatron pairs (`megatron_pairs`, by the names Megatron,
    Hugging Face and torchtitan models use: q/k/v, gate/up and fc1 split by output rows,
    o/down/proj and fc2 by input columns) are declared split on the tensor-parallel axis,
    everything else broadcast. A pair graphc cannot find is only slower, never wrong: SBP
    inference converts what a split needs (graphc's numbers do not depend on the layout);
  * the data-parallel axis splits the batch: inputs given whole are split by graphc.
The user's own set_stage / to_global declarations are replaced by the layout's (search takes
them as constraints: `constraints_of`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch.nn as nn

from ..errors import GraphcError
from ..placement import Layout as SbpLayout
from ..placement import placement as make_placement
from ..placement import sbp as sbp_values

# the schedules whose stage count is 2 per pipeline rank, and where stage s runs
V_SCHEDULES = ("zbv", "dualpipev")
LOOPED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "zero_bubble")

COLUMN_NAMES = ("q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv",
                "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "fc", "fc1", "c_fc", "w1",
                "w3", "wi", "wi_0", "wi_1", "lin1", "wq", "wk", "wv")
ROW_NAMES = ("o", "o_proj", "out_proj", "proj", "c_proj", "down_proj", "fc2", "w2", "wo",
             "lin2", "dense_4h_to_h")


# NOTE: Run-time search
# `config.enable_auto_parallel(True, device=..., memory=...)` records an AutoRequest; the
# Graph resolves it at its first call (or compile), before it splits the batch: rank 0 looks
# the layout up in the search cache (graphc/auto/cache.py, keyed by the model, its inputs, the
# world and the device) or searches (NOTE: Layout search; bounded by a count of candidates,
# not by seconds, so it is the same on every machine), and every rank trains on the layout
# rank 0 broadcasts, as load_layout would. The search compiles and simulates (the tools), and
# the API never imports the tools (docs/design.md: Layers), so the Graph finds it by the name
# SEARCHER, as plan mode finds its writer (NOTE: Plan-mode writer, graphc/modes.py);
# tests/test_layers.py checks that the name resolves.
SEARCHER = "graphc.auto.search:run_time_layout"


@dataclass(frozen=True)
class AutoRequest:
    """What enable_auto_parallel asked for (See NOTE: Run-time search)."""

    device: str = "h100"                  # the device preset the search models
    memory_gib: Optional[float] = None    # per rank; None: the device's memory
    top: int = 8                          # candidates compiled and simulated
    cache: Optional[str] = None           # the search cache's folder; None: GRAPHC_AUTO_CACHE or ~/.cache


def named_searcher():
    """The run-time search SEARCHER names (See NOTE: Run-time search)."""
    import importlib
    module, name = SEARCHER.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Layout:
    """A whole parallel layout (See NOTE: Auto layouts)."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    schedule: str = "1f1b"
    microbatches: int = 1
    zero: int = 0
    checkpointing: str = "never"
    boundaries: Tuple[int, ...] = ()      # first layer of stages 1 .. stages-1
    layers: str = ""                       # the layer list's qualified name
    device: str = "cpu"

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def chunks(self) -> int:
        """Stages per pipeline rank."""
        return 2 if self.pp > 1 and self.schedule in V_SCHEDULES + LOOPED_SCHEDULES else 1

    @property
    def stages(self) -> int:
        return self.pp * self.chunks

    def rank_group(self, stage: int) -> int:
        """Which pipeline rank's grid runs `stage`."""
        if self.chunks == 1:
            return stage
        if self.schedule in V_SCHEDULES:
            return min(stage, 2 * self.pp - 1 - stage)
        return stage % self.pp

    def ranks(self, stage: int):
        """The stage's ranks: a dp x tp grid (rows data-parallel, columns tensor-parallel),
        flat when one of them is 1."""
        first = self.rank_group(stage) * self.dp * self.tp
        grid = [[first + d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]
        return grid if self.dp > 1 and self.tp > 1 else [r for row in grid for r in row]

    def placement(self, stage: int):
        return make_placement(self.device, self.ranks(stage))

    def split_sbp(self, dim: Optional[int]) -> tuple:
        """A parameter split on `dim` over the tensor-parallel axis (None: broadcast)."""
        tp = sbp_values.split(dim) if dim is not None and self.tp > 1 else sbp_values.broadcast
        return (sbp_values.broadcast, tp) if self.dp > 1 and self.tp > 1 else (tp,)

    def describe(self) -> str:
        parts = [f"pp{self.pp}", f"tp{self.tp}", f"dp{self.dp}"]
        if self.pp > 1:
            parts.append(f"{self.schedule} m{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"m{self.microbatches}")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.checkpointing != "never":
            parts.append(f"ckpt {self.checkpointing}")
        return " ".join(parts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "Layout":
        d = json.loads(text)
        d["boundaries"] = tuple(d.get("boundaries", ()))
        return Layout(**d)

    @staticmethod
    def load(path: str) -> "Layout":
        try:
            with open(path) as f:
                return Layout.from_json(f.read())
        except (OSError, ValueError, TypeError) as exc:
            raise GraphcError(f"load_layout: cannot read a layout from {path!r} ({exc}). Fix: pass "
                              "the layout.json that `graphc plan --auto` wrote") from None


def layer_list(root: nn.Module) -> Tuple[str, List[nn.Module]]:
    """The longest ModuleList / Sequential whose children are all of one class (the model's
    repeated layers), by qualified name; ("", []) when the model has none."""
    best: Tuple[str, List[nn.Module]] = ("", [])
    for name, m in root.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > len(best[1]):
            kids = list(m)
            if kids and len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
                best = (name, kids)
    return best


def megatron_pairs(layer: nn.Module, tp: int) -> Tuple[List[str], List[str]]:
    """(column-parallel, row-parallel) Linear names inside one layer, by Megatron's names;
    empty unless both kinds are found and every split dimension divides by tp."""
    cols, rows = [], []
    for name, m in layer.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if leaf in COLUMN_NAMES and m.out_features % tp == 0:
            cols.append(name)
        elif leaf in ROW_NAMES and m.in_features % tp == 0:
            rows.append(name)
    return (cols, rows) if cols and rows else ([], [])


def even_boundaries(layers: int, stages: int) -> Tuple[int, ...]:
    """The first layer of stages 1 .. stages-1 when layers split as evenly as they go."""
    return tuple(s * layers // stages for s in range(1, stages))


def _outer_modules(root: nn.Module, layers_name: str) -> Tuple[List[str], List[str]]:
    """The outermost modules with parameters or buffers that neither hold the layer list nor
    lie in it: (those defined before the list, those after it). A module after the list that
    holds buffers and no parameters counts as before it: such a table (HF Llama's
    `rotary_emb`, defined after `layers` and `norm`) feeds the layers from constants, and on
    the last stage every earlier stage would read a later one's value."""
    before: List[str] = []
    after: List[str] = []
    seen_list = False
    for name, m in root.named_modules():
        if name == layers_name:
            seen_list = True
        if not name or name == layers_name or layers_name.startswith(name + ".") \
                or name.startswith(layers_name + "."):
            continue          # the root, the list, an ancestor of it, or a layer
        if any(name.startswith(taken + ".") for taken in before + after):
            continue          # inside a module already taken whole
        if next(m.parameters(), None) is None and next(m.buffers(), None) is None:
            continue
        table = next(m.parameters(), None) is None
        (after if seen_list and not table else before).append(name)
    return before, after


def apply_layout(spec, layout: Layout):
    """The CompileSpec `layout` gives `spec` (See NOTE: Auto layouts)."""
    from ..compiler import ModuleSpec
    from ..sbp.declared import DeclaredLayouts
    root = spec.root
    name, layers = layer_list(root)
    if not layers:
        raise GraphcError(f"{spec.name}: no layer list found (a ModuleList or Sequential of one "
                          "module class) to cut into pipeline stages or tensor-parallel pairs. Fix: "
                          "keep the repeated layers in an nn.ModuleList, or declare the layout by hand")
    stages = layout.stages
    if stages > len(layers):
        raise GraphcError(f"{spec.name}: {stages} stages need at least {stages} layers, "
                          f"{name} has {len(layers)}")
    cuts = layout.boundaries or even_boundaries(len(layers), stages)
    stage_of_layer = [sum(1 for c in cuts if i >= c) for i in range(len(layers))]
    modules: Dict[str, ModuleSpec] = {}
    before, after = _outer_modules(root, name)
    for m in before:
        modules[m] = ModuleSpec(0, layout.placement(0))
    for i, s in enumerate(stage_of_layer):
        modules[f"{name}.{i}"] = ModuleSpec(s, layout.placement(s))
    for m in after:
        modules[m] = ModuleSpec(stages - 1, layout.placement(stages - 1))
    declared = {}
    if layout.tp > 1:
        for i, layer in enumerate(layers):
            cols, rows = megatron_pairs(layer, layout.tp)
            where = layout.placement(stage_of_layer[i])
            for c in cols:
                lin = layer.get_submodule(c)
                declared[f"{name}.{i}.{c}.weight"] = SbpLayout(where, layout.split_sbp(0))
                if lin.bias is not None:
                    declared[f"{name}.{i}.{c}.bias"] = SbpLayout(where, layout.split_sbp(0))
            for r in rows:
                declared[f"{name}.{i}.{r}.weight"] = SbpLayout(where, layout.split_sbp(1))
    return replace(spec, modules=modules, declared=DeclaredLayouts(declared),
                   gradient_accumulation_steps=layout.microbatches,
                   pipeline_schedule=layout.schedule if layout.pp > 1 else "1f1b",
                   zero_stage=layout.zero if layout.dp > 1 else 0,
                   activation_checkpointing=layout.checkpointing)


def input_stages(spec, inputs, layout: Layout) -> List[Optional[int]]:
    """The stage that first reads each input under `layout`'s stage cut: where graphc places
    a plain tensor input (its first user's stage), found by compiling the cut alone (one
    rank per stage: the cut, not the data or tensor degree nor the micro-batches, decides it).
    Only the trace and the place phase run (compiler.stages_of): a whole compile of a
    Llama-3-8B-shaped model cost the search ~10 s a cut, these ~3 s (benchmarks/auto_paper.py)."""
    from ..compiler import stages_of
    from ..meta import META_STAGE
    alone = replace(layout, tp=1, dp=1, zero=0, checkpointing="never", microbatches=1)
    gm = stages_of(apply_layout(spec, alone), inputs, alone.world)
    return [n.meta.get(META_STAGE) for n in gm.graph.nodes if n.op == "placeholder"]


def batched_inputs(inputs, names, whole_inputs) -> List[bool]:
    """Which inputs split over the data-parallel ranks: those micro-batches split (dim 0 equal
    to the first input's, not named by set_whole_inputs)."""
    first = inputs[0].shape[0] if inputs and inputs[0].dim() else None
    return [t.dim() > 0 and t.shape[0] == first and n not in whole_inputs for t, n in zip(inputs, names)]


def batch_layouts(layout: Layout, inputs, batched, stages: Sequence[Optional[int]]) -> list:
    """The compile's input layouts under `layout`: each batched tensor input split over the
    data-parallel axis of the stage that reads it (`stages`, from input_stages; whole on its
    tensor-parallel ranks); the others whole."""
    out = []
    for t, b, stage in zip(inputs, batched, stages):
        if not b or layout.dp == 1 or stage is None or not hasattr(t, "dim") or t.dim() == 0:
            out.append(None)
            continue
        sbp = (sbp_values.split(0), sbp_values.broadcast) if layout.tp > 1 else (sbp_values.split(0),)
        out.append(SbpLayout(layout.placement(stage), sbp))
    return out


def with_layers(layout: Layout, root: nn.Module) -> Layout:
    """The layout with its layer list named and its stage cuts filled in (even)."""
    name, layers = layer_list(root)
    return replace(layout, layers=name,
                   boundaries=layout.boundaries or even_boundaries(len(layers), layout.stages))


def constraints_of(spec) -> Dict[str, int]:
    """What the user's own declarations fix: the stage count of their set_stage calls."""
    stages = {m.stage_id for m in spec.modules.values() if m.stage_id is not None}
    return {"stages": len(stages)} if stages else {}


__all__ = ["AutoRequest", "SEARCHER", "named_searcher", "Layout", "apply_layout", "input_stages", "batched_inputs", "batch_layouts", "layer_list", "megatron_pairs", "even_boundaries",
           "with_layers", "constraints_of", "V_SCHEDULES", "LOOPED_SCHEDULES"]

