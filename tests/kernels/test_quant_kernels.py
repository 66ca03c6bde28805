"""``llm_api.kernels.cpu.quant``: weights in GGUF's block formats, on the three builds of the CPU kernels
(``-march=native``, ``x86-64-v3`` = AVX2, plain ``x86-64`` = scalar C; tests/kernels/test_cpu_kernels.py).

* De-quantization equals the ``gguf`` package's reference bit for bit, in GGUF's layout and in groups of 8 rows.
* Q8_0, Q4_0, Q4_1 and Q5_0 quantization equals the gguf package's bit for bit; Q4_K and Q6_K round-trip within
  the error of their bits.
* A product equals, up to float32 sums, the float64 product of the de-quantized weights and the input as the
  kernel quantizes it (two 8-bit digits a value, re-derived here in numpy float32, the same IEEE operations), so
  any mistake in unpacking a block shows at full size; and it is within the digits' error of the float product.
* A row's result does not depend on the rows beside it (batch invariance), whatever the layout.
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from llm_api.kernels.cpu import library as cpu_library
from llm_api.kernels.cpu import quant
from quant_helpers import random_blocks

BUILDS = ["native", "x86-64-v3", "x86-64"]
pytestmark = pytest.mark.skipif(cpu_library._compiler() is None, reason="no C compiler: the CPU kernels are not built")


@pytest.fixture(scope="module")
def libraries(kernel_libraries):
    """The builds this CPU runs, by march (tests/kernels/conftest.py: built once a session; sanitized where
    ``LLM_API_CPU_KERNELS_SANITIZED=1``, tests/kernels/test_sanitized.py)."""
    return kernel_libraries


@pytest.fixture(params=BUILDS)
def build(request, libraries, monkeypatch):
    if request.param not in libraries:
        pytest.skip(f"no {request.param} build here: this CPU does not run its code, or LLM_API_CPU_KERNELS_BUILDS leaves it out")
    monkeypatch.setattr(cpu_library, "_library", libraries[request.param])
    return request.param


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def reference(weight: quant.QuantizedWeight) -> np.ndarray:
    """The gguf package's de-quantization of a GGUF-layout weight (float32)."""
    assert weight.layout == "gguf"
    return gguf.quants.dequantize(weight.blocks.numpy(), GGMLQuantizationType(weight.format.type_id))


def quantized_input(x: np.ndarray, digits: int = 2) -> np.ndarray:
    """The input as the kernels quantize it, in float64 (the same float32 operations in numpy). quant.c, per block
    of 32: two digits, hi = rint(x / (max|x| / 63)) and lo = the rest in units of max|x| / (63 x 127), clamped
    to 64; one digit, hi = rint(x / (max|x| / 127))."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = amax / np.float32(63 if digits == 2 else 127)
    with np.errstate(divide="ignore"):
        inverse = np.where(scale != 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    hi = np.rint(blocks * inverse).astype(np.float32)
    if digits == 1:
        return (scale.astype(np.float64) * hi.astype(np.float64)).reshape(rows, k)
    rest = blocks - hi * scale
    unit = scale / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse_unit = np.where(unit != 0, np.float32(1) / unit, np.float32(0)).astype(np.float32)
    lo = np.clip(np.rint(rest * inverse_unit), -64, 64)
    return (unit.astype(np.float64) * (127 * hi.astype(np.float64) + lo)).reshape(rows, k)


# (rows, k): a few whole groups of 8 rows and a tail, K of one block and of several
SHAPES = {32: [(8, 32), (21, 96), (40, 576)], 256: [(8, 256), (19, 512), (16, 1536)]}


def _cases():
    for name, fmt in quant.FORMATS.items():
        for rows, k in SHAPES[fmt.block]:
            yield name, rows, k


@pytest.mark.parametrize("name,rows,k", list(_cases()))
def test_dequantization_is_the_gguf_reference_bit_for_bit(build, name, rows, k):
    fmt = quant.FORMATS[name]
    weight = quant.QuantizedWeight(fmt, random_blocks(fmt, rows, k, _rng(f"{name}{rows}{k}")), k)
    expected = reference(weight)
    layouts = [weight] + ([quant.repack(weight)] if name in quant.REPACKABLE else [])
    for each in layouts:
        got = quant.dequantize(each).numpy()
        assert got.view(np.uint32).tolist() == expected.view(np.uint32).tolist(), each.layout
        ids = torch.tensor([[rows - 1, 0], [rows // 2, 3]])
        assert torch.equal(quant.dequantize(each, ids), torch.from_numpy(expected)[ids])
        as_bf16 = quant.dequantize(each, dtype=torch.bfloat16)
        assert torch.equal(as_bf16, torch.from_numpy(expected).to(torch.bfloat16))


@pytest.mark.parametrize("name", quant.REPACKABLE)
def test_groups_of_8_rows_are_the_same_bytes_reordered(build, name):
    fmt = quant.FORMATS[name]
    weight = quant.QuantizedWeight(fmt, random_blocks(fmt, 27, fmt.block * 2, _rng(name)), fmt.block * 2)
    grouped = quant.repack(weight)
    assert grouped.layout == "rows8" and not torch.equal(grouped.blocks[:8], weight.blocks[:8])
    assert torch.equal(grouped.blocks[24:], weight.blocks[24:])  # (the rows past the last whole group)
    assert torch.equal(quant.repack(grouped, "gguf").blocks, weight.blocks)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0"])
def test_quantization_is_the_gguf_packages_bit_for_bit(build, name):
    fmt = quant.FORMATS[name]
    values = (torch.from_numpy(_rng(name).standard_normal((24, 512)).astype(np.float32)) * 0.1)
    values[0, :32] = 0.0  # (a block of zeros: d = 0)
    expected = gguf.quants.quantize(values.numpy(), GGMLQuantizationType(fmt.type_id))
    assert np.array_equal(quant.quantize(values, fmt).blocks.numpy(), expected)


@pytest.mark.parametrize("name,bound", [("Q4_K", 0.10), ("Q6_K", 0.025), ("Q8_0", 0.008)])
def test_quantization_round_trips_within_its_bits(build, name, bound):
    fmt = quant.FORMATS[name]
    values = torch.from_numpy(_rng(name).standard_normal((16, 1024)).astype(np.float32)) * 0.05
    back = quant.dequantize(quant.quantize(values, fmt))
    assert ((back - values).norm() / values.norm()).item() < bound


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("name,rows,k", list(_cases()))
def test_products_are_exact_up_to_float32_sums(build, name, rows, k, digits):
    fmt = quant.FORMATS[name]
    rng = _rng(f"product{name}{rows}{k}")
    weight = quant.QuantizedWeight(fmt, random_blocks(fmt, rows, k, rng), k, input_digits=digits)
    w64 = reference(weight).astype(np.float64)
    x = rng.standard_normal((7, k)).astype(np.float32)
    x[1, :5] *= 100.0  # (a block with an outlier: the second digit keeps its small neighbours)
    exact = quantized_input(x, digits) @ w64.T
    float_product = x.astype(np.float64) @ w64.T
    magnitude = np.abs(quantized_input(x, digits)) @ np.abs(w64).T
    for each in [weight] + ([quant.repack(weight)] if name in quant.REPACKABLE else []):
        assert each.input_digits == digits
        got = quant.product(torch.from_numpy(x), quant.Product([each], k)).double().numpy()
        assert np.all(np.abs(got - exact) <= 2e-6 * magnitude + 1e-30), (each.layout, np.abs(got - exact).max())
        # and the digits' error: at most half a unit of max|x| / (63 x 127) a value (one digit: of max|x| / 127)
        unit = np.abs(x.reshape(7, -1, 32)).max(-1).repeat(32, -1) / (63 * 127 if digits == 2 else 127)
        assert np.all(np.abs(got - float_product) <= (unit @ np.abs(w64).T) * 0.51 + 2e-6 * magnitude)


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("name", quant.REPACKABLE)
def test_a_rows_result_does_not_depend_on_its_batch(build, name, digits):
    fmt = quant.FORMATS[name]
    k = fmt.block * 2
    rng = _rng(f"batch{name}")
    weight = quant.QuantizedWeight(fmt, random_blocks(fmt, 37, k, rng), k, input_digits=digits)
    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
    for each in (weight, quant.repack(weight)):
        product = quant.Product([each], k)
        whole = quant.product(x, product)
        for rows in (slice(0, 1), slice(3, 5), slice(5, 22), slice(66, 70)):
            assert torch.equal(quant.product(x[rows], product), whole[rows]), (each.layout, rows)


@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("name", quant.REPACKABLE)
def test_the_native_build_computes_the_avx2_builds_numbers(libraries, monkeypatch, name, digits):
    """Where the host has more than AVX2 (VNNI's dpbusd on the Intel kinds and Zen 4: quant.c's ROWS8_VNNI), the
    grouped products compute the same integers by other instructions: the results equal the AVX2 build's to the
    bit, so which build a host runs never changes an answer. (On an AVX2-only host both builds are one code.)"""
    if "x86-64-v3" not in libraries:
        pytest.skip("this CPU does not run the AVX2 build")
    monkeypatch.setattr(cpu_library, "_library", libraries["native"])
    fmt = quant.FORMATS[name]
    k = fmt.block * 3
    rng = _rng(f"builds{name}")
    weight = quant.repack(quant.QuantizedWeight(fmt, random_blocks(fmt, 24, k, rng), k, input_digits=digits))
    x = torch.from_numpy(rng.standard_normal((6, k)).astype(np.float32) * 3)
    results = {}
    for march in ("native", "x86-64-v3"):
        monkeypatch.setattr(cpu_library, "_library", libraries[march])
        results[march] = quant.product(x, quant.Product([weight], k))
    assert torch.equal(results["native"], results["x86-64-v3"])


def test_a_product_of_parts_of_different_formats_with_a_bias(build):
    rng = _rng("parts")
    k = 512
    parts = [quant.repack(quant.QuantizedWeight(quant.FORMATS["Q4_K"], random_blocks(quant.FORMATS["Q4_K"], 24, k, rng), k)),
             quant.QuantizedWeight(quant.FORMATS["Q5_1"], random_blocks(quant.FORMATS["Q5_1"], 8, k, rng), k),
             torch.from_numpy(rng.standard_normal((5, k)).astype(np.float32))]
    bias = torch.from_numpy(rng.standard_normal(37).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    got = quant.product(x, quant.Product(parts, k), bias)
    alone = [quant.product(x, quant.Product([p], k)) for p in parts[:2]]
    dense = x @ parts[2].T
    expected = torch.cat([*alone, dense], dim=1) + bias
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert quant.Product(parts, k).sizes == [24, 8, 5]


def test_a_non_finite_input_row_harms_only_itself(build):
    fmt = quant.FORMATS["Q4_1"]
    weight = quant.repack(quant.QuantizedWeight(fmt, random_blocks(fmt, 16, 64, _rng("nan")), 64))
    x = torch.randn(3, 64)
    clean = quant.product(x, quant.Product([weight], 64))
    x[1, 7] = float("inf")
    got = quant.product(x, quant.Product([weight], 64))
    assert torch.isnan(got[1]).all() and torch.equal(got[0], clean[0]) and torch.equal(got[2], clean[2])


def test_bfloat16_inputs_give_the_float32_result_rounded(build):
    fmt = quant.FORMATS["Q8_0"]
    weight = quant.repack(quant.QuantizedWeight(fmt, random_blocks(fmt, 16, 128, _rng("bf16")), 128))
    x = torch.randn(4, 128).to(torch.bfloat16)
    product = quant.Product([weight], 128)
    assert torch.equal(quant.product(x, product), quant.product(x.float(), product).to(torch.bfloat16))


def test_bad_arguments_are_refused(build):
    fmt = quant.FORMATS["Q4_K"]
    blocks = random_blocks(fmt, 8, 256, _rng("bad"))
    with pytest.raises(ValueError, match="whole blocks"):
        quant.QuantizedWeight(fmt, blocks, 255)
    with pytest.raises(ValueError, match="uint8"):
        quant.QuantizedWeight(fmt, blocks.view(torch.int8), 256)
    weight = quant.QuantizedWeight(fmt, blocks, 256)
    with pytest.raises(ValueError, match="cannot take"):
        quant.product(torch.randn(2, 128), quant.Product([weight], 256))
    with pytest.raises(IndexError):
        quant.dequantize(weight, torch.tensor([8]))
    with pytest.raises(IndexError):
        quant.dequantize(weight, torch.tensor([-1]))
    with pytest.raises(ValueError, match="layout"):
        quant.repack(quant.QuantizedWeight(quant.FORMATS["Q5_1"], random_blocks(quant.FORMATS["Q5_1"], 8, 32, _rng("x")), 32))
    with pytest.raises(ValueError, match="1 or 2 digits"):
        quant.QuantizedWeight(fmt, blocks, 256, input_digits=3)
    with pytest.raises(ValueError, match="alike"):
        quant.Product([weight, quant.QuantizedWeight(fmt, blocks, 256, input_digits=1)], 256)
    product = quant.Product([weight], 256)
    product.struct.digits = 3  # (what the C side alone refuses: no input precision but 1 and 2 digits)
    x, y = torch.randn(1, 256), torch.empty(1, 8)
    assert cpu_library.lib().llm_q_product(x.data_ptr(), 256, product.pointer(), None, y.data_ptr(), 8, 1, 256, 0, 1) == 2
    # the C side refuses what the wrappers would: an unknown type, K not whole blocks
    lib = cpu_library.lib()
    out = torch.empty(1, 256)
    assert lib.llm_q_dequantize(99, 0, blocks.data_ptr(), 8, None, 1, 256, out.data_ptr(), 256, 0, 1) == 2
    assert lib.llm_q_dequantize(fmt.type_id, 0, blocks.data_ptr(), 8, None, 1, 255, out.data_ptr(), 256, 0, 1) == 2
    assert lib.llm_q_dequantize(fmt.type_id, 5, blocks.data_ptr(), 8, None, 1, 256, out.data_ptr(), 256, 0, 1) == 2
