"""What a run's step outputs cost a process: TensorBoard's writer loads without torch, and its events read back."""

import json
import subprocess
import sys

from tests.tensorboard_events import scalar_steps

WRITE = """
import json, sys
from streamrl_jax.records.metrics_log import add_row, tensorboard_writer
writer = tensorboard_writer(sys.argv[1], [dict(step=1, reward_mean=0.25)])
add_row(writer, dict(step=2, reward_mean=0.5, arm="lead"))
writer.close()
loaded = "torch" in sys.modules
import torch  # refused only while tensorboardX loaded
print(json.dumps(dict(torch_loaded_by_the_writer=loaded, torch=torch.__name__)))
"""


def test_the_tensorboard_writer_loads_without_torch_and_torch_still_imports_after(tmp_path):
  # a fresh interpreter: pytest's has torch loaded already (then tensorboardX takes it as it is)
  done = subprocess.run([sys.executable, "-c", WRITE, str(tmp_path)], capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout.splitlines()[-1]) == dict(torch_loaded_by_the_writer=False, torch="torch")
  assert scalar_steps(tmp_path / "tensorboard") == {"step": [1, 2], "reward_mean": [1, 2]}  # strings left out
