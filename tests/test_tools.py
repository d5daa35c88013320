"""common/tools.py and common/tool_format.py: the calculator's results and refusals, both call formats' detection,
the observation text (Qwen2.5's ChatML framing taken from its chat template, the tiny model's), truncation, the
dispatcher's errors, the Python tool's observation for each sandbox status, and one end-to-end run of the Python tool
in the real sandbox.

Every expected value is worked out by hand from the rules in the modules' docstrings. The file stays fast: no
tokenizer is loaded through transformers (only its chat-template renderer is imported, about a second, and the tiny
tokenizer is read with `tokenizers`), and one sandbox test runs four short programs.
"""

import time
from pathlib import Path

import pytest
import tokenizers

from common import sandbox as sb
from common import tool_format, tools
from common.sandbox import SandboxResult
from common.tools import (
    CHATML_FRAMING,
    PYTHON_STOP_STRINGS,
    ChatFraming,
    ToolCall,
    ToolOutput,
    calculator,
    chat_framing,
    closed_python_block,
    detect_tool_call,
    find_python_call,
    format_python_observation,
    parse_tool_call,
    python_tool,
    run_tool_call,
    stop_strings,
    truncate_observation,
)

TINY = Path(__file__).resolve().parent.parent / "common" / "tiny_model"

# Qwen/Qwen2.5-*-Instruct's chat template, byte for byte as huggingface/trl keeps it for identity comparison
# (trl/chat_templates/qwen2_5.jinja), its long lines split into adjacent literals
QWEN25_TEMPLATE = "\n".join(
    [
        "{%- if tools %}",
        "    {{- '<|im_start|>system\\n' }}",
        "    {%- if messages[0]['role'] == 'system' %}",
        "        {{- messages[0]['content'] }}",
        "    {%- else %}",
        ("        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"),
        "    {%- endif %}",
        (
            '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user'
            " query.\\n\\nYou are provided with function signatures within <tools></tools> XML"
            ' tags:\\n<tools>" }}'
        ),
        "    {%- for tool in tools %}",
        '        {{- "\\n" }}',
        "        {{- tool | tojson }}",
        "    {%- endfor %}",
        (
            '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function'
            " name and arguments within <tool_call></tool_call> XML"
            ' tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\":'
            ' <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
        ),
        "{%- else %}",
        "    {%- if messages[0]['role'] == 'system' %}",
        "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}",
        "    {%- else %}",
        (
            "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a"
            " helpful assistant.<|im_end|>\\n' }}"
        ),
        "    {%- endif %}",
        "{%- endif %}",
        "{%- for message in messages %}",
        (
            '    {%- if (message.role == "user") or (message.role == "system" and not'
            ' loop.first) or (message.role == "assistant" and not message.tool_calls) %}'
        ),
        ("        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"),
        '    {%- elif message.role == "assistant" %}',
        "        {{- '<|im_start|>' + message.role }}",
        "        {%- if message.content %}",
        "            {{- '\\n' + message.content }}",
        "        {%- endif %}",
        "        {%- for tool_call in message.tool_calls %}",
        "            {%- if tool_call.function is defined %}",
        "                {%- set tool_call = tool_call.function %}",
        "            {%- endif %}",
        '            {{- \'\\n<tool_call>\\n{"name": "\' }}',
        "            {{- tool_call.name }}",
        '            {{- \'", "arguments": \' }}',
        "            {{- tool_call.arguments | tojson }}",
        "            {{- '}\\n</tool_call>' }}",
        "        {%- endfor %}",
        "        {{- '<|im_end|>\\n' }}",
        '    {%- elif message.role == "tool" %}',
        '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}',
        "            {{- '<|im_start|>user' }}",
        "        {%- endif %}",
        "        {{- '\\n<tool_response>\\n' }}",
        "        {{- message.content }}",
        "        {{- '\\n</tool_response>' }}",
        '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}',
        "            {{- '<|im_end|>\\n' }}",
        "        {%- endif %}",
        "    {%- endif %}",
        "{%- endfor %}",
        "{%- if add_generation_prompt %}",
        "    {{- '<|im_start|>assistant\\n' }}",
        "{%- endif %}",
        "",
    ]
)


# ----------------------------------------------------------------------------------------------
# The calculator
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "expression, expected",
    [
        ("2+3*4", "14"),  # precedence
        ("(2+3)*4", "20"),
        ("7/2", "3.5"),  # true division
        ("6/3", "2.0"),  # true division is a float, as in Python
        ("7//2", "3"),
        ("-7//2", "-4"),  # floor, not truncation
        ("-7%3", "2"),  # Python's sign of the divisor
        ("2**10", "1024"),
        ("-2**2", "-4"),  # ** binds tighter than unary minus
        ("2**-1", "0.5"),
        ("1.5*4", "6.0"),
        (" 1,234 + 1 ", "1235"),  # thousands separators, surrounding spaces
        ("12345 * 6789", "83810205"),  # 12345*6000 + 12345*789 = 74070000 + 9740205
        ("-" * 100 + "7", "7"),  # an even number of unary minuses
        ("10**299", "1" + "0" * 299),  # 300 digits: the largest power of ten allowed
    ],
)
def test_calculator_evaluates(expression, expected):
    out = calculator(expression)
    assert out == expected and isinstance(out, ToolOutput) and out.status == "ok"


@pytest.mark.parametrize(
    "expression, message",
    [
        ("9**9**9", "exponent is larger than 1000"),  # 9**387420489: refused before computing
        ("2**1001", "exponent is larger than 1000"),
        ("10**300", "more than 300 digits"),  # 301 digits
        ("(10**200)*(10**200)", "more than 300 digits"),  # each factor allowed, the product not
        ("x+1", "not Name"),
        ("abs(-1)", "not Call"),
        ("(1).real", "not Attribute"),
        ("__import__('os')", "not Call"),
        ("'a'*3", "not str"),
        ("True+1", "not bool"),
        ("1 if 1 else 2", "not IfExp"),
        ("3 > 2", "not Compare"),
        ("1,2", "not Tuple"),  # not a thousands separator
        ("1" + "+1" * 100, "longer than 200 characters"),  # 201 characters
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("1%0", "division by zero"),
        ("0**-1", "division by zero"),
        ("1e308*10", "not a finite number"),
        ("(-8)**0.5", "not a real number"),  # complex in Python
        ("1+", "invalid expression"),
        ("", "empty expression"),
    ],
)
def test_calculator_refuses(expression, message):
    out = calculator(expression)
    assert out.startswith("Error: ") and message in out and out.status == "error", out


def test_calculator_refuses_non_strings_and_huge_powers_at_once():
    assert calculator(5) == "Error: the expression must be a string"
    start = time.perf_counter()
    for expression in ("9**9**9", "2**1000**1", "(10**150)**3", "99**999"):
        assert calculator(expression).status == "error"
    assert time.perf_counter() - start < 0.1  # nothing large was computed


# ----------------------------------------------------------------------------------------------
# The python-block format
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, code",
    [
        ("Let me compute.\n```python\nprint(1 + 1)\n```\n", "print(1 + 1)"),
        ("```python\nx = 3\nprint(x * x)\n```", "x = 3\nprint(x * x)"),
        ("```python\nprint(1)\n```\n\n", "print(1)"),  # the stop's token carried a second newline
        ("```python\nprint(1)\n```\n```output\n1\n```\nNow:\n```python\nprint(2)\n```\n", "print(2)"),  # the last
        ("So:```python\nprint(3)\n```\n", "print(3)"),  # prose before the opening fence on its line (ToRL's rule)
        ("```python\ns = '```'\nprint(s)\n```\n", "s = '```'\nprint(s)"),  # a fence inside a line is code
        ("```python\n```\n", ""),  # an empty block is still a call
    ],
)
def test_find_python_call(text, code):
    assert find_python_call(text) == code and closed_python_block(text)
    assert detect_tool_call(text, "python") == ToolCall("python", {"code": code})


@pytest.mark.parametrize(
    "text",
    [
        "```python\nprint(1)\n",  # unclosed
        "```python\nprint(1)\n```\nSo the answer is 1.",  # closed, but not at the end
        "```text\nhello\n```\n",  # another language
        "```python\nprint(1)\n```\n```output\n1\n```\n",  # ends by closing the output fence
        "```markdown\n```python\n```\n",  # the last fence closes the markdown block
        "Here:\n```\n",  # a bare fence opening
        "The answer is 4.",
        "",
    ],
)
def test_find_python_call_negative(text):
    assert find_python_call(text) is None and not closed_python_block(text)
    assert detect_tool_call(text, "python") is None


def test_python_stop_string_ends_a_closing_fence_not_an_opening_one():
    """The engine stops at the first stop string in the sampled text: after a closing fence, never at "```python"."""
    (stop,) = stop_strings("python")
    assert stop_strings("python") == PYTHON_STOP_STRINGS and stop_strings("chat") == ("</tool_call>",)
    sampled = "Compute:\n```python\nprint(2+2)\n```\n```output\n4\n```\nThe answer is 4."
    turn = sampled[: sampled.index(stop) + len(stop)]
    assert turn == "Compute:\n```python\nprint(2+2)\n```\n" and find_python_call(turn) == "print(2+2)"
    # a bare block's opening fence also matches: no call there, the loop samples on
    bare = "See:\n```\nplain\n```\n"
    assert not closed_python_block(bare[: bare.index(stop) + len(stop)])


def test_python_observation_and_calculator_as_block_tool():
    assert format_python_observation("42\n") == "```output\n42\n```\n"
    assert format_python_observation("a\nb") == "```output\na\nb\n```\n"
    assert format_python_observation("") == "```output\n\n```\n"
    call = detect_tool_call("I multiply:\n```python\n12345 * 6789\n```\n", "python", block_tool="calculator")
    assert call == ToolCall("calculator", {"expression": "12345 * 6789"})
    assert format_python_observation(run_tool_call(call)) == "```output\n83810205\n```\n"
    unknown = detect_tool_call("```python\n1\n```\n", "python", block_tool="abacus")
    assert unknown.error == "unknown tool 'abacus'"


# ----------------------------------------------------------------------------------------------
# The chat format
# ----------------------------------------------------------------------------------------------
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12345*678"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text",
    [
        CALL,
        "I will multiply.\n" + CALL,
        CALL + "<|im_end|>",  # the model sampled the end of turn and the loop decoded it
        CALL + "\n",
        '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>\nand\n' + CALL,  # the last
    ],
)
def test_parse_tool_call(text):
    call = parse_tool_call(text)
    assert call == ToolCall("calculator", {"expression": "12345*678"}) and call.error is None
    assert detect_tool_call(text, "chat") == call
    assert run_tool_call(call) == "8369910"  # 12345*678 = 12345*600 + 12345*78 = 7407000 + 962910


@pytest.mark.parametrize(
    "text",
    [
        CALL + "\nThe result is",  # text after </tool_call>
        CALL[: -len("</tool_call>")],  # unclosed
        CALL + "<|eot_id|>",  # another end-of-turn than the one named
        "The answer is 2.",
        "",
    ],
)
def test_parse_tool_call_negative(text):
    assert parse_tool_call(text) is None


def test_parse_tool_call_forms_and_errors():
    as_string = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    assert parse_tool_call(as_string) == ToolCall("python", {"code": "print(1)"})  # Hermes' string arguments
    assert parse_tool_call('<tool_call>{"name": "python"}</tool_call>') == ToolCall("python", {})
    assert parse_tool_call(CALL + "<|eot_id|>", end_of_turn="<|eot_id|>").name == "calculator"
    bad_json = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}\n</tool_call>'  # one } short
    call = parse_tool_call(bad_json)
    assert call.name == "" and call.error.startswith("the tool call is not valid JSON (")
    out = run_tool_call(call)
    assert out.startswith("Error: could not parse the tool call: the tool call is not valid JSON")
    assert out.status == "error"
    assert "JSON object" in parse_tool_call('<tool_call>["calculator"]</tool_call>').error
    listed = parse_tool_call('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    assert listed.name == "calculator" and '"arguments" must be a JSON object' in listed.error
    assert parse_tool_call("oops</tool_call>").error == "</tool_call> without an opening <tool_call>"
    nested = parse_tool_call("<tool_call>" + "[" * 100_000 + "</tool_call>")  # json's recursion limit
    assert nested.error is not None


QWEN_OBSERVATION = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def test_chat_framing_from_qwen25_template():
    framing = chat_framing(QWEN25_TEMPLATE)
    assert framing == CHATML_FRAMING
    assert framing.observation("42") == QWEN_OBSERVATION
    # the model sampled <|im_end|> itself (the engine stopped on the stop id): it is not appended twice
    assert framing.observation("42", turn_ended=True) == QWEN_OBSERVATION[len("<|im_end|>") :]
    assert chat_framing(None) == CHATML_FRAMING


class TemplateTokenizer:
    """What chat_framing uses of a transformers tokenizer: chat_template, eos_token, apply_chat_template."""

    def __init__(self, chat_template, eos_token="<|im_end|>"):
        self.chat_template, self.eos_token = chat_template, eos_token

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False
        return tool_format._render_template(self.chat_template, messages, add_generation_prompt)


def test_chat_framing_from_the_tiny_models_template():
    template = (TINY / "chat_template.jinja").read_text()
    expected = ChatFraming("<|im_end|>", "\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")
    assert chat_framing(template) == expected
    assert chat_framing(TemplateTokenizer(template)) == expected
    assert chat_framing(TemplateTokenizer(None)) == CHATML_FRAMING  # a tokenizer without a template
    # the observation's markers are single special-token ids of the tiny tokenizer, and encode back to the text
    tok = tokenizers.Tokenizer.from_file(str(TINY / "tokenizer.json"))
    text = expected.observation("42")
    encoded = tok.encode(text, add_special_tokens=False)
    end, start = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|im_start|>")
    assert encoded.ids.count(end) == 2 and encoded.ids.count(start) == 2 and encoded.ids[0] == end
    assert tok.decode(encoded.ids, skip_special_tokens=False) == text


def test_chat_framing_refuses_a_template_without_tool_turns():
    drops_tools = "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}|{% endif %}{% endfor %}"
    with pytest.raises(ValueError, match="does not render a tool message"):
        chat_framing(drops_tools)
    with pytest.raises(ValueError, match="content verbatim"):
        chat_framing("{% for m in messages %}{{ m.role }}{% endfor %}")


# ----------------------------------------------------------------------------------------------
# Truncation and the dispatcher
# ----------------------------------------------------------------------------------------------
def test_truncate_observation():
    text = "a" * 50 + "b" * 50
    # marker sized for 100: "...[truncated 100 chars]..." is 27 chars; keep 40 - 27 = 13: head 7, tail 6, 87 cut
    assert truncate_observation(text, 40) == "a" * 7 + "...[truncated 87 chars]..." + "b" * 6
    # 30 chars into 29: marker for 30 is 26 chars; keep 3: head 2, tail 1, 27 cut (the marker stays 26 chars)
    assert truncate_observation("x" * 30, 29) == "xx...[truncated 27 chars]...x"
    assert truncate_observation(text, 10) == "a" * 10  # no room for the marker: the head alone
    assert truncate_observation(text, 100) == text and truncate_observation(text, 0) == text
    for budget in range(1, 100):
        assert len(truncate_observation(text, budget)) <= budget


def test_run_tool_call_errors_are_observations():
    unknown = run_tool_call(ToolCall("search", {"q": "x"}))
    assert unknown == "Error: unknown tool 'search' (available: calculator, python)" and unknown.status == "error"
    assert run_tool_call(ToolCall("calculator", {"expr": "1+1"})) == "Error: calculator takes 'expression', not 'expr'"
    assert run_tool_call(ToolCall("calculator", {})) == "Error: calculator needs the argument 'expression'"
    assert run_tool_call(ToolCall("calculator", {"expression": 5})) == "Error: the expression must be a string"
    # a call cannot set the loop's settings (verl reads "timeout" from the model's arguments); nothing runs
    override = run_tool_call(ToolCall("python", {"code": "print(1)", "timeout_s": 1000}))
    assert override == "Error: python takes 'code', not 'timeout_s'"
    # the result is cut to max_chars with its status kept: "1" + 299 zeros; marker for 300 is 27 chars, keep 23:
    # head 12, tail 11, 277 cut
    long = run_tool_call(ToolCall("calculator", {"expression": "10**299"}), max_chars=50)
    assert long == "1" + "0" * 11 + "...[truncated 277 chars]..." + "0" * 11 and long.status == "ok"


def test_run_tool_call_routes_settings_and_catches_tool_exceptions():
    def echo(text: str, *, prefix: str = ">") -> str:
        return prefix + text

    def broken(x: str) -> str:
        raise RuntimeError("boom")

    registry = {"echo": echo, "broken": broken}
    out = run_tool_call(ToolCall("echo", {"text": "hi"}), tools=registry, prefix="#", timeout_s=3.0)
    assert out == "#hi" and out.status == "ok"  # timeout_s is not echo's, so it was not passed
    failed = run_tool_call(ToolCall("broken", {"x": "1"}), tools=registry)
    assert failed == "Error: broken failed: RuntimeError: boom" and failed.status == "error"


# ----------------------------------------------------------------------------------------------
# The Python tool
# ----------------------------------------------------------------------------------------------
HARNESS_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/sandbox/harness.py", line 66, in run_source\n'
    '    exec(compile(source, name, "exec"), namespace)\n'
    '  File "<program>", line 2, in <module>\n'
    "ZeroDivisionError: division by zero\n"
)
HARNESS_SYNTAX_ERROR = (
    "Traceback (most recent call last):\n"
    '  File "/sandbox/harness.py", line 66, in run_source\n'
    '    exec(compile(source, name, "exec"), namespace)\n'
    "         ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "<program>", line 2\n'
    "    print(2\n"
    "         ^\n"
    "SyntaxError: '(' was never closed\n"
)


@pytest.mark.parametrize(
    "result, expected, status",
    [
        (SandboxResult("ok", 0, "42\n", "a warning\n", 0.1), "42", "ok"),
        (
            SandboxResult("error", 1, "1\n", HARNESS_TRACEBACK, 0.1),
            '1\nTraceback (most recent call last):\n  File "<program>", line 2, in <module>\n'
            "ZeroDivisionError: division by zero",
            "error",
        ),
        (
            SandboxResult("error", 1, "", HARNESS_SYNTAX_ERROR, 0.1),  # the last 4 lines, indents kept
            "  File \"<program>\", line 2\n    print(2\n         ^\nSyntaxError: '(' was never closed",
            "error",
        ),
        (SandboxResult("error", 3, "", "", 0.1), "Error: the program exited with code 3", "error"),
        (
            SandboxResult("timeout", None, "5\n", "", 1.0),
            "5\nTimeoutError: the program did not finish within 0.5 s",
            "timeout",
        ),
        (
            SandboxResult("memory", 86, "", "MemoryError\n", 0.1),
            "MemoryError: the program ran out of its 256 MB of memory",
            "error",
        ),
        (
            SandboxResult("output_limit", None, "aaaa", "", 0.1),
            "aaaa\nError: the program printed more than the sandbox's output limit",
            "error",
        ),
        (
            SandboxResult("sandbox_error", None, "", "bwrap: no", 0.0),
            "Error: the sandbox failed to run the program",
            "sandbox_error",
        ),
    ],
)
def test_python_tool_observation_per_status(monkeypatch, result, expected, status):
    seen = {}

    def fake_run_python(source, stdin="", timeout_s=10.0, memory_mb=1024):
        seen.update(source=source, timeout_s=timeout_s, memory_mb=memory_mb)
        return result

    monkeypatch.setattr(tools, "run_python", fake_run_python)
    out = run_tool_call(ToolCall("python", {"code": "print(6*7)"}), timeout_s=0.5, memory_mb=256)
    assert out == expected and out.status == status
    assert seen == {"source": "print(6*7)", "timeout_s": 0.5, "memory_mb": 256}


def test_python_tool_without_a_sandbox(monkeypatch):
    def unavailable(*args, **kwargs):
        raise sb.SandboxUnavailableError("no rung")

    monkeypatch.setattr(tools, "run_python", unavailable)
    out = python_tool("print(1)")
    assert out == "Error: no sandbox to run the program in" and out.status == "sandbox_error"


def test_python_tool_end_to_end_in_the_sandbox():
    """The real sandbox: output, a fresh interpreter per call (no state carried over), and a timeout."""
    try:
        sb.get_sandbox()
    except sb.SandboxUnavailableError as e:
        pytest.skip(f"no sandbox rung works here: {e}")
    text = "Let me check.\n```python\nprint(6 * 7)\n```\n"
    assert format_python_observation(run_tool_call(detect_tool_call(text, "python"))) == "```output\n42\n```\n"
    assigned = python_tool("x = 5")
    assert assigned == "" and assigned.status == "ok"
    fresh = python_tool("print(x)")
    assert fresh.status == "error" and fresh.endswith("NameError: name 'x' is not defined")
    assert fresh.startswith('Traceback (most recent call last):\n  File "<program>", line 1, in <module>')
    slow = python_tool("print('started', flush=True)\nwhile True:\n    pass", timeout_s=0.1)
    assert slow == "started\nTimeoutError: the program did not finish within 0.1 s" and slow.status == "timeout"
