"""The device side of an MXFP4 block: every (code, exponent) pair's float32 bits, and
the exponents refused on the host before the program runs."""

import types

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import meshinit
from meshinit._checkpoint.encodings.mxfp4 import program as mxfp4_program


def test_every_code_under_every_applied_exponent_has_the_bits_of_ldexp():
    codes = np.repeat(np.arange(16, dtype=np.uint8), 253)
    exps = np.tile(np.arange(2, 255, dtype=np.uint8), 16)
    got = np.asarray(mxfp4_program.bits(jnp.asarray(codes), jnp.asarray(exps)))
    with np.errstate(over="ignore"):
        want = np.ldexp(np.array(mxfp4_program.VALUES)[codes], exps.astype(np.int32) - 127)
        want = want.astype(np.float32)
    finite = np.isfinite(want)  # above 2^128 checked() refuses first
    assert finite.sum() > 3900
    assert (got.view(np.uint32)[finite] == want.view(np.uint32)[finite]).all()


def reached():
    scales = types.SimpleNamespace(name="w_scales")
    return [(types.SimpleNamespace(quant=types.SimpleNamespace(scales=scales)), None)]


@pytest.mark.parametrize(
    "byte,value,dtype,said",
    [
        (255, 0x00, np.float32, "exponent byte 255, NaN in e8m0"),
        (0, 0x10, np.float32, "exponent byte 0 under a non-zero value"),
        (141, 0x07, np.float16, "exponent byte 141 under values that overflow float16"),
    ],
)
def test_exponents_the_device_cannot_apply_are_refused(byte, value, dtype, said):
    raw = np.zeros((1, 1, 2, 3, 16), np.uint8)
    exps = np.full((1, 1, 2, 3), 120, np.uint8)
    raw[0, 0, 1, 2, 5], exps[0, 0, 1, 2] = value, byte
    dtypes = (np.dtype(dtype), np.dtype(ml_dtypes.bfloat16))
    with pytest.raises(meshinit.PlanError, match=said):
        mxfp4_program.checked(raw, exps, dtypes, "w", reached())


def test_zeros_under_exponents_zero_and_one_and_large_exponents_that_fit_pass():
    raw = np.zeros((1, 1, 2, 3, 16), np.uint8)
    exps = np.full((1, 1, 2, 3), 120, np.uint8)
    exps[0, 0, 0, 0], exps[0, 0, 0, 1] = 0, 1  # +-0 only there
    raw[0, 0, 0, 0, :] = 0x88
    exps[0, 0, 1, 1], raw[0, 0, 1, 1, :] = 141, 0x11  # 0.5 x 2^14 fits float16
    mxfp4_program.checked(raw, exps, (np.dtype(np.float16),) * 2, "w", reached())


def test_only_the_values_of_a_blocks_span_are_kept_for_the_check():
    """Groups of 4 values (2 bytes); the span K 5 to 9 of groups 0 to 3: groups 1 and 2,
    K 4 (a low nibble) and K 10, 11 (a byte) zeroed."""
    raw = np.full((1, 1, 1, 4, 2), 0x77, np.uint8)
    exps = np.arange(4, dtype=np.uint8).reshape(1, 1, 1, 4)
    got, kept = mxfp4_program.spanned(raw, exps, 5, 5, 4)
    assert kept.tolist() == [[[[1, 2]]]]
    assert got[0, 0, 0].tolist() == [[0x70, 0x77], [0x77, 0x00]]
