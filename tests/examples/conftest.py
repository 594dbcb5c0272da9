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


@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
  """A tiny Llama directory and a text task's files (``tiny_llama``)."""
  # Imported here: it skips the test without safetensors and tokenizers.
  from tests.support import tiny_llama  # pylint: disable=g-import-not-at-top
  return tiny_llama.write_workspace(tmp_path_factory.mktemp('finetune'))
