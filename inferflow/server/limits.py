"""Defaults of the server's per-request work limits that the CLI shows (no web imports)."""

from __future__ import annotations

# echo / prompt_logprobs: prompt tokens one request may have scored by default (the model's
# context where that is longer: every prompt the model takes can be scored)
MAX_SCORED = 32768
# prompt positions scored between two engine steps (at most the step's token budget): each runs
# the output layer over the whole vocabulary, so a chunk costs about as much as a prefill of it
SCORE_CHUNK = 128
