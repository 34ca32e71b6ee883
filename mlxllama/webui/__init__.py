"""The chat page `mlxllama serve` shows at `/`: plain HTML, CSS and JavaScript, no build step."""
