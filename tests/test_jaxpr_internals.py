"""The adapter over jaxpr internals, pinned on the smallest programs.

``taco_optax._src.routing.jaxpr_internals`` is the one place the trace
reads primitive names and parameters. Each test builds the smallest program
that has the equation and checks what the adapter reads against what the
program means (operand counts, axes, shapes), so a jax that changes an
internal fails here, by name, on every jax the project supports (CI runs
this file on jax 0.10 and on the newest jax).
"""

import jax
from jax.extend import core as jex_core
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import pytest

from taco_optax._src.routing import jaxpr_internals as jx
from tests.support import jaxpr_cases

X = jnp.ones((2, 4))
W = jnp.ones((4, 3))


_eqns = jaxpr_cases.eqns
_shard_map = jaxpr_cases.shard_map
_custom_vjp = jaxpr_cases.custom_vjp
_custom_jvp = jaxpr_cases.custom_jvp


def _last(fn, *args):
  return _eqns(fn, *args)[-1]


CALL_CASES = {
    'jit': jax.jit, 'remat2': jax.checkpoint, 'custom_vjp_call': _custom_vjp,
    'custom_jvp_call': _custom_jvp, 'shard_map': _shard_map}


@pytest.mark.parametrize('name', list(CALL_CASES))
def test_called_jaxpr_takes_the_operands_one_to_one(name):
  (eqn,) = _eqns(CALL_CASES[name](lambda w, x: x @ w), W, X)
  assert jx.primitive(eqn) == name
  assert name in jx.CALLS
  sub = jx.open_jaxpr(jx.called_jaxpr(eqn))
  assert isinstance(sub, jex_core.Jaxpr)
  assert len(sub.invars) == len(eqn.invars)
  assert [v.aval.shape for v in sub.invars] == [(4, 3), (2, 4)]
  assert [jx.primitive(e) for e in sub.eqns] == ['dot_general']


def test_open_jaxpr_opens_closed_and_plain():
  closed = jax.make_jaxpr(lambda x: x + 1.0)(X)
  assert jx.open_jaxpr(closed) is closed.jaxpr
  assert jx.open_jaxpr(closed.jaxpr) is closed.jaxpr


def test_literals_and_dropped_results():
  (add,) = _eqns(lambda x: x + 2.0, X)
  assert [jx.is_literal(v) for v in add.invars] == [False, True]
  # make_jaxpr keeps unread results as variables (fori_loop's counter);
  # transformations write DropVar, which the walk must not bind.
  (scan,) = _eqns(lambda w, x: jax.lax.fori_loop(0, 3, lambda i, c: c @ w, x),
                  jnp.ones((4, 4)), X)
  assert not any(jx.is_dropped(v) for v in scan.outvars)
  assert jx.is_dropped(jex_core.DropVar(scan.outvars[0].aval))


@pytest.mark.parametrize('consts,carries,xs', [(0, 1, 1), (1, 1, 1),
                                               (2, 2, 1), (1, 2, 0)])
def test_scan_split_counts_constants_and_carries(consts, carries, xs):
  # Constants are closed over, carries a tuple, scanned inputs stacked:
  # every count a different number, so a swapped count fails.
  cs = [jnp.full((4, 4), float(i + 1)) for i in range(consts)]
  init = tuple(jnp.ones((4,)) for _ in range(carries))
  stacked = tuple(jnp.ones((5, 4)) for _ in range(xs))

  def program(cs, init, stacked):
    def body(carry, x):
      new = tuple(c @ w for c in carry for w in cs[:1]) or carry
      if x:
        new = (new[0] + x[0],) + new[1:]
      return new, new[0].sum()
    return jax.lax.scan(body, init, stacked, length=5)

  (scan,) = _eqns(program, cs, init, stacked)
  assert jx.primitive(scan) == 'scan'
  used_consts = min(consts, 1)  # only the first constant is read
  assert jx.scan_split(scan) == (used_consts, carries)
  body = jx.scan_body(scan)
  shapes = [v.aval.shape for v in scan.invars]
  assert shapes == ([(4, 4)] * used_consts + [(4,)] * carries
                    + [(5, 4)] * xs)
  # The body sees the scanned inputs one slice at a time.
  assert [v.aval.shape for v in body.invars] == (
      [(4, 4)] * used_consts + [(4,)] * carries + [(4,)] * xs)
  assert len(scan.outvars) == carries + 1  # carries, then the stacked sums


def test_while_split_and_jaxprs():
  w = jnp.ones((4, 4))
  loop = _last(lambda w, x: jax.lax.while_loop(
      lambda c: c[1].sum() < jnp.sum(w), lambda c: (c[0] + 1.0, c[1] @ w),
      (x, x)), w, X @ jnp.ones((4, 4)))
  assert jx.primitive(loop) == 'while'
  cond_consts, body_consts = jx.while_split(loop)
  assert (cond_consts, body_consts) == (1, 1)
  cond, body = jx.while_jaxprs(loop)
  # Operands: the cond's constants, the body's, then the two carries.
  assert len(loop.invars) == cond_consts + body_consts + 2
  assert len(cond.invars) == cond_consts + 2
  assert len(body.invars) == body_consts + 2
  assert body.invars[0].aval.shape == (4, 4)


def test_cond_branches_take_the_operands_after_the_index():
  branch = _last(lambda w, x: jax.lax.cond(
      x.sum() > 0, lambda w, x: x @ w, lambda w, x: -(x @ w), w, x), W, X)
  assert jx.primitive(branch) == 'cond'
  branches = jx.cond_branches(branch)
  assert len(branches) == 2
  assert len(branch.invars) == 3  # the index, then the operands
  for sub in branches:
    assert [v.aval.shape for v in jx.open_jaxpr(sub).invars] == [(4, 3),
                                                                 (2, 4)]


def test_dot_dimension_numbers():
  (dot,) = _eqns(lambda w, x: x @ w, W, X)
  assert jx.primitive(dot) == 'dot_general'
  assert jx.dot_dimension_numbers(dot) == (((1,), (0,)), ((), ()))
  (batched,) = _eqns(lambda a, b: jnp.einsum('bij,bjk->bik', a, b),
                     jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)))
  assert jx.dot_dimension_numbers(batched) == (((2,), (1,)), ((0,), (0,)))


def test_ragged_dot_axes():
  experts = jnp.ones((3, 4, 5))  # (groups, in, out)
  (ragged,) = _eqns(lambda x, w, s: jax.lax.ragged_dot(x, w, s),
                    jnp.ones((6, 4)), experts, jnp.array([2, 2, 2], jnp.int32))
  assert jx.primitive(ragged) == 'ragged_dot_general'
  assert jx.ragged_dot_axes(ragged) == ((1,), (), (0,))


def test_gather_and_dynamic_slice_sizes():
  gather = _last(lambda t, ids: t[ids], W, jnp.ones((2,), jnp.int32))
  assert jx.primitive(gather) == 'gather'
  assert jx.slice_sizes(gather) == (1, 3)
  assert jx.gather_batching_dims(gather) == ()
  sliced = _last(lambda t, i: jax.lax.dynamic_slice_in_dim(t, i, 1), W,
                 jnp.int32(1))
  assert jx.primitive(sliced) == 'dynamic_slice'
  assert jx.slice_sizes(sliced) == (1, 3)


def test_structural_parameters():
  (transpose,) = _eqns(lambda w: w.T, W)
  assert (jx.primitive(transpose), jx.permutation(transpose)) == (
      'transpose', (1, 0))
  (broadcast,) = _eqns(lambda w: jnp.broadcast_to(w, (2, 4, 3)), W)
  assert jx.primitive(broadcast) == 'broadcast_in_dim'
  assert jx.broadcast_dimensions(broadcast) == (1, 2)
  squeeze = _last(lambda w: w[1], jnp.ones((2, 4, 3)))
  assert jx.primitive(squeeze) == 'squeeze'
  assert jx.squeezed_dimensions(squeeze) == (0,)


@pytest.mark.parametrize('tiled', [False, True])
def test_all_gather_axis(tiled):
  mesh = jax.make_mesh((1,), ('d',))
  gathered = jax.shard_map(
      lambda w: jax.lax.all_gather(w, 'd', axis=1, tiled=tiled), mesh=mesh,
      in_specs=P(), out_specs=P(), check_vma=False)
  (call,) = _eqns(gathered, W)
  (gather,) = jx.open_jaxpr(jx.called_jaxpr(call)).eqns
  assert jx.primitive(gather) == 'all_gather'
  assert jx.all_gather_axis(gather) == (tiled, 1)


def test_is_remat_for_checkpoint_and_not_for_other_calls():
  (remat,) = _eqns(jax.checkpoint(lambda w, x: x @ w), W, X)
  (jitted,) = _eqns(jax.jit(lambda w, x: x @ w), W, X)
  assert jx.is_remat(remat) and not jx.is_remat(jitted)


@pytest.mark.parametrize('reverse', [False, True])
def test_scan_options_reads_length_and_direction(reverse):
  (scan,) = _eqns(lambda c, xs: jax.lax.scan(
      lambda c, x: (c + x, None), c, xs, reverse=reverse)[0],
                  jnp.zeros(3), jnp.ones((5, 3)))
  assert jx.scan_options(scan) == (5, reverse)


def test_function_of_runs_a_slice_of_equations():
  closed = jax.make_jaxpr(lambda x, y: jnp.sin(x) * y + 1.0)(X, X)
  jaxpr = closed.jaxpr
  sin, mul = jaxpr.eqns[:2]
  # The first two equations, as a function of both inputs, returning sin's
  # and mul's results; differentiable and jittable as a jax function.
  run = jx.function_of([sin, mul], jaxpr.invars, [sin.outvars[0],
                                                 mul.outvars[0]])
  a, b = run(X, 2 * X)
  assert (a == jnp.sin(X)).all() and (b == jnp.sin(X) * 2 * X).all()
  grad = jax.grad(lambda x: run(x, X)[1].sum())(X)
  assert jnp.allclose(grad, jnp.cos(X))
  body = jx.closed_function(jx.called_jaxpr(
      _eqns(jax.checkpoint(lambda w, x: x @ w), W, X)[0]))
  assert (body(W, X)[0] == X @ W).all()


def test_inline_calls_opens_jit_and_keeps_remat_and_custom_calls():
  def loss(w, x):
    h = jax.jit(lambda w, x: jnp.take(w, x.astype(jnp.int32), axis=0))(w, x)
    h = jax.checkpoint(lambda h: jnp.tanh(h) * 2.0)(h)
    return _custom_jvp(lambda h: jnp.sum(h * h))(h)
  closed = jax.make_jaxpr(loss)(W, jnp.zeros((2,), jnp.float32))
  assert [jx.primitive(e) for e in closed.jaxpr.eqns][0] == 'jit'
  inlined = jx.inline_calls(closed)
  names = [jx.primitive(e) for e in inlined.jaxpr.eqns]
  assert 'jit' not in names and 'pjit' not in names
  assert 'gather' in names
  assert names.count('remat2') + names.count('checkpoint') == 1
  assert names[-1] == 'custom_jvp_call'
  x = jnp.array([2.0, 0.0])
  assert jex_core.jaxpr_as_fun(inlined)(W * 3.0, x)[0] == loss(W * 3.0, x)


def test_bind_like_rebinds_with_changed_parameters():
  gather = next(e for e in _eqns(lambda t, i: t[i], W, jnp.array([1, 2]))
                if jx.primitive(e) == 'gather')
  offset, collapsed, starts = jx.gather_numbers(gather)
  assert (offset, collapsed, starts) == ((1,), (0,), (0,))
  table = jnp.arange(12.0).reshape(4, 3)
  rows = jx.bind_like(gather, [table[:, :2], jnp.array([[1], [3]])],
                      slice_sizes=(1, 2))[0]
  assert rows.tolist() == [[3.0, 4.0], [9.0, 10.0]]
