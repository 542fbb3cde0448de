"""The matmul measurement and its figure, checked against the FLOP formula and a brute-force timing."""
import time

import matplotlib

matplotlib.use("agg")  # pytest only; stage kernels use the inline backend

import pytest
import torch

from slm_bench.pipeline.hardware import bench_matmul, collect_environment, matmul_flops, measure_matmul, peak_gflops, plot_matmul


def test_flops_formula():
    assert matmul_flops(1) == 2 and matmul_flops(3) == 54  # 3x3 @ 3x3: 9 outputs x 3 multiply-adds x 2


def test_measurement_agrees_with_a_plain_timing():
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    measured, plain = [], []
    for _ in range(3):  # interleaved rounds, best of each: a burst of other work on a shared box hits one round, not all
        results = measure_matmul([n], repeats=5, device="cpu", min_time_s=0.02)
        measured.append(results[0]["best_gflops"])
        loops = []
        for _ in range(5):  # a plain loop, timed a few times
            start = time.perf_counter()
            for _ in range(50):
                torch.matmul(a, b)
            loops.append((time.perf_counter() - start) / 50)
        plain.append(matmul_flops(n) / min(loops) / 1e9)
        assert results[0]["loops_per_repeat"] >= 1 and len(results[0]["seconds"]) == 5
    # the same machine measured two ways must agree within the noise of a shared box (factor 4, STACK.md)
    assert max(plain) / 4 < max(measured) < max(plain) * 4


def test_device_validation():
    with pytest.raises(ValueError, match="device must be"):
        measure_matmul([8], device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no GPU"):
            measure_matmul([8], device="cuda")


def test_plot_shows_medians_and_peak():
    results = measure_matmul([32, 64], repeats=3, device="cpu", min_time_s=0.001)
    fig = plot_matmul(results)
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [32, 64]
    assert list(line.get_ydata()) == [r["gflops"] for r in results]
    assert fig.axes[0].lines[1].get_ydata()[0] == peak_gflops(results)


def test_environment_has_versions_and_hardware():
    env = collect_environment()
    assert env["versions"]["torch"] == torch.__version__
    assert env["cpu"]["torch_threads"] == torch.get_num_threads()
    assert env["memory_gib"] is None or env["memory_gib"] > 0
