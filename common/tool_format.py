"""Tool-call formats for tool-integrated rollouts: the text a call is written in and the text around its result.

The tool loop (issue 39) samples a turn, looks at the decoded text of that turn, runs the call it ends with, appends
the observation's token ids and samples on. This module is the text of that: where a turn ends with a call, and the
text an observation is framed in. Pure functions on str: it runs no tool (``common.tools`` runs them, imports this
module and re-exports its public names; nothing here imports ``common.tools``), and it never tokenizes (token in,
token out is the loop's: it encodes the observation text returned here with special tokens parsed and appends those
ids; it never re-encodes the history).

Two call formats, each with the stop strings the loop passes to the engine (``stop_strings``):

    python   ToRL's (arXiv 2503.23383): a ```python block; the engine stops at the line after its closing fence
             (stop string "\\n```\\n"); the observation is an output fence "```output\\n<result>\\n```\\n".
    chat     Qwen2.5 / Hermes: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>; the engine stops at
             "</tool_call>" (or at the end-of-turn token after it); the observation is a ``tool`` turn framed as the
             model's chat template renders one (``chat_framing``; Qwen2.5's ChatML when there is no template).

Contract (what the loop calls per sample is total: malformed input gives None or a ToolCall with ``error`` set, never
an exception; ``chat_framing``, called once at start-up, raises on a template that cannot frame a tool turn):

    stop_strings(fmt) -> tuple[str, ...]        the engine's stop strings for format ``fmt``
    find_python_call(text) -> str | None        the code of a python block that ``text`` ends by closing
    closed_python_block(text) -> bool           whether ``text`` ends by closing a python block
    format_python_observation(result) -> str    "```output\\n{result}\\n```\\n"
    parse_tool_call(text) -> ToolCall | None    the <tool_call> ``text`` ends with; bad JSON -> ToolCall.error
    chat_framing(tokenizer_or_template) -> ChatFraming   the text around a tool result; .observation(result)
    truncate_observation(text, max_chars) -> str     head + "...[truncated N chars]..." + tail, at most max_chars

Turning a python block into a call of a registered tool (``detect_tool_call``) needs the tool registry, so it is
``common.tools``'s.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["python", "chat"]


# ----------------------------------------------------------------------------------------------
# The python-block format (ToRL)
# ----------------------------------------------------------------------------------------------
# ToRL (GAIR-NLP/ToRL `verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`) stops vLLM at "```output", a fence
# the model writes itself after closing its block, runs the last ```python block (`extract_program`, last_only) and
# appends "```output\n{result}\n```\n" (OBS_START + "\n" + result + OBS_END). Here the engine stops at the closing
# fence instead, so the whole output fence is observation (masked from the loss), and nothing is decoded and
# re-encoded. A bare "```" cannot be the stop string: it also ends "```python", so the engine would stop as soon as a
# block opens. Our engines' stop strings are one list for the whole batch (no per-row "only while a block is open"),
# so the stop is "\n```\n": a fence alone on its line. It matches a closing fence and never "```python"; it also
# matches the opening of a bare "```" block and the closing of a non-python block, where ``find_python_call`` finds
# no call: the loop then samples on with no observation. The token that completes the stop string may carry more
# whitespace ("```\n\n"), so trailing whitespace after the fence is allowed.
PYTHON_STOP_STRINGS = ("\n```\n",)
CHAT_STOP_STRINGS = ("</tool_call>",)
OUTPUT_FENCE = "```output"
_PYTHON_OPEN = re.compile(r"```python[ \t]*$")  # ToRL's extract_program: the line starts or ends with ```python


def stop_strings(fmt: ToolFormat) -> tuple[str, ...]:
    """The stop strings the loop passes to the engine for format ``fmt`` (besides the usual stop token ids)."""
    return {"python": PYTHON_STOP_STRINGS, "chat": CHAT_STOP_STRINGS}[fmt]


def find_python_call(text: str) -> str | None:
    """The code of the ```python block that ``text`` ends by closing (trailing whitespace allowed), else None.

    Lines are read as ToRL's ``extract_program`` reads them: a line ending in "```python" opens a block, a line that
    is only "```" closes the open one. None when the text ends inside a block, after some other text, or by closing a
    block that is not python (an output fence, a "```text" block). A closed empty block gives "" (a call)."""
    lines = text.rstrip().split("\n")
    if not lines or lines[-1].strip() != "```":
        return None
    block: list[str] | None = None  # the python block's lines while one is open
    other_open = False  # inside a fenced block of another language (its "```" lines close it, not a python block)
    for i, line in enumerate(lines):
        bare = line.strip()
        if block is not None:
            if bare == "```":
                if i == len(lines) - 1:
                    return "\n".join(block)
                block = None
            else:
                block.append(line)
        elif other_open:
            other_open = bare != "```"
        elif _PYTHON_OPEN.search(line):
            block = []
        elif bare.startswith("```"):
            other_open = True
    return None


def closed_python_block(text: str) -> bool:
    """Whether ``text`` ends by closing a ```python block: the tool call the python format's stop string marks."""
    return find_python_call(text) is not None


def format_python_observation(result_text: str) -> str:
    """The output fence appended after a python call: "```output\\n{result}\\n```\\n" (ToRL's OBS_START/OBS_END,
    Qwen2.5-Math's tool-integrated format). The turn ends with the newline of the stop string, so none is added
    before; one trailing newline of the result is dropped so the fence closes on its own line."""
    result = result_text[:-1] if result_text.endswith("\n") else result_text
    return f"{OUTPUT_FENCE}\n{result}\n```\n"


# ----------------------------------------------------------------------------------------------
# The chat format (Qwen2.5 / Hermes)
# ----------------------------------------------------------------------------------------------
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One tool call: the tool's ``name`` and its keyword ``arguments``. ``error`` is set instead when the call could
    not be parsed; ``run_tool_call`` turns it into the observation, so the model learns what went wrong."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_call(text: str, end_of_turn: str = "<|im_end|>") -> ToolCall | None:
    """The <tool_call> that ``text`` ends with, else None.

    ``text`` may end with whitespace and with ``end_of_turn`` (when the model sampled the end-of-turn token after the
    call and the loop decoded it); anything else after "</tool_call>" means no call. The body is Qwen2.5's JSON
    ``{"name": ..., "arguments": {...}}`` (``arguments`` may also be a JSON string of an object, as some Hermes
    models write it). A body that is not such JSON gives a ToolCall with ``error`` set, never an exception. Only the
    last call of a turn is returned: the stop string ends a turn at its first "</tool_call>"."""
    tail = text.rstrip()
    if end_of_turn and tail.endswith(end_of_turn):
        tail = tail[: -len(end_of_turn)].rstrip()
    if not tail.endswith(_CALL_CLOSE):
        return None
    body_end = len(tail) - len(_CALL_CLOSE)
    start = tail.rfind(_CALL_OPEN, 0, body_end)
    if start < 0:
        return ToolCall("", error=f"{_CALL_CLOSE} without an opening {_CALL_OPEN}")
    body = tail[start + len(_CALL_OPEN) : body_end].strip()
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; RecursionError: absurd nesting
        return ToolCall("", error=f"the tool call is not valid JSON ({e})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='a tool call is a JSON object {"name": <tool name>, "arguments": {...}}')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            pass  # still a str: refused below
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], error='"arguments" must be a JSON object of the tool\'s arguments')
    return ToolCall(obj["name"], arguments)


@dataclass(frozen=True)
class ChatFraming:
    """The text a chat template puts around a tool result, after the assistant's content:
    ``end_of_turn + before + result + after``. For Qwen2.5 (CHATML_FRAMING):

        end_of_turn, closes the assistant's turn:  "<|im_end|>"
        before, opens the tool turn:               "\\n<|im_start|>user\\n<tool_response>\\n"
        after, closes it and opens the next turn:  "\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"

    All of it is observation: masked from the loss."""

    end_of_turn: str
    before: str
    after: str

    def observation(self, result: str, turn_ended: bool = False) -> str:
        """The observation text for ``result``. ``turn_ended``: the model sampled the end-of-turn token itself (the
        engine stopped on the stop id, not on "</tool_call>"), so it is not appended a second time."""
        return ("" if turn_ended else self.end_of_turn) + self.before + result + self.after


CHATML_FRAMING = ChatFraming(
    end_of_turn="<|im_end|>",
    before="\n<|im_start|>user\n<tool_response>\n",
    after="\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
)
"""Qwen2.5's rendering of a tool turn (Qwen/Qwen2.5-*-Instruct's chat template, kept byte for byte in huggingface/trl
`trl/chat_templates/qwen2_5.jinja`: a run of tool messages becomes one user turn of <tool_response> blocks). The
fallback when there is no chat template."""

_ASSISTANT_SENTINEL = "@@ASSISTANT_CONTENT@@"
_RESULT_SENTINEL = "@@TOOL_RESULT@@"


def chat_framing(source: Any = None, *, tool_name: str = "tool", eos_token: str | None = None) -> ChatFraming:
    """The framing of a tool turn under a chat template, taken from the template itself.

    ``source``: a tokenizer (anything with ``apply_chat_template``; its ``chat_template`` and ``eos_token`` are used),
    a template string, or None. Without a template (None, or a tokenizer whose ``chat_template`` is None) the result
    is CHATML_FRAMING. The template renders [user, assistant(S)] and [user, assistant(S), tool(R)] + generation
    prompt with sentinel contents S and R; the framing is what follows S: the first render's turn closing gives
    ``end_of_turn`` (the ``eos_token`` when the closing starts with it, the closing without trailing whitespace
    otherwise; TRL's `_get_tool_suffix_ids` aligns to the EOS likewise), and the second render, split at R, gives
    ``before`` and ``after``. TRL (`trl/trainer/grpo_trainer.py` `_get_tool_suffix_ids`) takes the same difference in
    token ids; text is enough here because the loop encodes the observation on its own. Raises ValueError when the
    template does not render the tool turn after the assistant's content (the model's template cannot frame tool
    results: pass a template that can, rather than fall back to a framing the model never saw)."""
    if source is None:
        return CHATML_FRAMING
    if isinstance(source, str):
        template = source

        def render(messages: list[dict], add_generation_prompt: bool) -> str:
            return _render_template(template, messages, add_generation_prompt, bos_token="", eos_token=eos_token or "")

    else:
        if getattr(source, "chat_template", None) is None:
            return CHATML_FRAMING
        eos_token = eos_token if eos_token is not None else getattr(source, "eos_token", None)

        def render(messages: list[dict], add_generation_prompt: bool) -> str:
            return source.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _ASSISTANT_SENTINEL}]
    tool_turn = {"role": "tool", "name": tool_name, "content": _RESULT_SENTINEL}
    closed = render(conversation, False)
    full = render([*conversation, tool_turn], True)
    for rendered in (closed, full):
        if rendered.count(_ASSISTANT_SENTINEL) != 1:
            raise ValueError("the chat template does not render an assistant message's content verbatim, once")
    closing = closed.split(_ASSISTANT_SENTINEL, 1)[1]
    rest = full.split(_ASSISTANT_SENTINEL, 1)[1]
    end_of_turn = eos_token if eos_token and closing.startswith(eos_token) else closing.rstrip()
    if not rest.startswith(end_of_turn) or rest.count(_RESULT_SENTINEL) != 1:
        raise ValueError(
            "the chat template does not render a tool message after the assistant's turn "
            f"(closing {closing!r}, then {rest!r}): pass a template that renders the 'tool' role"
        )
    before, after = rest[len(end_of_turn) :].split(_RESULT_SENTINEL)
    return ChatFraming(end_of_turn, before, after)


def _render_template(template: str, messages: list[dict], add_generation_prompt: bool, **special_tokens: str) -> str:
    """Render a chat template string exactly as a tokenizer's apply_chat_template would (transformers'
    `render_jinja_template`: its sandboxed jinja2 environment, tojson, raise_exception, {% generation %} blocks),
    with the special tokens as template variables. Imported here: transformers takes seconds to import, and a
    script that frames tool turns has imported it already."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=add_generation_prompt, **special_tokens
    )
    return rendered[0]


# ----------------------------------------------------------------------------------------------
# The observation budget
# ----------------------------------------------------------------------------------------------
TRUNCATION_MARKER = "...[truncated {n} chars]..."


def truncate_observation(text: str, max_chars: int) -> str:
    """``text`` if it has at most ``max_chars`` characters (or ``max_chars`` <= 0: no budget), else its head and tail
    around TRUNCATION_MARKER naming how many characters were cut, at most ``max_chars`` in all.

    Head and tail halves, as verl's default side "middle" (`verl/trainer/config/rollout/rollout.yaml`
    multi_turn.tool_response_truncate_side; `verl/experimental/agent_loop/tool_agent_loop.py` cuts to
    text[:L//2] + "...(truncated)..." + text[-L//2:]) and ToRL (text[:128] + "..." + text[-128:] past 256): the
    head holds what a program printed first, the tail the end of a traceback. Unlike both, the marker counts toward
    the budget, so ``max_chars`` is a hard bound, and it says how much is missing. A budget too small for the marker
    and a character on each side keeps the head alone. Tokens are the loop's to bound (after encoding)."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    # the marker's width depends on the count it shows: size it for the largest count (len(text)), so the result
    # fits; with the true, smaller count it can only be shorter
    keep = max_chars - len(TRUNCATION_MARKER.format(n=len(text)))
    if keep < 2:
        return text[:max_chars]
    head, tail = (keep + 1) // 2, keep // 2
    return text[:head] + TRUNCATION_MARKER.format(n=len(text) - head - tail) + text[len(text) - tail :]


__all__ = [
    "ToolFormat",
    "ToolCall",
    "ChatFraming",
    "CHATML_FRAMING",
    "PYTHON_STOP_STRINGS",
    "CHAT_STOP_STRINGS",
    "OUTPUT_FENCE",
    "TRUNCATION_MARKER",
    "stop_strings",
    "find_python_call",
    "closed_python_block",
    "format_python_observation",
    "parse_tool_call",
    "chat_framing",
    "truncate_observation",
]
