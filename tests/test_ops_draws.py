"""Counter-based uniform draws (qat4.ops.draws): the reference's properties, and the Triton kernel
equal to it bit for bit (CUDA, or the interpreter in a subprocess)."""

import torch

from qat4.ops import draws
from kernel_harness import KERNEL_DEVICE, kernel_test, run_interpreted


def test_uniforms_are_a_function_of_seed_and_position():
    seeds = torch.tensor([7, 7, 8, (1 << 62) + 7])
    positions = torch.tensor([100, 101, 100, 100])
    u = draws.uniforms_reference(seeds, positions)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert len(set(u.tolist())) == 4  # the seed's high half and the position both count
    assert torch.equal(draws.uniforms_reference(seeds[:1], positions[:1]), u[:1])
    many = draws.uniforms_reference(torch.full((20_000,), 3), torch.arange(20_000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float((many < 0.1).double().mean()) - 0.1) < 0.01


def test_uniforms_take_the_reference_on_cpu(monkeypatch):
    monkeypatch.setenv("QAT4_OPS", "auto")
    seeds, positions = torch.tensor([3, 1 << 40]), torch.tensor([5, 6])
    assert torch.equal(draws.uniforms(seeds, positions), draws.uniforms_reference(seeds, positions))


# ----------------------------------------------------------------------------------------------
# Triton kernels


def test_triton_kernels_under_interpreter(request):
    """Runs this file's kernel tests in a subprocess with TRITON_INTERPRET=1 (shared by the kernel
    test files of the session)."""
    run_interpreted(__file__, request)


@kernel_test
def test_kernel_uniforms_equal_the_reference_bit_for_bit():
    """Seeds over all 63 bits (high halves whose hash products leave 2^63), positions past 2^32
    (only their low 32 bits count), row counts around the kernel's block, and none."""
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 5, 128, 300):
        seeds = torch.randint(0, 1 << 62, (n,), generator=g) * 2 + torch.randint(0, 2, (n,), generator=g)
        positions = torch.randint(0, 1 << 40, (n,), generator=g)
        if n:
            seeds[0], positions[0] = (1 << 63) - 1, (1 << 32) + 7
        expected = draws.uniforms_reference(seeds, positions)
        got = draws.uniforms_triton(seeds.to(KERNEL_DEVICE), positions.to(KERNEL_DEVICE))
        assert got.dtype == torch.float64 and got.shape == (n,)
        assert torch.equal(got.cpu(), expected), n
