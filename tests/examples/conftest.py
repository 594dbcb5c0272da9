"""The example's tests keep their caches out of the user's.

``python -m examples.finetune`` keeps what it compiles in
``$TACO_OPTAX_CACHE_DIR/jax`` (``examples/finetune/compile_cache.py``), and
``taco_optax`` builds its C++ kernel in ``$TACO_OPTAX_CACHE_DIR``: from the
first of the example's tests to the end of the session both go to one
folder of the session, for the runs in this process and in the processes
the tests start (module fixtures that launch runs included, hence a session
fixture). Runs with the same settings share it, as a user's runs share
theirs.
"""

import pytest


@pytest.fixture(scope='session', autouse=True)
def session_cache_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp('taco_optax_cache')
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('TACO_OPTAX_CACHE_DIR', str(folder))
    yield folder
