# SPDX-License-Identifier: BSD-3-Clause
"""The RPC paper's remote functions, shared by every benchmark backend."""



def identity(x):
    return x


def heavy(x):
    """100 x (x *= 2; x /= 2): 200 in-place ops."""
    for _ in range(100):
        x *= 2
        x /= 2
    return x
