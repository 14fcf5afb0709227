"""FLOP and byte models of utils.roofline (CPU only); utils/test_render.py draws the plot."""

import pytest

from utils import roofline


def test_attention_flops_formula():
    assert roofline.attention_flops(4, 8, 4096, 4096, 64) == 4 * 4 * 8 * 4096 * 4096 * 64


def test_causal_counts_the_lower_triangle():
    S = 1000
    expected = 4 * S * (S + 1) / 2 * 64  # rows i keep i + 1 keys
    assert roofline.attention_flops(1, 1, S, S, 64, causal=True) == pytest.approx(expected)
    # Sq > Sk: rows past Sk keep all keys
    assert roofline.attention_flops(1, 1, 6, 4, 1, causal=True) == pytest.approx(4 * (1 + 2 + 3 + 4 + 4 + 4))


def test_stride_divides_work():
    assert roofline.attention_flops(1, 1, 64, 64, 32, stride=4) == roofline.attention_flops(1, 1, 64, 64, 32) / 4


def test_attention_bytes_read_inputs_once_write_output_once():
    assert roofline.attention_bytes(2, 3, 10, 20, 8, elem_bytes=2) == 2 * 2 * 3 * (10 * 8 * 2 + 20 * 8 * 2)
    unfused = roofline.unfused_attention_bytes(1, 1, 10, 20, 8)
    assert unfused - roofline.attention_bytes(1, 1, 10, 20, 8) == 4 * 4 * 10 * 20


def test_matmul_and_rates():
    assert roofline.matmul_flops(2, 3, 4, batch=5) == 2 * 5 * 2 * 3 * 4
    assert roofline.matmul_bytes(2, 3, 4) == 4 * (8 + 12 + 6)
    assert roofline.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert roofline.gbps(3e9, 1000.0) == pytest.approx(3.0)


def test_mlp_and_layer_norm_models():
    assert roofline.mlp_flops(8192, 512, 2048) == 4 * 8192 * 512 * 2048
    assert roofline.layer_norm_bytes(10, 16) == 4 * (2 * 10 * 16 + 2 * 16)
    assert roofline.layer_norm_bytes(10, 16, residual=True) == 4 * (4 * 10 * 16 + 2 * 16)


def test_ridge_point():
    assert roofline.ridge_point({"fp32_TFLOPs": 60.0, "dram_TBps": 3.0}) == pytest.approx(20.0)
