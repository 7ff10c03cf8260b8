"""Golden tests of the KL estimators (d = logp - ref_logp) and of k3's gradient."""

from __future__ import annotations

import math

import torch

from rlpipe.algorithms.kl import KL_ESTIMATORS

F64 = torch.float64


def kl(name, logp, ref):
    return KL_ESTIMATORS.get(name)(torch.tensor(logp, dtype=F64), torch.tensor(ref, dtype=F64))


def test_k1():
    # d = logp - ref: -0.5 - (-1.0) = 0.5; -2.0 - (-1.5) = -0.5 (k1 can be negative); equal -> 0
    out = kl("k1", [[-0.5, -2.0, -1.0]], [[-1.0, -1.5, -1.0]])
    assert torch.allclose(out, torch.tensor([[0.5, -0.5, 0.0]], dtype=F64))
    # (B, T) = (2, 1): d = 0.25 and -3
    assert torch.allclose(kl("k1", [[0.0], [-4.0]], [[-0.25], [-1.0]]), torch.tensor([[0.25], [-3.0]], dtype=F64))


def test_k2():
    # d^2 / 2: 0.5 -> 0.125; -0.5 -> 0.125; 0 -> 0
    out = kl("k2", [[-0.5, -2.0, -1.0]], [[-1.0, -1.5, -1.0]])
    assert torch.allclose(out, torch.tensor([[0.125, 0.125, 0.0]], dtype=F64))
    # d = 2 -> 2; d = -0.1 -> 0.005
    assert torch.allclose(kl("k2", [[0.0, -1.1]], [[-2.0, -1.0]]), torch.tensor([[2.0, 0.005]], dtype=F64))


def test_k3():
    # exp(-d) - 1 + d: d = 0.5 -> e^-0.5 - 0.5 = 0.10653066; d = -0.5 -> e^0.5 - 1.5 = 0.14872127; d = 0 -> 0
    out = kl("k3", [[-0.5, -2.0, -1.0]], [[-1.0, -1.5, -1.0]])
    assert torch.allclose(out, torch.tensor([[math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]], dtype=F64))
    # d = ln 2 -> 1/2 - 1 + ln 2 = 0.19314718; d = -ln 2 -> 2 - 1 - ln 2 = 0.30685282
    out = kl("k3", [[math.log(2), -math.log(2)]], [[0.0, 0.0]])
    assert torch.allclose(out, torch.tensor([[0.5 - 1 + math.log(2), 1 - math.log(2)]], dtype=F64))
    assert torch.all(kl("k3", torch.randn(50).tolist(), torch.randn(50).tolist()) >= 0)


def test_k3_gradient_is_one_minus_the_reference_ratio():
    # d k3 / d logp = 1 - exp(-d) = 1 - pi_ref / pi (docs/algorithms.md Notation)
    logp = torch.tensor([[-0.3, -1.2]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-0.9, -0.4]], dtype=F64)
    KL_ESTIMATORS.get("k3")(logp, ref).sum().backward()
    assert torch.allclose(logp.grad, 1 - torch.exp(ref - logp.detach()))
