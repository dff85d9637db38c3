"""Automatic layouts: a layout as a value, applied to a Graph's compile spec, and the search
for the fastest one that fits (See NOTE: Auto layouts in layout.py, NOTE: Layout search in
search.py). `graphc plan SCRIPT --nproc N --auto` runs the search; `config.load_layout(path)`
trains with a saved one;
`config.enable_auto_parallel(True, ...)` searches at the first call (NOTE: Run-time search)."""
from .layout import AutoRequest, Layout, apply_layout, layer_list, megatron_pairs
from .search import AutoResult, search

__all__ = ["AutoRequest", "Layout", "apply_layout", "layer_list", "megatron_pairs", "AutoResult", "search"]
