"""The shortest text that turns a JSON prefix into a complete JSON value (for structured output cut
by max_tokens: the engine feeds it as the last tokens, so the content still parses).

``closing_suffix(text)`` scans the prefix once with a small state machine (containers, strings
and their escapes, partial numbers and literals, what each container expects next) and returns
what closes it: a value where one is expected (``null``), the rest of a literal, a digit after
``-``/``.``/``e``, ``"`` for an open string, ``:null`` after a bare key, and the brackets.  None
when the text does not start a JSON object or array, or is already complete."""

from __future__ import annotations

_LITERALS = ("true", "false", "null")


def closing_suffix(text: str) -> str | None:
    s = text.lstrip()
    if not s or s[0] not in "{[":
        return None
    stack: list[str] = []  # "{" / "["
    # what the innermost container expects next:
    #   obj: "key_or_end" (after '{'), "key" (after ','), "colon" (after a key), "value" (after ':'), "comma_or_end"
    #   arr: "value_or_end" (after '['), "value" (after ','), "comma_or_end"
    expect = ""
    in_str = esc = False
    uni = -1  # hex digits still owed by a \u escape
    str_is_key = False
    num = ""  # the number being read
    lit = ""  # the literal being read
    done = False
    for ch in s:
        if done:
            if not ch.isspace():
                return None  # text after a complete value: not ours to fix
            continue
        if in_str:
            if uni > 0:
                uni -= 1
            elif esc:
                esc = False
                if ch == "u":
                    uni = 4
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                expect = "colon" if str_is_key else "comma_or_end"
            continue
        if num:
            if ch in "0123456789+-.eE":
                num += ch
                continue
            num = ""
            expect = "comma_or_end"
        if lit:
            if ch.isalpha():
                lit += ch
                continue
            lit = ""
            expect = "comma_or_end"
        if ch.isspace():
            continue
        if ch in "{[":
            stack.append(ch)
            expect = "key_or_end" if ch == "{" else "value_or_end"
        elif ch in "}]":
            if not stack:
                return None
            stack.pop()
            expect = "comma_or_end"
            if not stack:
                done = True
        elif ch == '"':
            in_str = True
            str_is_key = expect in ("key_or_end", "key")
        elif ch == ":":
            expect = "value"
        elif ch == ",":
            expect = "key" if stack and stack[-1] == "{" else "value"
        elif ch in "-0123456789":
            num = ch
        elif ch.isalpha():
            lit = ch
        else:
            return None
    if done:
        return None
    out = ""
    if in_str:
        if uni > 0:
            out += "0" * uni
        elif esc:
            out += "n"
        out += '"'
        expect = "colon" if str_is_key else "comma_or_end"
    elif num:
        if num[-1] in "-+.eE":
            out += "0"
        expect = "comma_or_end"
    elif lit:
        full = next((w for w in _LITERALS if w.startswith(lit)), None)
        if full is None:
            return None
        out += full[len(lit) :]
        expect = "comma_or_end"
    if expect == "colon":
        out += ":null"
    elif expect == "value":
        out += "null"
    elif expect == "key":
        out += '"":null'
    for c in reversed(stack):
        out += "}" if c == "{" else "]"
    return out
