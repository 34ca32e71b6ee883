"""A plain `pip install .` must carry the demo model, the built-in templates and the CUDA kernels' source."""

import subprocess
import sys
import zipfile

from conftest import REPO

REPO = REPO


def test_wheel_contains_demo_model_and_templates(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True,
    )
    (wheel,) = tmp_path.glob("mlxllama-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "mlxllama/data/chat-tiny-Q4_K_M.gguf" in names
    for template in ("zephyr", "llama2", "llama3", "chatml", "mistral", "gemma", "phi3"):
        assert f"mlxllama/templates/{template}.jinja" in names
    assert "mlxllama/cli.py" in names
    assert {"mlxllama/cuda/decode_step.cu", "mlxllama/cuda/decode_batch.cu"} <= names  # read by mlxllama.cuda
    assert {"mlxllama/models/llama.py", "mlxllama/models/qwen2.py", "mlxllama/models/phi3.py"} <= names
    assert {"mlxllama/server/app.py", "mlxllama/server/engine.py", "mlxllama/line_editor.py"} <= names
