#!/usr/bin/env python3
"""Reference renderer for the chattemplate differential test.

Renders chat templates with Python jinja2 exactly as Hugging Face
transformers does in apply_chat_template (render_jinja_template and
_compile_jinja_template): an ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks, loopcontrols and the {% generation %} tag,
HF's tojson filter, raise_exception and strftime_now. transformers itself
is not needed (and is not installed on CI); only jinja2 is.

Input (stdin, JSON): {"now": "YYYY-MM-DDTHH:MM:SS",
                      "templates": {name: source},
                      "cases": [{"template": name, "vars": {...},
                                 "continue_final_message": bool}]}
Output (stdout, JSON): a list with one entry per case, in order:
  {"out": rendered} or {"error": message, "raised": bool}
"raised" is true when the template called raise_exception.
"""
import json
import sys
from copy import deepcopy
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Raised(jinja2.exceptions.TemplateError):
    """What raise_exception raises (transformers raises a plain TemplateError
    with the same message; the subclass only lets us tell it apart)."""


class Generation(jinja2.ext.Extension):
    """transformers' AssistantTracker without the index tracking: the
    {% generation %} body renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

    def _support(self, caller):
        return caller()


def compile_template(source, now):
    def raise_exception(message):
        raise Raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return now.strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render(source, compiled, variables, continue_final_message):
    """transformers' render_jinja_template for one conversation."""
    variables = dict(variables)
    if continue_final_message:
        chat = deepcopy(variables["messages"])
        final = chat[-1].get("content")
        if final is None:
            raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
        if "content" not in source:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field in the chat_template')
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
        else:
            chat[-1]["content"] = chat[-1]["content"] + TAG
        variables["messages"] = chat
    out = compiled.render(**variables)
    if continue_final_message:
        if final.strip() not in out or TAG.strip() not in out:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat after applying the chat template!")
        loc = out.rindex(TAG.strip())
        if out[loc : loc + len(TAG)] == TAG:
            out = out[:loc]
        else:
            out = out[:loc].rstrip()
    return out


def main():
    req = json.load(sys.stdin)
    now = datetime.fromisoformat(req["now"])
    compiled = {}
    results = []
    for case in req["cases"]:
        name = case["template"]
        source = req["templates"][name]
        try:
            if name not in compiled:
                compiled[name] = compile_template(source, now)
            out = render(source, compiled[name], case["vars"], case.get("continue_final_message", False))
            results.append({"out": out})
        except Raised as e:
            results.append({"error": str(e), "raised": True})
        except Exception as e:  # any other failure: the test only needs to know it failed
            results.append({"error": "%s: %s" % (type(e).__name__, e), "raised": False})
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
