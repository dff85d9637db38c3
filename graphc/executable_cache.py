"""A Graph's executables, and the one descent of a call: `executable_for(specs, tree)`.

Per input signature the cache keeps one Executable per set of guarded values (NOTE: Guards),
and what they all share: the graph's state (parameters, optimizer, steps: graphc/checkpoint/graph_state.py),
this rank, and the agreed base seed. A call asks for the executable of its inputs; the cache
looks it up, or compiles, agrees and starts one, whole, and the Graph then calls it:

    Graph.__call__: specs -> cache.executable_for(specs, tree) -> exe.call(specs, draw)

The cache reads of its Graph what a compile and a start take (its CompileSpec, optimizer,
settings as RunOptions); the executables below it are built from those values.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

from . import env, modes
from .auto.layout import apply_layout
from .errors import GraphcError
from .executable import (Executable, InputSpec, InputTree, check_cuda_available, check_same_stages,
                         named_placements, plans_lowered, signature)
from .graph_spec import compile_spec
from .guards import MISSING, Guard, difference, fingerprint
from .log import get_logger, warn_user
from .runtime.dist_env import ensure_process_group, timeout_seconds
from .runtime.rng import agree_base_seed
from .runtime.zero import whole_parameters
from .checkpoint.dcp import dcp_state_dict
from .checkpoint.dcp_load import unprefixed
from .checkpoint.graph_state import GraphState

_log = get_logger("guards")
# executables kept per input signature before a warning: a value that changes on every call
# (a counter read by build()) would otherwise compile on every call, unseen (torch.compile's
# cache_size_limit is 8 for the same reason)
PLANS_PER_SIGNATURE = 8


class ExecutableCache:
    """A Graph's executables (per input signature, one per set of guarded values) and the
    state they share; `executable_for` is a call's one way in (module docstring)."""

    def __init__(self, graph):
        self.graph = graph   # read for what a compile and a start take, never for a step
        self.name = type(graph).__name__
        self.entries: Dict[tuple, List[Executable]] = {}
        self.current: Optional[Executable] = None
        self.key: Optional[tuple] = None
        self.recompiles: List[str] = []  # why each executable after the first was compiled
        self.state: Optional[GraphState] = None   # made by the first compile on a rank
        self.pending_state = None   # (state dict, strict) loaded before the first compile
        self.rank = 0
        self.base_seed = 0          # rank 0's torch.initial_seed(), agreed at the first compile
        self.forward_calls = 0      # a forward-only graph's calls: its random ops' step

    # -- a call's executable -------------------------------------------------------------
    def executable_for(self, specs: Sequence[InputSpec], tree: Optional[InputTree]) -> Executable:
        """The executable for this call's inputs: the first compiled (and started) here, or
        the one whose guards hold, or a new one compiled, agreed and started. In plan mode
        the first step stops the script instead (the plans are written)."""
        if self.current is None:
            self.compile_first(specs, tree)
        elif self.current.runtime is not None:
            self._select(specs, tree)
        if self.current.runtime is None:  # plan mode (graphc plan): plans written, no training
            modes.stop_before_step(self.graph)
        return self.current

    def draw(self) -> Tuple[int, int]:
        """What this step's random ops draw by: the agreed base seed and the step (a
        forward-only graph counts its calls), so a resumed run replays the same masks
        (NOTE: Replica-equal randomness)."""
        return self.base_seed, self.state.steps if self.current.compiled.training else self.forward_calls

    def count_step(self) -> None:
        """A step ran: the next draws by the next step."""
        if self.current.compiled.training:
            self.state.steps += 1
        else:
            self.forward_calls += 1

    def compile_first(self, specs: Sequence[InputSpec], tree: Optional[InputTree] = None) -> None:
        """The first compile: in plan mode for N ranks here, written, no process group; else
        this rank's plan, the graph's state, rank agreement and the runtime, then the base seed."""
        graph, mode = self.graph, modes.active_plan()
        if mode is not None and mode.auto is not None and graph.config.layout is None:
            # graphc plan --auto: the tools search a layout, compile it; written as any plan
            graph.config.layout, compiled = mode.auto(graph, compile_spec(graph), specs, tree, mode)
            mode.write_graph(graph, compiled)
            self.add((signature(specs), tree), Executable(compiled))
            return
        if mode is not None:  # graphc plan: compile for N ranks here, write, no process group
            exe = Executable.compile(self.spec(), specs, mode.nproc, tree)
            mode.write_graph(graph, exe.compiled)  # the tools' writer (See NOTE: Plan-mode writer)
            self.add((signature(specs), tree), exe)
            return
        spec = self.spec()
        check_cuda_available(spec, specs)  # before torch's own AssertionError, on every rank
        device_types = {where.type for _, where in named_placements(spec, specs)}  # set_stage or not
        rank, world = ensure_process_group(device_types or {"cpu"})
        # a model another graph holds as ZeRO stage 3 shards is traced and agreed on whole
        with whole_parameters(graph._root.parameters()):
            exe = Executable.compile(spec, specs, world, tree, ranks=plans_lowered(rank))
            self.rank = rank
            self._start(exe, new_state=True)
        self.add((signature(specs), tree), exe)
        # after a pending checkpoint is loaded: it names the run's base seed (or its RNG state,
        # from older graphc, carries the run's initial seed)
        seed = agree_base_seed(graph._instance, timeout_seconds())
        self.base_seed = seed if self.state.base_seed is None else self.state.base_seed

    def _select(self, specs: Sequence[InputSpec], tree: Optional[InputTree]) -> None:
        """A new input shape or structure (NOTE: Input trees), or a Python value build() read
        that changed (NOTE: Guards), selects (or compiles and caches) another executable.

        Every rank calls the graph with the same program, so every rank changes plan at the
        same call (compiling is deterministic; new process groups are created collectively).
        """
        key = (signature(specs), tree)
        if key != self.key:   # (the current executable's inputs passed when it was chosen)
            same = self.same_structure(key)  # a new structure is a new program (NOTE: Input trees)
            if same is not None:
                same.check_inputs(specs, self.name)
        exe, failures = self.lookup(key)
        if exe is None:
            with self._traceable():
                exe = Executable.compile(self.spec(), specs, self.current.compiled.world_size, tree,
                                         ranks=plans_lowered(self.rank))
            check_same_stages(self.current.compiled, exe.compiled)
            self.state.adopt(exe.compiled, exe.device(self.rank))
            self.state.compiled = exe.compiled
            self._start(exe, new_state=False)
            self.add(key, exe, failures)
        elif env.read("GRAPHC_RETRACE") == "1":   # the guards' oracle (NOTE: Retrace check)
            with self._traceable():
                exe.retrace(self.spec(), specs, tree, self.name)
        self.use(key, exe)
        self.state.compiled = exe.compiled

    def spec(self):
        """What compiler.compile reads of the Graph, taken now, under its loaded layout."""
        spec = compile_spec(self.graph)
        layout = self.graph.config.layout   # load_layout, or what graphc plan --auto chose
        return spec if layout is None else apply_layout(spec, layout)

    @contextmanager
    def _traceable(self):
        """The parameters as a trace reads them after the first call: split ones hold shards
        by now (their global shapes stand in), ZeRO stage 3's are gathered."""
        with whole_parameters(self.graph._root.parameters()), self.state.global_shapes():
            yield

    def _start(self, exe: Executable, new_state: bool) -> None:
        """The graph's state (the first time), rank agreement, then the executable's runtime."""
        graph = self.graph
        if new_state:
            self.state = GraphState(graph._root, exe.compiled, self.rank, graph._optimizer,
                                    graph._lr_scheduler, graph.config.param_dtype)
            self.state.take_ownership(exe.device(self.rank))
            if self.pending_state is not None:
                self.state.load(*self.pending_state)
                self.pending_state = None
        # every rank runs the same plans from equal replicas (See NOTE: Rank agreement)
        options = graph.config.run_options()
        self.state.agree(exe.compiled, options, f"the compiled {self.name}",
                         f"{graph._instance}/{len(self)}", with_parameters=new_state)
        exe.start(self.rank, graph._optimizer, graph._lr_scheduler, options, graph.grad_scaler,
                  self.state.masters)

    # -- the graph's state (graph.state_dict and friends) ---------------------------------
    def state_dict(self) -> dict:
        """graph.state_dict(): this rank's DCP state dict, ZeRO stage 3's shards gathered for it."""
        if self.state is None:
            raise GraphcError("state_dict() needs a compiled graph: run one step or call "
                              "graph.compile(*inputs) first")
        with whole_parameters(self.graph._root.parameters()):   # (NOTE: ZeRO stage 3)
            return dcp_state_dict(self.state, self.base_seed)

    def load_state_dict(self, state: dict, strict: bool) -> None:
        """graph.load_state_dict(): loaded now, or kept for the first compile; written whole,
        kept as ZeRO stage 3's rows. The saved run's base seed replaces this run's (runtime/rng.py)."""
        if self.state is None:
            self.pending_state = (state, strict)
            return
        with whole_parameters(self.graph._root.parameters()):
            self.state.load(state, strict)
        if self.state.base_seed is not None:
            self.base_seed = self.state.base_seed

    def full_state_dict(self, rank0_only: bool, cpu_offload: bool) -> dict:
        """graph.full_state_dict(): the whole model's, by the user's names (the model's own
        state before the first compile)."""
        root = self.graph._root
        if self.state is None:
            return unprefixed(root, {k: v.detach().clone() for k, v in root.state_dict().items()})
        with whole_parameters(root.parameters()):   # ZeRO stage 3's shards (NOTE: ZeRO stage 3)
            return unprefixed(root, self.state.full_state_dict(rank0_only, cpu_offload))

    # -- the executables by key ----------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def lookup(self, key: tuple) -> Tuple[Optional[Executable], List[Guard]]:
        """The executable whose guards hold for `key` (the current one first), else None and,
        per cached executable of these inputs, the guard that failed. A module or parameter
        replaced after compile is a GraphcError (see check_replaceable)."""
        failures: List[Guard] = []
        candidates = ([self.current] if key == self.key else []) + \
            [e for e in reversed(self.entries.get(key, [])) if e is not self.current]
        for exe in candidates:
            failed = exe.check()
            if failed is None:
                return exe, failures
            check_replaceable(self.name, failed)
            failures.append(failed)
        return None, failures

    def same_structure(self, key: tuple) -> Optional[Executable]:
        """An executable compiled for inputs of `key`'s structure (the number of inputs and
        their tree, NOTE: Input trees), the current one first; None for a new structure."""
        if self.current is not None and _structure(self.key) == _structure(key):
            return self.current
        return next((v[-1] for k, v in self.entries.items() if _structure(k) == _structure(key)), None)

    def add(self, key: tuple, exe: Executable, failures: Sequence[Guard] = ()) -> None:
        new_structure = self.same_structure(key) is None
        entries = self.entries.setdefault(key, [])
        entries.append(exe)
        if self.current is not None:
            why = _new_structure(key) if new_structure else self._why(failures)
            self.recompiles.append(why)
            if len(entries) == PLANS_PER_SIGNATURE + 1:
                warn_user(f"{self.name} has compiled {len(entries)} plans for the same input "
                          f"shapes, the last because {why}. A value build() reads changes from call "
                          "to call, and every new value compiles a plan (slow). Fix: pass a "
                          "changing number as a tensor input, or keep it constant between calls.")
        self.use(key, exe)

    def use(self, key: tuple, exe: Executable) -> None:
        self.current, self.key = exe, key

    def _why(self, failures: Sequence[Guard]) -> str:
        """The recompile log's reason, as TORCH_LOGS=recompiles gives it: per cached plan of
        these input shapes, the first value that no longer matches."""
        reasons: List[str] = []
        for failed in failures:
            if failed.detail is not None:
                reason = f"{failed.where} changed ({failed.detail(failed.expected)})"
            else:
                path, was, now = difference(failed.expected, fingerprint(failed.read()))
                reason = f"{failed.where}{path} changed (compiled for {was}, now {now})"
            reasons += [reason] if reason not in reasons else []
        why = "; ".join(reasons) or "the inputs' shapes, dtypes or layouts are new"
        _log.info("recompiling %s: %s", self.name, why)
        return why


def _structure(key: tuple) -> tuple:
    """A cache key's input structure: the number of inputs and their tree (NOTE: Input trees)."""
    signature_, tree = key
    return len(signature_), tree


def _new_structure(key: tuple) -> str:
    signature_, tree = key
    names = ", ".join(tree.names) if tree is not None else f"{len(signature_)} tensors"
    why = f"the inputs' structure is new ({names})"
    _log.info("compiling for new inputs: %s", why)
    return why


def check_replaceable(name: str, failed: Guard) -> None:
    """A module, parameter or buffer replaced after compile cannot get a plan of its own."""
    if failed.replaceable:
        return
    now = failed.read()
    what = "removed" if now is MISSING else f"replaced by another {type(now).__name__}"
    raise GraphcError(
        f"'{failed.where}' of {name} was {what} after the graph compiled. The "
        "graph's optimizer, gradient buckets and parameter shards hold the objects it was "
        "compiled with, so the new one would not be trained as eager trains it. Fix: build a "
        "new Graph (and optimizer) for the changed model, or copy new values into the existing "
        "parameters in place (with torch.no_grad(): p.copy_(new)).")
