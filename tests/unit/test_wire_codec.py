# SPDX-License-Identifier: BSD-3-Clause
"""rpc::Message <-> frame codec: round trips, view compaction, and rejections."""

import struct

import pytest
import torch

from torch_rpc_ext import _testing

PYTHON_CALL = 0x0C | 0x100  # a request type
PYTHON_RET = 0x0D | 0x200  # a response type


def roundtrip(tensors, payload=b"payload", type_=PYTHON_CALL, id_=42):
    head, segments = _testing.encode_message(type_, payload, tensors, id_)
    t, i, p, out = _testing.decode_message(head, segments)
    assert (t, i, p) == (type_, id_, payload)
    return out, head, segments


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
     torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
     torch.complex64, torch.complex128],
)
def test_dense_tensors_round_trip_bit_exact(dtype):
    x = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    (y,), _, _ = roundtrip([x])
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(y, x)


def test_empty_message_and_empty_tensors():
    out, _, _ = roundtrip([], payload=b"")
    assert out == []
    (y,), _, _ = roundtrip([torch.empty(0, 5)])
    assert y.shape == (0, 5)


def test_requires_grad_travels():
    x = torch.ones(3, requires_grad=True)
    (y,), _, _ = roundtrip([x])
    assert y.requires_grad


def test_tensors_sharing_a_storage_still_share_it():
    base = torch.arange(100.0)
    a, b = base[10:20], base[50:60]
    (ya, yb), _, segments = roundtrip([a, b])
    assert torch.equal(ya, a) and torch.equal(yb, b)
    assert ya.untyped_storage().data_ptr() == yb.untyped_storage().data_ptr()
    # Only the used span [10, 60) of the storage travels, not all 100 floats.
    assert len(segments) == 2 and len(segments[1]) == 50 * 4


def test_sparse_view_of_large_base_is_compacted():
    big = torch.arange(1_000_000.0).reshape(1000, 1000)
    column = big[:, 3]  # 1000 floats scattered over ~4 MB
    (y,), _, segments = roundtrip([column])
    assert torch.equal(y, column)
    assert sum(len(s) for s in segments[1:]) == 1000 * 4


def test_non_contiguous_dense_view_keeps_strides():
    x = torch.arange(12.0).reshape(3, 4).t()
    (y,), _, _ = roundtrip([x])
    assert torch.equal(y, x) and y.stride() == x.stride()


@pytest.mark.parametrize("n", [1, 5, 6, 64, 1000])
def test_many_zero_dim_tensors_fit_the_head_that_holds_them(n):
    # A 0-dim tensor takes 17 head bytes: a bound of 20 refused six.
    xs = [torch.tensor(float(i)) for i in range(n)]
    out, head, _ = roundtrip(xs, payload=b"")
    assert [float(y) for y in out] == [float(x) for x in xs]
    assert len(head) == 16 + 17 * n


def test_lazy_conjugate_and_negative_views_arrive_resolved():
    # The conj and neg bits live on the tensor, not in its bytes: sent as
    # bytes alone, x.conj() arrived as x.
    z = torch.randn(3, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(1))
    for sent in (z.conj(), z.mH, z.conj().imag, torch._neg_view(torch.arange(4.0))):
        assert sent.is_conj() or sent.is_neg()
        (y,), _, _ = roundtrip([sent])
        assert torch.equal(y, sent.resolve_conj().resolve_neg()) and not (y.is_conj() or y.is_neg())
    # Beside the plain tensor it is a view of, each keeps its own values.
    (a, b), _, _ = roundtrip([z, z.conj()])
    assert torch.equal(a, z) and torch.equal(b, z.conj().resolve_conj())


def test_sparse_coo_round_trip():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([3.0, 4.0, 5.0])
    s = torch.sparse_coo_tensor(i, v, (2, 3)).coalesce()
    (y,), _, _ = roundtrip([s])
    assert y.is_sparse and y.is_coalesced()
    assert torch.equal(y.to_dense(), s.to_dense())


def quantized_cases():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    per_channel = (torch.tensor([0.1, 0.2, 0.05]), torch.tensor([0, 3, 2]))
    return [
        torch.quantize_per_tensor(x, 0.1, 3, torch.qint8),
        torch.quantize_per_tensor(x, 0.05, 128, torch.quint8),
        torch.quantize_per_tensor(x, 0.001, -7, torch.qint32),
        torch.quantize_per_tensor(x, 0.1, 3, torch.qint8).t(),  # a view
        torch.quantize_per_tensor(torch.tensor(1.5), 0.5, 0, torch.quint8),  # 0-dim
        torch.quantize_per_channel(x, *per_channel, 0, torch.qint8),
        torch.quantize_per_channel(x.t(), *per_channel, 1, torch.quint8),
        torch.quantize_per_channel(x, per_channel[0], per_channel[1].float(), 0, torch.quint8),
    ]


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
def test_quantized_tensors_round_trip():
    # As TensorPipe's (torch's pickler) sends them: the integers, the scheme
    # and its parameters. Before session 98 they were refused.
    sent = quantized_cases()
    out, _, _ = roundtrip(sent)
    for x, y in zip(sent, out):
        assert y.is_quantized and y.dtype == x.dtype and y.qscheme() == x.qscheme()
        assert y.shape == x.shape and torch.equal(y.int_repr(), x.int_repr())
        assert torch.equal(y.dequantize(), x.dequantize())
        if x.qscheme() == torch.per_tensor_affine:
            assert (y.q_scale(), y.q_zero_point()) == (x.q_scale(), x.q_zero_point())
        else:
            assert y.q_per_channel_axis() == x.q_per_channel_axis()
            assert torch.equal(y.q_per_channel_scales(), x.q_per_channel_scales())
            assert torch.equal(y.q_per_channel_zero_points(), x.q_per_channel_zero_points())


def quantized_head(scales=3, zero_points=3, axis=0, qdtype=12, integers=1, scheme=1,
                   scales_dtype=7, zero_points_dtype=4, sizes=(3, 4), strides=(4, 1),
                   scales_grad=False):
    """A per-channel quantized [3, 4] tensor (quint8, ints in segment 1,
    scales in 2, zero points in 3), with what a peer could get wrong."""
    def dense(dtype, sizes, segment, strides=(1,), grad=False):
        return (struct.pack("<BBB", dtype, grad, len(sizes)) + struct.pack(f"<{len(sizes)}q", *sizes)
                + struct.pack(f"<{len(sizes)}q", *strides) + struct.pack("<qIb", 0, segment, -1))
    h = struct.pack("<Iqi", PYTHON_CALL, 7, 1) + struct.pack("<BBBB", 2, qdtype, scheme, axis)
    h += dense(scales_dtype, (scales,), 2, grad=scales_grad)
    h += dense(zero_points_dtype, (zero_points,), 3)
    return h + dense(integers, sizes, 1, strides)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({}, None),
        ({"scales": 2}, "per-channel parameters do not fit it"),  # read past their end
        ({"zero_points": 1}, "per-channel parameters do not fit it"),
        ({"axis": 2}, "per-channel parameters do not fit it"),
        ({"scales_dtype": 6}, "per-channel parameters do not fit it"),
        ({"zero_points_dtype": 6}, "per-channel parameters do not fit it"),
        ({"scales_grad": True}, "per-channel parameters do not fit it"),
        ({"integers": 0}, "integers are not of its dtype"),
        ({"qdtype": 16}, "unknown quantized dtype 16"),  # quint4x2
        ({"scheme": 9}, "unknown qscheme 9"),
        # 12 bytes standing for 3 x 2^30 integers, which torch would copy.
        ({"sizes": (3, 1 << 30), "strides": (0, 0)}, "more elements than its segment holds"),
    ],
)
def test_a_quantized_tensor_that_does_not_fit_its_parameters_is_rejected(bad, match):
    head = quantized_head(**bad)
    segments = [b"", bytes(12), bytes(8 * 3), bytes(8 * 3)]
    if match is None:
        _, _, _, (t,) = _testing.decode_message(head, segments)
        assert t.is_quantized and t.shape == (3, 4) and t.qscheme() == torch.per_channel_affine
        return
    with pytest.raises(ValueError, match=match):
        _testing.decode_message(head, segments)


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions")
def test_unmapped_cuda_other_devices_and_layouts_are_refused_at_encode():
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.quint4x2)
    with pytest.raises(RuntimeError, match="cannot send quantized tensors of dtype QUInt4x2"):
        _testing.encode_message(PYTHON_CALL, b"", [q], 1)
    # Per-channel parameters torch took unchecked: refused here, where the
    # receiver would have closed the connection over them.
    q = torch._make_per_channel_quantized_tensor(torch.zeros(2, 3, dtype=torch.uint8),
                                                 torch.tensor([0.1], dtype=torch.float64),
                                                 torch.tensor([0]), 0)
    with pytest.raises(RuntimeError, match=r"parameters do not fit it \(axis 0 of 2 dims, 1 scales"):
        _testing.encode_message(PYTHON_CALL, b"", [q], 1)
    csr = torch.eye(3).to_sparse_csr()
    with pytest.raises(RuntimeError, match="cannot send tensors of layout SparseCsr"):
        _testing.encode_message(PYTHON_CALL, b"", [csr], 1)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(RuntimeError, match="cannot send nested tensors"):
        _testing.encode_message(PYTHON_CALL, b"", [nested], 1)
    meta = torch.empty(2, device="meta")
    with pytest.raises(RuntimeError, match="sends CPU and CUDA tensors, got a tensor on meta"):
        _testing.encode_message(PYTHON_CALL, b"", [meta], 1)
    # A CUDA tensor (a view of an address no one reads: encoding refuses it
    # before touching its bytes) needs a device map, which this call lacks.
    cuda = _testing.cuda.device_tensor(0x1000, [4], torch.ones(1), 0)
    with pytest.raises(RuntimeError, match="no device map names cuda:0"):
        _testing.encode_message(PYTHON_CALL, b"", [cuda], 1)
    # A sparse tensor's dims go in a byte, and the peer takes 64 at most:
    # 65 were refused by the peer (closing the connection), 256 wrapped.
    for dims in (65, 256):
        sparse = torch.sparse_coo_tensor(torch.zeros(dims, 1, dtype=torch.long),
                                         torch.ones(1), (1,) * dims)
        with pytest.raises(RuntimeError, match=f"sparse tensor of {dims} dims: at most 64"):
            _testing.encode_message(PYTHON_CALL, b"", [sparse], 1)


# --- rejections: what a hostile or broken peer could send -------------------


def dense_head(dtype=6, ndim=1, sizes=(4,), strides=(1,), offset=0, segment=1,
               ntensors=1, type_=PYTHON_CALL, layout=0, device=-1):
    h = struct.pack("<Iqi", type_, 7, ntensors)
    h += struct.pack("<BBBB", layout, dtype, 0, ndim)
    h += struct.pack(f"<{ndim}q", *sizes) + struct.pack(f"<{ndim}q", *strides)
    h += struct.pack("<qIb", offset, segment, device)
    return h


def test_handmade_head_decodes():
    _, _, _, (t,) = _testing.decode_message(dense_head(), [b"", bytes(16)])
    assert t.shape == (4,) and t.dtype == torch.float32


@pytest.mark.parametrize(
    "head, segments, match",
    [
        (dense_head()[:-3], [b"", bytes(16)], "truncated"),
        (dense_head() + b"x", [b"", bytes(16)], "trailing bytes"),
        (dense_head(), [b"", bytes(15)], "needs 16 bytes but its segment has 15"),
        (dense_head(offset=1), [b"", bytes(16)], "needs 20 bytes"),
        (dense_head(segment=2), [b"", bytes(16)], "refers to segment 2"),
        (dense_head(segment=0), [b"", bytes(16)], "refers to segment 0"),
        (dense_head(dtype=250), [b"", bytes(16)], "unknown dtype"),
        (dense_head(sizes=(-1,)), [b"", bytes(16)], "negative"),
        (dense_head(strides=(-1,)), [b"", bytes(16)], "negative"),
        (dense_head(sizes=(1 << 62,), strides=(1 << 62,)), [b"", bytes(16)], "overflow|huge"),
        (dense_head(ndim=65, sizes=(1,) * 65, strides=(1,) * 65), [b"", bytes(16)], "too many dims"),
        (dense_head(layout=9), [b"", bytes(16)], "unknown layout"),
        (dense_head(ntensors=1 << 30), [b"", bytes(16)], "tensor count"),
        (dense_head(type_=0x0C), [b"", bytes(16)], "bad message type"),
        # Request bit set, but beyond rpc::MessageType's range (0..0x3FF).
        (dense_head(type_=0x1164), [b"", bytes(16)], "bad message type"),
        (dense_head(), [], "without a payload segment"),
        # -2-d: host bytes that land on cuda:d ({"cpu": d} maps): only an
        # agent with that device can take them.
        (dense_head(device=-2), [b"", bytes(16)], "cuda:0 arrived at an agent without devices"),
        # CUDA bytes come from a device channel, never through the stream.
        (dense_head(device=0), [b"", bytes(16)], "came through the stream"),
    ],
)
def test_malformed_heads_are_rejected_with_a_reason(head, segments, match):
    with pytest.raises(ValueError, match=match):
        _testing.decode_message(head, segments)


def test_sparse_with_out_of_range_indices_is_rejected():
    i = torch.tensor([[0, 5]])  # index 5 in a size-2 dimension
    v = torch.tensor([1.0, 2.0])
    s = torch.sparse_coo_tensor(i, v, (6,))
    head, segments = _testing.encode_message(PYTHON_CALL, b"", [s], 1)
    # Shrink the announced sparse size from 6 to 2 in the head.
    needle = struct.pack("<Bq", 1, 6)
    assert needle in head
    bad = head.replace(needle, struct.pack("<Bq", 1, 2), 1)
    with pytest.raises(ValueError, match="index|size"):
        _testing.decode_message(bad, segments)


def test_sparse_announced_coalesced_with_unsorted_indices_is_rejected():
    # A peer may say "coalesced" of indices that are not (sorted, unique):
    # kernels that trust the bit would give wrong results far from here.
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (2,)).coalesce()
    head, segments = _testing.encode_message(PYTHON_CALL, b"", [s], 1)
    ordered = struct.pack("<2q", 0, 1)
    segments = [bytes(g) for g in segments]
    (k,) = [n for n, g in enumerate(segments) if g == ordered]
    (y,) = _testing.decode_message(head, segments)[3]
    assert y.is_coalesced() and torch.equal(y.to_dense(), s.to_dense())
    for swapped in (struct.pack("<2q", 1, 0), struct.pack("<2q", 1, 1)):
        bad = segments[:k] + [swapped] + segments[k + 1:]
        with pytest.raises(ValueError, match="coalesced"):
            _testing.decode_message(head, bad)


def test_sparse_indices_must_be_backed_by_their_segment():
    # Indices [[0, 1]] (shape 1x2, strides 2, 1) redescribed as 2**40 copies
    # of one index through a zero stride: 16 bytes would stand for 2**40
    # indices to validate (tests/fuzz found this as a hang).
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (2,))
    head, segments = _testing.encode_message(PYTHON_CALL, b"", [s], 1)
    needle = struct.pack("<BBB2q2q", 4, 0, 2, 1, 2, 2, 1)  # int64, 2 dims
    assert needle in head
    bad = head.replace(needle, struct.pack("<BBB2q2q", 4, 0, 2, 1, 1 << 40, 0, 0), 1)
    with pytest.raises(ValueError, match="more elements than their segment"):
        _testing.decode_message(bad, segments)
