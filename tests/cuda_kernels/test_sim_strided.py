# SPDX-License-Identifier: BSD-3-Clause
"""pack_strided and unpack_strided in numba's simulator, against numpy views.

Each case takes a numpy view of a random base array (transposes, slices with
steps, 0 to 4 dimensions, element sizes 1 to 16 bytes) and describes it as
C++ will describe a torch tensor: offset, sizes and strides in elements.
Packing must give ``np.ascontiguousarray(view)``; unpacking must change the
base exactly as ``view[...] = values`` does. The simulator maps only the
view's own elements, so a stray access fails the test.
"""

import numpy as np
import pytest

DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.dtype("V16")}
VIEWS = {
    "contiguous_2d": ((11, 13), lambda a: a),
    "step_1d": ((97,), lambda a: a[3::7]),
    "transpose_2d": ((13, 17), lambda a: a.T),
    "slice_steps_2d": ((20, 15), lambda a: a[1:19:3, ::4]),
    "permute_3d": ((5, 6, 7), lambda a: a.transpose(2, 0, 1)),
    "slices_3d": ((6, 7, 8), lambda a: a[1:, ::2, 3:7]),
    "mixed_4d": ((4, 5, 6, 7), lambda a: a[:, 1::2].transpose(3, 1, 0, 2)[1:, :, ::2]),
    "scalar_0d": ((5,), lambda a: a[2, ...]),
    "empty": ((4, 5), lambda a: a[:, 2:2]),
}
BROADCAST = ((3, 9), lambda a: np.broadcast_to(a[1, 2:8], (4, 6)))  # stride 0


def base_array(shape, elem_size, seed):
    nbytes = int(np.prod(shape)) * elem_size
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return data.view(DTYPES[elem_size]).reshape(shape)


def describe(view, base):
    """(offset, sizes, strides) in elements, as torch's data_ptr/size/stride."""
    itemsize = base.itemsize
    delta = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    assert delta % itemsize == 0 and all(s % itemsize == 0 for s in view.strides)
    return delta // itemsize, list(view.shape), [s // itemsize for s in view.strides]


def check(sim, shape, make_view, elem_size, pack, launch=(2, 16)):
    base = base_array(shape, elem_size, seed=elem_size)
    view = make_view(base)
    offset, sizes, strides = describe(view, base)
    numel = int(np.prod(sizes))
    values = np.random.default_rng(7).integers(0, 256, numel * elem_size, np.uint8)
    contiguous = values.tobytes() if not pack else bytes(numel * elem_size)
    strided_after, contiguous_after = sim.run_strided(
        pack, base.tobytes(), contiguous, offset, sizes, strides, elem_size, launch
    )
    if pack:
        assert contiguous_after == np.ascontiguousarray(view).tobytes()
        assert strided_after == base.tobytes()
    else:
        expected = base.copy()
        make_view(expected)[...] = values.view(base.dtype).reshape(view.shape)
        assert strided_after == expected.tobytes()
        assert contiguous_after == contiguous


@pytest.mark.parametrize("elem_size", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(VIEWS))
@pytest.mark.parametrize("pack", [True, False], ids=["pack", "unpack"])
def test_strided_view_round_trips_like_numpy(sim, pack, name, elem_size):
    check(sim, *VIEWS[name], elem_size, pack)


@pytest.mark.parametrize("elem_size", [1, 8])
def test_pack_reads_broadcast_views_with_zero_strides(sim, elem_size):
    check(sim, *BROADCAST, elem_size, pack=True)


@pytest.mark.parametrize("launch", [(1, 1), (2, 7), (8, 32)], ids=str)
def test_strided_result_does_not_depend_on_launch_shape(sim, launch):
    check(sim, *VIEWS["mixed_4d"], 4, pack=True, launch=launch)
    check(sim, *VIEWS["mixed_4d"], 4, pack=False, launch=launch)
