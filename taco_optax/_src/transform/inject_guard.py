"""Refuse routing arguments that ``optax.inject_hyperparams`` made schedules.

``optax.inject_hyperparams(taco, static_args=('k',))`` treats every callable
argument not in ``static_args`` as a learning-rate-like schedule: a callable
``weight_dimension_numbers`` (or ``update_scale``, or a dtype) is called with
the step count and :func:`taco` receives whatever that returns, so the
routing silently falls back to a wrong one. :func:`taco` cannot see the
callable it was meant to get, only that it is being rebuilt by
``inject_hyperparams`` with these arguments among its schedules: the frame
that calls it is optax's, and holds them (``sched_hps``).

This reads optax's frame, an optax internal, so it is pinned and cannot go
quiet: ``pyproject.toml`` allows the optax releases the tests pass on, and
when an optax function calls :func:`taco` without that local (an optax that
renamed it, or another caller) the guard raises instead of letting a
callable be scheduled unseen. ``tests/test_inject_routing.py`` checks both
against the installed optax.
"""

import sys

# taco()'s arguments that say what a leaf is, never a value over steps.
ROUTING_ARGS = ('weight_dimension_numbers', 'update_scale', 'values_dtype',
                'index_dtype')


# The local of optax.inject_hyperparams's init and update that holds the
# arguments it turned into schedules (optax 0.2.6 to 0.2.8).
SCHEDULES_LOCAL = 'sched_hps'


def refuse_scheduled_routing(factory: str, depth: int = 2) -> None:
  """Raises if ``optax.inject_hyperparams`` scheduled a routing argument.

  Args:
    factory: the name of the factory being rebuilt, for the message.
    depth: frames above this function's caller where optax would be.

  Raises:
    ValueError: naming the arguments to add to ``static_args``.
    RuntimeError: when an optax function calls the factory and its
      schedules cannot be read (an optax this guard does not know).
  """
  try:
    frame = sys._getframe(depth)  # pylint: disable=protected-access
  except ValueError:  # pragma: no cover - no such frame
    return
  module = frame.f_globals.get('__name__', '')
  if not module.startswith('optax'):
    return
  schedules = frame.f_locals.get(SCHEDULES_LOCAL)
  if not isinstance(schedules, dict):
    raise RuntimeError(
        f'{factory}() is called by {module}.{frame.f_code.co_name}, which has '
        f'no `{SCHEDULES_LOCAL}` of scheduled arguments: taco_optax cannot '
        'check that optax.inject_hyperparams left its routing arguments '
        '(weight_dimension_numbers, update_scale, values_dtype, index_dtype) '
        'unscheduled with this optax. taco_optax supports the optax releases '
        'pyproject.toml names; install one of them.')
  scheduled = [name for name in ROUTING_ARGS if name in schedules]
  if scheduled:
    static = ', '.join(repr(name) for name in ('k', *scheduled))
    raise ValueError(
        f'optax.inject_hyperparams treats {", ".join(scheduled)} as a '
        f'schedule (a callable not in static_args): {factory}() would get '
        'what it returns for the step count, not the callable, and route '
        'leaves by that. Add '
        f'them to static_args: optax.inject_hyperparams({factory}, '
        f'static_args=({static})). Trees (e.g. '
        'taco_optax.nnx.dimension_numbers(model)) need no static_args, but '
        'for trees of Equinox modules, which are callable too.')
