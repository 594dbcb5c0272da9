"""The example's tests keep their caches out of the user's.

``python -m examples.finetune`` keeps what it compiles in
``$TACO_OPTAX_CACHE_DIR/jax`` (``examples/finetune/compile_cache.py``), and
``taco_optax`` builds its C++ kernel in ``$TACO_OPTAX_CACHE_DIR``: here both
go to one folder of the test session, for the runs in this process and in
the processes the tests start. Runs with the same settings share it, as a
user's runs share theirs.
"""

import pytest


@pytest.fixture(scope='session')
def session_cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('taco_optax_cache')


@pytest.fixture(autouse=True)
def _cache_of_the_session(session_cache_dir, monkeypatch):
  monkeypatch.setenv('TACO_OPTAX_CACHE_DIR', str(session_cache_dir))
