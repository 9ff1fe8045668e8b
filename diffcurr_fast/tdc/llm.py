"""LLM proposer for proxy-based pruning: an OpenAI-compatible chat-completions endpoint (standard library only).

TDC (arXiv 2312.13307, Sec. 3.3) asks GPT-4 for candidate allocations given the memory bank. Here the endpoint is
whatever the user configures (``url``, ``model``, the *name* of the environment variable holding the API key); no
request is made unless an ``LLMProposer`` is built and asked to propose. The reply must be a JSON object
``{"candidates": [{"heads": [...], "mlp_hidden": [...]}, ...]}`` (optionally inside one ```json fence). Replies are
parsed strictly: anything else is counted in ``stats`` as a parse error and gives no proposals (the search fills
the round from its fallback). An endpoint that gives no reply (network error, HTTP error, timeout) is counted too
and, by default (``on_unreachable="raise"``, ``tdc.llm_fallback`` none), stops the search with
``ProposerUnavailable``; with ``"report"`` (``tdc.llm_fallback=local``) it gives no proposals and prints, every
round, that the round's candidates come from the fallback. The allocations themselves are checked by the search
(widths, budget, repeats), as those of every proposer.
"""

from __future__ import annotations

import json
import os
import random
import sys
import urllib.error
import urllib.request
from typing import Any

from diffcurr_fast.tdc.search import ProposerUnavailable, SearchState

__all__ = ["LLMProposer", "SYSTEM_PROMPT", "parse_reply"]

SYSTEM_PROMPT = (
    "You allocate the width of a pruned diffusion transformer (DiT). For every block choose how many attention "
    "heads and MLP hidden channels to keep, at most the given maxima, so that the total FLOPs stay within "
    "flops_budget (FLOPs are linear in the widths: flops_per_head and flops_per_mlp_channel per unit, on top of a "
    "fixed part). Lower proxy_loss is better; learn from the memory bank of tried allocations. Answer with JSON "
    'only: {"candidates": [{"heads": [int per block], "mlp_hidden": [int per block]}, ...]}.'
)

_STATS = ("requests", "network_errors", "timeouts", "parse_errors")


class ReplyError(ValueError):
    """The endpoint's reply is not the expected JSON."""


def parse_reply(body: bytes | str) -> list[dict[str, Any]]:
    """Candidates of a chat-completions response body; raises ``ReplyError`` on anything malformed."""
    try:
        response = json.loads(body)
        content = response["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ReplyError(f"not a chat-completions response: {type(exc).__name__}: {exc}") from None
    if not isinstance(content, str):
        raise ReplyError(f"message content must be a string, got {type(content).__name__}")
    text = content.strip()
    if text.startswith("```"):
        first_newline = text.find("\n")
        if first_newline < 0 or not text.endswith("```"):
            raise ReplyError("unterminated code fence in the reply")
        text = text[first_newline + 1 : -3].strip()
    try:
        payload = json.loads(text)
    except ValueError as exc:
        raise ReplyError(f"reply content is not JSON: {exc}") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("candidates"), list):
        raise ReplyError('reply JSON must be an object with a "candidates" list')
    out = []
    for i, c in enumerate(payload["candidates"]):
        if not isinstance(c, dict) or set(c) != {"heads", "mlp_hidden"}:
            raise ReplyError(f'candidate {i} must be an object with exactly "heads" and "mlp_hidden"')
        out.append(c)
    return out


class LLMProposer:
    """Candidates from an OpenAI-compatible ``/chat/completions`` endpoint (see the module docstring).

    Args:
        url: base URL (``https://host/v1``) or the full ``.../chat/completions`` URL.
        model: model name sent in the request.
        api_key_env: name of the environment variable holding the API key (sent as a Bearer token), or None.
        timeout: seconds for the whole request.
        temperature: sampling temperature sent in the request.
        max_tokens: reply length limit sent in the request.
        bank_entries: how many best memory-bank entries the prompt shows.
        on_unreachable: ``"raise"`` (``ProposerUnavailable`` when a request gets no reply) or ``"report"`` (no
            proposals; one line on stderr per round says that the fallback proposes instead).
    """

    name = "llm"

    def __init__(
        self,
        url: str,
        model: str,
        api_key_env: str | None = None,
        *,
        timeout: float = 60.0,
        temperature: float = 0.7,
        max_tokens: int = 2048,
        bank_entries: int = 16,
        on_unreachable: str = "raise",
    ):
        if on_unreachable not in ("raise", "report"):
            raise ValueError(f"on_unreachable must be 'raise' or 'report', got {on_unreachable!r}")
        self.on_unreachable = on_unreachable
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.url = url.rstrip("/")
        if not self.url.endswith("/chat/completions"):
            self.url += "/chat/completions"
        self.model = model
        self.api_key: str | None = None
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise ValueError(f"environment variable {api_key_env!r} (api_key_env) is not set or empty")
            self.api_key = key
        self.timeout = float(timeout)
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.bank_entries = int(bank_entries)
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        self.last_error: str | None = None

    def _request(self, state: SearchState, n: int) -> bytes | None:
        prompt = {"task": f"propose {n} new allocations", **state.describe(self.bank_entries)}
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": json.dumps(prompt)},
            ],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
        self.stats["requests"] += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read()
        except TimeoutError as exc:
            self.stats["timeouts"] += 1
            self.last_error = f"timeout: {exc}"
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                self.stats["timeouts"] += 1
            else:
                self.stats["network_errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        except (OSError, ValueError) as exc:  # connection reset, bad status line, ...
            self.stats["network_errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        return None

    def propose(self, state: SearchState, n: int, rng: random.Random) -> list[tuple[Any, Any]]:
        """Ask the endpoint once for ``n`` allocations; return the ``(heads, mlp_hidden)`` of its reply, as given."""
        del rng  # the endpoint samples on its own
        body = self._request(state, n)
        if body is None:
            if self.on_unreachable == "raise":
                raise ProposerUnavailable(
                    f"tdc.proposer 'llm': the endpoint {self.url} gave no reply ({self.last_error}); check tdc.llm_url "
                    "and rerun with --resume (finished stages are kept), or set tdc.llm_fallback=local to let the "
                    "local proposer fill such rounds"
                )
            msg = (
                f"tdc: round {state.round}: the llm endpoint gave no reply ({self.last_error}); this round's "
                "candidates come from the local proposer (tdc.llm_fallback=local)"
            )
            print(msg, file=sys.stderr, flush=True)
            return []
        try:
            return [(c["heads"], c["mlp_hidden"]) for c in parse_reply(body)]
        except ReplyError as exc:
            self.stats["parse_errors"] += 1
            self.last_error = str(exc)
            return []
