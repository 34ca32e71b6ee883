"""A plain `pip install .` must carry the demo model, the built-in templates and the CUDA kernels' source."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).parents[1]


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
    assert "mlxllama/decode_step.cu" in names  # read by cuda_step.py at import
