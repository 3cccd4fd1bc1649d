"""Host-to-device copies through the page-locked arena arrive exactly, in order, across many
wrap-arounds of its two halves; copies too large for it take the pageable way. (CUDA only: page-locked
memory needs a GPU; on CPU the stager is off and hands the tensor through.)"""

import pytest

torch = pytest.importorskip("torch")

from swiftlm.backends.torch.staging import Stager  # noqa: E402


def test_cpu_stager_is_a_pass_through():
    s = Stager(torch.device("cpu"))
    t = torch.arange(10)
    assert not s.enabled and torch.equal(s.to_device(t), t)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a CUDA device")
def test_arena_copies_exact_across_wraps():
    dev = torch.device("cuda")
    s = Stager(dev, nbytes=1 << 16)  # 32 KiB halves: wraps every few dozen copies
    g = torch.Generator().manual_seed(0)
    outs, refs = [], []
    for i in range(400):
        n = int(torch.randint(1, 700, (1,), generator=g))
        t = torch.randn(n, generator=g) if i % 3 else torch.randint(-(2**40), 2**40, (n,), generator=g)
        refs.append(t.clone())
        outs.append(s.to_device(t))
        t.zero_()  # the caller may reuse its host tensor at once
    torch.cuda.synchronize()
    assert all(torch.equal(o.cpu(), r) for o, r in zip(outs, refs))
    big = torch.randn(1 << 14)  # 64 KiB: more than a quarter of the arena
    assert torch.equal(s.to_device(big).cpu(), big)
