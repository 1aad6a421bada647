"""Megatron-LM's weak-scaling table (examples/megatron_gpt.py, bench/megatron_table.py): Eq. 3, the rows, the
configurations the bench forces, and the model's capture."""

from __future__ import annotations

import sys

import pytest

from tests.paths import ROOT

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from examples.megatron_gpt import ROWS, SEQ, VOCAB, eq3_flops, param_count, row, tflops_per_gpu


def test_eq3_is_the_papers_count_of_one_iteration():
    """Eq. 3 from the GEMMs of one row, counted by hand as the paper's Section 5.1 does: per layer and forward,
    the QKV projection 6Bsh^2, the attention scores 2Bs^2h, the attention over values 2Bs^2h, the output
    projection 2Bsh^2 and the MLP 16Bsh^2; the backward is twice the forward and recomputation a third
    forward; the logit layer 2BshV forward, with its backward 6BshV."""
    r = row("1.7B")
    b, s, h, layers, v = r.batch, SEQ, r.hidden, r.layers, VOCAB
    forward_per_layer = 6 * b * s * h**2 + 2 * b * s**2 * h + 2 * b * s**2 * h + 2 * b * s * h**2 + 16 * b * s * h**2
    by_hand = layers * 4 * forward_per_layer + 3 * 2 * b * s * h * v
    assert eq3_flops(b, s, layers, h, v) == pytest.approx(by_hand, rel=1e-12)


def test_tflops_per_gpu_is_flops_over_time_and_gpus():
    r = row("1.7B")
    seconds = 2.5
    expected = eq3_flops(r.batch, SEQ, r.layers, r.hidden, VOCAB) / (seconds * r.gpus) / 1e12
    assert tflops_per_gpu(r, seconds) == pytest.approx(expected)
    assert tflops_per_gpu(r, seconds, gpus=16) == pytest.approx(2 * expected)


#: Table 1's aggregate petaFLOP/s column: each row's per-GPU figure times its GPUs must give it (to rounding).
AGGREGATE_PFLOPS = (4.4, 8.8, 18.2, 34.6, 70.8, 143.8, 227.1, 297.4, 410.2, 502.0)


def test_rows_agree_with_the_papers_other_columns():
    assert len(ROWS) == 10
    for r, aggregate in zip(ROWS, AGGREGATE_PFLOPS, strict=True):
        assert r.tflops * r.gpus / 1000 == pytest.approx(aggregate, rel=0.01), r.name
        assert r.gpus % (r.tensor * r.pipeline) == 0 and r.gpus % 8 == 0, r.name
        assert r.hidden % r.heads == 0 and r.layers % r.pipeline == 0, r.name
        # The name is the parameter count the paper rounds (the tied head counted once).
        assert param_count(r) / 1e9 == pytest.approx(float(r.name.rstrip("B")), rel=0.03), r.name
    assert row("1008b") is ROWS[-1]
    with pytest.raises(KeyError, match=r"1\.7B"):
        row("2B")


def test_forced_configurations_are_megatrons_and_schedulable():
    from megatron_table import MEGATRON_RUNS, forced_options

    assert set(MEGATRON_RUNS) == {r.name for r in ROWS}
    for r in ROWS:
        options = forced_options(r, tensor_parallel=True)
        run = MEGATRON_RUNS[r.name]
        # A plan's stages count virtual ones: Megatron's pipeline depth times its chunks per device.
        assert options["stages"] == r.pipeline * run.virtual and options["tensor_parallel"] == r.tensor
        assert options["data_parallel"] == r.data
        assert options["recompute"] == "all" and options["replication"] == "round-robin"
        m = options["microbatches"]
        # Whole microbatches of Megatron's size, each replica its share: batch / (DP * MBS) per pipeline.
        assert m * run.micro_batch == r.batch and m % r.data == 0
        if options["schedule"] == "interleaved":
            # Megatron's condition: the microbatches per pipeline divide by its stages.
            assert (m // r.data) % r.pipeline == 0 and (r.layers // r.pipeline) % options["virtual"] == 0
        assert not {"tensor_parallel", "data_parallel"} & set(forced_options(r, tensor_parallel=False))


def test_tiny_model_captures_and_its_parameters_match_the_closed_form():
    from examples.megatron_gpt import GPTShape, MegatronRow, factory_tiny

    model, (idx,), loss, (targets,) = factory_tiny()
    tiny = MegatronRow("tiny", 4, 64, 2, 1, 1, 8, 8, 0.0)
    assert sum(p.numel() for p in model.parameters()) == param_count(tiny, vocab=256, seq=32)
    assert float(loss(model(idx), targets).detach()) > 0
    assert GPTShape(256, 32, 64, 2, 4).dropout == 0.0


@pytest.mark.slow
def test_the_largest_row_captures_on_meta_quickly():
    import time

    from dapple_ir.frontend.spec_loader import capture_spec

    started = time.perf_counter()
    module = capture_spec(f"{ROOT / 'examples' / 'megatron_gpt.py'}:factory_1008b", device="meta")
    assert time.perf_counter() - started < 60
    assert sum(1 for op in module.ops if op.attrs.module_path and op.attrs.module_path.endswith("qkv")) == 128


def test_relaxations_drop_the_microbatch_count_then_interleaving():
    from megatron_table import forced_options, relaxations

    steps = relaxations(forced_options(row("76.1B"), tensor_parallel=True))
    assert [label for label, _ in steps] == ["(a) Megatron's", "(a) M free", "(a) M free, 1f1b"]
    assert steps[0][1]["virtual"] == 3 and "microbatches" not in steps[1][1]
    assert steps[2][1]["schedule"] == "1f1b" and "virtual" not in steps[2][1]
    assert len(relaxations(forced_options(row("1008B"), tensor_parallel=True))) == 2
