"""What the conversation benchmarks share: a .pte registered for ``llm`` in
a throwaway user dir, and the user messages of one eight-turn conversation."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

MESSAGES = [
    "What is the capital of France?", "Tell me about its history in a few sentences.",
    "What are the most famous museums there?", "Which one should I visit first, and why?",
    "How do I get there from the main train station?", "What else is nearby?",
    "Recommend a restaurant close to it.", "Summarise our conversation in two sentences.",
]


def register_pte(pte: pathlib.Path, tokenizer: pathlib.Path, name: str, env: dict | None = None) -> str:
    """``llm pte register`` in a child process, in the user dir ``env`` (default:
    this process's) names with ``LLM_USER_PATH``; returns the model id."""
    done = subprocess.run(
        [sys.executable, "-m", "llm", "pte", "register", str(pte), "--tokenizer", str(tokenizer), "--name", name],
        env=env if env is not None else os.environ, capture_output=True, text=True,
    )
    if done.returncode:
        sys.exit(f"llm pte register failed: {done.stdout}{done.stderr}")
    return f"pte:{name}"
