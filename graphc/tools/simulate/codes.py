"""The op tuples the simulation engine runs, one per instruction, by their first item.

    (COMPUTE, seconds)
    (SEND, seconds on the sender, link, seconds on the wire, latency)
    (RECV, link, seconds of the copy out)
    (COLLECTIVE, group, seconds)
    (OPTIMIZER, seconds)            waits for the rank's sends to drain first (gloo)
With symmetric ranks folded (NOTE: Symmetric ranks, folding.py) a representative runs two
more:
    (FANOUT, <a SEND's items>, ((other rank, its SEND op), ...))
                                    a send that also feeds the links of the other ranks of
                                    its class to representatives
    (QCOLLECTIVE, ((representative, index), ...), seconds)
                                    a collective waiting on the members' representatives
The engine (engine.py) runs them and folding.py rewrites them; both read the codes here.
"""

COMPUTE, SEND, RECV, COLLECTIVE, OPTIMIZER = range(5)
FANOUT, QCOLLECTIVE = 5, 6      # only where ranks are folded
