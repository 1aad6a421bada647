"""`dapple calibrate`: a measured cluster TOML that `--cluster` accepts, and the efficiency fit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dapple_ir.cli import main
from dapple_ir.cluster.spec import DEFAULT_LINKS, PRESETS, DeviceKind
from dapple_ir.cluster.toml_file import resolve_cluster
from dapple_ir.commands.calibrate import fit_efficiency, fit_split_price
from dapple_ir.errors import RuntimeFailure


def test_fit_efficiency_is_roofline_over_measured(tmp_path: Path) -> None:
    kind = DeviceKind("toy", 1e9, {"f32": 1e10}, 1e9, op_overhead=0.01)
    ops = {
        # Compute bound: roofline 0.1 s forward + 0.2 s backward, measured 0.6 s less two calls' overhead.
        "mm": {"fwd_s": 0.2, "bwd_s": 0.4, "fwd_flops": 1e9, "bwd_flops": 2e9, "mem_bytes": 1e3, "op_class": "matmul"},
        # Bandwidth bound: 1e8 bytes at 1 GB/s = 0.1 s forward, twice that backward; measured 1.2 s.
        "relu": {
            "fwd_s": 0.4,
            "bwd_s": 0.8,
            "fwd_flops": 0.0,
            "bwd_flops": 0.0,
            "mem_bytes": 1e8,
            "op_class": "elementwise",
        },
        "x": {"fwd_s": 0.0, "bwd_s": 0.0},
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"microbatch": 1, "ops": ops}))
    expected = {"elementwise": pytest.approx(0.3 / 1.18, abs=1e-4), "matmul": pytest.approx(0.3 / 0.58, abs=1e-4)}
    assert fit_efficiency(str(path), kind) == expected


def test_fit_scales_op_times_to_the_whole_step(tmp_path: Path) -> None:
    # Ops timed apart sum to 0.6 s, the whole step took 0.3 s: every op counts half, so the matmul
    # class (roofline 0.3 s) runs at full efficiency rather than half.
    kind = DeviceKind("toy", 1e9, {"f32": 1e10}, 1e9)
    entry = {"fwd_s": 0.2, "bwd_s": 0.4, "fwd_flops": 1e9, "bwd_flops": 2e9, "mem_bytes": 1e3, "op_class": "matmul"}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"microbatch": 1, "ops": {"mm": entry}}))
    assert fit_efficiency(str(path), kind) == {"matmul": pytest.approx(0.5)}
    path.write_text(json.dumps({"microbatch": 1, "step_s": 0.3, "ops": {"mm": entry}}))
    assert fit_efficiency(str(path), kind) == {"matmul": pytest.approx(1.0)}


def test_calibrate_writes_a_usable_cluster(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    entry = {"fwd_s": 1e-3, "bwd_s": 2e-3, "fwd_flops": 1e6, "bwd_flops": 2e6, "mem_bytes": 1e4, "op_class": "matmul"}
    profile.write_text(json.dumps({"microbatch": 1, "ops": {"fc": entry}}))
    out = tmp_path / "cluster.toml"
    assert main(["calibrate", "--devices", "2", "--fit", str(profile), "-o", str(out)]) == 0
    spec = resolve_cluster(str(out))
    assert spec.num_devices == 2
    cpu = spec.device(1)
    # Loose sanity bounds for any CPU a test runs on: 100 MFLOP/s .. 10 TFLOP/s, 100 MB/s .. 1 TB/s.
    assert 1e8 < cpu.flops("f32") < 1e13
    assert 1e8 < cpu.mem_bandwidth < 1e12
    assert 0 < spec.efficiency_of("matmul") <= 1
    # The link between the two CPU ranks was timed with gloo between two processes, not taken from the preset.
    link = spec.link(0, 1)
    assert link != DEFAULT_LINKS["cpu"][0]
    assert 1e6 < link.bandwidth < 1e12 and 0 < link.latency < 1
    # So was how much slower a transfer moves into a rank that computes (any figure the fit allows: on a machine
    # with idle cores it may well be 1), and the file carries it.
    assert 1.0 <= cpu.busy_receive_slowdown <= 1000.0
    assert (cpu.busy_receive_slowdown != 1.0) == ("busy_receive_slowdown" in out.read_text())
    # And what a split backward costs beyond a whole one per weight op and byte (zero where it costs nothing).
    assert 0.0 <= cpu.split_backward_overhead < 0.1 and 0.0 <= cpu.split_backward_per_byte < 1e-6
    assert (cpu.split_backward_overhead != 0.0) == ("split_backward_overhead" in out.read_text())
    assert (cpu.split_backward_per_byte != 0.0) == ("split_backward_per_byte" in out.read_text())
    # And the runtime's own host time per instruction and per message, from a real 2-rank run: some host work
    # there always is, and far less than a second.
    assert 0.0 < cpu.instruction_overhead + cpu.message_overhead < 0.1
    assert cpu.instruction_overhead >= 0.0 and cpu.message_overhead >= 0.0
    assert (cpu.instruction_overhead != 0.0) == ("instruction_overhead" in out.read_text())
    # And what an allreduce member's host spends per byte it reduces beyond the link (gloo's sums and copies): from
    # 0 to a microsecond a byte (a CPU below 1 MB/s), in the file where not 0.
    assert 0.0 <= cpu.reduce_per_byte < 1e-6
    assert (cpu.reduce_per_byte != 0.0) == ("reduce_per_byte" in out.read_text())
    # And from the same run, a woken rank's wait for a core: none below 0, under a second, in the file where not 0.
    assert 0.0 <= cpu.wake_overhead < 1.0
    assert (cpu.wake_overhead != 0.0) == ("wake_overhead" in out.read_text())
    # Two ranks share this machine's cores only where it has fewer than two.
    import os

    usable = len(os.sched_getaffinity(0))
    assert spec.cores_per_node == (usable if usable < 2 else 0)


def test_calibrate_names_the_cores_where_the_ranks_outnumber_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """`shared_cores`: the cores this process may use, where fewer than the node's CPU ranks; else 0 (a core per
    rank, or GPUs, share nothing)."""
    import os

    from dapple_ir.frontend import measure

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 3}, raising=False)
    assert measure.shared_cores("cpu", 4) == 2
    assert measure.shared_cores("cpu", 3) == 2
    assert measure.shared_cores("cpu", 2) == 0
    assert measure.shared_cores("cuda", 4) == 0


def test_the_split_overhead_is_timed_on_the_runtimes_own_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`measure_split_overhead` times the runtime's `input_pass` and `weight_passes`, not a copy of them: with 10 ms
    planted in each weight pass (one per Linear of its chains) every width reads at least those 10 ms per layer, less
    what noise in the two backwards it subtracts can take off (a whole backward preempted for a few 4 ms time slices
    on a loaded 2-core machine costs its 4 layers 1 ms each per slice: 2 ms planted once read below 1.5), and each
    point carries its layer's weight and bias bytes."""
    from dapple_ir.backends.torch import split_backward

    original = split_backward.weight_passes

    def slow(deferred: list[split_backward.WeightPass]) -> None:
        for wp in deferred:
            if wp.roots and wp.params:
                time.sleep(10e-3)
        original(deferred)

    monkeypatch.setattr(split_backward, "weight_passes", slow)
    monkeypatch.setitem(split_backward.SPLIT_CHAIN, "cpu", (4, 4, (8, 16)))
    points = split_backward.measure_split_overhead("cpu", rounds=10)
    assert [nbytes for nbytes, _ in points] == [4.0 * (8 * 8 + 8), 4.0 * (16 * 16 + 16)]
    assert all(seconds > 6e-3 for _, seconds in points)


def test_the_split_price_is_the_line_through_the_widths() -> None:
    """`fit_split_price`: points on a known line give back its intercept and slope; a line that falls with size is
    read as a constant (the mean), and a negative intercept as 0."""
    line = [(x, 1e-4 + 5e-11 * x) for x in (2.6e5, 1.05e6, 4.2e6)]
    assert fit_split_price(line) == pytest.approx((1e-4, 5e-11), rel=1e-9)
    assert fit_split_price([(1e5, 3e-4), (1e6, 1e-4)]) == pytest.approx((2e-4, 0.0))
    assert fit_split_price([(1e5, 0.0), (1e6, 9e-4)]) == pytest.approx((0.0, 1e-9))


def test_neighbours_run_the_same_work_and_stop(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU ranks share the machine: `--devices 2` measures one rank while another does the same work."""
    import threading
    import time

    import torch

    from dapple_ir.commands import calibrate
    from dapple_ir.frontend.measure import _busy

    # The runtime's host time is a run of its own (test_calibrate_writes_a_usable_cluster runs it); here it fails,
    # and calibrate keeps the preset's figures with a note.
    def fails(device: str, ranks: int) -> tuple[float, float, float]:
        raise RuntimeFailure("rank 1 could not start")

    monkeypatch.setattr(calibrate, "measure_host_time", fails)

    calls = [0, 0]
    before = threading.active_count()
    with _busy(2, lambda k: calls.__setitem__(k, calls[k] + 1)):
        while min(calls) < 3:
            pass
    assert threading.active_count() == before  # every neighbour stopped with the block
    settled = list(calls)
    time.sleep(0.05)
    assert min(settled) >= 3 and calls == settled  # nothing ran after the block
    threads = torch.get_num_threads()
    assert main(["calibrate", "--devices", "2", "-o", "/dev/null"]) == 0
    assert torch.get_num_threads() == threads
    err = capsys.readouterr().err
    assert "GFLOP/s per rank (" in err and " alone)" in err  # both figures, the shared one first
    assert "host time was not measured (rank 1 could not start); keeping the preset's" in err
    assert f"host {PRESETS['cpu'].instruction_overhead * 1e6:.0f} us per instruction" in err


def test_the_runtimes_host_figures_reach_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `measure_host_time` measured on the runtime (test_calibrate_writes_a_usable_cluster runs it for real) is
    what the cluster file carries, the woken rank's wait for a core with the host's time per instruction and
    message; and the summary line names it."""
    from dapple_ir.commands import calibrate

    monkeypatch.setattr(calibrate, "measure_host_time", lambda device, ranks: (1e-4, 2e-5, 3e-4))
    out = tmp_path / "cluster.toml"
    assert main(["calibrate", "--devices", "2", "-o", str(out)]) == 0
    cpu = resolve_cluster(str(out)).device(0)
    assert (cpu.instruction_overhead, cpu.message_overhead, cpu.wake_overhead) == pytest.approx((1e-4, 2e-5, 3e-4))


def test_a_cpu_rank_gets_its_share_of_the_rate_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several CPU ranks, a rank's matmul rate is the rate alone times the median alone/shared ratio of
    back-to-back rounds (`_shared_rate`), not a shared figure taken at another moment. Wired through: with the
    ratio forced to 0.5 every dtype's rate is exactly half the solo one. And the ratio itself, with no neighbour
    busy, compares like with like: near 1 (any CPU, any load: within 0.5-2)."""
    from dapple_ir.frontend import measure

    assert 0.5 < measure._shared_rate(torch.device("cpu"), "cpu", neighbours=0, rounds=7) < 2.0
    monkeypatch.setattr(measure, "_shared_rate", lambda device, kind_name, neighbours: 0.5)
    monkeypatch.setattr(measure, "measure_cpu_link", lambda: (DEFAULT_LINKS["cpu"][0], 1.0, 0.0))
    node = measure.measure_node("cpu", 2)
    assert node.kind.peak_flops == {k: v * 0.5 for k, v in node.solo.peak_flops.items()}
    assert node.kind.peak_flops  # there was a rate to share
