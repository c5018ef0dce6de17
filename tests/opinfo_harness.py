"""Run one torch OpInfo sample on a ShardedParam and on the plain tensor, and classify the outcome.

The sample's input (or the first tensor of a list input) becomes the only parameter of a bare module sharded
by ``shard_module`` (so gradients go through the real gradient hooks); every other argument stays plain.  Each
(op, variant) case runs the same way on every rank of a world; samples and random streams are seeded from the
case, so all ranks see the same tensors.  Outcomes:

  match     the sharded run gives the plain run's values (or both raise)
  refused   ShardedOpError (allowed only for the in-place variant)
  mismatch  different values, shapes or dtypes: a silent wrong answer
  crash     any other exception where the plain run works (or a rank died)
  skip      no sample with a shardable (dim >= 1, floating) input, or no such variant

Variants: ``forward`` (grad mode on, parameter requires grad), ``no_grad``, ``backward`` (gradient of a random
projection of the outputs with respect to the parameter), ``inplace`` (the op's in-place form under no_grad)
and ``nan`` (forward under no_grad with a NaN in the last rank's rows).
"""

from __future__ import annotations

import functools
import zlib

import torch
import torch.utils._pytree as pytree
from torch import nn

VARIANTS = ("forward", "no_grad", "backward", "inplace", "nan")
# Ops whose output is uninitialised memory: only shape and dtype are compared.
UNINITIALISED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
                 "nn.functional.dropout", "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout"}


@functools.lru_cache(maxsize=1)
def ops_by_key() -> dict:
    from torch.testing._internal.common_methods_invocations import op_db

    return {op_key(op): op for op in op_db}


def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def _target_of(x):
    """The tensor of a sample input that becomes the ShardedParam (None when none can be sharded)."""
    if isinstance(x, (list, tuple)):
        x = x[0] if x else None
    if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.dtype in (torch.float32, torch.float64) \
            and x.layout == torch.strided:
        return x
    return None


def _dtype(op):
    dtypes = op.supported_dtypes("cpu")
    return torch.float64 if torch.float64 in dtypes else torch.float32 if torch.float32 in dtypes else None


@functools.lru_cache(maxsize=None)
def sample_of(key: str):
    """A deterministic sample with a shardable input; one with an odd dim 0 (>= 3) is preferred (padding).
    Cached per op: the variants reuse it (only the in-place variant writes, and into a copy of the input)."""
    op = ops_by_key()[key]
    dtype = _dtype(op)
    if dtype is None:
        return None
    torch.manual_seed(_seed(op_key(op)))
    first = None
    for i, s in enumerate(op.sample_inputs("cpu", dtype, requires_grad=op.supports_autograd)):
        t = _target_of(s.input)
        if t is not None:
            if t.shape[0] >= 3 and t.shape[0] % 2:
                first = s
                break
            first = first or s
        if i >= 40:
            break
    if first is None:
        return None
    detach = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return first.transform(detach)


def _with_target(inp, new):
    if isinstance(inp, (list, tuple)):
        return type(inp)([new, *inp[1:]])
    return new


def _shard(t: torch.Tensor, requires_grad: bool):
    from shardtensor import shard_module

    m = nn.Module()
    m.w = nn.Parameter(t.detach().clone(), requires_grad=requires_grad)
    shard_module(m, gather="sequential")
    return m


def _value(x):
    from shardtensor import ShardedParam
    from shardtensor.gather import gather_full

    if isinstance(x, ShardedParam):
        with torch.no_grad():
            return gather_full(x).detach().clone()
    if isinstance(x, torch.Tensor):
        return x.detach()
    return x


def _compare(got, want, exact_values: bool) -> str | None:
    """None when equal; else what differs."""
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs, plain gives {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g = _value(g)
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"output {i}: {type(g).__name__}, plain gives a tensor"
            if g.shape != w.shape or g.dtype != w.dtype:
                return f"output {i}: {tuple(g.shape)} {g.dtype}, plain gives {tuple(w.shape)} {w.dtype}"
            if not exact_values:
                continue
            if w.layout != torch.strided:
                w, g = w.to_dense(), g.to_dense()
            tol = dict(rtol=1e-5, atol=1e-7) if w.dtype in (torch.float64, torch.complex128) else dict(rtol=1e-4, atol=1e-5)
            try:
                torch.testing.assert_close(g, w, equal_nan=True, check_stride=False, **tol)
            except AssertionError as exc:
                return f"output {i}: {str(exc).splitlines()[0:4]}"
        elif isinstance(w, float) and w != w:
            if not (isinstance(g, float) and g != g):
                return f"output {i}: {g!r}, plain gives nan"
        elif g != w:
            return f"output {i}: {g!r}, plain gives {w!r}"
    return None


def _run(fn):
    torch.manual_seed(0)
    try:
        return True, fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what we compare
        return False, exc


def _projection_loss(out):
    """A scalar whose gradient is a fixed random projection of every differentiable output."""
    gen = torch.Generator().manual_seed(7)
    loss = None
    for o in pytree.tree_leaves(out):
        if isinstance(o, torch.Tensor) and o.requires_grad and (o.is_floating_point() or o.is_complex()):
            g = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
            term = (o * g).sum()
            term = term.real if term.is_complex() else term
            loss = term if loss is None else loss + term
    return loss


def _place_nan(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    if t.numel():
        t[-1].view(-1)[0] = float("nan")  # the last row is on the last rank (odd dim 0 at world 2: a padded shard)
    return t


def _call(op, variant: str, inp, sample):
    fn = op.inplace_variant if variant == "inplace" else op.op
    return fn(inp, *sample.args, **sample.kwargs)


def run_case(key: str, variant: str, world: int) -> tuple[str, str]:
    """(outcome, detail) of one case on this rank."""
    from shardtensor import ShardedOpError

    op = ops_by_key()[key]
    sample = sample_of(key)
    if sample is None:
        return "skip", "no shardable sample"
    if variant == "inplace" and op.inplace_variant is None:
        return "skip", "no in-place variant"
    if variant == "backward" and not op.supports_autograd:
        return "skip", "no autograd"
    target = _target_of(sample.input)
    if variant == "nan":
        target = _place_nan(target)
    grad_on = variant in ("forward", "backward")

    def plain():
        p = target.detach().clone().requires_grad_(grad_on)
        with torch.set_grad_enabled(grad_on):
            out = _call(op, variant, _with_target(sample.input, p), sample)
            if variant == "inplace":
                out = p
            if variant == "backward":
                loss = _projection_loss(out)
                if loss is None:
                    return "no differentiable output"
                loss.backward()
                return p.grad
            return out

    def sharded():
        m = _shard(target, grad_on)
        with torch.set_grad_enabled(grad_on):
            out = _call(op, variant, _with_target(sample.input, m.w), sample)
            if variant == "inplace":
                out = m.w
            if variant == "backward":
                loss = _projection_loss(out)
                if loss is None:
                    return "no differentiable output"
                loss.backward()
                return m.w.grad
            return out

    ok_ref, ref = _run(plain)
    ok_ref2, ref2 = _run(plain)
    ok, got = _run(sharded)
    if not ok_ref:
        return ("match", "both raise") if not ok else ("mismatch", f"plain raises {type(ref).__name__}: {ref}"[:300])
    if not ok:
        kind = "refused" if isinstance(got, ShardedOpError) else "crash"
        return kind, f"{type(got).__name__}: {got}"[:400]
    exact = op.name not in UNINITIALISED and ok_ref2 and _compare(ref2, ref, True) is None
    diff = _compare(got, ref, exact)
    return ("mismatch", diff[:400]) if diff else ("match", "" if exact else "shapes only (nondeterministic op)")


def run_batch(cases: list[tuple[str, str]], world: int) -> list[tuple[str, str]]:
    """Every case in one process (one rank of a world); collectives time out fast instead of hanging."""
    from shardtensor import _comm

    previous = _comm.set_collective_timeout(20)
    torch.set_num_threads(1)
    try:
        return [run_case(key, variant, world) for key, variant in cases]
    finally:
        _comm.set_collective_timeout(previous)
