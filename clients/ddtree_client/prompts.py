"""The load test's built-in prompt set, and reading a prompts file.

A mix of the workloads speculative decoding is usually measured on (code, math, chat, summary,
translation, lists): acceptance length depends on how predictable the continuation is, so one
kind alone would flatter or punish the drafter.
"""
from __future__ import annotations

import json

BUILTIN_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Explain the difference between a process and a thread in two short paragraphs.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step.",
    "Translate into French: The weather is lovely today, let us take a walk by the river.",
    "List ten common kitchen herbs and one dish each is used in.",
    "Summarize the plot of Romeo and Juliet in five sentences.",
    "Write a SQL query that returns the five customers with the highest total order value.",
    "What is the derivative of x^3 * sin(x)? Show the steps.",
    "Write a haiku about the first snow of winter.",
    "Give a short, friendly reply to a customer whose package arrived two days late.",
    "Implement binary search in C and explain its time complexity.",
    "Describe how a hash map handles collisions, with an example.",
    "A train travels 120 km in 1.5 hours. What is its average speed in m/s? Explain.",
    "Write a bash one-liner that counts the lines of every .py file under the current directory.",
    "What are the main causes of the French Revolution? Answer as a bulleted list.",
    "Write a JSON object describing a book with title, author, year and three tags.",
    "Explain gradient descent to a high-school student.",
    "Write a short story opening, three sentences, set on a night train across the desert.",
    "Convert this list to a Markdown table: apples 3, pears 5, plums 2, cherries 12.",
    "Write a Rust function that reverses the words of a sentence.",
    "What is 17 * 23 + 144 / 12? Compute step by step.",
    "Give three tips for writing clear commit messages.",
    "Explain what a transformer's attention layer computes, with the formula.",
    "Write a regular expression that matches ISO 8601 dates like 2024-03-15 and explain each part.",
)


Prompt = str | list[int]   # text, or token ids the server takes as they are


def load_prompts(path: str) -> list[Prompt]:
    """One prompt per line; JSON lines give "prompt" (or "text") or pre-tokenized "token_ids"."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = [line.rstrip("\n") for line in fh]
    except OSError as exc:
        raise ValueError(f"cannot read prompts file {path}: {exc.strerror}") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
            ids = obj.get("token_ids") if isinstance(obj, dict) else None
            if ids is not None:
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                    raise ValueError(f'{path}:{lineno}: "token_ids" must be a non-empty list of ids >= 0')
                prompts.append(ids)
                continue
            text = obj.get("prompt", obj.get("text")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text:
                raise ValueError(f'{path}:{lineno}: a JSON line needs a non-empty "prompt" string or "token_ids"')
            prompts.append(text)
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts")
    return prompts
