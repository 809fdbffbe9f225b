"""The GPU check scripts run on a CPU too (small shapes, the Triton kernels interpreted): a script that would fail
on the GPU machine fails here first, where it costs no device time."""

from __future__ import annotations

import json
from pathlib import Path

from tools.gpu import forward_check


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
