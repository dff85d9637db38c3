"""history_text (graphc/history.py): passes.txt's text, each shared instruction formatted once,
equals the records' texts read one by one."""
from graphc.history import history_text, record
from graphc.plan.instructions import parse_instruction
from graphc.plan.plan import ExecutionPlan


def _plans(extra=()):
    shared = [parse_instruction(t) for t in ("0F0", "0SEND_F0 to=1 stage=1 [x:f32[2,3]]", "0B0")]
    return lambda: [ExecutionPlan(rank, 2, shared + [parse_instruction(t) for t in extra])
                    for rank in (0, 1)]


def test_history_text_equals_each_record_read_alone():
    first, second = _plans(), _plans(("OPTIMIZER_STEP",))
    alone = [record("lower_plan", 0.001, first()), record("insert_grad_sync", 0.002, second())]
    shared = [record("lower_plan", 0.001, first()), record("insert_grad_sync", 0.002, second())]
    expected = "\n\n".join(r.text for r in alone)
    assert "0SEND_F0 to=1 stage=1 [x:f32[2,3]]" in expected and "OPTIMIZER_STEP" in expected
    assert history_text(shared) == expected
