"""The functions a stage program calls, one home for all of them.

Passes put calls to these into the fx programs and the runtime runs those programs, so both
import this package and neither imports the other (tests/test_layers.py: the `ops` layer
sits between the plan IR and the runtime, and the plan IR imports none of it: plan/ is
data only).

  * conversions.py: SBP conversions (`box`), the vocabulary-parallel lookup, process groups
    and NOTE: Shapes only (insert_boxing, localize_ops);
  * random_ops.py: random ops seeded by their layout (NOTE: Replica-equal randomness;
    seed_random_ops);
  * loss.py: token-mean losses normalised by the whole batch (feed_whole_batch);
  * autocast.py: autocast regions entered and left (NOTE: Autocast regions;
    insert_autocast_modes);
  * buffers.py: `module.buf = value` in a forward, a copy into the buffer (trace_build).
The local forms of ops under a split (graphc/sbp/local_ops.py, localize_ops) belong here too
and move when that module is free to move.

NOTE: Stage-program names
A stage program names each function by its qualified name (`graphc.ops.conversions.box`
prints as `graphc_ops_conversions_box`), which is how it prints and pickles. Nothing graphc
writes to disk holds a program (plans, histories and checkpoints hold text and tensors), so
a move renames what programs print and nothing persisted breaks.
"""
