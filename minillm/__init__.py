"""minillm: LLM inference from scratch."""
