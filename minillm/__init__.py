"""minillm: LLM inference from scratch."""
from pathlib import Path

#: The model shipped in the repository (see minillm/checkpoints/shakespeare/README.md).
BUNDLED_MODEL = Path(__file__).resolve().parent / "checkpoints" / "shakespeare"
