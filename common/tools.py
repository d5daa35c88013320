"""Tools for tool-integrated rollouts: the two tools, their registry, and running the call a turn ends with.

The tool loop (issue 39) samples a turn, looks at the decoded text of that turn, runs the call it ends with, appends
the observation's token ids and samples on. The text-level half (the call formats, their stop strings, parsing a call,
framing and truncating an observation) is ``common.tool_format``; this module holds what needs the tools: the
calculator, the Python tool, the registry ``TOOLS``, detection of a call as a call of a registered tool, and the
dispatcher. It imports ``common.tool_format`` (never the reverse) and re-exports all its public names, so
``from common.tools import X`` works for every name of either module.

Contract (what the loop calls per sample is total: malformed input gives None or an error observation, never an
exception):

    detect_tool_call(text, fmt) -> ToolCall | None   either format, as a ToolCall (python: of ``block_tool``)
    calculator(expression) -> ToolOutput        bounded arithmetic, in process
    python_tool(code, *, timeout_s, memory_mb) -> ToolOutput   one fresh run in common/sandbox.py's sandbox
    run_tool_call(call, *, tools, max_chars, **settings) -> ToolOutput   dispatch; every failure is an observation

A ``ToolOutput`` is a ``str`` (the observation text) with a ``status`` ("ok", "error", "timeout", "sandbox_error")
for the loop's error and timeout rates. Interpreter state does not persist across calls: each python call runs a
fresh program, as ToRL and verl do (see ``python_tool``).
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any

from common.sandbox import SandboxUnavailableError, run_python
from common.tool_format import (  # re-exported: `from common.tools import X` works for these too
    CHAT_STOP_STRINGS,
    CHATML_FRAMING,
    OUTPUT_FENCE,
    PYTHON_STOP_STRINGS,
    TRUNCATION_MARKER,
    ChatFraming,
    ToolCall,
    ToolFormat,
    chat_framing,
    closed_python_block,
    find_python_call,
    format_python_observation,
    parse_tool_call,
    stop_strings,
    truncate_observation,
)

TOOL_STATUSES = ("ok", "error", "timeout", "sandbox_error")
"""ok: the tool answered; error: the call or the program failed (bad call, refused expression, exception, memory,
output limit); timeout: the program ran past its limit; sandbox_error: the sandbox itself failed (not the model's
doing: the loop should report it apart)."""


class ToolOutput(str):
    """An observation's text (it is a ``str``) together with how the call ended, ``status`` (one of TOOL_STATUSES).

    A str subclass so that a tool's result drops into any text while the loop can still count errors and timeouts
    without parsing the text (a program may print "Error" itself)."""

    status: str

    def __new__(cls, text: str, status: str = "ok") -> ToolOutput:
        self = super().__new__(cls, text)
        self.status = status
        return self


def _error(message: str, status: str = "error") -> ToolOutput:
    return ToolOutput(f"Error: {message}", status)


# ----------------------------------------------------------------------------------------------
# The calculator
# ----------------------------------------------------------------------------------------------
# nanochat (`nanochat/engine.py` `use_calculator`) evals the expression after checking its characters (digits,
# + - * / . ( ) and spaces, commas stripped), refuses "**" outright and bounds the time with SIGALRM. Here an AST
# walk admits numbers and arithmetic only, so nothing is eval'd, and bounds sizes before computing instead of timing
# out: SIGALRM works only on the main thread, and the loop runs tools on pool threads. "**" is allowed with a bounded
# exponent and result.
MAX_EXPRESSION_CHARS = 200
MAX_INT_DIGITS = 300  # an integer result (or intermediate) has at most this many digits
MAX_EXPONENT = 1000  # |exponent| of "**"
_INT_LIMIT = 10**MAX_INT_DIGITS
_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "1,234,567" -> "1234567"; "1,2" stays (and is refused)


class _Refused(Exception):
    """The expression is outside what the calculator evaluates; the message is the observation."""


def calculator(expression: str) -> ToolOutput:
    """Evaluate arithmetic: int and float literals, + - * / // % **, unary minus and plus, parentheses, Python's
    semantics (7/2 = 3.5, 6/3 = 2.0, -7//2 = -4, -2**2 = -4); thousands separators ("1,234") are allowed.

    Bounded: at most MAX_EXPRESSION_CHARS characters, integers of at most MAX_INT_DIGITS digits at every step, a
    "**" exponent of at most MAX_EXPONENT in magnitude (9**9**9 is refused before anything is computed), finite
    float results. No names, calls, attributes, strings, comparisons or anything else. Deterministic; a refusal or
    an arithmetic error (division by zero) is an "Error: ..." observation with status "error", never an exception."""
    if not isinstance(expression, str):
        return _error("the expression must be a string")
    expression = _THOUSANDS.sub("", expression.strip())
    if not expression:
        return _error("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        return _error(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
        value = _evaluate(tree.body)
    except _Refused as e:
        return _error(str(e))
    except ZeroDivisionError:
        return _error("division by zero")
    except OverflowError:
        return _error("the result is too large")
    except SyntaxError:
        return _error("invalid expression")
    except (ValueError, TypeError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        return _error(f"invalid expression ({type(e).__name__})")
    return ToolOutput(str(value) if isinstance(value, int) else repr(value))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): True and False are refused
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _checked(_UNARY_OPS[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _checked(_BINARY_OPS[type(node.op)](left, right))
    what = type(node.value).__name__ if isinstance(node, ast.Constant) else type(node).__name__
    raise _Refused(f"only numbers, + - * / // % ** and parentheses are allowed, not {what}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power too large to compute, before computing it (2**10**9 would take minutes and gigabytes)."""
    if abs(exponent) > MAX_EXPONENT:
        raise _Refused(f"the exponent is larger than {MAX_EXPONENT} in magnitude")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # digits of base**exponent: floor(exponent * log10|base|) + 1; refuse early only what is surely too long
        # (the slack covers log10's rounding); _checked then applies the exact bound
        if exponent * math.log10(abs(base)) > MAX_INT_DIGITS + 1:
            raise _Refused(f"the result has more than {MAX_INT_DIGITS} digits")


def _checked(value: Any) -> int | float:
    if isinstance(value, int):
        if abs(value) >= _INT_LIMIT:
            raise _Refused(f"the result has more than {MAX_INT_DIGITS} digits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Refused("the result is not a finite number")
        return value
    raise _Refused("the result is not a real number")  # (-8) ** 0.5 is complex


# ----------------------------------------------------------------------------------------------
# The Python tool
# ----------------------------------------------------------------------------------------------
TRACEBACK_LINES = 4
_FOREIGN_FRAME = re.compile(r'^  File "(?!<program>")')  # a frame of the sandbox's harness, not of the program


def python_tool(code: str, *, timeout_s: float = 5.0, memory_mb: int = 1024) -> ToolOutput:
    """Run ``code`` as a fresh program in the sandbox (``common.sandbox.run_python``) and describe how it went.

    ok: its stdout. error: the stdout it printed, then the last TRACEBACK_LINES lines of its traceback (the
    harness's own frames removed, so the text is the program's alone and does not change with the harness). timeout,
    memory, output limit, sandbox failure: the stdout so far and a one-line message. Trailing whitespace is dropped.

    No state persists across calls: each call is a new process, as in ToRL (each ```python block goes alone to
    SandboxFusion's run_code: `send_request` in GAIR-NLP/ToRL `verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py`)
    and verl (`verl/tools/sandbox_fusion_tools.py` `execute_code`: one run_code request per call). A sample that
    needs earlier values recomputes them, which keeps every call reproducible on its own. ``timeout_s`` and
    ``memory_mb`` are keyword-only: the loop sets them, a tool call cannot (verl reads "timeout" from the model's
    arguments)."""
    if not isinstance(code, str):
        return _error("the code must be a string")
    try:
        result = run_python(code, timeout_s=timeout_s, memory_mb=memory_mb)
    except SandboxUnavailableError:  # the loop probes the sandbox at start-up and refuses to start without one
        return _error("no sandbox to run the program in", "sandbox_error")
    stdout = result.stdout.rstrip()
    lead = stdout + "\n" if stdout else ""
    if result.status == "ok":
        return ToolOutput(stdout)
    if result.status == "timeout":
        return ToolOutput(f"{lead}TimeoutError: the program did not finish within {timeout_s:g} s", "timeout")
    if result.status == "memory":
        return ToolOutput(f"{lead}MemoryError: the program ran out of its {memory_mb} MB of memory", "error")
    if result.status == "output_limit":
        return ToolOutput(f"{lead}Error: the program printed more than the sandbox's output limit", "error")
    if result.status == "sandbox_error":
        return ToolOutput(f"{lead}Error: the sandbox failed to run the program", "sandbox_error")
    trace = _program_traceback(result.stderr)
    if not trace:
        trace = f"Error: the program exited with code {result.exit_code}"
    return ToolOutput(lead + trace, "error")


def _program_traceback(stderr: str, lines: int = TRACEBACK_LINES) -> str:
    """The last ``lines`` lines of ``stderr`` with the harness's frames (a "File" line not in "<program>" and the
    indented source lines under it) left out."""
    kept: list[str] = []
    in_foreign = False
    for line in stderr.rstrip().split("\n"):
        if _FOREIGN_FRAME.match(line):
            in_foreign = True
            continue
        if in_foreign and line.startswith("    "):
            continue
        in_foreign = False
        kept.append(line)
    return "\n".join(kept[-lines:]).strip("\n")  # not .strip(): a frame line's indent is part of it


# ----------------------------------------------------------------------------------------------
# The registry, detection and the dispatcher
# ----------------------------------------------------------------------------------------------
TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator, "python": python_tool}
"""Tool name -> function. A tool's positional-or-keyword parameters are what a call may pass (``arguments``); its
keyword-only parameters are the loop's settings (``run_tool_call(**settings)``). It returns its observation, a str (a
ToolOutput to report a status other than "ok"), and does not raise."""


def _model_parameters(tool: Callable[..., str]) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(tool).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]


def detect_tool_call(
    text: str,
    fmt: ToolFormat,
    *,
    block_tool: str = "python",
    tools: Mapping[str, Callable[..., str]] | None = None,
    end_of_turn: str = "<|im_end|>",
) -> ToolCall | None:
    """The call that ``text`` (a turn's decoded text) ends with, in format ``fmt``, else None.

    python: the closed block's code becomes the first argument of ``block_tool`` ("python": ``code``; "calculator":
    ``expression``, nanochat's way of running a calculator from a code span); chat: ``parse_tool_call(text,
    end_of_turn)``."""
    if fmt == "chat":
        return parse_tool_call(text, end_of_turn)
    code = find_python_call(text)
    if code is None:
        return None
    tool = (TOOLS if tools is None else tools).get(block_tool)
    if tool is None:
        return ToolCall(block_tool, error=f"unknown tool {block_tool!r}")
    parameters = _model_parameters(tool)
    if not parameters:
        return ToolCall(block_tool, error=f"{block_tool} takes no argument to pass a code block to")
    return ToolCall(block_tool, {parameters[0].name: code})


def run_tool_call(
    call: ToolCall, *, tools: Mapping[str, Callable[..., str]] = TOOLS, max_chars: int = 0, **settings: Any
) -> ToolOutput:
    """Run ``call`` and return its observation, cut to ``max_chars`` by ``truncate_observation`` (0: no cut).

    A parse error, an unknown tool, an argument the tool does not take, a missing argument or an exception inside a
    tool becomes an "Error: ..." observation with status "error". ``settings`` (timeout_s, memory_mb, ...) go to the
    tools whose keyword-only parameters name them, and only there: a call's own arguments cannot set them."""
    output = _dispatch(call, tools, settings)
    return ToolOutput(truncate_observation(output, max_chars), output.status)


def _dispatch(call: ToolCall, tools: Mapping[str, Callable[..., str]], settings: dict[str, Any]) -> ToolOutput:
    if call.error is not None:
        return _error(f"could not parse the tool call: {call.error}")
    tool = tools.get(call.name)
    if tool is None:
        return _error(f"unknown tool {call.name!r} (available: {', '.join(sorted(tools))})")
    parameters = _model_parameters(tool)
    names = [p.name for p in parameters]
    unexpected = [name for name in call.arguments if name not in names]
    if unexpected:
        return _error(f"{call.name} takes {', '.join(map(repr, names)) or 'no arguments'}, not {unexpected[0]!r}")
    missing = [p.name for p in parameters if p.default is p.empty and p.name not in call.arguments]
    if missing:
        return _error(f"{call.name} needs the argument {missing[0]!r}")
    keyword_only = {p.name for p in inspect.signature(tool).parameters.values() if p.kind is p.KEYWORD_ONLY}
    try:
        output = tool(**call.arguments, **{k: v for k, v in settings.items() if k in keyword_only})
    except Exception as e:  # a tool should not raise; if one does, the sample still goes on
        return _error(f"{call.name} failed: {type(e).__name__}: {e}")
    return output if isinstance(output, ToolOutput) else ToolOutput(str(output))


__all__ = [
    "TOOL_STATUSES",
    "ToolOutput",
    "TOOLS",
    "detect_tool_call",
    "calculator",
    "python_tool",
    "run_tool_call",
    "CHAT_STOP_STRINGS",
    "CHATML_FRAMING",
    "OUTPUT_FENCE",
    "PYTHON_STOP_STRINGS",
    "TRUNCATION_MARKER",
    "ChatFraming",
    "ToolCall",
    "ToolFormat",
    "chat_framing",
    "closed_python_block",
    "find_python_call",
    "format_python_observation",
    "parse_tool_call",
    "stop_strings",
    "truncate_observation",
]
