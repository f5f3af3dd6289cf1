"""kvnumba imported straight from a source checkout (the repository root first on the
path, no install mapping anything: as after a regular `pip install .`, whose installed
package the checkout's kvnumba/ shadows) still has `kvnumba.statemachines` and
`kvnumba.bench`, the top-level folders an install maps into it; the checkout root
itself is no part of kvnumba."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import importlib, importlib.util, sys
# forget what an editable install maps: only the checkout on the path remains
sys.meta_path[:] = [f for f in sys.meta_path
                    if not getattr(f, "__module__", "").startswith("__editable__")]
import kvnumba as kv
root = sys.argv[1]
assert kv.__file__ == f"{root}/kvnumba/__init__.py", kv.__file__
import kvnumba.statemachines
assert kvnumba.statemachines.__file__ == f"{root}/statemachines/__init__.py"
assert importlib.util.find_spec("kvnumba.bench.sass").origin == f"{root}/bench/sass/__init__.py"
for name in ("kvnumba.kvnumba", "kvnumba.tests"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError(f"{name} imports")
cache = kv.BatchedSequenceCache(kv.CacheConfig())
print("ok", type(cache).__name__)
"""


def test_kvnumba_from_a_checkout_without_an_install_mapping():
    env = {**os.environ, "KVNUMBA_DEVICE": "simulator"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok BatchedSequenceCache")
