"""The GPU check scripts run on a CPU too (small shapes, the Triton kernels interpreted): a script that would fail
on the GPU machine fails here first, where it costs no device time."""

from __future__ import annotations

import json
from pathlib import Path

from tools.gpu import check, forward_check


def test_the_forward_check_runs_small_on_a_cpu(tmp_path: Path) -> None:
    assert forward_check.main(["--device", "cpu", "--tiny", "--parts", "correct", "launches", "--context", "40",
                               "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "forward_check.json").read_text())
    for shape, cases in report["parts"]["correct"].items():
        for case, result in cases.items():  # float32 here: the fused layer computes what the reference does
            assert result["argmax_agree"] == 1.0 and result["max_abs_diff"] < 1e-4, (shape, case, result)
    launches = report["parts"]["launches"]
    assert set(launches) == {f"{shape} {kernels}" for shape in ("tiny", "tiny-gqa3")
                             for kernels in ("reference", "triton")}
    assert "Forward check: CPU" in (tmp_path / "forward_check.md").read_text()


def test_the_gpu_checks_smollm2_part_runs_small_on_a_cpu(tmp_path: Path) -> None:
    """Plain decoding and a static recycling tree, one round of 4 tokens at batch 1: the part runs to its report
    with no error and every row written."""
    assert check.main(["--device", "cpu", "--batches", "1", "--max-tokens", "4", "--rounds", "1", "--skip", "shape",
                       "--contenders", "plain", "recycle16", "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "errors" not in report, report.get("errors")
    rows = {row["contender"]: row for row in report["smollm2"]}
    assert set(rows) == {"plain", "recycle16"} and rows["plain"]["vs_plain"] == 1.0
    assert rows["recycle16"]["tokens"] == 4 and rows["recycle16"]["execution"] == "default"
    assert "recycle16" in (tmp_path / "gpu_check.md").read_text()
