"""Small programs that put a matmul inside each call-like primitive (jit,
remat, custom_vjp, custom_jvp, shard_map), for the jaxpr tests."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def eqns(fn, *args):
  """The top-level equations of ``fn``'s jaxpr."""
  return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def shard_map(fn):
  mesh = jax.make_mesh((1,), ('d',))
  return jax.shard_map(fn, mesh=mesh, in_specs=(P(), P()), out_specs=P())


def custom_vjp(fn):
  wrapped = jax.custom_vjp(fn)
  wrapped.defvjp(lambda w, x: (fn(w, x), (w, x)), lambda r, g: (
      jnp.zeros_like(r[0]), jnp.zeros_like(r[1])))
  return wrapped


def custom_jvp(fn):
  wrapped = jax.custom_jvp(fn)
  wrapped.defjvp(lambda p, t: (fn(*p), fn(*t)))
  return wrapped
