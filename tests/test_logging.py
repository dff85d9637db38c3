"""graphc's output through logging (graphc/log.py): rank-labelled records, rank 0 prints by
default, GRAPHC_LOG_RANKS chooses others, warnings once per job at the user's line."""
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from graphc import GraphcError, log
from helpers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "tools", "scripts", "log_train.py")
SUMMARY = re.compile(r"^\[rank (\d)\] graphc\.compile: compiled SpareGraph: 4 stage\(s\)", re.M)
WARNING = "have parameters but build() never uses them"


def run_4_ranks(log_ranks=None):
    env = dict(os.environ, OMP_NUM_THREADS="1", GRAPHC_TIMEOUT="60", GRAPHC_DEBUG="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("GRAPHC_LOG_RANKS", None)
    if log_ranks is not None:
        env["GRAPHC_LOG_RANKS"] = log_ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
           "--master_port", str(free_port()), SCRIPT]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def user_line():
    with open(SCRIPT) as f:
        return next(i for i, line in enumerate(f, 1) if "LOG-TEST" in line)


@pytest.mark.world
@pytest.mark.parametrize("log_ranks, printing", [
    (None, ["0"]), pytest.param("1,3", ["1", "3"], marks=pytest.mark.slow),
    pytest.param("all", ["0", "1", "2", "3"], marks=pytest.mark.slow)])
def test_four_ranks_print_once_per_job_with_the_rank(log_ranks, printing):
    text = run_4_ranks(log_ranks)
    assert sorted(SUMMARY.findall(text)) == printing, text   # the summary, once per chosen rank
    warned = [line for line in text.splitlines() if WARNING in line]
    assert len(warned) == len(printing), text           # not once per rank
    # the warning names the user's line that called the graph, not graphc's
    assert all(f"log_train.py:{user_line()}: UserWarning" in line for line in warned), warned


def test_records_carry_the_rank_and_respect_the_choice(monkeypatch, capsys):
    logger = log.get_logger("runtime")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("GRAPHC_LOG_RANKS", "0")
    logger.info("not here")
    logger.error("errors print on every rank")
    monkeypatch.setenv("GRAPHC_LOG_RANKS", "0,2")
    logger.info("chosen")
    err = capsys.readouterr().err
    assert "not here" not in err
    assert "[rank 2] graphc.runtime: errors print on every rank" in err
    assert "[rank 2] graphc.runtime: chosen" in err


def test_records_reach_handlers_added_to_graphc(monkeypatch):
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append((record.rank, record.name, record.getMessage()))
    handler = Keep()
    logging.getLogger("graphc").addHandler(handler)
    try:
        monkeypatch.setenv("RANK", "0")
        log.get_logger("plan").info("hello")
    finally:
        logging.getLogger("graphc").removeHandler(handler)
    assert seen == [(0, "graphc.plan", "hello")]


def test_bad_log_ranks_is_a_graphc_error(monkeypatch):
    monkeypatch.setenv("GRAPHC_LOG_RANKS", "rank0")
    with pytest.raises(GraphcError, match="GRAPHC_LOG_RANKS must be 'all' or a list of ranks"):
        log.prints_here()


def test_warning_names_the_users_line_in_one_process(monkeypatch):
    from models import PipelineGraph, SkipNet
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("GRAPHC_LOG_RANKS", raising=False)

    class Spare(PipelineGraph):
        def __init__(self, model):
            super().__init__(model, None)
            self.spare = torch.nn.Linear(2, 2)
    graph = Spare(SkipNet(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph(torch.randn(4, 16), torch.randint(0, 5, (4,))); line = sys._getframe().f_lineno  # noqa: E702
    (w,) = [w for w in caught if WARNING in str(w.message)]
    assert (w.filename, w.lineno) == (__file__, line)
