"""bench/vs_trl.py's accounting on cases with a known answer: trained samples/s and model
tokens/s from fake project and TRL step logs, accuracy at equal wall time, the RESULT line,
and peak memory (VmHWM) of a child that holds a known allocation. No TRL import."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from importlib import metadata

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def V():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("vs_trl", REPO / "bench" / "vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_project_metrics_give_samples_and_tokens_per_second(V):
    # metrics.jsonl rows: 8 leaves and 100 model tokens per step, a step every 10 s
    rows = [{"step": s, "time": 100.0 + 10 * (s - 1), "leaves": 8, "model_tokens": 100.0,
             "groups": 2, "wall_time": 5.0 * s} for s in range(1, 6)]
    th = V.throughput(V.project_steps(rows))
    # steps 2..5 after the end of step 1: 32 samples, 400 tokens in 40 s
    assert th["samples"] == 32 and th["seconds"] == pytest.approx(40.0)
    assert th["samples_per_s"] == pytest.approx(0.8)
    assert th["model_tokens_per_s"] == pytest.approx(10.0)


def test_trl_cumulative_counters_become_per_step_rows(V):
    # steps.jsonl: cumulative counters, 8 samples and 64 tokens per step, 5 s apart,
    # written out of order
    rows = [{"step": s, "time": 50.0 + 5 * s, "samples": 8 * s, "model_tokens": 64 * s,
             "generate_s": 1.0 * s, "rollout_s": 1.5 * s} for s in (3, 1, 4, 2)]
    steps = V.trl_steps(rows)
    assert [r["samples"] for r in steps] == [8, 8, 8, 8]
    assert [r["model_tokens"] for r in steps] == [64, 64, 64, 64]
    th = V.throughput(steps)
    assert th["samples_per_s"] == pytest.approx(24 / 15)
    assert th["model_tokens_per_s"] == pytest.approx(192 / 15)
    assert th["median_step_s"] == pytest.approx(5.0)


def test_median_step_ignores_one_slow_step(V):
    # steps 5 s apart but one 35 s stall: the window gives 8 * 4 / 50, the median step 8 / 5
    times = [0.0, 5.0, 40.0, 45.0, 50.0]
    rows = [{"step": i + 1, "time": t, "samples": 8, "model_tokens": 10}
            for i, t in enumerate(times)]
    th = V.throughput(rows)
    assert th["samples_per_s"] == pytest.approx(32 / 50)
    assert th["median_step_s"] == pytest.approx(5.0)
    assert th["samples_per_median_step_s"] == pytest.approx(8 / 5)


def test_throughput_refuses_what_it_cannot_measure(V):
    with pytest.raises(ValueError, match="at least 2 steps"):
        V.throughput([{"step": 1, "time": 0.0, "samples": 8, "model_tokens": 1}])
    with pytest.raises(ValueError, match="took 0"):
        V.throughput([{"step": s, "time": 1.0, "samples": 8, "model_tokens": 1}
                      for s in (1, 2)])


def test_bounds_leave_out_step_one(V):
    # the project's learner: step 1 waits 60 s for the engines to start; then 1 s waiting
    # and 3 s training per 4 s step
    rows = [{"step": 1, "wait_s": 60.0, "train_time_s": 1.0, "step_time_s": 61.0}]
    rows += [{"step": s, "wait_s": 1.0, "train_time_s": 3.0, "step_time_s": 4.0}
             for s in (2, 3)]
    b = V.project_bound(rows)
    assert (b["learner_wait_s"], b["learner_train_s"], b["learner_steps_s"]) == (2.0, 6.0, 8.0)
    assert b["wait_share"] == pytest.approx(0.25) and b["train_share"] == pytest.approx(0.75)
    # TRL: cumulative timers; steps 2..3 take 20 s, 12 s of it generating, 13 s rollout
    trl = [{"step": 1, "time": 10.0, "generate_s": 9.0, "rollout_s": 9.5},
           {"step": 2, "time": 20.0, "generate_s": 15.0, "rollout_s": 16.0},
           {"step": 3, "time": 30.0, "generate_s": 21.0, "rollout_s": 22.5}]
    t = V.trl_bound(trl)
    assert t["generate_share"] == pytest.approx(0.6) and t["rollout_share"] == pytest.approx(0.65)


def test_trl_figures_from_a_fake_run_folder(V, tmp_path):
    rows = [{"step": s, "time": 1000.0 + 4 * s, "t_begin": 1000.0, "samples": 8 * s,
             "model_tokens": 100 * s, "generate_s": 2.0 * s, "rollout_s": 2.5 * s,
             "prompt_ids_match": True} for s in range(1, 5)]
    (tmp_path / "steps.jsonl").write_text("".join(f"{json.dumps(r)}\n" for r in rows))
    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    f = V.arm_figures("trl", tmp_path, t_launch=990.0)
    assert f["throughput"]["samples_per_s"] == pytest.approx(24 / 12)
    assert f["checkpoints"] == [(18.0, 2, str(tmp_path / "checkpoint-2")),
                                (26.0, 4, str(tmp_path / "checkpoint-4"))]
    assert f["bound"]["generate_share"] == pytest.approx(0.5)
    assert f["bound"]["prompt_ids_match"] is True


def test_accuracy_at_equal_time_takes_the_newest_checkpoint_by_then(V):
    a = [(0.0, 0.1), (60.0, 0.3), (120.0, 0.5), (180.0, 0.6)]
    b = [(0.0, 0.1), (100.0, 0.2), (150.0, 0.4)]
    assert V.accuracy_at(a, 119.9) == 0.3
    assert V.accuracy_at(a, 120.0) == 0.5
    eq = V.equal_time(a, b)  # b ends first, at 150 s
    assert eq == {"seconds": 150.0, "a": 0.5, "b": 0.4}
    with pytest.raises(ValueError):
        V.accuracy_at([(10.0, 0.2)], 5.0)


def test_result_line_is_last_line_format(V):
    line = V.result_line(2.0, 0.5, 0.4)
    assert line == ("RESULT vs_trl samples_per_s_ratio=2.00 accuracy_at_equal_time="
                    "0.500vs0.400 target=samples_per_s_ratio>=2 met")
    assert V.result_line(1.99, 0.5, 0.4).endswith(" missed")
    assert re.fullmatch(r"RESULT vs_trl( \S+=\S+)+ (met|missed)", line)


def test_status_fields_and_role_peaks(V):
    text = "Name:\tpython\nVmPeak:\t  900 kB\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n"
    assert V.status_kb(text, "VmHWM") == 2048
    assert V.status_kb(text, "VmSwap") == 0
    peaks = V.role_peaks({1: 1024, 2: 2048, 3: 512}, {1: "learner", 2: "actor0", 3: "actor0"})
    assert peaks == {"actor0": 2.5, "learner": 1.0}
    assert V.role_peaks({9: 1024}, {}) == {"other": 1.0}


def test_peak_memory_sees_a_known_allocation(V):
    # a child touches 80 MB and holds it for 2 s: its VmHWM must show it
    code = "import time; b = bytearray(80 * 2**20); time.sleep(2)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    mem = V.PeakMemory(proc.pid, lambda: {proc.pid: "child"}, period_s=0.1)
    proc.wait()
    time.sleep(0.2)
    peaks = mem.stop()
    assert 80 <= peaks["child"] < 80 + 60  # the interpreter itself: ~10-20 MB


def test_the_extra_pins_the_installed_trl():
    try:
        installed = metadata.version("trl")
    except metadata.PackageNotFoundError:
        pytest.skip("trl not installed (pip install -e .[bench-trl])")
    pinned = re.search(r'bench-trl = \["trl==([^"]+)"\]',
                       (REPO / "pyproject.toml").read_text())
    assert pinned and pinned.group(1) == installed
