"""The launchers' host-side integer helpers give what Triton's own constexpr functions give."""
import triton

from smf_kernels.triton_kernels.launch import cdiv, next_pow2


def test_cdiv_and_next_pow2_match_triton():
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 200) for b in range(1, 40))
    assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert next_pow2(2**31 + 1) == 2**32
