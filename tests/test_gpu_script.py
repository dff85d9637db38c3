"""benchmarks/gpu.py, the script prepared for a lent GPU machine, run in its dry mode
(--device cpu, tiny sizes): every step that needs no GPU runs, and its JSON and markdown
table are written and complete. The script is then known to work before a GPU is lent
(issue 37 Part 1)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["install", "pytest", "gpt_bf16", "cuda_graphs", "float64", "amp", "stages", "simulate", "compile"]
# what the dry mode runs here: the pytest step is pytest inside pytest (6 s); it runs the same
# run_command as install, which does run
DRY_STEPS = [s for s in STEPS if s != "pytest"]


def test_dry_mode_writes_every_step(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu.py"), "--device", "cpu",
                           "--out", str(out), "--steps", ",".join(DRY_STEPS)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    rows = {r["step"]: r for r in result["steps"]}
    assert list(rows) == DRY_STEPS
    assert result["meta"]["device"] == "cpu (dry mode)" and result["meta"]["torch"]
    for name, row in rows.items():
        assert row["status"] == ("refused" if name == "cuda_graphs" else "ok"), (name, row)
    assert rows["install"]["rc"] == 0
    # the measurements carry real numbers, not placeholders
    assert rows["gpt_bf16"]["graphc_tokens_s"] > 0 and rows["gpt_bf16"]["eager_tokens_s"] > 0
    assert rows["float64"]["loss_diff"] <= 1e-10 and rows["float64"]["param_diff"] <= 1e-10
    assert rows["amp"]["bf16_loss_diff"] == 0.0 and rows["amp"]["fp16_loss_diff"] == 0.0
    assert rows["stages"]["loss_diff"] < 1e-5       # float32: 2 stages reorder nothing but micro-batches
    assert rows["simulate"]["preset"] == "h100" and rows["simulate"]["predicted_ms"] > 0
    assert rows["compile"]["backend"] == "eager" and rows["compile"]["compiled_tokens_s"] > 0
    assert rows["cuda_graphs"]["status"] == "refused" and "placement type" in rows["cuda_graphs"]["message"]
    table = (out / "gpu.md").read_text()
    for name in DRY_STEPS:
        assert f"| {name} | {rows[name]['status']}" in table
